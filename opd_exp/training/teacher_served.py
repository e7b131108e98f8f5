"""A served teacher: a stock vLLM OpenAI-compatible server scores the student's tokens.

Per sequence (prompt + response ids, without padding) one ``POST /v1/completions`` with the ids
as the prompt, ``max_tokens=1`` and ``prompt_logprobs=k``. The reply holds, per prompt position
i, the log-probs of token i given the tokens before it (position 0: null): the top-k and the
actual token's, normalised over the whole vocabulary of the untempered logits. The response
positions give a sparse ``TeacherScores`` (``divergences.topk_estimate`` is exact on the top-k
and unbiased in the tail at any k); where k covers the vocabulary the payload is rebuilt dense
and everything is exact.

Several sequences go in one request, several requests are in flight (a thread each), each
attempt with a deadline for its whole reply (``teacher.timeout_s``) and retries with backoff
(transport faults too: a body cut short, a garbage status line, a reset), cut short by SIGTERM.
A reply is checked as a whole (``_request``, ``_parse_row``): one choice per prompt by index, the
positions and tokens asked for, probabilities summing to at most 1. After a failed attempt the
server must still be the teacher ``connect`` saw. Before training (``connect``): the server answers, serves
``teacher.model`` (``/v1/models``), tokenizes like the local tokenizer (``/tokenize`` of a probe
string, hashed), fits the run's lengths (``max_model_len``) and allows ``teacher.k`` (vLLM's
``--max-logprobs``); ``self_test`` scores one sequence twice, then once more in one request after a
prompt that shares its prefix (prefix caching makes vLLM's ``prompt_logprobs`` depend on that:
vLLM #42245), and, with the pair's in-process teacher, compares them. Each problem is one line
naming the server, the model, what is wrong and what is allowed. A server lost mid-run raises
``TeacherUnavailable`` after the retries: the trainer stops at the step boundary with a checkpoint
(never a step on partial scores).

A teacher with another tokenizer (``teacher.align=bytes``, ``build_served_byte_aligned``): the client
renders the student's text with the teacher's tokenizer and aligns by bytes as in process
(``training/teacher_align.py``); the server scores the teacher's own ids (the top-1 asked, only the
actual token's log-prob used), and its tokenizer must be the teacher's own (the probe above).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import http.client
import json
import math
import signal
import socket
import threading
import time
import urllib.parse
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from opd_exp.runtime.errors import ConfigError
from opd_exp.runtime.guards import preemption_requested
from opd_exp.runtime.secrets import redact_url
from opd_exp.training.rollout import Batch
from opd_exp.training.scoring import InProcessTeacher, Pending, TeacherScorer, TeacherScores, dense_from_topk, teacher_topk, token_logprobs

# Tokenized on both sides before training; the hash of the server's ids is part of the identity.
PROBE = "Distil 12+35=47 in 3 steps: ÷, é, 中文, 🙂.\n\tThe teacher's tokens, the student's turn!"
START = "opd-serve-teacher model_pair=<pair> port=<port>"
# The probabilities of one position's top-k and actual token sum to at most 1; vLLM's float32
# log-probs sum to 1 within ~1e-6, so beyond this the reply is not one distribution.
MASS_ATOL = 1e-3


class TeacherUnavailable(ConfigError, RuntimeError):
    """The server stopped answering (or answered nonsense) during the run, after the retries.
    The trainer stops at the step boundary with a checkpoint; anywhere else (the eval before
    training) it is a ConfigError: one line, exit 2."""


def split_url(key: str, url: str) -> tuple[str, str, str | None]:
    """(``scheme://host:port/prefix`` without credentials or a trailing ``/v1``, the URL as it may be
    shown, an ``Authorization`` header from ``user:password@`` or None); one line if unusable."""
    shown = redact_url(url)
    parts = urllib.parse.urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = -1
    if parts.scheme not in ("http", "https") or not parts.hostname or port == -1 or parts.query or parts.fragment:
        raise ConfigError(f"{key}={shown!r} is not allowed; allowed: http://HOST:PORT (the server opd-serve-teacher prints)")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    path = parts.path.rstrip("/")
    if path.endswith("/v1"):  # the OpenAI clients' base URL: the routes below add /v1 themselves
        path = path[:-3]
    auth = None
    if parts.username is not None or parts.password is not None:
        pair = f"{urllib.parse.unquote(parts.username or '')}:{urllib.parse.unquote(parts.password or '')}"
        auth = "Basic " + base64.b64encode(pair.encode()).decode()
    return f"{parts.scheme}://{host}{'' if port is None else f':{port}'}{path}", shown, auth


class _Reply(Exception):
    """One failed attempt: ``retry`` says whether another attempt may help."""

    def __init__(self, what: str, *, retry: bool, timeout: bool = False):
        super().__init__(what)
        self.what, self.retry, self.timeout = what, retry, timeout


def _tokens_hash(tokens: list) -> str:
    return hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16]


def _short(ex: BaseException) -> str:
    """An exception's text, one line and short (a garbage status line can be anything)."""
    return " ".join(str(ex).split())[:120] or "no detail"


