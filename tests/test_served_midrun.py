"""A served teacher mid-run (issue 36): what a flaky or hostile server does after the start-up
checks passed. Each case ends in one line or the documented recovery, never a traceback, a hang
or a silently wrong score. A stand-in (``Front``) sits before the ``FakeVllm`` of the other tests:
it passes requests through and lets a test rewrite a reply, break the transport, or swap the
server behind it."""

from __future__ import annotations

import base64
import copy
import dataclasses
import http.client
import json
import math
import os
import signal
import socket
import struct
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from helpers.fake_vllm import FakeVllm
from helpers.tiny import AddTask, small_config
from opd_exp.config.schema import TeacherConfig, TeacherName
from opd_exp.runtime.errors import ConfigError
from opd_exp.runtime.guards import Preempted, PreemptionGuard
from opd_exp.training.teacher_served import ServedTeacher, TeacherUnavailable, build_served_teacher, probe_batch
from opd_exp.training.trainer import Trainer


class Front:
    """A stand-in server before ``fake``: every request passes through, except that a completion
    request takes the next of ``faults`` (a transport fault, or ``("edit", fn)`` rewriting the
    reply's JSON), or ``edit`` for every completion; ``auth`` demands that Basic credential."""

    def __init__(self, fake: FakeVllm):
        self.fake, self.faults, self.edit, self.auth = fake, [], None, None
        self.on_fault = None  # called (with the fault) after a fault is served
        self.seen_auth: list[str | None] = []
        self.completions = 0
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def _forward(self, method: str, path: str, body: bytes | None) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection(self.fake.url.split("://")[1], timeout=30)
        try:
            conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
            r = conn.getresponse()
            return r.status, r.read()
        finally:
            conn.close()

    def _handler(self):
        front = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                return

            def _reply(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _handle(self, method: str) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"])) if method == "POST" else None
                front.seen_auth.append(self.headers.get("Authorization"))
                if front.auth is not None and self.headers.get("Authorization") != front.auth:
                    return self._reply(401, b'{"error": {"message": "Unauthorized"}}')
                status, out = front._forward(method, self.path, body)
                if self.path != "/v1/completions":
                    return self._reply(status, out)
                front.completions += 1
                fault = front.faults.pop(0) if front.faults else None
                if fault is None:
                    if front.edit is not None:
                        out = json.dumps(front.edit(json.loads(body), json.loads(out))).encode()
                    return self._reply(status, out)
                self._fault(fault, status, out, json.loads(body))
                if front.on_fault is not None:
                    front.on_fault(fault)

            def _fault(self, fault, status: int, out: bytes, req: dict) -> None:
                self.close_connection = True
                if isinstance(fault, tuple):  # ("edit", fn): this reply rewritten
                    return self._reply(status, json.dumps(fault[1](req, json.loads(out))).encode())
                if fault == "error500":
                    return self._reply(500, b'{"error": {"message": "EngineCore died"}}')
                if fault == "incomplete":  # the body cut short: IncompleteRead
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(out) + 100))
                    self.end_headers()
                    self.wfile.write(out)
                elif fault == "bad_status":  # a garbage status line: BadStatusLine
                    self.wfile.write(b"garbage\r\n\r\n")
                elif fault == "disconnect":  # closed before any reply: RemoteDisconnected
                    pass
                elif fault == "reset":  # RST instead of FIN: ConnectionResetError
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                elif fault == "trickle":  # a byte every 20 ms: the whole reply would take > 10 s
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(out)))
                    self.end_headers()
                    self.wfile.flush()
                    try:
                        for b in out[:500]:
                            self.wfile.write(bytes([b]))
                            self.wfile.flush()
                            time.sleep(0.02)
                    except OSError:  # the client gave up: the point
                        pass

            def do_GET(self):
                self._handle("GET")

            def do_POST(self):
                self._handle("POST")

        return Handler


@pytest.fixture
def fake(tiny_pair):
    server = FakeVllm(tiny_pair.teacher, tiny_pair.tokenizer, tiny_pair.vocab_size)
    yield server
    server.stop()


@pytest.fixture
def front(fake):
    f = Front(fake)
    yield f
    f.stop()


def client(tiny_pair, url: str, k: int = 4, **fields) -> ServedTeacher:
    te = TeacherConfig(name=TeacherName.served, url=url, k=k, **{"retries": 0, "backoff_s": 0.0, "timeout_s": 30.0, **fields})
    return ServedTeacher(te, k, tiny_pair.vocab_size, tokenizer=tiny_pair.tokenizer).connect()


