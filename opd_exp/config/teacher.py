"""The ``teacher`` group: where the teacher's scores come from, and the limits of each kind.

Kinds (``teacher.name``, a registry: ``training.teachers.register_teacher_scorer`` adds one):

* ``in_process``: the pair's frozen teacher in this process (dense logits);
* ``served``: a stock vLLM OpenAI-compatible server (top-k + sampled-token log-probs);
* teachers made from the student (on-policy self-distillation; ``training/teacher_student.py``):
  ``ema`` (an exponential moving average of the student's weights, ``teacher.decay``), ``lagged``
  (a copy refreshed every ``teacher.refresh_every`` applied updates) and ``live`` (the current
  student itself, without gradient).

``teacher.privileged`` (every in-process kind): the teacher is asked the problem plus privileged
context (the task's worked solution or final answer) and scores the student's response tokens
under that prompt; the student never sees it.

``teacher.align=bytes`` (in process or served): a teacher with ANOTHER tokenizer. The student's sampled text is
rendered for the teacher with the teacher's tokenizer, the teacher scores its own tokens, and the two
tokenizations are aligned by byte offsets into chunks (``training/teacher_align.py``,
``divergences/chunks.py``); the teacher's chunk log-probs go to ``estimator=sampled`` as a sampled-only
payload whose rkl costs sum to log S(y) - log T_canon(x): with ``loss.credit=sequence`` (gamma=1) an
unbiased estimate of the gradient of the sequence-level KL(S || T_canon) (docs/training.md, "Teachers
with another tokenizer").
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from opd_exp.config.checks import check as _check
from opd_exp.config.checks import fail as _fail
from opd_exp.config.checks import finite as _finite
from opd_exp.config.choices import RegistryChoice

# name -> what it is (the built-in kinds; a registered scorer adds its own)
BUILT_IN = {
    "in_process": "the pair's teacher in the training process (dense logits)",
    "served": "a vLLM OpenAI-compatible server (top-k + sampled-token log-probs)",
    "ema": "an exponential moving average of the student's weights (teacher.decay)",
    "lagged": "a copy of the student refreshed every teacher.refresh_every applied updates",
    "live": "the current student itself, scored without gradient",
}
TeacherName = RegistryChoice("TeacherName", [(n, n) for n in BUILT_IN])
FROM_STUDENT = ("ema", "lagged", "live")  # kinds whose weights are the student's
ALIGN = ("none", "bytes")  # teacher.align
ALIGN_PLACEMENTS = ("sequence", "chunk")  # teacher.align_placement (divergences.chunks.PLACEMENTS)
ALIGN_VOCABS = ("none", "shared")  # teacher.align_vocab
SHARED_VOCAB_ESTIMATORS = ("full", "topk")  # what teacher.align_vocab=shared feeds
# what a teacher that is the student may do instead (here and in pairs.load.check_teacher_is_not_student)
SELF_TEACHER_ALLOWED = (
    "teacher.privileged=solution|answer (the student with privileged context as its own teacher), "
    "or teacher=ema|lagged (self-distillation, named; a frozen copy of the starting student, as a negative control: "
    "teacher=lagged with teacher.refresh_every above trainer.max_steps)"
)


class Privileged(Enum):
    none = "none"  # the teacher sees what the student sees
    solution = "solution"  # plus the task's worked solution (Problem.solution)
    answer = "answer"  # plus the final answer (Problem.answer)


@dataclass
class TeacherConfig:
    """Where the teacher's scores come from (docs/engines.md). Only ``name`` matters in process."""

    # in_process: the pair's teacher in this process | served: a stock vLLM OpenAI-compatible
    # server (opd-serve-teacher starts one), read through its prompt_logprobs | ema | lagged | live:
    # made from the student (module docstring) | any registered with register_teacher_scorer
    name: TeacherName = TeacherName.in_process
    # ema: theta_T <- decay * theta_T + (1 - decay) * theta_S after every applied update, from the
    # student's starting weights (TRL's teacher_update_rate is 1 - decay)
    decay: float = 0.99
    # lagged: the teacher's weights are the student's of the last multiple of refresh_every updates
    refresh_every: int = 10
    # none | solution | answer: privileged context in the teacher's prompt (never the student's)
    privileged: Privileged = Privileged.none
    # served: http://HOST:PORT of the server (where it runs; not part of the teacher's identity)
    url: str | None = None
    # served: the model name the server serves (vLLM --served-model-name)
    model: str = "teacher"
    # served: top-k log-probs asked per position (vLLM prompt_logprobs; the server's
    # --max-logprobs must allow it); null: estimator.k. The exact loss needs k >= vocabulary
    k: int | None = None
    # served: seconds one request may take before it counts as failed
    timeout_s: float = 120.0
    # served: attempts after a failed request (connection error, 5xx, timeout), then the run stops
    retries: int = 3
    # served: seconds before the first retry, doubled at each next one
    backoff_s: float = 1.0
    # served: sequences per request (the server batches them)
    rows_per_request: int = 8
    # served: requests in flight at once (a thread each)
    max_in_flight: int = 4
    # served: send every micro-batch's request at the step's start, so the server scores
    # micro-batch i+1 while the trainer computes micro-batch i (same scores, same step)
    overlap: bool = True
    # served: before training, score one sequence twice (equal) and compare it with the pair's
    # in-process teacher; refuse when they differ by more than self_test_atol (nats, max over tokens)
    self_test: bool = True
    self_test_atol: float = 1e-3
    # none: the teacher scores the student's tokens (one tokenizer) | bytes: the teacher scores its
    # own tokenization of the student's text, aligned by byte offsets (in_process or served; module docstring)
    align: str = "none"
    # bytes: where each teacher log-prob is placed among the student's tokens: sequence (the whole
    # teacher log-prob at the row's last token: exact for every pair of tokenizers) | chunk (at each
    # chunk's last student token: exact without teacher look-ahead, biased with it; identical
    # tokenizers give the same losses as align=none)
    align_placement: str = "sequence"
    # bytes: none (the chunk payload above, estimator=sampled) | shared: the teacher's next-token
    # distribution at one-to-one chunks mapped onto the student's vocabulary through identical token
    # strings, plus one tail bucket per side, for estimator=full|topk (GOLD/ULD-style; BIASED for the
    # sequence KL, measured in docs/training.md; training/shared_vocab.py)
    align_vocab: str = "none"
    # bytes: allow what is biased for the sequence KL (loss.credit=token or gamma < 1; placement=chunk
    # with a teacher whose tokenizer is not the student's), named on purpose
    align_biased: bool = False

    def __post_init__(self) -> None:
        if self.k is not None:
            _check(isinstance(self.k, int) and self.k >= 1, "teacher.k", self.k, "null (estimator.k) or an integer >= 1")
        _check(_finite(self.timeout_s) and self.timeout_s > 0, "teacher.timeout_s", self.timeout_s, "> 0")
        _check(isinstance(self.retries, int) and self.retries >= 0, "teacher.retries", self.retries, "integer >= 0")
        _check(_finite(self.backoff_s) and self.backoff_s >= 0, "teacher.backoff_s", self.backoff_s, ">= 0")
        _check(self.rows_per_request >= 1, "teacher.rows_per_request", self.rows_per_request, "integer >= 1")
        _check(self.max_in_flight >= 1, "teacher.max_in_flight", self.max_in_flight, "integer >= 1")
        _check(_finite(self.self_test_atol) and self.self_test_atol > 0, "teacher.self_test_atol", self.self_test_atol, "> 0")
        _check(_finite(self.decay) and 0.0 <= self.decay < 1.0, "teacher.decay", self.decay, "0 <= decay < 1 (1 would never move)")
        _check(isinstance(self.refresh_every, int) and self.refresh_every >= 1, "teacher.refresh_every", self.refresh_every, "integer >= 1")
        name = self.name.value
        if name == "live" and self.privileged is Privileged.none:
            # D(S || S) = 0 at every token: a run that trains on nothing and says nothing
            _fail(
                "teacher.privileged",
                "none",
                "solution or answer with teacher=live (the live student scoring its own tokens gives zero signal); "
                "or teacher=ema / lagged / in_process",
            )
        _check(self.align in ALIGN, "teacher.align", self.align, " | ".join(ALIGN))
        _check(self.align_placement in ALIGN_PLACEMENTS, "teacher.align_placement", self.align_placement, " | ".join(ALIGN_PLACEMENTS))
        _check(self.align_vocab in ALIGN_VOCABS, "teacher.align_vocab", self.align_vocab, " | ".join(ALIGN_VOCABS))
        _check(isinstance(self.align_biased, bool), "teacher.align_biased", self.align_biased, "true or false")
        if self.url is not None:
            ok = self.url.startswith(("http://", "https://")) and len(self.url.split("://", 1)[1].strip("/")) > 0
            _check(ok, "teacher.url", self.url, "http://HOST:PORT (the server opd-serve-teacher prints)")

    @property
    def served(self) -> bool:
        return self.name is TeacherName.served

    @property
    def from_student(self) -> bool:
        return self.name.value in FROM_STUDENT


