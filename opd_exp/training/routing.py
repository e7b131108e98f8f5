"""Several teachers (``teachers.map``): which teacher scores each row, and what each one's tokens say.

``Router`` gives a problem its teacher by ``teachers.route`` (config/teachers.py) and writes a
batch's ``route`` (one teacher index per row). ``TeacherMap`` is a ``TeacherScorer`` over one
scorer per teacher: each scores the rows routed to it, and their scores are laid back in row
order. A batch whose rows all go to one teacher goes to it whole, so one teacher through the map
scores exactly as that teacher alone. With ``teacher.align=bytes`` each teacher is a byte-aligned
scorer over its own tokenizer whose sampled-only chunk payload sits on the student's positions, so
rows merge the same way (``align/*`` pooled over every teacher's chunks). The scores carry the
rows' routes (``RoutedScores``), from which ``RoutedMonitors`` adds per-teacher sums beside the step's monitors; ``teacher_metrics``
turns them into ``teacher/<name>/token_share`` (share of the step's response tokens) and
``teacher/<name>/{jsd,kl_reverse,kl_forward}`` (the step's ``jsd/mean``, ``kl/reverse``,
``kl/forward`` estimates over that teacher's tokens: sum_k share_k * value_k is the global one).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from opd_exp.config.teachers import FIELD, OPERATOR, OPERATORS, pick
from opd_exp.runtime.errors import ConfigError
from opd_exp.training.monitors import Monitors, Readings
from opd_exp.training.ppo import select_rows
from opd_exp.training.rollout import Batch
from opd_exp.training.scoring import Pending, TeacherScorer, TeacherScores
from opd_exp.training.teacher_align import ByteAlignedTeacher, align_metrics

# a step's per-token estimate -> its per-teacher name, and the exact value a teacher-sampled step logs under it
PER_TEACHER = {
    "jsd/mean": ("jsd", "exact/jsd"),
    "kl/reverse": ("kl_reverse", "exact/kl_reverse"),
    "kl/forward": ("kl_forward", "exact/kl_forward"),
}


def share_key(name: str) -> str:
    return f"teacher/{name}/token_share"


class Router:
    """A problem -> the index of its teacher in ``names`` (the order of ``teachers.map``)."""

    def __init__(self, teachers):
        self.route = teachers.route
        self.names = tuple(teachers.map)
        self.covers = [list(src.covers) for src in teachers.map.values()]

    def label(self, problem: Any) -> frozenset:
        """The route's values of ``problem``: its operators, or its column's value."""
        if self.route is None:
            return frozenset()
        if self.route == OPERATOR:
            return frozenset(c for c in problem.prompt if c in OPERATORS)
        column = self.route[len(FIELD) :]
        value = problem.get(column) if isinstance(problem, Mapping) else getattr(problem, column, None)
        if value is None:
            raise ConfigError(
                f"teachers.route={self.route!r}: a problem has no {column!r} ({str(getattr(problem, 'prompt', problem))[:60]!r}); "
                f"allowed: a column every problem of the task carries, or teachers.route=operator for arithmetic"
            )
        return frozenset({str(value)})

    def of(self, problem: Any) -> int:
        index = pick(self.covers, self.label(problem))
        if index is None:
            shown = sorted(self.label(problem))
            raise ConfigError(
                f"teachers.route={self.route!r}: no teacher covers a problem with {shown} ({str(getattr(problem, 'prompt', problem))[:60]!r}); "
                f"allowed: teachers.map entries whose covers include {shown}, or a catch-all teacher (covers=[])"
            )
        return index

    def check(self, splits: Mapping[str, Sequence[Any]]) -> dict[str, list[int]]:
        """Every problem of each split routed (one line for the first that cannot be): teacher -> problem count per split."""
        return {split: [sum(1 for p in problems if self.of(p) == k) for k in range(len(self.names))] for split, problems in splits.items()}

    def attach(self, batch: Batch, problems: Sequence[Any]) -> Batch:
        """``batch`` with each row's teacher (rows point into ``problems`` by ``prompt_index``)."""
        teacher = torch.tensor([self.of(p) for p in problems], dtype=torch.long)
        index = batch.prompt_index.cpu()
        return replace(batch, route=teacher[index].to(batch.prompt_index.device))

    def accuracies(self, problems: Sequence[Any], correct: Sequence[bool]) -> dict[str, float]:
        """``eval/teacher/<name>/accuracy``: the share of each teacher's prompts answered right."""
        hits: dict[int, list[bool]] = {}
        for p, ok in zip(problems, correct):
            hits.setdefault(self.of(p), []).append(ok)
        return {f"eval/teacher/{self.names[k]}/accuracy": sum(v) / len(v) for k, v in sorted(hits.items())}