def _error_message(body: bytes) -> str:
    """The server's own error text (vLLM: ``{"error": {"message": ...}}`` or ``{"message": ...}``)."""
    try:
        data = json.loads(body)
    except ValueError:
        return body.decode("utf-8", "replace").strip()[:300]
    if isinstance(data, dict):
        err = data.get("error", data)
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])[:300]
    return str(data)[:300]


class ServedTeacher(TeacherScorer):
    """``teacher=served``: sparse ``TeacherScores`` from a vLLM server's ``prompt_logprobs``."""

    def __init__(self, te, k: int, vocab_size: int, *, tokenizer=None, whose: str = "the pair's tokenizer"):
        self.te, self.k, self.vocab_size, self.tokenizer = te, int(k), int(vocab_size), tokenizer
        self.whose = whose  # whose tokenizer the server must have (named in the refusal)
        # base: where requests go and what lines show (never the credentials, sent as a header)
        self.base, self.shown_url, self._auth = split_url("teacher.url", te.url)
        self.full_distribution = self.k >= self.vocab_size
        self.self_tested = False
        self._pool = ThreadPoolExecutor(max_workers=te.max_in_flight, thread_name_prefix="teacher")
        self._server: dict[str, Any] = {}

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- talking to the server ------------------------------------------------
    def _where(self) -> str:
        return f"teacher.url={self.base} (model {self.te.model!r})"

    def _once(self, method: str, path: str, payload: dict | None) -> Any:
        """One attempt. ``teacher.timeout_s`` is its deadline as a whole (connect, headers and
        body): a timer cuts the socket then, so a reply trickled a byte at a time cannot hold
        the run. Direct connections: a proxy from the environment never sits in between."""
        data = None if payload is None else json.dumps(payload).encode()
        headers = {"Content-Type": "application/json"}
        if self._auth is not None:
            headers["Authorization"] = self._auth
        scheme, rest = self.base.split("://", 1)
        netloc, _, prefix = rest.partition("/")
        cls = http.client.HTTPSConnection if scheme == "https" else http.client.HTTPConnection
        limit = self.te.timeout_s
        conn = cls(netloc, timeout=limit)
        late = f"no reply to {path} within teacher.timeout_s={limit:g} s"
        # the socket is kept here: the connection lets go of it once the reply's headers are in
        guard, state = threading.Lock(), {"done": False, "cut": False, "sock": None}

        def cut() -> None:
            with guard:
                if state["done"]:
                    return
                state["cut"] = True
            if state["sock"] is not None:
                with contextlib.suppress(OSError):
                    state["sock"].shutdown(socket.SHUT_RDWR)

        timer = threading.Timer(limit, cut)
        timer.daemon = True
        timer.start()
        try:
            try:
                conn.connect()
                with guard:
                    state["sock"] = conn.sock
                    if state["cut"]:  # the deadline passed while connecting
                        raise TimeoutError
            except TimeoutError:
                raise _Reply(late, retry=True, timeout=True) from None
            except OSError as ex:
                raise _Reply(f"cannot reach the server ({_short(ex)})", retry=True) from None
            try:
                conn.request(method, f"/{prefix}{path}" if prefix else path, body=data, headers=headers)
                response = conn.getresponse()
                status, body = response.status, response.read()
            except TimeoutError:
                raise _Reply(late, retry=True, timeout=True) from None
            except (http.client.HTTPException, OSError) as ex:  # IncompleteRead, BadStatusLine, reset, closed mid-reply
                if state["cut"]:
                    raise _Reply(late, retry=True, timeout=True) from None
                raise _Reply(f"the connection broke ({ex.__class__.__name__}: {_short(ex)})", retry=True) from None
            with guard:
                state["done"] = True
                if state["cut"]:  # a close-delimited body cut at the deadline reads as complete
                    raise _Reply(late, retry=True, timeout=True)
        finally:
            timer.cancel()
            conn.close()
        if status >= 400:
            raise _Reply(f"HTTP {status} from {path}: {_error_message(body)}", retry=status >= 500 or status == 429)
        try:
            return json.loads(body)
        except ValueError:
            raise _Reply(f"{path} answered with something that is not JSON ({body[:80]!r})", retry=False) from None

    def _call(self, method: str, path: str, payload: dict | None = None, *, attempts: int | None = None) -> Any:
        """One request with ``teacher.retries`` retries (backoff doubling); raises the last ``_Reply``.
        A preemption signal (SIGTERM) cuts the retries short: one more attempt at once, no backoff,
        so the step ends soon (and the run at its boundary) whatever the server does. A reply after
        a failed attempt is used only once the server is seen to be the same teacher."""
        last = (self.te.retries + 1 if attempts is None else attempts) - 1
        cut = False
        attempt = 0
        while True:
            try:
                reply = self._once(method, path, payload)
            except _Reply as ex:
                if ex.retry and attempt < last:
                    if not self._backoff(self.te.backoff_s * 2**attempt) and not cut:
                        cut, last = True, attempt + 1
                    attempt += 1
                    continue
                notes = [f"after {attempt + 1} attempts"] if attempt else []
                if cut:
                    notes.append(f"{signal.Signals(preemption_requested() or signal.SIGTERM).name} received: the retries were cut short")
                ex.what += f" ({'; '.join(notes)})" if notes else ""
                raise
            if attempt and self._server:
                self._same_teacher(path)
            return reply

    @staticmethod
    def _backoff(seconds: float) -> bool:
        """Sleep before a retry; False (at once) when a preemption signal arrives."""
        end = time.monotonic() + seconds
        while preemption_requested() is None:
            left = end - time.monotonic()
            if left <= 0:
                return True
            time.sleep(min(left, 0.05))
        return False

    def _served_entry(self, models: Any) -> dict | None:
        entries = models.get("data") if isinstance(models, dict) else None
        if not isinstance(entries, list):
            return None
        return next((m for m in entries if isinstance(m, dict) and m.get("id") == self.te.model), None)

    def _same_teacher(self, path: str) -> None:
        """After a failed attempt the server may have been restarted with another model on the same
        port: its model list and tokenizer must still be what ``connect`` saw; one line if not."""
        try:
            models = self._once("GET", "/v1/models", None)
            tokens = self._once("POST", "/tokenize", {"model": self.te.model, "prompt": PROBE, "add_special_tokens": False})
        except _Reply as ex:
            raise TeacherUnavailable(f"{self._where()}: checking the server again after a failed {path}: {ex.what}") from None
        entry = self._served_entry(models)
        if entry is None:
            ids = [str(m.get("id")) for m in models.get("data", []) if isinstance(m, dict)] if isinstance(models, dict) else []
            changed = [f"it serves {', '.join(map(repr, ids)) or 'no model'}, not {self.te.model!r}"]
        else:
            now = {"root": entry.get("root"), "max_model_len": entry.get("max_model_len")}
            changed = [f"{k} {self._server[k]!r} -> {v!r}" for k, v in now.items() if v != self._server[k]]
            got = tokens.get("tokens") if isinstance(tokens, dict) else None
            if not isinstance(got, list) or _tokens_hash(got) != self._server.get("tokenizer_hash"):
                changed.append("another tokenizer")
        if changed:
            raise TeacherUnavailable(
                f"{self._where()}: after a failed {path} the server came back as another teacher ({'; '.join(changed)}); "
                "allowed: the run's own teacher behind teacher.url (a resume is checked against it again)"
            )

    def _start_error(self, ex: _Reply) -> ConfigError:
        """A failure before training: one line with what is allowed."""
        if ex.timeout:
            allowed = "a larger teacher.timeout_s, or a server with less load"
        elif "cannot reach" in ex.what or "connection broke" in ex.what:
            allowed = f"the URL of a running vLLM OpenAI-compatible server ({START} starts one and prints it)"
        else:
            allowed = f"a vLLM OpenAI-compatible server for this pair's teacher ({START})"
        return ConfigError(f"{self._where()}: {ex.what}; allowed: {allowed}")

    # -- before training ------------------------------------------------------
    def connect(self, *, max_sequence_tokens: int | None = None) -> ServedTeacher:
        """Check the server before training (see the module docstring); one ConfigError line."""
        try:
            models = self._call("GET", "/v1/models", attempts=1)
        except _Reply as ex:
            raise self._start_error(ex) from None
        entries = models.get("data") if isinstance(models, dict) else None
        if not isinstance(entries, list):
            raise ConfigError(
                f"{self._where()}: /v1/models answered {str(models)[:120]!r}, not a model list; allowed: a vLLM OpenAI-compatible server"
            )
        ids = [str(m.get("id")) for m in entries if isinstance(m, dict)]
        entry = self._served_entry(models)
        if entry is None:
            raise ConfigError(
                f"{self._where()}: the server serves {', '.join(map(repr, ids)) or 'no model'}, not {self.te.model!r}; "
                f"allowed: teacher.model set to the served name (vLLM --served-model-name), or a server for {self.te.model!r}"
            )
        max_len = entry.get("max_model_len")
        self._server = {"model": self.te.model, "root": entry.get("root"), "max_model_len": max_len, "k": self.k}
        if max_sequence_tokens is not None and isinstance(max_len, int) and max_sequence_tokens + 1 > max_len:
            raise ConfigError(
                f"{self._where()}: the server's max_model_len={max_len} is shorter than a rollout's "
                f"{max_sequence_tokens} tokens + 1 (rollout.max_prompt_tokens + rollout.max_new_tokens, or an episode's budget); allowed: a server started with "
                f"--max-model-len >= {max_sequence_tokens + 1}, or shorter rollouts"
            )
        self._server["tokenizer_hash"] = self._check_tokenizer()
        return self

    def _check_tokenizer(self) -> str:
        """The server tokenizes the probe string as the local tokenizer does; returns the hash."""
        try:
            got = self._call("POST", "/tokenize", {"model": self.te.model, "prompt": PROBE, "add_special_tokens": False}, attempts=1)
        except _Reply as ex:
            raise self._start_error(ex) from None
        tokens = got.get("tokens") if isinstance(got, dict) else None
        if not isinstance(tokens, list):
            raise ConfigError(f"{self._where()}: /tokenize answered {str(got)[:120]!r}; allowed: a vLLM OpenAI-compatible server")
        if self.tokenizer is not None:
            local = list(self.tokenizer(PROBE, add_special_tokens=False)["input_ids"])
            if tokens != local:
                raise ConfigError(
                    f"{self._where()}: the server tokenizes a probe string into {len(tokens)} ids, {self.whose} into "
                    f"{len(local)} (first difference at id {next((i for i, (a, b) in enumerate(zip(tokens, local)) if a != b), min(len(tokens), len(local)))}): "
                    f"another tokenizer; allowed: a server for this pair's teacher (same tokenizer as {self.whose})"
                )
        return _tokens_hash(tokens)

    def identity(self) -> dict[str, Any]:
        """What this run trained against (fingerprinted; the URL is where, not who)."""
        return {f"teacher.server.{k}": v for k, v in self._server.items()}

    @torch.no_grad()
    def self_test(self, reference: InProcessTeacher | None, ids: list[int] | None = None) -> dict[str, float]:
        """Score one sequence twice (replicas behind one URL must agree), then in one request after a
        prompt sharing its prefix (a server whose scores depend on that, prefix caching on, is
        refused) and, with ``reference`` (the pair's teacher in this process), compare with it;
        ConfigError beyond ``teacher.self_test_atol``. Returns the largest differences (nats)."""
        if ids is None:
            ids = list(self.tokenizer(PROBE, add_special_tokens=False)["input_ids"]) if self.tokenizer is not None else list(range(1, 17))
        ids = [int(i) for i in ids]
        batch = probe_batch(ids)
        sibling = _sibling(ids, self.vocab_size)  # the probe's prompt, another response
        try:
            first, second = (self._score_now(batch) for _ in range(2))
            # the sibling, then the probe, in ONE request: the probe's prefix is already in the server's batch
            pair = probe_batch(sibling, ids)
            shared = _row(_Requests(self, pair, [(range(2), self._pool.submit(self._request, [sibling, ids]))]).result(), 1)
        except TeacherUnavailable as ex:
            raise ConfigError(f"{ex}") from None
        atol = self.te.self_test_atol
        out = {"repeat": _max_gap(first, second, batch)}
        if out["repeat"] > atol:
            raise ConfigError(
                f"{self._where()}: the same sequence scored twice differs by {out['repeat']:.3g} nats (> teacher.self_test_atol={atol:g}): "
                "replicas or a nondeterministic server disagree; allowed: one teacher behind the URL, or a larger teacher.self_test_atol"
            )
        out["shared_prefix"] = _max_gap(first, shared, batch)
        if out["shared_prefix"] > atol:
            raise ConfigError(
                f"{self._where()}: a sequence scored in one request after a prompt sharing its first {batch.prompt_len} tokens differs "
                f"from it scored alone by {out['shared_prefix']:.3g} nats (> teacher.self_test_atol={atol:g}): the server's "
                "prompt_logprobs depend on what shares the batch (vLLM's prefix caching, vLLM #42245); allowed: a server started with "
                "--no-enable-prefix-caching (opd-serve-teacher does), or a larger teacher.self_test_atol"
            )
        if reference is not None:
            dense = reference.score(batch)
            want = dense if self.full_distribution else _sparse_from_dense(dense.logits, batch.response_ids, self.k)
            out["in_process"] = _max_gap(first, want, batch)
            if out["in_process"] > atol:
                raise ConfigError(
                    f"{self._where()}: its log-probs differ from the pair's in-process teacher by {out['in_process']:.3g} nats "
                    f"(> teacher.self_test_atol={atol:g}): another model, weights or precision; allowed: a server for this pair's teacher "
                    "(float32 on CPU), a larger teacher.self_test_atol, or teacher.self_test=false"
                )
        return out

    # -- scoring --------------------------------------------------------------
    def score(self, batch: Batch) -> TeacherScores:
        return self._score_now(batch)

    def submit(self, batch: Batch) -> Pending:
        if not self.te.overlap:
            return Pending(lambda: self.score(batch))
        return _Requests(self, batch, self._send(batch))

    def _score_now(self, batch: Batch) -> TeacherScores:
        return _Requests(self, batch, self._send(batch)).result()

    def _send(self, batch: Batch) -> list[tuple[range, Future]]:
        rows = _sequences(batch)
        step = self.te.rows_per_request
        chunks = [range(i, min(i + step, len(rows))) for i in range(0, len(rows), step)]
        return [(c, self._pool.submit(self._request, [rows[i][0] for i in c])) for c in chunks]

    def _request(self, prompts: list[list[int]]) -> list:
        payload = {
            "model": self.te.model,
            "prompt": prompts,
            "max_tokens": 1,
            "temperature": 0.0,
            "prompt_logprobs": self.k,
        }
        try:
            reply = self._call("POST", "/v1/completions", payload)
        except _Reply as ex:
            raise TeacherUnavailable(self._run_error(ex)) from None
        choices = reply.get("choices") if isinstance(reply, dict) else None
        n = len(prompts)
        if not isinstance(choices, list) or len(choices) != n:
            raise TeacherUnavailable(self._malformed(f"{len(choices) if isinstance(choices, list) else 'no'} choices for {n} prompts"))
        named = reply.get("model")
        if isinstance(named, str) and named != self.te.model:
            raise TeacherUnavailable(self._malformed(f"the reply is from model {named!r}, not {self.te.model!r}"))
        # one choice per prompt, matched by its index (a server may answer out of order; a choice
        # without its index cannot be matched to its prompt)
        by_index: dict[int, dict] = {}
        for i, c in enumerate(choices):
            index = c.get("index") if isinstance(c, dict) else None
            if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < n or index in by_index:
                raise TeacherUnavailable(
                    self._malformed(
                        f"choice {i} has index {index!r} (each of the {n} prompts' indices 0..{n - 1} once is what matches a choice to its prompt)"
                    )
                )
            by_index[index] = c
        out = []
        for i in range(n):
            echoed = by_index[i].get("prompt_token_ids")
            if echoed is not None and echoed != prompts[i]:
                raise TeacherUnavailable(self._malformed(f"choice {i} is for other token ids than prompt {i}'s"))
            out.append(by_index[i].get("prompt_logprobs"))
        return out

    def _run_error(self, ex: _Reply) -> str:
        where = self._where()
        if "max allowed" in ex.what or "max_logprobs" in ex.what:
            return (
                f"{where}: the server refuses prompt_logprobs={self.k} ({ex.what}); allowed: teacher.k at most the server's "
                f"--max-logprobs, or a server started with --max-logprobs >= {self.k} (opd-serve-teacher sets it from teacher.k)"
            )
        if "maximum context length" in ex.what or "max_model_len" in ex.what:
            return f"{where}: a sequence is longer than the server allows ({ex.what}); allowed: a server with a larger --max-model-len, or shorter rollouts"
        if ex.timeout:
            return f"{where}: {ex.what}; allowed: a larger teacher.timeout_s, more teacher.retries, or a server with less load"
        return f"{where}: {ex.what}; allowed: a running server (teacher.retries={self.te.retries}, teacher.backoff_s={self.te.backoff_s:g})"

    def _malformed(self, what: str) -> str:
        return (
            f"{self._where()}: malformed prompt_logprobs reply: {what}; allowed: a vLLM OpenAI-compatible server (prompt_logprobs support)"
        )

    def _parse_row(self, plp: Any, ids: list[int], start: int, length: int, out: dict[str, torch.Tensor], row: int) -> None:
        """Row ``row``'s response positions start..start+length-1 of ``plp`` into ``out``. Each
        position must be the one asked for: the top-k plus the actual token and no other, ids in
        the vocabulary, log-probs <= 0 whose probabilities sum to at most 1 (to 1 when k covers
        the vocabulary), within ``MASS_ATOL``."""
        k, V = self.k, self.vocab_size
        if not isinstance(plp, list) or len(plp) != len(ids):
            n = len(plp) if isinstance(plp, list) else type(plp).__name__
            raise TeacherUnavailable(self._malformed(f"{n} prompt positions for a {len(ids)}-token sequence"))
        if plp[0] is not None:  # nothing comes before the first token: a list shifted by a position
            raise TeacherUnavailable(self._malformed(f"position 0 is {str(plp[0])[:80]!r}, not null (another position's log-probs)"))
        for j in range(length):
            pos = start + j
            entry = plp[pos]
            try:
                items = [(int(tok), float(v["logprob"]), int(v["rank"])) for tok, v in entry.items()]
            except (AttributeError, KeyError, TypeError, ValueError):
                raise TeacherUnavailable(self._malformed(f"position {pos} is {str(entry)[:80]!r}")) from None
            actual = next((lp for tok, lp, _ in items if tok == ids[pos]), None)
            top = sorted((it for it in items if it[2] <= k), key=lambda it: (it[2], -it[1]))[:k]
            if actual is None or len(top) < min(k, V) or any(not 0 <= tok < V or not lp <= 0.0 or math.isnan(lp) for tok, lp, _ in items):
                raise TeacherUnavailable(
                    self._malformed(
                        f"position {pos} holds {len(top)} of the top-{k} (ids within 0..{V - 1}, log-probs <= 0) "
                        f"{'and' if actual is not None else 'without'} the actual token {ids[pos]}"
                    )
                )
            kept = {tok for tok, _, _ in top} | {ids[pos]}
            stray = next(((tok, rank) for tok, _, rank in items if tok not in kept), None)
            if stray is not None or len({tok for tok, _, _ in items}) != len(items):
                what = f"token {stray[0]} (rank {stray[1]})" if stray else "a token twice"
                raise TeacherUnavailable(
                    self._malformed(
                        f"position {pos} holds {what} besides its top-{k} and the actual token {ids[pos]} (another position's log-probs)"
                    )
                )
            mass = sum(math.exp(lp) for tok, lp, _ in {it[0]: it for it in items}.values())
            if mass > 1.0 + MASS_ATOL or (self.full_distribution and mass < 1.0 - MASS_ATOL):
                bound = "1" if self.full_distribution else "at most 1"
                raise TeacherUnavailable(
                    self._malformed(
                        f"position {pos}: the probabilities of its {len(kept)} tokens sum to {mass:.6g}, not {bound} "
                        f"(within {MASS_ATOL:g}): not the log-probs of one distribution"
                    )
                )
            out["sampled"][row, j] = actual
            out["ids"][row, j] = torch.tensor([t for t, _, _ in top])
            out["lp"][row, j] = torch.tensor([lp for _, lp, _ in top])