def served(cfg, url: str, **fields):
    te = TeacherConfig(name=TeacherName.served, url=url, **{"retries": 0, "backoff_s": 0.0, "timeout_s": 30.0, **fields})
    return dataclasses.replace(cfg, teacher=te)


def fresh(tiny_pair):
    pair = copy.copy(tiny_pair)
    pair.student = type(tiny_pair.student).from_pretrained(tiny_pair.student.name_or_path)
    return pair


def malformed(url: str, what: str) -> str:
    return (
        f"teacher.url={url} (model 'teacher'): malformed prompt_logprobs reply: {what}; "
        "allowed: a vLLM OpenAI-compatible server (prompt_logprobs support)"
    )


def lost(url: str, what: str, retries: int = 0, backoff: str = "0") -> str:
    return (
        f"teacher.url={url} (model 'teacher'): {what}; allowed: a running server (teacher.retries={retries}, teacher.backoff_s={backoff})"
    )


BATCH = [2, 3, 4, 5, 6, 7]  # probe_batch: prompt 0..2, response positions 3, 4, 5


# -- a reply checked as a whole --------------------------------------------------------------


def test_a_top_k_whose_probabilities_sum_above_one_is_refused(tiny_pair, front):
    """Every log-prob -0.01 (each one valid alone): 4 tokens of probability 0.99 are no
    distribution. Before: accepted, and a run trained on it to a negative kl/reverse."""

    def flat(req, reply):
        for c in reply["choices"]:
            ids = req["prompt"][c["index"]]
            c["prompt_logprobs"] = [None] + [
                {str(t): {"logprob": -0.01, "rank": r + 1} for r, t in enumerate([ids[i]] + [x for x in range(4) if x != ids[i]][:3])}
                for i in range(1, len(ids))
            ]
        return reply

    t = client(tiny_pair, front.url)
    front.edit = flat
    with pytest.raises(TeacherUnavailable) as ex:
        t.score(probe_batch(BATCH))
    mass = 4 * math.exp(-0.01)
    assert str(ex.value) == malformed(
        front.url,
        f"position 3: the probabilities of its 4 tokens sum to {mass:.6g}, not at most 1 (within 0.001): not the log-probs of one distribution",
    )
    assert f"{mass:.6g}" == "3.9602"
    t.close()


def test_a_full_vocabulary_reply_must_sum_to_one(tiny_pair, front):
    """k covers the vocabulary: the payload is the whole distribution, so its mass is 1; the
    stand-in's own replies pass, one with every log-prob shifted down by 1 nat is refused."""
    V = tiny_pair.vocab_size
    t = client(tiny_pair, front.url, k=V)
    t.score(probe_batch(BATCH))  # the true distribution: accepted

    def shifted(req, reply):
        for c in reply["choices"]:
            for entry in c["prompt_logprobs"][1:]:
                for v in entry.values():
                    v["logprob"] -= 1.0
        return reply

    front.edit = shifted
    with pytest.raises(
        TeacherUnavailable, match=r"position 3: the probabilities of its \d+ tokens sum to 0\.36787\d, not 1 \(within 0\.001\)"
    ):
        t.score(probe_batch(BATCH))
    t.close()


def _synthetic(ids: list[int], V: int) -> list:
    """prompt_logprobs of a made-up teacher: at position i the top-4 are tokens i..i+3 (log-probs
    -1..-4), and the actual token, if not among them, at rank 10 with -6."""
    out: list = [None]
    for i in range(1, len(ids)):
        entry = {str((i + r) % V): {"logprob": -1.0 - r, "rank": r + 1} for r in range(4)}
        entry.setdefault(str(ids[i]), {"logprob": -6.0, "rank": 10})
        out.append(entry)
    return out