@dataclass(frozen=True)
class RoutedScores(TeacherScores):
    """``TeacherScores`` of a routed batch, with each row's teacher and the tokens scored (what the
    per-teacher monitors read)."""

    route: torch.Tensor | None = None  # [N] index into TeacherMap.names
    response_ids: torch.Tensor | None = None  # [N, R]

    def to(self, device) -> RoutedScores:
        base = super().to(device)
        move = lambda x: None if x is None else x.to(device)
        return RoutedScores(
            base.logits, base.topk_ids, base.topk_logprobs, base.sampled_logprobs, move(self.route), move(self.response_ids)
        )


_FIELDS = ("logits", "topk_ids", "topk_logprobs", "sampled_logprobs")


class _Routed(Pending):
    """Each teacher's share of a batch on its way; ``result`` lays the scores back in row order."""

    def __init__(self, batch: Batch, parts: list[tuple[torch.Tensor | None, Pending]]):
        self.batch, self.parts = batch, parts

    def result(self) -> RoutedScores:
        got = [(rows, p.result()) for rows, p in self.parts]
        extra = dict(route=self.batch.route, response_ids=self.batch.response_ids)
        if len(got) == 1 and got[0][0] is None:  # the whole batch to one teacher: its scores as they are
            s = got[0][1]
            return RoutedScores(s.logits, s.topk_ids, s.topk_logprobs, s.sampled_logprobs, **extra)
        n = self.batch.num_sequences
        out = {}
        for name in _FIELDS:
            pieces = [(rows, getattr(s, name)) for rows, s in got]
            if pieces[0][1] is None:
                continue
            first = pieces[0][1]
            full = torch.empty((n, *first.shape[1:]), dtype=first.dtype, device=first.device)
            for rows, x in pieces:
                full[rows.to(full.device)] = x
            out[name] = full
        return RoutedScores(**out, **extra)

    def cancel(self) -> None:
        for _, p in self.parts:
            p.cancel()


