"""Where the chain-world student slips, and what follows a slip.

    python benchmarks/chain_slips.py [overrides ...]

Greedy responses of the prepared chain pair (``model_pair=embedded_chain task=chain``) on the
task's eval problems; each worked step ``a op b = c`` is checked on its own. Prints, for the
student and the teacher, at which step the first slip falls (a wrong result, or a right
result on operands that are not the ones the correct chain has at that step), the share of
locally right steps before and after the first slip (not controlled for position: later
steps are more often after a slip), and the teacher's local step accuracy when it greedily
continues the student's prefixes up to and including their first slip. Overrides are the
``model_pair.embedded.*`` / ``task.*`` keys ``opd-prepare`` accepts.
"""

from __future__ import annotations

import re
import sys
from collections import Counter

import torch

from opd_exp.cli.prepare import _parse_overrides
from opd_exp.pairs.embedded.models import load_model
from opd_exp.pairs.embedded.prepare import _sft_data, prepare_embedded
from opd_exp.pairs.embedded.tokenizer import load_tokenizer
from opd_exp.tasks import build_task
from opd_exp.training.evaluate import evaluate_accuracy

STEP = re.compile(r"^(-?\d+)([+\-*])(-?\d+)=(-?\d+)$")


def steps_of(text: str) -> list[str]:
    return [s for s in text.split("####")[0].split(";") if s.strip()]


def local_ok(step: str) -> bool | None:
    """Is ``a op b = c`` right on its own terms (None: not a step)?"""
    m = STEP.match(step.strip())
    if not m:
        return None
    a, op, b, c = int(m[1]), m[2], int(m[3]), int(m[4])
    return {"+": a + b, "-": a - b, "*": a * b}[op] == c


def analyse(name, model, tok, task, evals):
    out = evaluate_accuracy(model, tok, task, evals, batch_size=256, max_new_tokens=56, return_completions=True)
    first_slip: Counter = Counter()
    before, after = [0, 0], [0, 0]
    prefixes = []
    for p, text in zip(evals, out["completions"]):
        got, ref = steps_of(text), steps_of(p.solution)
        slipped = False
        for i, s in enumerate(got):
            ok = local_ok(s)
            if ok is None:
                continue
            tally = after if slipped else before
            tally[0] += ok
            tally[1] += 1
            if slipped:
                continue
            misread = ok and i < len(ref) and s.split("=")[0] != ref[i].split("=")[0]
            if not ok or misread:
                slipped = True
                first_slip[f"{i + 1}{' (operands)' if misread else ''}"] += 1
                prefixes.append((p, ";".join(got[: i + 1]) + ";"))
    print(f"{name}: greedy accuracy {out['accuracy']:.3f} (n={out['n']})")
    print(f"  first slip at step: {dict(sorted(first_slip.items()))}; no slip: {out['n'] - sum(first_slip.values())}")
    print(
        f"  locally right steps before any slip {before[0]}/{before[1]} = {before[0] / max(before[1], 1):.3f}; after one {after[0]}/{after[1]} = {after[0] / max(after[1], 1):.3f}"
    )
    return prefixes


def main(argv: list[str]) -> None:
    torch.set_num_threads(1)
    pair_cfg, task_cfg = _parse_overrides(["model_pair=embedded_chain", "task=chain", *argv])
    pair = prepare_embedded(pair_cfg, task_cfg, progress=False)
    tok = load_tokenizer(pair.tokenizer)
    task = build_task(task_cfg)
    evals, _ = _sft_data(task_cfg, pair_cfg.embedded)
    student, teacher = load_model(pair.student).eval(), load_model(pair.teacher).eval()
    prefixes = analyse("student", student, tok, task, evals)
    analyse("teacher", teacher, tok, task, evals)
    ok = n = 0
    for p, prefix in prefixes:
        ids = tok(task.render_prompt(p, tok) + prefix, return_tensors="pt").input_ids
        gen = teacher.generate(ids, max_new_tokens=40, do_sample=False, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        for s in steps_of(tok.decode(gen[0, ids.shape[1] :], skip_special_tokens=True)):
            r = local_ok(s)
            if r is not None:
                ok, n = ok + r, n + 1
    print(f"teacher continuing the student's {len(prefixes)} slipped prefixes: locally right steps {ok}/{n} = {ok / max(n, 1):.3f}")


if __name__ == "__main__":
    main(sys.argv[1:])