def test_another_positions_log_probs_are_refused(tiny_pair, front):
    """Position 3 answered with position 4's entry (tokens 4..7 and position 4's token 10 at rank
    10). It holds the actual token 5 among its top-4, so before it was taken as position 3's;
    now the stray token 10 gives it away. A list shifted by one (position 0 not null) too."""
    V = tiny_pair.vocab_size
    ids = [1, 2, 3, 5, 10, 11]
    t = client(tiny_pair, front.url)

    def synthetic(req, reply):
        for c in reply["choices"]:
            c["prompt_logprobs"] = _synthetic(req["prompt"][c["index"]], V)
        return reply

    front.edit = synthetic
    got = t.score(probe_batch(ids))  # the made-up teacher, consistent: accepted as sent
    assert got.topk_ids[0, 0].tolist() == [3, 4, 5, 6] and got.sampled_logprobs[0].tolist() == [-3.0, -6.0, -6.0]

    def swapped(req, reply):
        plp = _synthetic(req["prompt"][0], V)
        plp[3] = plp[4]
        reply["choices"][0]["prompt_logprobs"] = plp
        return reply

    front.edit = swapped
    with pytest.raises(TeacherUnavailable) as ex:
        t.score(probe_batch(ids))
    assert str(ex.value) == malformed(
        front.url, "position 3 holds token 10 (rank 10) besides its top-4 and the actual token 5 (another position's log-probs)"
    )

    def shifted(req, reply):
        plp = _synthetic(req["prompt"][0], V)
        reply["choices"][0]["prompt_logprobs"] = plp[1:] + [plp[-1]]
        return reply

    front.edit = shifted
    with pytest.raises(TeacherUnavailable, match=r"position 0 is .*, not null \(another position's log-probs\)"):
        t.score(probe_batch(ids))
    t.close()


def _two_rows():
    from opd_exp.training.rollout import Batch, positions_from_mask

    ids = torch.tensor([[2, 3, 4, 5, 6], [7, 8, 9, 10, 11]])
    attn = torch.ones_like(ids)
    return Batch(ids, attn, positions_from_mask(attn), 2, torch.ones(2, 3, dtype=torch.bool), torch.arange(2))


def test_choices_are_matched_to_prompts_by_index(tiny_pair, front):
    """Two prompts in one request: choices sent in reverse order are put back by their index (the
    scores equal the in-order reply's); a choice without an index, or an index twice, is refused
    (before: the order of the list was taken, rows silently swapped)."""
    t = client(tiny_pair, front.url, rows_per_request=2)
    batch = _two_rows()
    want = t.score(batch)
    front.edit = lambda req, reply: {**reply, "choices": reply["choices"][::-1]}
    got = t.score(batch)
    assert torch.equal(got.topk_ids, want.topk_ids) and torch.equal(got.sampled_logprobs, want.sampled_logprobs)

    def no_index(req, reply):
        choices = reply["choices"][::-1]
        for c in choices:
            del c["index"]
        return {**reply, "choices": choices}

    front.edit = no_index
    with pytest.raises(TeacherUnavailable) as ex:
        t.score(batch)
    assert str(ex.value) == malformed(
        front.url, "choice 0 has index None (each of the 2 prompts' indices 0..1 once is what matches a choice to its prompt)"
    )

    def twice(req, reply):
        reply["choices"][1]["index"] = 0
        return reply

    front.edit = twice
    with pytest.raises(TeacherUnavailable, match=r"choice 1 has index 0 \(each of the 2 prompts' indices 0\.\.1 once"):
        t.score(batch)
    t.close()


# -- the transport: deadline, faults, identity -------------------------------------------------


def test_a_reply_trickled_a_byte_at_a_time_meets_the_deadline(tiny_pair, front):
    """teacher.timeout_s bounds the whole reply, not one read: a server sending a byte every 20 ms
    is cut at 0.5 s (before: each byte restarted the clock, the reply took > 10 s)."""
    t = client(tiny_pair, front.url, timeout_s=0.5)
    front.faults = ["trickle"]
    start = time.monotonic()
    with pytest.raises(TeacherUnavailable) as ex:
        t.score(probe_batch(BATCH))
    assert time.monotonic() - start < 2.5
    assert str(ex.value) == (
        f"teacher.url={front.url} (model 'teacher'): no reply to /v1/completions within teacher.timeout_s=0.5 s; "
        "allowed: a larger teacher.timeout_s, more teacher.retries, or a server with less load"
    )
    t.close()