def validate_teacher(cfg) -> None:
    """What a served teacher cannot do, known from the config alone (what depends on the
    vocabulary is checked by the objective once the pair is loaded)."""
    te = cfg.teacher
    if te.from_student and cfg.teachers.active:
        _fail(
            "teacher.name",
            te.name.value,
            f"in_process or served with teachers.map (a map's teachers are frozen models), not {te.name.value}",
        )
    if te.from_student and cfg.rollout.on_policy_fraction < 1.0:
        _fail(
            "rollout.on_policy_fraction",
            cfg.rollout.on_policy_fraction,
            f"1.0 with teacher={te.name.value} (its rollouts would be the student's own: no teacher-sampled steps)",
        )
    if te.align == "bytes":
        validate_align(cfg)
    elif te.align_vocab != "none":
        _fail(
            "teacher.align_vocab",
            te.align_vocab,
            "none with teacher.align=none (the map is between two tokenizers), or teacher.align=bytes",
        )
    validate_not_the_student(cfg)
    if not te.served:
        return
    if te.privileged is not Privileged.none:
        _fail(
            "teacher.privileged",
            te.privileged.value,
            "none with teacher=served (the server is sent the student's prompt), or an in-process teacher",
        )
    if te.url is None and not cfg.teachers.active:  # several teachers: each one's teachers.map.<name>.url
        _fail("teacher.url", None, "http://HOST:PORT of a running vLLM server with teacher=served (opd-serve-teacher prints it)")
    if cfg.divergence.temperature != 1.0:
        _fail(
            "divergence.temperature",
            cfg.divergence.temperature,
            "1.0 with teacher=served (a server returns log-probs of the untempered logits; those of tempered logits cannot be "
            "recovered from its top-k), or teacher=in_process",
        )
    k = te.k if te.k is not None else cfg.estimator.k
    if cfg.estimator.name.value in ("topk", "topk_renorm", "topk_generalized_kl") and cfg.estimator.k > k:
        _fail("estimator.k", cfg.estimator.k, f"at most teacher.k={k} with teacher=served (the server sends its top-{k})")