class TeacherMap(TeacherScorer):
    """One scorer per teacher (``teachers.map`` order); a batch's ``route`` says which scores each row."""

    def __init__(self, names: Sequence[str], scorers: Sequence[TeacherScorer]):
        self.names, self.scorers = tuple(names), list(scorers)
        self.full_distribution = all(s.full_distribution for s in self.scorers)

    def score(self, batch: Batch) -> RoutedScores:
        return self.submit(batch).result()

    def submit(self, batch: Batch) -> Pending:
        if batch.route is None:
            raise ValueError("TeacherMap: a batch without routes (Batch.route); Router.attach writes them")
        parts: list[tuple[torch.Tensor | None, Pending]] = []
        for k, scorer in enumerate(self.scorers):
            rows = (batch.route == k).nonzero().squeeze(-1)
            if rows.numel() == batch.num_sequences:
                parts = [(None, scorer.submit(batch))]
                break
            if rows.numel():
                parts.append((rows, scorer.submit(select_rows(batch, rows.to(batch.input_ids.device)))))
        if not parts:  # no rows at all (or routes to no teacher): the first teacher's scores of the empty batch
            parts = [(None, self.scorers[0].submit(batch))]
        return _Routed(batch, parts)

    def close(self) -> None:
        for s in self.scorers:
            s.close()

    def set_clock(self, clock) -> None:
        for s in self.scorers:
            s.set_clock(clock)

    def sync(self, student, step: int) -> None:
        for s in self.scorers:
            s.sync(student, step)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {f"{name}.{k}": v for name, s in zip(self.names, self.scorers) for k, v in s.state_dict().items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for name, s in zip(self.names, self.scorers):
            s.load_state_dict({k[len(name) + 1 :]: v for k, v in state.items() if k.startswith(f"{name}.")})

    def metrics(self) -> dict[str, float]:
        aligned = [s for s in self.scorers if isinstance(s, ByteAlignedTeacher)]
        out = {k: v for s in self.scorers if s not in aligned for k, v in s.metrics().items()}
        if aligned:  # byte-aligned teachers' chunk counts pooled: one align/* over every teacher's rows
            out.update(align_metrics([sum(c) for c in zip(*(s.counts() for s in aligned))]))
        return out


class RoutedMonitors(Monitors):
    """The step's monitors, plus per-teacher sums of routed scores: each teacher's token count and
    its tokens' ``jsd/mean``, ``kl/reverse`` (and ``kl/forward`` where logged), the values the
    objective summed (same formulas, same inputs)."""

    def __init__(self, cfg, names: Sequence[str], objective, *, sparse: bool = False):
        super().__init__(cfg, sparse=sparse)
        self.teacher_names, self.objective = tuple(names), objective
        self.per_teacher = {g: PER_TEACHER[g] for g in PER_TEACHER if g in objective.names}

    def __call__(self, student_z, teacher, out, *, engine_logprobs=None) -> Readings:
        readings = super().__call__(student_z, teacher, out, engine_logprobs=engine_logprobs)
        if isinstance(teacher, RoutedScores) and teacher.route is not None:
            readings.sums.update(self.teacher_sums(student_z, teacher, out))
        return readings

    @torch.no_grad()
    def teacher_sums(self, student_z: torch.Tensor, scores: RoutedScores, out) -> dict[str, float]:
        m, zero = out.kept, torch.zeros((), dtype=student_z.dtype, device=student_z.device)
        obj = self.objective
        if out.on_policy:  # the objective's unbiased one-sample estimates under y ~ S
            s0, zs = out.logprobs, student_z.detach()
            t = scores.token_logprobs(scores.response_ids).detach()
            values = {
                "jsd/mean": lambda: obj.value(obj.jsd, s0, t, zs, scores.logits, m),
                "kl/reverse": lambda: obj.value(obj.rkl, s0, t, zs, scores.logits, m),
                "kl/forward": lambda: obj.fkl.token_value(s0, t),
            }
            per = {g: values[g]() for g in self.per_teacher}
        else:  # a teacher-sampled step logs the exact values under those names
            per = {g: out.exact[exact] for g, (_, exact) in self.per_teacher.items()}
        route = scores.route.to(m.device)
        sums = {}
        for k, name in enumerate(self.teacher_names):
            rows = m & (route == k).unsqueeze(-1)
            sums[share_key(name)] = float(rows.sum())
            for g, (short, _) in self.per_teacher.items():
                sums[f"teacher/{name}/{short}"] = float(torch.where(rows, per[g].to(zero.dtype), zero).sum())
        return sums


def teacher_metrics(metrics: dict[str, float], sums: Mapping[str, float], names: Sequence[str]) -> dict[str, float]:
    """``metrics`` (a step's, each per-token sum divided by the step's token count) with each
    teacher's values as means over its own tokens; a teacher without tokens this step logs its
    share (0) and no values."""
    for name in names:
        count = sums.get(share_key(name))
        for short, _ in PER_TEACHER.values():
            key = f"teacher/{name}/{short}"
            if key in sums:
                if count:
                    metrics[key] = sums[key] / count
                else:
                    metrics.pop(key, None)
    return metrics