FAULTS = {
    "incomplete": r"the connection broke \(IncompleteRead: IncompleteRead\(\d+ bytes read, 100 more expected\)\)",
    "bad_status": r"the connection broke \(BadStatusLine: garbage\)",
    "disconnect": r"the connection broke \(RemoteDisconnected: Remote end closed connection without response\)",
    "reset": r"the connection broke \((ConnectionResetError: \[Errno 104\] Connection reset by peer|RemoteDisconnected: .*)\)",
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_transport_fault_is_one_line_without_retries(tiny_pair, front, fault):
    """Before: IncompleteRead and BadStatusLine escaped as tracebacks (not OSErrors)."""
    import re

    t = client(tiny_pair, front.url)
    front.faults = [fault]
    with pytest.raises(TeacherUnavailable) as ex:
        t.score(probe_batch(BATCH))
    line = str(ex.value)
    assert re.fullmatch(
        re.escape(f"teacher.url={front.url} (model 'teacher'): ")
        + FAULTS[fault]
        + re.escape("; allowed: a running server (teacher.retries=0, teacher.backoff_s=0)"),
        line,
    ), line
    t.close()


def test_transport_faults_are_retried_and_the_scores_are_the_clean_ones(tiny_pair, front):
    t = client(tiny_pair, front.url, retries=4, backoff_s=0.01)
    want = t.score(probe_batch(BATCH))
    front.faults = ["incomplete", "bad_status", "disconnect", "reset"]
    got = t.score(probe_batch(BATCH))
    assert front.faults == [] and front.completions == 1 + 5
    assert torch.equal(got.topk_ids, want.topk_ids) and torch.equal(got.topk_logprobs, want.topk_logprobs)
    t.close()


def test_a_body_cut_short_mid_run_stops_with_a_checkpoint(tiny_pair, front, tmp_path):
    """The teacher-lost stop (checkpoint at the last finished step, exit 2), not a traceback and
    exit 1 with nothing saved, once the retries are spent on IncompleteRead."""
    cfg = small_config(divergence={"name": "rkl"}, estimator={"name": "topk", "k": 6}, trainer={"max_steps": 3, "micro_batch_size": 4})
    run = tmp_path / "run"
    t = Trainer(served(cfg, front.url, retries=1, backoff_s=0.01), run, pair=fresh(tiny_pair), task=AddTask())
    front.completions = 0
    real = t.train_step

    def step():
        if t.step == 1:  # step 2: every attempt of its one request cut short
            front.faults = ["incomplete"] * 2
        return real()

    t.train_step = step
    with pytest.raises(ConfigError) as ex:
        t.run()
    line = str(ex.value)
    assert "\n" not in line
    assert "the connection broke (IncompleteRead: IncompleteRead(" in line
    assert line.endswith(
        "100 more expected)) (after 2 attempts); allowed: a running server (teacher.retries=1, teacher.backoff_s=0.01); "
        f"the run stopped before step 2 (nothing trained on partial scores), checkpoint at step 1 saved to {run}/checkpoints/step_000001; "
        "to resume: start the teacher server again and run the same command"
    )


def test_a_server_that_came_back_with_another_model_is_refused(tiny_pair, front, fake):
    """The server dies mid-request and comes back on the same port serving another model under
    the same name: the retry's reply is not used (before: used without a word)."""
    other = FakeVllm(tiny_pair.teacher, tiny_pair.tokenizer, tiny_pair.vocab_size, root="/models/another", max_model_len=32)
    try:
        t = client(tiny_pair, front.url, retries=2, backoff_s=0.01)
        front.faults = ["disconnect"]
        t.score(probe_batch(BATCH))  # the same teacher after the fault: used
        front.faults = ["disconnect"]
        front.on_fault = lambda fault: setattr(front, "fake", other)
        with pytest.raises(TeacherUnavailable) as ex:
            t.score(probe_batch(BATCH))
        assert str(ex.value) == (
            f"teacher.url={front.url} (model 'teacher'): after a failed /v1/completions the server came back as another teacher "
            "(root '/models/tiny-teacher' -> '/models/another'; max_model_len 64 -> 32); "
            "allowed: the run's own teacher behind teacher.url (a resume is checked against it again)"
        )
        other.name = "student"  # and one that serves another name
        with pytest.raises(TeacherUnavailable, match=r"HTTP 404 from /v1/completions: The model `teacher` does not exist"):
            t.score(probe_batch(BATCH))
        t.close()
    finally:
        other.stop()


# -- SIGTERM while waiting ---------------------------------------------------------------------


def test_sigterm_cuts_the_retries_short(tiny_pair, front):
    """A signal during the backoff: one more attempt at once, then the line (before: the backoff
    slept on, 6 s here, whatever the signal)."""
    t = client(tiny_pair, front.url, retries=1, backoff_s=6.0)
    front.faults = ["error500", "error500"]
    front.on_fault = lambda fault: threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM)).start() if front.completions == 1 else None
    start = time.monotonic()
    with PreemptionGuard() as guard, pytest.raises(TeacherUnavailable) as ex:
        t.score(probe_batch(BATCH))
    assert guard.signum == signal.SIGTERM
    assert time.monotonic() - start < 3.0
    assert str(ex.value) == lost(
        front.url,
        "HTTP 500 from /v1/completions: EngineCore died (after 2 attempts; SIGTERM received: the retries were cut short)",
        retries=1,
        backoff="6",
    )
    t.close()


