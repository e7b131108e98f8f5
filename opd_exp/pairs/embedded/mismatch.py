"""How far the student's own states lie from the teacher's, and whether the teacher guides from them.

GKD's case for on-policy distillation is a train/test state mismatch: the student, sampling,
reaches prefixes the teacher's own samples never reach, and only on-policy batches show it
the teacher's guidance there. ``state_mismatch`` measures both halves on a pair and a set of
prompts, with k temperature-1 samples of each model per prompt (fixed row seeds):

* ``student_states_off``  share of the student's decision states (response prefixes, one per
  token it chose, EOS included) that no teacher sample of the same prompt passes through;
* ``student_samples_off`` share of student samples that leave every teacher sample's path;
* ``teacher_samples_off_reference`` share of teacher samples that differ from the reference
  solution (the teacher's own slips);
* ``teacher_samples_corrected`` share of teacher samples with a correction marker (``!``);
* ``student_samples_corrected`` the same for the student's samples, and
  ``student_corrections_right`` the share of those that end in the right answer (whether a
  distilled student picked up the teacher's guidance from its own slips);
* ``student_samples_right``   share of the student's samples with the right answer;
* ``teacher_mark_prob`` / ``student_mark_prob`` each model's mean probability of the marker as
  the next token at the student's slipped prefixes above (cut before the step's ``;``): how
  strongly the teacher signals "correct here", and how much of that the student has taken up;
* ``teacher_recovers``    the teacher's greedy continuation of each student sample cut after
  the step in which it left the teacher's paths: the share that ends in the right answer
  (``n_recover`` such prefixes).

The old chain world (``model_pair=embedded_chain``) has the first half and not the second:
its teacher continues a slipped prefix from the wrong running value. ``benchmarks/state_mismatch.py``
prints both worlds; docs/world.md has the numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import torch

from opd_exp.pairs.embedded.recovery import MARK

# row seeds of the samples (one per prompt and sample): the same draws on every call
SAMPLE_SEED = 7_654_321


def _engine(model, tokenizer, max_new_tokens: int):
    from opd_exp.training.evaluate import UNCAPPED_PROMPT_TOKENS
    from opd_exp.training.rollout import ModuleRollout

    ro = SimpleNamespace(max_new_tokens=max_new_tokens, max_prompt_tokens=UNCAPPED_PROMPT_TOKENS, temperature=1.0, top_k=0, top_p=1.0)
    return ModuleRollout(model, tokenizer, ro, vocab_size=len(tokenizer))


def _samples(engine, tokenizer, prompts: Sequence[str], k: int, seed: int, batch: int) -> list[list[str]]:
    from opd_exp.training.rollout import decode_responses

    out: list[list[str]] = []
    per = max(1, batch // k)
    for start in range(0, len(prompts), per):
        chunk = list(prompts[start : start + per])
        seeds = [seed + (start + i) * k + j for i in range(len(chunk)) for j in range(k)]
        texts = decode_responses(tokenizer, engine.generate(chunk, seeds, n_samples=k))
        out += [texts[i * k : (i + 1) * k] for i in range(len(chunk))]
    return out


def _greedy(engine, tokenizer, prompts: Sequence[str], batch: int) -> list[str]:
    from opd_exp.training.rollout import decode_responses

    out: list[str] = []
    for start in range(0, len(prompts), batch):
        out += decode_responses(tokenizer, engine.generate(list(prompts[start : start + batch]), greedy=True))
    return out


def _next_prob(model, tokenizer, texts: Sequence[str], token: str) -> float:
    """Mean probability of ``token`` as the next token after each of ``texts``, one unpadded
    row at a time (no padding, so positions are the generation's)."""
    ids = tokenizer(token, add_special_tokens=False)["input_ids"]
    assert len(ids) == 1, f"{token!r} is not one token"
    total = 0.0
    for text in texts:
        row = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
        total += torch.softmax(model(row).logits[0, -1].double(), -1)[ids[0]].item()
    return total / max(len(texts), 1)


def leave_point(text: str, paths: Sequence[str]) -> int | None:
    """Length of the longest prefix of ``text`` that some path in ``paths`` starts with, or
    None when a path starts with the whole of ``text`` and ends there too (never left)."""
    j = 0
    while j < len(text) and any(p.startswith(text[: j + 1]) for p in paths):
        j += 1
    if j == len(text) and text in paths:
        return None
    return j


def step_end(text: str, j: int) -> int:
    """End of the worked step holding character ``j``: the index of the next ``;`` or ``!``
    from ``j`` on, or the end of ``text``."""
    ends = [i for i in (text.find(";", j), text.find(MARK, j)) if i >= 0]
    return min(ends) if ends else len(text)


@torch.no_grad()
def state_mismatch(
    student, teacher, tokenizer, task, problems: Sequence[Any], *, k: int = 4, max_new_tokens: int = 64, batch: int = 256
) -> dict[str, float]:
    """The statistics of the module docstring on ``problems`` (``k`` samples per model and prompt)."""
    prompts = [task.render_prompt(p, tokenizer) for p in problems]
    s_engine, t_engine = _engine(student, tokenizer, max_new_tokens), _engine(teacher, tokenizer, max_new_tokens)
    s_texts = _samples(s_engine, tokenizer, prompts, k, SAMPLE_SEED, batch)
    t_texts = _samples(t_engine, tokenizer, prompts, k, SAMPLE_SEED + 1_000_003, batch)
    states = off_states = off_samples = 0
    cut_prompts, cut_prefixes, cut_answers = [], [], []
    for prompt, p, mine, theirs in zip(prompts, problems, s_texts, t_texts):
        for text in mine:
            j = leave_point(text, theirs)
            states += len(text) + 1  # one decision per token, EOS included
            if j is None:
                continue
            off_samples += 1
            off_states += len(text) - j  # the states after its first token off every teacher path
            prefix = text[: max(j + 1, step_end(text, j))]  # that token included, to the end of its step
            cut_prompts.append(prompt + prefix)
            cut_prefixes.append(prefix)
            cut_answers.append(p.answer)
    continued = _greedy(t_engine, tokenizer, cut_prompts, batch)
    recovered = sum(bool(task.verify(pre + c, a)) for pre, c, a in zip(cut_prefixes, continued, cut_answers))
    n_samples = len(problems) * k
    corrected = [(t, p.answer) for p, ts in zip(problems, s_texts) for t in ts if MARK in t]
    return {
        "student_states_off": off_states / max(states, 1),
        "student_samples_off": off_samples / max(n_samples, 1),
        "teacher_samples_off_reference": sum(t != p.solution for p, ts in zip(problems, t_texts) for t in ts) / max(n_samples, 1),
        "teacher_samples_corrected": sum(MARK in t for ts in t_texts for t in ts) / max(n_samples, 1),
        "teacher_recovers": recovered / max(len(cut_prompts), 1),
        "student_samples_right": sum(bool(task.verify(t, p.answer)) for p, ts in zip(problems, s_texts) for t in ts) / max(n_samples, 1),
        "student_samples_corrected": len(corrected) / max(n_samples, 1),
        "student_corrections_right": sum(bool(task.verify(t, a)) for t, a in corrected) / max(len(corrected), 1),
        "teacher_mark_prob": _next_prob(teacher, tokenizer, cut_prompts, MARK),
        "student_mark_prob": _next_prob(student, tokenizer, cut_prompts, MARK),
        "n_recover": len(cut_prompts),
        "n_samples": n_samples,
    }