class _Requests(Pending):
    """A micro-batch's requests in flight; ``result`` waits for all of them and builds the
    scores, or raises (never partial scores)."""

    def __init__(self, teacher: ServedTeacher, batch: Batch, futures: list[tuple[range, Future]]):
        self.teacher, self.batch, self.futures = teacher, batch, futures

    def cancel(self) -> None:
        for _, f in self.futures:
            f.cancel()

    def result(self) -> TeacherScores:
        with self.teacher.clock("teacher"):  # the learner's wait for the server (perf/teacher_s)
            return self._result()

    def _result(self) -> TeacherScores:
        t, batch = self.teacher, self.batch
        rows = _sequences(batch)
        N, R = batch.response_mask.shape
        k = min(t.k, t.vocab_size)
        # finite filler outside the response mask: a uniform teacher there (never counted)
        fill = -math.log(t.vocab_size)
        out = {
            "ids": torch.arange(k).expand(N, R, k).clone(),
            "lp": torch.full((N, R, k), fill, dtype=torch.float32),
            "sampled": torch.full((N, R), fill, dtype=torch.float32),
        }
        try:
            for chunk, future in self.futures:
                for i, plp in zip(chunk, future.result()):
                    ids, start, length = rows[i]
                    t._parse_row(plp, ids, start, length, out, i)
        except BaseException:
            self.cancel()
            raise
        device = batch.input_ids.device
        if t.full_distribution:  # every token's log-prob: the dense teacher, exactly
            return TeacherScores(logits=dense_from_topk(out["ids"], out["lp"], t.vocab_size).to(device))
        return TeacherScores(topk_ids=out["ids"].to(device), topk_logprobs=out["lp"].to(device), sampled_logprobs=out["sampled"].to(device))


