"""The run's teachers, picked once: the pair's teacher (the default), or ``teachers.map``'s, each
prompt routed to one (``training/routing.py``; docs/training.md, "Several teachers").

``TeacherSet`` is what the trainer asks of them, the same calls either way: the scorer, the
batch's routes, the monitors, a step's metrics, the teachers' eval accuracy, and what the run
records of them. Without a map every call is what the trainer did before the map existed.

A map's teacher comes from a conf/model_pair option (``pair``: its teacher, prepared with that
option's recipe and task) or from ``path`` (as ``model_pair.teacher`` takes it); it shares the
pair's tokenizer, or with ``teacher.align=bytes`` keeps its own (each teacher's rows rendered for its
own tokenizer and scored on its own tokens; the chunk payloads, all on the student's positions, are
laid back row by row). A teacher whose folder is the pair's own teacher is that loaded module (not a
second copy). Its content (SHA-256 of the folder's files; a hub id by its id) goes into the run's
fingerprint under ``teachers.loaded.<name>`` and the run record's ``teachers``: a resume with
another teacher set is refused, naming the key.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from typing import Any

from opd_exp.runtime import fingerprint
from opd_exp.runtime import precision as prec
from opd_exp.training.monitors import Monitors, Tally
from opd_exp.training.routing import RoutedMonitors, Router, TeacherMap, teacher_metrics
from opd_exp.training.teachers import build_teacher_scorer


class TeacherSet:
    def __init__(
        self, cfg, models: list, *, device, names: Sequence[str] = (), router: Router | None = None, records=None, tokenizers=None
    ):
        self.cfg, self.models, self.device = cfg, models, device
        self.names, self.router = tuple(names), router  # empty names, no router: the pair's one teacher
        self.records: dict[str, dict[str, Any]] = records or {}
        self.scorers: list = []
        self._engines: dict[int, Any] = {}
        self.teacher_tokenizer = None  # the pair's teacher's own tokenizer, where it has one (teacher.align=bytes)
        self.tokenizers: list = list(tokenizers or [None] * len(models))  # each map teacher's own (teacher.align=bytes), else None

    @classmethod
    def load(cls, cfg, pair, device, splits: dict[str, Sequence[Any]], load=None, *, student=None) -> tuple[Any, TeacherSet]:
        """(the module the teacher's rollout engines use, the set): the pair's teacher, or the
        map's teachers (every problem of ``splits`` routed first: one line before they load),
        each loaded by ``load`` (``pairs.teacher_map.load_map_teacher``, handed down
        by the entry point: loading models is the pairs package's concern)."""
        sc = cfg.scale
        if cfg.teacher.from_student:  # ema / lagged: a frozen copy of the student; live: the student itself
            from opd_exp.training.teacher_student import frozen_copy

            model = student if cfg.teacher.name.value == "live" else frozen_copy(student)
            return model, cls(cfg, [model], device=student.device)
        if not cfg.teachers.active:
            model = prec.prepare_teacher(pair.teacher, sc, device)  # frozen, no grad
            one = cls(cfg, [model], device=device)
            one.teacher_tokenizer = getattr(pair, "teacher_tokenizer", None)
            return model, one
        if load is None:
            raise ValueError("TeacherSet.load: teachers.map is set but no loader was given (pairs.teacher_map.load_map_teacher)")
        router = Router(cfg.teachers)
        counts = router.check(splits)  # one line for a problem no teacher takes, before any loads
        models, records, tokenizers = [], {}, []
        for k, (name, src) in enumerate(cfg.teachers.map.items()):
            key = f"teachers.map.{name}"
            model, records[name], tokenizer = load(key, src, cfg, pair)
            models.append(prec.prepare_teacher(model, sc, device))
            tokenizers.append(tokenizer)
            records[name].update(covers=list(src.covers), prompts={split: n[k] for split, n in counts.items()})
        names = tuple(cfg.teachers.map)
        return models[0], cls(cfg, models, device=device, names=names, router=router, records=records, tokenizers=tokenizers)

    @property
    def active(self) -> bool:
        return self.router is not None

    def scorer(self, tokenizer, vocab_size: int, *, autocast, warn):
        """The run's ``TeacherScorer``: the ``teacher`` group's, or a ``TeacherMap`` of one per teacher."""
        self._engine_args = (tokenizer, vocab_size, autocast)
        kw = dict(device=self.device, autocast=autocast, warn=warn)
        if not self.active:
            return build_teacher_scorer(self.cfg, self.models[0], tokenizer, vocab_size, teacher_tokenizer=self.teacher_tokenizer, **kw)
        self.scorers = [
            build_teacher_scorer(self._entry_config(n), m, tokenizer, vocab_size, teacher_tokenizer=t, **kw)
            for n, m, t in zip(self.names, self.models, self.tokenizers)
        ]
        return TeacherMap(self.names, self.scorers)

    def _entry_config(self, name: str):
        """The run's config with the ``teacher`` group pointing at this teacher's server (served)."""
        if not self.cfg.teacher.served:
            return self.cfg
        src = self.cfg.teachers.map[name]
        out = copy.copy(self.cfg)  # no __post_init__: teacher.url stays null in the run's own config
        out.teacher = dataclasses.replace(self.cfg.teacher, url=src.url, model=src.model)
        return out

    def route(self, problems: Sequence[Any], batch):
        """``batch`` with each row's teacher (unchanged without a map)."""
        return batch if self.router is None else self.router.attach(batch, problems)

    def monitors(self, cfg, objective) -> Monitors:
        # a teacher with its own tokenizer has no distribution over the student's vocabulary to monitor
        # (the shared-vocabulary path's is the student's own outside one-to-one chunks)
        sparse = objective.sparse or cfg.teacher.align == "bytes"
        if not self.active:
            return Monitors(cfg, sparse=sparse)
        return RoutedMonitors(cfg, self.names, objective, sparse=sparse)

    def metrics(self, tally: Tally, n_tokens: int) -> dict[str, float]:
        """A step's metrics from its ``Tally``; with a map, each teacher's too."""
        metrics = tally.metrics(n_tokens)
        return metrics if not self.active else teacher_metrics(metrics, tally, self.names)

    def accuracy(self, evaluator, engine) -> dict[str, float]:
        """``eval/teacher_accuracy`` (``engine``: the teacher's greedy engine); with several
        teachers each one on its own prompts (``eval/teacher/<name>/teacher_accuracy``), and the
        global one over all prompts, each answered by its teacher."""
        if not self.active or len(self.models) == 1:
            own = self._own_tokenizer(0)
            acc = self._own_tokenizer_accuracy(evaluator, 0, evaluator.problems) if own else evaluator.accuracy(engine)
            return {"eval/teacher_accuracy": acc, **{f"eval/teacher/{n}/teacher_accuracy": acc for n in self.names}}
        groups: dict[int, list] = {}
        for p in evaluator.problems:
            groups.setdefault(self.router.of(p), []).append(p)
        out, correct = {}, 0
        for k, problems in sorted(groups.items()):
            own = self._own_tokenizer(k)
            acc = self._own_tokenizer_accuracy(evaluator, k, problems) if own else evaluator.accuracy(self._engine(k), problems)
            out[f"eval/teacher/{self.names[k]}/teacher_accuracy"] = acc
            correct += round(acc * len(problems))
        return {"eval/teacher_accuracy": correct / max(len(evaluator.problems), 1), **out}

    def _tokenizer(self, k: int):
        """Teacher ``k``'s own tokenizer (teacher.align=bytes), None: the pair's."""
        return self.tokenizers[k] if self.active else self.teacher_tokenizer

    def prompt_tokenizer(self, k: int):
        """The tokenizer whose chat template renders teacher ``k``'s prompt (``teacher_prompt.own_template``)."""
        from opd_exp.training.teacher_prompt import own_template

        return own_template(self._engine_args[0], self._tokenizer(k)) if self._own_tokenizer(k) else None

    def _own_tokenizer(self, k: int) -> bool:
        """Teacher ``k`` has a tokenizer of its own, not the student's (teacher.align=bytes)."""
        from opd_exp.training.teacher_align import same_tokenizer

        tok = self._tokenizer(k)
        return tok is not None and not same_tokenizer(self._engine_args[0], tok)

    def _own_tokenizer_accuracy(self, evaluator, k: int, problems) -> float:
        """Teacher ``k``'s greedy accuracy on ``problems`` asked its own way: the task's prompt rendered
        with the teacher's tokenizer and chat template (its BOS first where its tokenizer prepends one),
        generated and decoded in the teacher's ids."""
        from opd_exp.tasks.environment import build_environment
        from opd_exp.training.engines import in_process_engine
        from opd_exp.training.evaluate import greedy_batches
        from opd_exp.training.rollout import decode_responses

        tok, autocast = self._tokenizer(k), self._engine_args[2]
        engine = in_process_engine(self.cfg, self.models[k], tok, len(tok), source="teacher", autocast=autocast)
        env = build_environment(self.cfg.task)
        if env is not None:
            from opd_exp.training.episodes import episode_engine

            engine = episode_engine(engine, env, self.cfg.rollout)
        task, correct = evaluator.task, 0
        for chunk, batch in greedy_batches(engine, tok, OwnPrompts(task), problems, evaluator.batch_size):
            correct += sum(bool(task.verify(t, p.answer)) for t, p in zip(decode_responses(tok, batch), chunk))
        return correct / max(len(problems), 1)

    def _engine(self, k: int):
        if k not in self._engines:
            from opd_exp.training.engines import in_process_engine

            tokenizer, vocab_size, autocast = self._engine_args
            self._engines[k] = in_process_engine(self.cfg, self.models[k], tokenizer, vocab_size, source="teacher", autocast=autocast)
        return self._engines[k]

    def identity(self, record: dict[str, Any], values: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """(the run record, the fingerprint) with the teacher set: per teacher its source, folder,
        content hash, covers (and a served one's identity)."""
        if not self.active:
            return record, values
        values = dict(values)
        teachers = {name: dict(r) for name, r in self.records.items()}
        for i, name in enumerate(self.names):
            values[f"{fingerprint.TEACHERS_LOADED}{name}.sha256"] = teachers[name]["sha256"]
            served = self.scorers[i].identity() if self.scorers else {}
            for k, v in served.items():
                values[f"{fingerprint.TEACHERS_LOADED}{name}.server.{k.rsplit('.', 1)[-1]}"] = v
            if served:
                teachers[name]["server"] = {k.rsplit(".", 1)[-1]: v for k, v in served.items()}
                if getattr(self.scorers[i], "self_tested", True) is False:
                    teachers[name]["server"]["self_tested"] = False
        return {**record, "teachers": {"route": self.cfg.teachers.route, **teachers}}, values


class OwnPrompts:
    """A task's prompts as a teacher with its own tokenizer is asked them: rendered as the task renders
    them for that tokenizer, with its BOS text first where the tokenizer prepends one and the text lacks
    it (prompts are encoded without special tokens: the BOS comes from the text, once)."""

    def __init__(self, task):
        self.task = task

    def render_prompt(self, problem, tokenizer) -> str:
        from opd_exp.training.teacher_align import bos_prepended

        text = self.task.render_prompt(problem, tokenizer)
        if bos_prepended(tokenizer) is not None and not text.startswith(tokenizer.bos_token):
            text = tokenizer.bos_token + text
        return text
