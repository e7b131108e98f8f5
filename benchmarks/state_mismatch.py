"""The state-mismatch statistics of a chain world (``opd_exp/pairs/embedded/mismatch.py``).

    python benchmarks/state_mismatch.py [--n 200] [--k 4] [overrides ...]

Default: the lab's mismatch world (``model_pair=embedded_chain_recovery task=chain``); pass
``model_pair=embedded_chain`` for the old chain world. Overrides are the ``model_pair.*`` /
``task.*`` keys ``opd-prepare`` accepts. ``--student DIR`` measures a trained student instead of
the prepared one: a run's checkpoint folder (``<run>/checkpoints/step_000300``), its weights on
the prepared student's architecture. Prints one line per statistic.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from opd_exp.cli.prepare import _parse_overrides
from opd_exp.pairs.embedded.mismatch import state_mismatch
from opd_exp.pairs.embedded.models import load_model
from opd_exp.pairs.embedded.prepare import prepare_embedded
from opd_exp.pairs.embedded.tokenizer import load_tokenizer
from opd_exp.runtime.errors import ConfigError
from opd_exp.tasks import build_task

STUDENT = "a run's checkpoints/step_* folder (model.safetensors), of a run of the world measured"


def fail(line: str) -> None:
    """One line on stderr, exit code 2 (an unknown override, a missing or empty folder, another world's run)."""
    print(f"state_mismatch: {line}", file=sys.stderr)
    sys.exit(2)


def check_student(folder: str, pair_name: str) -> str:
    """The weights file of ``--student``, refused in one line when there is none or when the run
    it comes from (``<run>/checkpoints/step_*``) trained another world's pair."""
    path = Path(folder)
    weights = path / "model.safetensors"
    if not weights.is_file():
        what = "no such folder" if not path.exists() else "not a folder" if not path.is_dir() else "no model.safetensors there"
        steps = sorted((path / "checkpoints").glob("step_*")) if path.is_dir() else []
        hint = f" (it is a run folder: its newest checkpoint is {steps[-1]})" if steps else ""
        fail(f"--student {folder}: {what}{hint}; allowed: {STUDENT}")
    record = path.resolve().parent.parent / ".hydra" / "config.yaml"
    if record.is_file():
        import yaml

        try:
            trained = (yaml.safe_load(record.read_text()) or {}).get("model_pair", {}).get("name")
        except (yaml.YAMLError, AttributeError, OSError, ValueError):
            trained = None
        if trained and trained != pair_name:
            fail(
                f"--student {folder}: a checkpoint of a model_pair={trained} run, not of {pair_name}'s world; "
                f"allowed: model_pair={trained} (with its task) to measure it, or {STUDENT}"
            )
    return str(weights)


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=200, help="eval problems (a prefix of the eval split)")
    ap.add_argument("--k", type=int, default=4, help="samples per model and prompt")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--student", default=None, help="a run's checkpoint folder (model.safetensors) to measure instead")
    args, overrides = ap.parse_known_args(argv)
    torch.set_num_threads(1)
    try:
        pair_cfg, task_cfg = _parse_overrides(["model_pair=embedded_chain_recovery", "task=chain", *overrides])
    except ConfigError as exc:  # an unknown option or key
        fail(str(exc))
    if not pair_cfg.student.startswith("embedded:"):
        given = next((o.split("=", 1)[1] for o in reversed(overrides) if o.startswith("model_pair=")), pair_cfg.name)
        fail(f"model_pair={given} is not allowed; allowed: an embedded chain world (embedded_chain_recovery, embedded_chain)")
    weights = check_student(args.student, pair_cfg.name) if args.student else None  # before the pair is prepared
    try:
        pair = prepare_embedded(pair_cfg, task_cfg, progress=False)
    except ConfigError as exc:  # e.g. a pair built for another task
        fail(str(exc))
    tok = load_tokenizer(pair.tokenizer)
    task = build_task(task_cfg)
    student, teacher = load_model(pair.student).eval(), load_model(pair.teacher).eval()
    if args.student:
        from safetensors.torch import load_model as load_weights

        try:  # strict (the default): a checkpoint of another architecture is an error, never a partial load
            load_weights(student, weights)
        except Exception as exc:  # damaged file, another world's student
            fail(f"--student {args.student}: cannot load it into {pair_cfg.name}'s student: {str(exc).splitlines()[0]}; allowed: {STUDENT}")
    started = time.perf_counter()
    out = state_mismatch(student, teacher, tok, task, task.eval_problems()[: args.n], k=args.k, max_new_tokens=args.max_new_tokens)
    print(f"{pair_cfg.name}: {args.n} eval problems, k={args.k} samples per model ({time.perf_counter() - started:.1f} s)")
    for key, value in out.items():
        small = isinstance(value, float) and 0 < abs(value) < 1e-3  # a probability near 0 keeps its size
        print(f"  {key:32s} {value:.2e}" if small else f"  {key:32s} {value:.4f}" if isinstance(value, float) else f"  {key:32s} {value}")


if __name__ == "__main__":
    main(sys.argv[1:])