def _sequences(batch: Batch) -> list[tuple[list[int], int, int]]:
    """Per row: (prompt + response ids without padding, where the response starts, its length)."""
    P = batch.prompt_len
    ids, attn, rmask = batch.input_ids.cpu(), batch.attention_mask.cpu().bool(), batch.response_mask.cpu().bool()
    out = []
    for i in range(ids.shape[0]):
        prompt = ids[i, :P][attn[i, :P]].tolist()
        length = int(rmask[i].sum())
        out.append((prompt + ids[i, P : P + length].tolist(), len(prompt), length))
    return out


def probe_batch(ids: list[int], *more: list[int]) -> Batch:
    """One sequence as a batch (or several of its length, one row each): the first half of each the
    prompt, the rest the response."""
    n = len(ids)
    if n < 2 or any(len(r) != n for r in more):
        raise ValueError("probe_batch: at least two tokens, every row as long as the first")
    P = max(1, n // 2)
    t = torch.tensor([ids, *more])
    rows = t.shape[0]
    return Batch(
        input_ids=t,
        attention_mask=torch.ones_like(t),
        position_ids=torch.arange(n).expand(rows, n).clone(),
        prompt_len=P,
        response_mask=torch.ones(rows, n - P, dtype=torch.bool),
        prompt_index=torch.zeros(rows, dtype=torch.long),
    )


def _sibling(ids: list[int], vocab_size: int) -> list[int]:
    """``ids`` with the same prompt (``probe_batch``'s first half) and another response (reversed,
    or each id moved by one where reversing changes nothing)."""
    P = max(1, len(ids) // 2)
    tail = ids[P:][::-1]
    if tail == ids[P:]:
        tail = [(i + 1) % vocab_size for i in tail]
    return ids[:P] + tail


def _row(scores: TeacherScores, i: int) -> TeacherScores:
    """Row ``i`` of ``scores`` as a one-row payload."""
    pick = lambda x: None if x is None else x[i : i + 1]
    return TeacherScores(pick(scores.logits), pick(scores.topk_ids), pick(scores.topk_logprobs), pick(scores.sampled_logprobs))


def _sparse_from_dense(logits: torch.Tensor, ids: torch.Tensor, k: int) -> TeacherScores:
    lp, top = teacher_topk(logits.float(), k)
    return TeacherScores(topk_ids=top, topk_logprobs=lp, sampled_logprobs=token_logprobs(logits.float(), ids))


def _max_gap(a: TeacherScores, b: TeacherScores, batch: Batch) -> float:
    """Largest |difference| (nats) of the sampled tokens' log-probs and of the sorted top-k log-probs."""
    m = batch.response_mask.bool()
    ids = batch.response_ids
    gaps = [(a.token_logprobs(ids) - b.token_logprobs(ids)).abs()[m]]
    if not a.dense and not b.dense:
        gaps.append((a.topk_logprobs - b.topk_logprobs).abs()[m].flatten())
    elif a.dense and b.dense:
        gaps.append((torch.log_softmax(a.logits.float(), -1) - torch.log_softmax(b.logits.float(), -1)).abs()[m].flatten())
    return float(torch.cat(gaps).max()) if m.any() else 0.0


def build_served_teacher(cfg, vocab_size: int, tokenizer, reference: InProcessTeacher | None, warn=print) -> ServedTeacher:
    """``teacher=served`` from a TrainConfig: connected, checked and self-tested, or one line."""
    te = cfg.teacher
    k = te.k if te.k is not None else cfg.estimator.k
    teacher = ServedTeacher(te, k, vocab_size, tokenizer=tokenizer)
    return connected(
        teacher, cfg, reference, warn, longest=cfg.rollout.max_prompt_tokens + max(cfg.rollout.max_new_tokens, cfg.rollout.episode_tokens)
    )


def connected(teacher: ServedTeacher, cfg, reference: InProcessTeacher | None, warn, *, longest: int | None) -> ServedTeacher:
    """``teacher`` connected, checked and self-tested (``longest``: the tokens a sequence may hold), or one line."""
    te = cfg.teacher
    try:
        if urllib.parse.urlsplit(te.url).path.rstrip("/").endswith("/v1"):
            warn(f"opd-train: teacher.url={teacher.shown_url} ends in /v1, which the client adds itself: using {teacher.base}")
        teacher.connect(max_sequence_tokens=longest)
        if te.self_test:
            gaps = teacher.self_test(reference)
            teacher.self_tested = reference is not None
            shown = ", ".join(f"{name} {gap:.2g}" for name, gap in gaps.items())
            warn(f"opd-train: served teacher {te.model!r} at {teacher.base}: self-test passed (largest log-prob differences: {shown} nats)")
        if reference is not None and not teacher.self_tested:
            warn(
                f"opd-train: warning: the served teacher at {teacher.base} was not compared with the pair's in-process teacher "
                f"(teacher.self_test={str(te.self_test).lower()}): eval/teacher_accuracy is the in-process copy's, not the server's"
            )
    except BaseException:
        teacher.close()
        raise
    return teacher


def build_served_byte_aligned(ctx):
    """``teacher=served teacher.align=bytes``: the byte-aligned scorer (``training/teacher_align.py``) whose
    teacher's own tokens are scored by the server (top-1 asked: only the actual token's log-prob is used),
    connected, its tokenizer checked against the teacher's own and self-tested against the pair's
    teacher in this process over the teacher's vocabulary."""
    from opd_exp.training.teacher_align import build_byte_aligned

    vocab = getattr(ctx.cfg.teacher, "align_vocab", "none")
    if vocab != "none":  # the shared-vocabulary path needs the teacher's whole next-token distributions
        raise ConfigError(
            f"teacher.align_vocab={vocab!r} is not allowed with teacher=served (a server sends the teacher's own tokens' "
            "log-probs, not its whole distributions); allowed: none (the chunk payload), or teacher=in_process"
        )
    t_tok = ctx.teacher_tokenizer or ctx.tokenizer
    V = len(t_tok)
    served = ServedTeacher(
        ctx.cfg.teacher, 1, V, tokenizer=t_tok, whose="the teacher's own tokenizer (model_pair.teacher's, teacher.align=bytes)"
    )
    try:
        aligned = build_byte_aligned(ctx, teacher=served)  # its refusals before the server is asked anything
    except BaseException:
        served.close()
        raise
    local = None
    if ctx.model is not None:
        local = InProcessTeacher(ctx.model, V, temperature=ctx.cfg.divergence.temperature, device=ctx.device, autocast=ctx.autocast)
    # the student's token budget says nothing of the teacher's own tokens: a too-long row is refused per request
    connected(served, ctx.cfg, local, ctx.warn, longest=None)
    return aligned
