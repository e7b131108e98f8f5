"""Evaluation: greedy accuracy through a rollout engine, and the exact eval divergences.

One path for every caller: the trainer (``eval/*`` metrics, the teacher's accuracy) and
``opd-prepare`` (the accuracy stored with a prepared pair) decode the same way — prompts
rendered by the task, left padding, the response cut at the first EOS of the model's
generation config or tokenizer — so their numbers agree on any pair.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from opd_exp.config.schema import TrainConfig
from opd_exp.divergences import Divergence, get_divergence
from opd_exp.runtime.errors import ConfigError
from opd_exp.training.monitors import metric_beta
from opd_exp.training.rollout import Batch, ModuleRollout, RolloutEngine, decode_responses
from opd_exp.training.sampling import SamplingSpec
from opd_exp.training.scoring import TeacherScorer, entropy

# opd-prepare checks models on short prompts of its own task: no cut needed
UNCAPPED_PROMPT_TOKENS = 1 << 20


def greedy_batches(engine: RolloutEngine, tokenizer, task, problems: Sequence[Any], batch_size: int) -> Iterator[tuple[list, Batch]]:
    """(problems, greedy batch) in chunks of ``batch_size``."""
    for start in range(0, len(problems), batch_size):
        chunk = list(problems[start : start + batch_size])
        prompts = [task.render_prompt(p, tokenizer) for p in chunk]
        yield chunk, engine.generate(prompts, greedy=True)


def accuracy(engine: RolloutEngine, tokenizer, task, problems: Sequence[Any], batch_size: int, *, return_completions: bool = False) -> dict:
    """Greedy accuracy and format rate (share of completions whose answer parses)."""
    if not problems:
        return {"accuracy": 0.0, "format_rate": 0.0, "n": 0}
    completions: list[str] = []
    correct = formatted = 0
    for chunk, batch in greedy_batches(engine, tokenizer, task, problems, batch_size):
        texts = decode_responses(tokenizer, batch)
        completions += texts
        correct += sum(bool(task.verify(t, p.answer)) for t, p in zip(texts, chunk))
        formatted += sum(task.extract_answer(t) is not None for t in texts)
    n = len(problems)
    out = {"accuracy": correct / n, "format_rate": formatted / n, "n": n}
    if return_completions:
        out["completions"] = completions
    return out


def evaluate_accuracy(
    model, tokenizer, task, problems: Sequence[Any], batch_size: int = 64, max_new_tokens: int = 64, return_completions: bool = False
) -> dict:
    """Greedy accuracy of a bare model (``opd-prepare``, benchmarks): an HF engine around it, run as
    episodes when the task has an environment (``max_new_tokens`` then caps each turn)."""
    from types import SimpleNamespace

    from opd_exp.tasks.environment import build_environment

    ro = SimpleNamespace(max_new_tokens=max_new_tokens, max_prompt_tokens=UNCAPPED_PROMPT_TOKENS)
    engine = ModuleRollout(model, tokenizer, ro, vocab_size=len(tokenizer), sampling=SamplingSpec())
    env = build_environment(task)
    if env is not None:  # a task with an environment: greedy episodes, up to the environment's own turn limit
        from opd_exp.training.episodes import EpisodeRollout

        engine = EpisodeRollout(engine, env)
    return accuracy(engine, tokenizer, task, problems, batch_size, return_completions=return_completions)


# What ``Evaluator`` needs per batch: sums over its response positions of each divergence
# (name -> Divergence), and with ``with_entropy`` of the student's entropy (key ``ENTROPY``).
PositionSums = Callable[[Batch, Mapping[str, Divergence], bool], dict[str, float]]
ENTROPY = "entropy"


def logit_sums(
    student_z: torch.Tensor, teacher_z: torch.Tensor | None, mask: torch.Tensor, divergences, chunk_size=None, with_entropy=False
) -> dict[str, float]:
    """Sums over the masked positions of each divergence's exact value (and of the student's
    entropy), from materialised logits ``[..., V]``."""
    m = mask.bool()
    out = {name: float(d.full(student_z, teacher_z, mask=m, chunk_size=chunk_size).sum()) for name, d in divergences.items()}
    if with_entropy:
        out[ENTROPY] = float(entropy(student_z)[m].sum())
    return out


# Row seeds of the eval samples: the same draws at every eval, so curves compare like with like.
EVAL_SAMPLE_SEED = 982_451_653


def sample_metrics(correct: Sequence[Sequence[bool]], found: Sequence[set] | None = None, n_answers: Sequence[int] | None = None) -> dict:
    """Metrics of k temperature-1 samples per prompt.

    ``correct[i][j]``: sample j of prompt i is correct. ``found[i]``: the distinct correct
    answers among prompt i's samples, ``n_answers[i]``: how many valid answers it has (both
    only for tasks that list their answers).

    * ``eval/precision``  share of all samples that are correct
    * ``eval/pass@k``     share of prompts with at least one correct sample
    * ``eval/coverage``   mean over prompts of |found| / n_answers
    """
    n = len(correct)
    if n == 0:
        return {}
    out = {
        "eval/precision": sum(sum(c) / max(len(c), 1) for c in correct) / n,
        "eval/pass@k": sum(any(c) for c in correct) / n,
    }
    if found is not None and n_answers is not None:
        out["eval/coverage"] = sum(len(f) / max(a, 1) for f, a in zip(found, n_answers)) / n
    return out


class Evaluator:
    """``eval/accuracy`` of the student's greedy responses, and on the same responses the exact
    divergences over the vocabulary (same S and T as the objective), per response token.

    With ``samples`` = k > 0 it also draws k responses per prompt from the student's sampling
    distribution (the rollout's temperature/top-k/top-p, fixed row seeds) and logs
    ``eval/precision``, ``eval/pass@k``, ``eval/entropy`` (the student's mean per-token
    entropy on those samples) and, when every problem lists its valid answers
    (``problem.answers``), ``eval/coverage``.
    """

    def __init__(
        self,
        task,
        tokenizer,
        problems: Sequence[Any],
        *,
        batch_size: int,
        divergences: dict[str, Divergence],
        student_logits: Callable[[Batch], torch.Tensor],
        teacher: TeacherScorer,
        chunk_size=None,
        on_prompts: Callable[[list[str]], Any] | None = None,
        samples: int = 0,
        position_sums: PositionSums | None = None,
        routing=None,
        teacher_view: Callable[[Batch, Sequence[Any]], Batch] | None = None,
    ):
        self.task, self.tokenizer, self.problems, self.batch_size = task, tokenizer, list(problems), batch_size
        self.samples = samples
        self.divergences, self.student_logits, self.teacher, self.chunk_size = divergences, student_logits, teacher, chunk_size
        self.on_prompts = on_prompts  # sees every rendered prompt (the trainer counts over-long ones)
        # the fused LM-head path passes its own (no [N, R, V] logits); by default both models' logits
        self.position_sums = position_sums or self._materialised_sums
        # several teachers (training/routing.py): each eval row scored by its prompt's teacher, and
        # eval/teacher/<name>/accuracy on each one's prompts
        self.routing = routing
        # teacher.privileged: the eval divergences are to the teacher as it scores in training
        self.teacher_view = teacher_view or (lambda batch, problems: batch)

    def _materialised_sums(self, batch: Batch, divergences: Mapping[str, Divergence], with_entropy: bool) -> dict[str, float]:
        zs = self.student_logits(batch)
        # dense (in-process, or a served payload that covers the vocabulary): the trainer passes no
        # divergences for a sparse teacher; the entropy alone needs no teacher
        zt = self.teacher.score(batch).logits if divergences else None
        return logit_sums(zs, zt, batch.response_mask, divergences, self.chunk_size, with_entropy)

    def _batches(self, engine, problems=None):
        problems = self.problems if problems is None else problems
        for chunk, batch in greedy_batches(engine, self.tokenizer, self.task, problems, self.batch_size):
            if self.on_prompts is not None:
                self.on_prompts([self.task.render_prompt(p, self.tokenizer) for p in chunk])
            batch = batch if self.routing is None else self.routing.attach(batch, chunk)
            yield chunk, self.teacher_view(batch, chunk)

    def accuracy(self, engine: RolloutEngine, problems: Sequence[Any] | None = None) -> float:
        """Greedy accuracy on the eval set (or on ``problems``, a part of it)."""
        problems = self.problems if problems is None else problems
        correct = 0
        for chunk, batch in self._batches(engine, problems):
            texts = decode_responses(self.tokenizer, batch)
            correct += sum(bool(self.task.verify(t, p.answer)) for t, p in zip(texts, chunk))
        return correct / max(len(problems), 1)

    @torch.no_grad()
    def __call__(self, engine: RolloutEngine, device) -> dict[str, float]:
        correct, n_tok, sums = [], 0, defaultdict(float)
        episodes = []  # an episode engine's (training/episodes.py), for its environment's metrics
        for chunk, batch in self._batches(engine):
            episodes += getattr(engine, "last_episodes", [])
            batch = batch.to(device)
            texts = decode_responses(self.tokenizer, batch)
            correct += [bool(self.task.verify(t, p.answer)) for t, p in zip(texts, chunk)]
            for name, v in self.position_sums(student_positions(batch), self.divergences, False).items():
                sums[name] += v
            n_tok += batch.num_trained_tokens
        out = {k: v / max(n_tok, 1) for k, v in sums.items()}
        out["eval/accuracy"] = sum(correct) / max(len(self.problems), 1)
        if episodes:  # the environment's own metrics (tools/* for the calculator) on the greedy episodes
            out.update({f"eval/{k}": v for k, v in engine.env.metrics(episodes).items()})
        if self.routing is not None:
            out.update(self.routing.accuracies(self.problems, correct))
        if self.samples > 0:
            out.update(self.sampled(engine, device))
        return out

    @torch.no_grad()
    def sampled(self, engine: RolloutEngine, device) -> dict[str, float]:
        """The k-sample metrics (see the class docstring)."""
        k = self.samples
        listed = bool(self.problems) and all(getattr(p, "answers", None) for p in self.problems)
        extract = getattr(self.task, "extract_answer", None)
        correct: list[list[bool]] = []
        found: list[set] = []
        ent_sum, n_tok = 0.0, 0
        per_chunk = max(1, self.batch_size // k)
        for start in range(0, len(self.problems), per_chunk):
            chunk = self.problems[start : start + per_chunk]
            prompts = [self.task.render_prompt(p, self.tokenizer) for p in chunk]
            seeds = [EVAL_SAMPLE_SEED + (start + i) * k + j for i in range(len(chunk)) for j in range(k)]
            batch = engine.generate(prompts, seeds, n_samples=k).to(device)
            texts = decode_responses(self.tokenizer, batch)
            ent_sum += self.position_sums(student_positions(batch), {}, True)[ENTROPY]
            n_tok += batch.num_trained_tokens
            for i, p in enumerate(chunk):
                rows = texts[i * k : (i + 1) * k]
                ok = [bool(self.task.verify(t, p.answer)) for t in rows]
                correct.append(ok)
                if listed and extract is not None:
                    found.append({extract(t) for t, good in zip(rows, ok) if good})
        out = sample_metrics(
            correct, found if listed and extract is not None else None, [len(p.answers) for p in self.problems] if listed else None
        )
        out["eval/entropy"] = ent_sum / max(n_tok, 1)
        return out


def student_positions(batch: Batch) -> Batch:
    """``batch`` with its layout mask narrowed to the student's own tokens, where an episode has
    others (the environment's): the eval divergences and entropy are over what the student wrote.
    One-turn batches are returned as they are."""
    if batch.loss_mask is None:
        return batch
    import dataclasses

    return dataclasses.replace(batch, response_mask=batch.response_mask & batch.loss_mask.bool(), loss_mask=None)


def require_finite(out: dict[str, Any], step: int) -> dict[str, Any]:
    """The evaluation before training (or on an extension's new eval set), checked: a non-finite
    value (a teacher with NaN/inf log-probs) stops the run at once (``Diverged``, exit 3), since
    every training step would be skipped."""
    from opd_exp.runtime.guards import Diverged

    bad = [f"{k}={v}" for k, v in out.items() if isinstance(v, float) and not math.isfinite(v)]
    if bad:
        raise Diverged(
            f"the evaluation before training (step {step}) is not finite ({', '.join(bad)}): the teacher's or the student's "
            f"log-probs are not finite, so every step would be skipped; stopped before training, no checkpoint written; "
            f"allowed: a teacher (and student) with finite log-probs"
        )
    return out


def eval_problems(cfg: TrainConfig, train: Sequence[Any], evals: Sequence[Any]) -> list:
    """The eval set (``eval.size`` of the task's eval split; 0: all of it). An empty split,
    or an eval size larger than the split, is one line (never clipped in silence)."""
    for split, problems in (("training", train), ("eval", evals)):
        if not problems:
            raise ConfigError(
                f"task: {cfg.task.name!r} has no {split} problems (empty dataset or split); allowed: a task with at least one"
            )
    size = cfg.eval.size
    if size > len(evals):
        raise ConfigError(
            f"eval.size={size} is more than the {len(evals)} eval problems of task {cfg.task.name!r}; "
            f"allowed: 0 (the whole split) up to {len(evals)}, or a larger task.n_eval"
        )
    return list(evals[:size] if size else evals)


class EvalDivergences(dict):
    """The fixed eval divergences (the two KLs, and JSD at ``metric_beta``: the variant's own beta
    for jsd, 0.5 otherwise, as ``jsd/mean``), plus ``eval/<name>`` (``own_key``): the trained
    divergence at its own parameters (what this variant optimises). When it equals one of the
    fixed ones (jsd at its beta, rkl, fkl) it is that value (``alias``), not a second pass."""

    def __init__(self, cfg: TrainConfig):
        super().__init__(
            {
                "eval/jsd": get_divergence("jsd", beta=metric_beta(cfg)),
                "eval/kl_reverse": get_divergence("rkl"),
                "eval/kl_forward": get_divergence("fkl"),
            }
        )
        if cfg.rollout.filtered:  # KL(T||S) is infinite under a filter: not logged (docs/training.md)
            del self["eval/kl_forward"]
        name = cfg.divergence.name.value
        own = get_divergence(name, **cfg.divergence.params())
        self.own_key = f"eval/{name}"
        self.alias = next((k for k, d in self.items() if type(d) is type(own) and d.params() == own.params()), None)
        if self.alias is None:
            self[self.own_key] = own

    def name_own(self, out: dict[str, Any]) -> dict[str, Any]:
        """``out`` with the trained divergence's value under its own name too (where it is an alias)."""
        if self.alias is not None and self.alias in out:
            out.setdefault(self.own_key, out[self.alias])
        return out