def test_sigterm_during_a_backoff_reaches_the_step_boundary_and_exit_75(tiny_pair, front, tmp_path):
    """Mid-run, one request fails and SIGTERM comes while the client waits to retry: the retry goes
    at once, the step finishes, the run stops at its boundary (Preempted: exit 75) with the step
    saved. Before: the 30 s backoff was slept through first."""
    cfg = small_config(divergence={"name": "rkl"}, estimator={"name": "topk", "k": 6}, trainer={"max_steps": 3, "micro_batch_size": 4})
    run = tmp_path / "run"
    t = Trainer(served(cfg, front.url, retries=2, backoff_s=30.0), run, pair=fresh(tiny_pair), task=AddTask())
    real = t.train_step

    def step():
        if t.step == 1:
            front.faults = ["error500"]
            front.on_fault = lambda fault: os.kill(os.getpid(), signal.SIGTERM)
        return real()

    t.train_step = step
    start = time.monotonic()
    with pytest.raises(Preempted) as ex:
        t.run()
    assert time.monotonic() - start < 20
    assert ex.value.step == 2 and ex.value.checkpoint == run / "checkpoints" / "step_000002"


# -- before training: the eval at step 0 ------------------------------------------------------


def test_a_fault_in_the_eval_before_training_is_one_line(tiny_pair, fake, tmp_path):
    """teacher.k >= V scores the step-0 eval through the server: lost there, the run ends in the
    teacher's one line (a ConfigError: exit 2), nothing to resume; before: an uncaught
    TeacherUnavailable traceback. The same command runs once the server is back."""
    V = tiny_pair.vocab_size
    cfg = small_config(estimator={"name": "full"}, trainer={"max_steps": 1})
    t = Trainer(served(cfg, fake.url, k=V), tmp_path / "run", pair=fresh(tiny_pair), task=AddTask())
    fake.mode = "error500"
    with pytest.raises(ConfigError) as ex:
        t.run()
    assert str(ex.value) == lost(fake.url, "HTTP 500 from /v1/completions: EngineCore died")
    fake.mode = "ok"
    summary = Trainer(served(cfg, fake.url, k=V), tmp_path / "run", pair=fresh(tiny_pair), task=AddTask()).run()
    assert summary["steps"] == 1


# -- the URL -----------------------------------------------------------------------------------


def test_a_url_ending_in_v1_is_normalised_with_a_notice(tiny_pair, fake):
    """The OpenAI clients' base URL (``.../v1``): the client drops it, says so, and works (before:
    a bare 404 from /v1/v1/models)."""
    cfg = served(small_config(estimator={"name": "topk", "k": 4}), fake.url + "/v1/", k=4)
    lines: list[str] = []
    t = build_served_teacher(cfg, tiny_pair.vocab_size, tiny_pair.tokenizer, None, warn=lines.append)
    assert t.base == fake.url
    assert lines[0] == f"opd-train: teacher.url={fake.url}/v1/ ends in /v1, which the client adds itself: using {fake.url}"
    t.score(probe_batch(BATCH))
    t.close()


def test_credentials_in_the_url_are_sent_as_basic_auth_and_never_shown(tiny_pair, front):
    """``http://user:PASSWORD@host``: the client sends ``Authorization: Basic ...`` (before: the URL
    could not be used), and every line it writes shows the URL without them."""
    host = front.url.split("://")[1]
    front.auth = "Basic " + base64.b64encode(b"user:pa ss@1").decode()
    t = client(tiny_pair, f"http://user:pa%20ss%401@{host}")
    t.score(probe_batch(BATCH))
    assert set(front.seen_auth) == {front.auth}
    assert t.base == front.url and "pa" not in str(t.identity())
    front.faults = ["disconnect"]
    with pytest.raises(TeacherUnavailable) as ex:
        t.score(probe_batch(BATCH))
    assert str(ex.value).startswith(f"teacher.url={front.url} (model 'teacher'): the connection broke")
    t.close()
    with pytest.raises(ConfigError) as ex:  # the wrong password: the server's 401, in one line
        client(tiny_pair, f"http://user:wrong@{host}")
    assert str(ex.value).startswith(f"teacher.url={front.url} (model 'teacher'): HTTP 401 from /v1/models: Unauthorized; allowed:")


