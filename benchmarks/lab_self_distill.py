"""lab_self_distill's probe (docs/lab.md): what each run's student and teacher can do at the end.

    python benchmarks/lab_self_distill.py multirun/lab_self_distill/embedded_self_distill [more sweep folders]

The training metrics say how far the student is from its teacher; they cannot say whether the
teacher still uses the context. Per finished run this loads the final checkpoint and asks the
run's eval problems greedily, plainly and with the worked solution in the prompt (as
``teacher.privileged=solution`` asks them), of

* the student (the checkpoint's weights), and
* the teacher at the end: ``ema`` / ``lagged``, the checkpoint's teacher state; ``live``, the
  student itself; ``in_process``, the run's pair teacher (this world: the starting student).

Then per arm (the sweep's ``variant``), mean ± 95% CI over seeds (Student's t). Runs of several
folders (the sweep, fresh seeds) are pooled by arm.
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

from opd_exp.analysis import AnalysisError, lab_fail, load_runs
from opd_exp.analysis import format_ci95 as ci95

ALLOWED = "allowed: folders of `opd-train -m sweep=lab_self_distill` (multirun/lab_self_distill/embedded_self_distill)"


fail = partial(lab_fail, "lab_self_distill")


def _models(run):
    """(tokenizer, task, student at the end, teacher at the end) of a finished run."""
    import torch
    from safetensors.torch import load_file, load_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from opd_exp.config.world import as_task_config
    from opd_exp.pairs.load import resolve_pair
    from opd_exp.runtime import checkpoint
    from opd_exp.tasks import build_task

    cfg = run.config
    student_dir, teacher_dir = resolve_pair(cfg["model_pair"], cfg["task"], progress=False)
    last = checkpoint.latest(run.path)
    if last is None:
        fail(f"{run.path}: no checkpoint (the sweep saves one at its last step); {ALLOWED}")
    tokenizer = AutoTokenizer.from_pretrained(student_dir)
    student = AutoModelForCausalLM.from_pretrained(student_dir).eval()
    load_model(student, str(last / "model.safetensors"))
    kind = cfg["teacher"]["name"]
    if kind == "live":
        teacher = student
    elif kind in ("ema", "lagged"):
        teacher = AutoModelForCausalLM.from_pretrained(student_dir).eval()
        state = load_file(str(last / checkpoint.TEACHER_FILE))
        with torch.no_grad():
            for name, p in teacher.named_parameters():
                p.copy_(state[f"weights.{name}"])
    else:
        teacher = AutoModelForCausalLM.from_pretrained(teacher_dir).eval()
    return tokenizer, build_task(as_task_config(cfg["task"])), student, teacher


def probe(run) -> dict[str, float]:
    """Greedy accuracy of the run's student and teacher at the end, plain and with the solution."""
    import torch

    from opd_exp.training.evaluate import evaluate_accuracy
    from opd_exp.training.teacher_prompt import with_context

    torch.set_num_threads(1)
    tokenizer, task, student, teacher = _models(run)
    problems = task.eval_problems()[: run.config["eval"]["size"] or None]
    max_new = int(run.config["rollout"]["max_new_tokens"])
    out = {}
    for who, model in (("student", student), ("teacher", teacher)):
        for how, asked in (("plain", problems), ("solution", [with_context(p, "solution") for p in problems])):
            out[f"{who} {how}"] = evaluate_accuracy(model, tokenizer, task, asked, batch_size=200, max_new_tokens=max_new)["accuracy"]
    return out


def main(folders) -> None:
    by_arm: dict[str, list[dict[str, float]]] = {}
    for folder in folders:
        try:
            runs = load_runs(Path(folder))
        except AnalysisError as exc:
            fail(f"{exc}; {ALLOWED}")
        finished = [r for r in runs if r.finished]
        if not finished:
            fail(f"{folder}: no finished run; {ALLOWED}")
        for r in sorted(finished, key=lambda r: (r.overrides.get("variant", ""), r.seed)):
            got = probe(r)
            arm = r.overrides.get("variant", r.variant)
            by_arm.setdefault(arm, []).append(got)
            print(f"{arm} seed {r.seed}: " + ", ".join(f"{k} {v:.3f}" for k, v in got.items()), file=sys.stderr)
    cols = ["student plain", "student solution", "teacher plain", "teacher solution"]
    print("| arm | seeds | " + " | ".join(f"{c} (greedy accuracy)" for c in cols) + " |\n|" + "---|" * (len(cols) + 2))
    for arm, rows in by_arm.items():
        print(f"| {arm} | {len(rows)} | " + " | ".join(ci95([r[c] for r in rows]) for c in cols) + " |")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        fail(f"usage: python benchmarks/lab_self_distill.py FOLDER [FOLDER ...]; {ALLOWED}")
    main(sys.argv[1:])