def validate_not_the_student(cfg) -> None:
    """The pair's teacher is the student's own model (the same value, or two paths to one folder)
    and has nothing the student lacks (``teacher.privileged=none``): D(S || S) = 0 at every token,
    a run that trains on nothing. One line before anything loads (a copy in another folder is
    refused once the pair is loaded: ``pairs.load.check_teacher_is_not_student``)."""
    te, pair = cfg.teacher, cfg.model_pair
    if te.privileged is not Privileged.none or te.name.value not in ("in_process", "served") or cfg.teachers.active:
        return
    student, teacher = getattr(pair, "student", None), getattr(pair, "teacher", None)  # the schema's "???" before a pair is set
    if isinstance(student, str) and isinstance(teacher, str) and student.strip() and same_source(student, teacher):
        _fail(
            "model_pair.teacher",
            teacher,
            f"a teacher other than the student (model_pair.student={student!r} is the same model: the student scoring its own "
            f"tokens gives zero signal), or {SELF_TEACHER_ALLOWED}",
        )


def same_source(student: str, teacher: str) -> bool:
    """Whether two ``model_pair`` values name one model: the same string, or two paths to one folder."""
    if student == teacher:
        return True
    a, b = Path(student).expanduser(), Path(teacher).expanduser()
    return a.is_dir() and b.is_dir() and a.resolve() == b.resolve()