def test_redaction_of_url_credentials():
    from opd_exp.cli.errors import one_line
    from opd_exp.runtime.secrets import REDACTED, redact_url, scrub, scrub_text

    assert redact_url("teacher.url=http://user:PASSWORD@10.0.0.1:8000 x") == f"teacher.url=http://user:{REDACTED}@10.0.0.1:8000 x"
    assert redact_url("https://TOKEN@h/x and http://u:p@ss@h:1") == f"https://{REDACTED}@h/x and http://u:{REDACTED}@h:1"
    assert scrub({"teacher": {"url": "http://u:PASSWORD@h:1"}}, secrets=[]) == {"teacher": {"url": f"http://u:{REDACTED}@h:1"}}
    assert scrub_text("- teachers.map.a.url=http://u:PASSWORD@h:1\n", secrets=[]) == f"- teachers.map.a.url=http://u:{REDACTED}@h:1\n"
    line = one_line(ConfigError("teacher.url='http://u:PASSWORD@h' is not allowed; allowed: http://HOST:PORT"))
    assert "PASSWORD" not in line
    assert redact_url("see http://host:8000/v1 or mailto:a@b") == "see http://host:8000/v1 or mailto:a@b"


def test_a_run_given_url_credentials_writes_them_nowhere(local_pair_dir, tmp_path, monkeypatch, capsys):
    """teacher.url and teachers.map.<name>.url with a password: after the refusal (no server
    there) neither .hydra/, history.yaml, W&B's files nor stderr holds it."""
    from helpers.reliability import BASE, pair_args, run_cli

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    cases = {
        "one": [f"teacher.url=http://user:PASSWORD1@127.0.0.1:{port}"],
        "map": [f"+teachers.map.t={{path: {local_pair_dir / 'teacher'}, url: 'http://user:PASSWORD2@127.0.0.1:{port}'}}"],
    }
    for name, extra in cases.items():
        run = tmp_path / name
        base = [a for a in BASE if a != "logger=none"]
        args = [*base, *pair_args(local_pair_dir), "logger=wandb", "estimator=topk", "estimator.k=4", "teacher=served", *extra]
        code, out, err = run_cli([*args, f"hydra.run.dir={run}"], monkeypatch, capsys)
        assert code == 2, err[-2000:]
        assert (
            err.strip()
            .splitlines()[-1]
            .startswith(f"opd-train: error: teacher.url=http://127.0.0.1:{port} (model 'teacher'): cannot reach the server (")
        ), err
        assert "PASSWORD" not in out + err
        assert (run / ".hydra" / "overrides.yaml").is_file() and (run / "wandb").is_dir()
        leaks = [str(f) for f in run.rglob("*") if f.is_file() and b"PASSWORD" in f.read_bytes()]
        assert leaks == []
        assert "user:<redacted>@127.0.0.1" in (run / ".hydra" / "overrides.yaml").read_text()


# -- teacher.self_test=false: whose accuracy ---------------------------------------------------


def test_without_the_self_test_the_summary_says_the_teacher_accuracy_is_the_local_copys(tiny_pair, fake, tmp_path, capsys):
    """The served teacher was never compared with the in-process copy whose greedy answers give
    eval/teacher_accuracy: the summary line says so (before: shown as the teacher's)."""
    cfg = small_config(estimator={"name": "topk", "k": 6}, trainer={"max_steps": 1})
    summary = Trainer(served(cfg, fake.url, self_test=False), tmp_path / "run", pair=fresh(tiny_pair), task=AddTask()).run()
    assert summary["pair"]["teacher_server"]["self_tested"] is False
    acc = summary["eval/teacher_accuracy"]
    out, err = capsys.readouterr()
    assert f"(teacher {acc:.3f}, the in-process copy's: teacher.self_test=false, not the server's)" in out
    assert (
        f"opd-train: warning: the served teacher at {fake.url} was not compared with the pair's in-process teacher "
        "(teacher.self_test=false): eval/teacher_accuracy is the in-process copy's, not the server's"
    ) in err
    # with the self-test: the teacher's accuracy, as before
    summary = Trainer(served(cfg, fake.url), tmp_path / "checked", pair=fresh(tiny_pair), task=AddTask()).run()
    assert "self_tested" not in summary["pair"]["teacher_server"]
    assert f"(teacher {summary['eval/teacher_accuracy']:.3f}); " in capsys.readouterr().out