def validate_align(cfg) -> None:
    """What ``teacher.align=bytes`` can feed: the sampled-only chunk payload, proven for reverse KL
    with sequence credit (divergences/chunks.py); one line for anything else."""
    te, why = cfg.teacher, "with teacher.align=bytes"
    if te.name.value not in ("in_process", "served"):
        _fail("teacher.name", te.name.value, f"in_process or served {why} (a student-made teacher has the student's tokenizer)")
    if cfg.teachers.active and te.align_vocab == "shared":
        # each teacher's shared vocabulary has its own size: its payloads cannot be laid row by row in one tensor
        _fail(
            "teacher.align_vocab",
            te.align_vocab,
            "none with teachers.map (routed teachers each give the chunk payload on the student's tokens), or one teacher",
        )
    if te.align_vocab == "shared":
        return validate_shared_vocab(cfg)
    if cfg.estimator.name.value != "sampled":
        _fail(
            "estimator.name",
            cfg.estimator.name.value,
            f"sampled {why} (the teacher's distribution is over its own vocabulary: only the sampled text's log-prob is shared); "
            "or full | topk with teacher.align_vocab=shared (biased, docs/training.md)",
        )
    if cfg.divergence.name.value != "rkl":
        _fail(
            "divergence.name",
            cfg.divergence.name.value,
            f"rkl {why} (only reverse KL's sequence log-ratio is a sum of chunk log-ratios; docs/training.md)",
        )
    if cfg.estimator.baseline.reads_teacher:
        _fail(
            "estimator.baseline",
            cfg.estimator.baseline.value,
            f"none or loo {why} (exact and topk need the teacher's distribution over the student's tokens; loo reads "
            "only the other samples' costs)",
        )
    credit, gamma = cfg.loss.credit.value, cfg.loss.gamma
    if (credit != "sequence" or gamma != 1.0) and not te.align_biased:
        key, value = ("loss.credit", credit) if credit != "sequence" else ("loss.gamma", gamma)
        _fail(
            key,
            value,
            f"loss.credit=sequence with loss.gamma=1.0 {why} (the unbiased estimate of grad KL(S || T_canon)); "
            "or teacher.align_biased=true to train the biased prefix-frozen chunk objective",
        )
    if cfg.rollout.on_policy_fraction < 1.0:
        _fail(
            "rollout.on_policy_fraction", cfg.rollout.on_policy_fraction, f"1.0 {why} (teacher-sampled steps need the exact per-token loss)"
        )
    if cfg.rollout.filtered:
        key, value = ("rollout.top_k", cfg.rollout.top_k) if cfg.rollout.top_k > 0 else ("rollout.top_p", cfg.rollout.top_p)
        _fail(key, value, f"rollout.top_k=0 and rollout.top_p=1.0 {why} (the filtered-mass term needs the teacher's distribution)")
    if te.privileged is not Privileged.none:
        _fail("teacher.privileged", te.privileged.value, f"none {why}")


def validate_shared_vocab(cfg) -> None:
    """What ``teacher.align_vocab=shared`` feeds: the dense or top-k estimator on the teacher's next-token
    distribution written over the student's vocabulary (training/shared_vocab.py); one line otherwise."""
    te, why = cfg.teacher, "with teacher.align_vocab=shared"
    if te.name.value != "in_process":
        _fail("teacher.name", te.name.value, f"in_process {why} (the map needs the teacher's whole next-token distribution)")
    est = cfg.estimator.name.value
    if est not in SHARED_VOCAB_ESTIMATORS:
        allowed = " | ".join(SHARED_VOCAB_ESTIMATORS)
        _fail("estimator.name", est, f"{allowed} {why} (estimator=sampled takes the unbiased chunk payload: teacher.align_vocab=none)")
    if cfg.positions.name.value == "entropy_gate":
        _fail("positions.name", "entropy_gate", f"a rule that reads no teacher entropy {why} (the teacher's is over its own vocabulary)")
    if cfg.rollout.on_policy_fraction < 1.0:
        _fail("rollout.on_policy_fraction", cfg.rollout.on_policy_fraction, f"1.0 {why} (a teacher-sampled row is in the teacher's tokens)")
    if cfg.rollout.filtered:
        key, value = ("rollout.top_k", cfg.rollout.top_k) if cfg.rollout.top_k > 0 else ("rollout.top_p", cfg.rollout.top_p)
        _fail(key, value, f"rollout.top_k=0 and rollout.top_p=1.0 {why} (the filtered-mass term needs the teacher's distribution)")
    if te.privileged is not Privileged.none:
        _fail("teacher.privileged", te.privileged.value, f"none {why}")
