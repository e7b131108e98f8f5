"""opd-compare --phases: where each variant's step goes (perf/<phase>_s, the mean over the steps
after the first, then over seeds), each phase's share, tokens/s per phase, and the FLOP ratio
N_T/(3 N_S) from the run record beside the measured teacher s / train s; on a synthetic folder
whose numbers are worked out by hand, and once on a real two-step run."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from opd_exp.analysis import flop_ratio, format_count, load_runs, parameter_counts, phase_stats
from opd_exp.cli.compare import main

PHASES = ("generate", "teacher", "train", "sync", "wait")
WARMUP = {"perf/step_s": 10.0, "perf/generate_s": 9.0, "perf/teacher_s": 0.5, "perf/train_s": 0.4, "perf/sync_s": 0.0, "perf/wait_s": 0.0}
TOKENS = 100  # sampled = scored = trained tokens per step


def _step(step_s, generate, teacher, train, sync=0.0, wait=0.0):
    row = {"perf/step_s": step_s, "perf/tokens_per_s": TOKENS / step_s}
    for p, s in zip(PHASES, (generate, teacher, train, sync, wait)):
        row[f"perf/{p}_s"] = s
        if p in ("generate", "teacher", "train"):
            row[f"perf/{p}_tokens_per_s"] = TOKENS / s
    return row


# variant -> seed -> (teacher name, (N_S, N_T) or None, [step 2, step 3] phase seconds, or None: no phases logged)
RUNS = {
    "rkl": {
        0: ("in_process", (1000, 6000), [_step(1.0, 0.4, 0.2, 0.4), _step(1.0, 0.2, 0.2, 0.5)]),
        1: ("in_process", (1000, 6000), [_step(2.0, 0.6, 0.4, 0.9), _step(2.0, 0.6, 0.4, 0.9)]),
    },
    "fkl": {0: ("ema", (1000, 6000), [_step(0.5, 0.1, 0.1, 0.2, sync=0.05), _step(0.5, 0.1, 0.1, 0.2, sync=0.05)])},
    "jsd": {0: ("in_process", None, None)},  # a run from before per-phase accounting and parameter counts
}


def make(root: Path) -> Path:
    folder = root / "multirun" / "phases"
    job = 0
    for div, seeds in RUNS.items():
        for seed, (teacher, counts, steps) in seeds.items():
            d = folder / str(job)
            (d / ".hydra").mkdir(parents=True)
            (d / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump([f"divergence={div}", f"seed={seed}"]))
            cfg = {"seed": seed, "trainer": {"max_steps": 3}, "divergence": {"name": div}, "teacher": {"name": teacher}}
            (d / ".hydra" / "config.yaml").write_text(yaml.safe_dump(cfg))
            rows = [{"step": 0, "eval/accuracy": 0.1}]
            for step, phases in enumerate([WARMUP, *(steps or [{}, {}])], start=1):
                perf = phases if steps else {"perf/step_s": 1.0, "perf/tokens_per_s": 100.0}
                rows.append({"step": step, "loss": 1.0, **perf})
            (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
            pair = {"student": {"hash": "s", "params": counts[0]}, "teacher": {"hash": "t", "params": counts[1]}} if counts else {}
            (d / "summary.json").write_text(json.dumps({"steps": 3, "elapsed_s": 1.0, **({"pair": pair} if pair else {})}))
            job += 1
    return folder


def compare(capsys, *args):
    with pytest.raises(SystemExit) as ex:
        main([str(a) for a in args])
    out = capsys.readouterr()
    return ex.value.code, out.out, out.err


def cells(line: str) -> list[str]:
    return [c.strip() for c in line.split("  ") if c.strip()]


def test_one_run_s_phases_leave_out_the_first_step_and_sum_tokens_over_seconds(tmp_path):
    runs = {r.path.name: r for r in load_runs(make(tmp_path))}
    s = phase_stats(runs["0"])  # rkl seed 0: steps 2 and 3 only (step 1's 9 s of generation is warm-up)
    assert s["steps"] == 2 and s["step_s"] == 1.0
    assert (s["generate_s"], s["teacher_s"], s["train_s"], s["sync_s"], s["wait_s"]) == pytest.approx((0.3, 0.2, 0.45, 0, 0))
    assert (s["generate_share"], s["teacher_share"], s["train_share"], s["other_share"]) == pytest.approx((30, 20, 45, 5))
    # 200 sampled tokens over 0.6 s of generation (the mean of the logged rates, 375, is not it)
    assert s["generate_tokens_per_s"] == pytest.approx(200 / 0.6)
    assert s["teacher_tokens_per_s"] == pytest.approx(500) and s["train_tokens_per_s"] == pytest.approx(200 / 0.9)
    assert s["teacher_over_train"] == pytest.approx(0.2 / 0.45)
    # the record's counts: N_T / (3 N_S) = 6000 / 3000; a teacher made from the student (ema) costs what the student does
    assert parameter_counts(runs["0"]) == (1000, 6000) and flop_ratio(runs["0"]) == 2.0
    assert parameter_counts(runs["2"]) == (1000, 1000) and flop_ratio(runs["2"]) == pytest.approx(1 / 3)
    old = phase_stats(runs["3"])  # no perf/<phase>_s, no counts
    assert old["generate_s"] is None and old["other_share"] is None and old["step_s"] == 1.0 and flop_ratio(runs["3"]) is None
    assert [format_count(n) for n in (999, 81984, 140032, 134515008, 1543714304)] == ["999", "82.0k", "140k", "135M", "1.54B"]


def test_the_phase_table_over_seeds(tmp_path, capsys):
    code, out, err = compare(capsys, make(tmp_path), "--phases", "--stat", "std")
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].endswith(
        "4 jobs, 3 variants; where the step goes: seconds per step (the mean over the steps after the first), "
        "each phase's share of the step, tokens/s per phase; mean ± std over seeds"
    )
    assert cells(lines[1]) == [
        "variant", "seeds", "step s", "generate s", "teacher s", "train s", "sync s", "wait s",
        "generate %", "teacher %", "train %", "sync %", "wait %", "other %",
        "generate tok/s", "teacher tok/s", "train tok/s", "params S/T", "N_T/(3 N_S)", "teacher s/train s",
    ]  # fmt: skip
    # rkl: seeds (1.0 s, 2.0 s) per step: 1.5 ± 0.71; generate (0.3, 0.6): 0.45 ± 0.21; shares 30/20/45, other 5 in both;
    # generate tokens/s (333.3, 166.7): 250 ± 117.9; teacher (500, 250); train (222.2, 111.1); teacher/train 0.444 in both
    assert cells(lines[3]) == [
        "divergence=rkl", "0,1", "1.50 ± 0.71", "0.450 ± 0.212", "0.300 ± 0.141", "0.675 ± 0.318", "0.0000 ± 0.0000", "0.000 ± 0.000",
        "30.0 ± 0.0", "20.0 ± 0.0", "45.0 ± 0.0", "0.0 ± 0.0", "0.0 ± 0.0", "5.0 ± 0.0",
        "250.0 ± 117.9", "375.0 ± 176.8", "166.7 ± 78.6", "1.00k/6.00k", "2", "0.444 ± 0.000",
    ]  # fmt: skip
    # fkl (ema, one seed): 0.1 / 0.1 / 0.2 / 0.05 of 0.5 s; N_T = N_S: 1/3
    assert cells(lines[4]) == [
        "divergence=fkl", "0", "0.50", "0.100", "0.100", "0.200", "0.0500", "0.000",
        "20.0", "20.0", "40.0", "10.0", "0.0", "10.0", "1000", "1000", "500.0", "1.00k/1.00k", "0.333", "0.500",
    ]  # fmt: skip
    assert cells(lines[5]) == ["divergence=jsd", "0", "1.00", *["—"] * 17]
    assert lines[6] == "note: 1 job(s) logged no perf/<phase>_s (runs from before per-phase accounting): shown —"


def test_the_phase_table_as_markdown_and_csv(tmp_path, capsys):
    folder = make(tmp_path)
    code, out, _ = compare(capsys, folder, "--phases", "--format", "markdown")
    assert code == 0
    table = [line for line in out.splitlines() if line.startswith("|")]
    assert len(table) == 5 and all(line.count("|") == 21 for line in table)
    assert "| 2 | 0.444 ± 0.000 |" in table[2]  # ci95 of two identical seeds
    code, out, _ = compare(capsys, folder, "--phases", "--format", "csv", "--stat", "minmax")
    rows = out.splitlines()
    head = rows[0].split(",")
    assert head[:5] == ["variant", "seeds", "step_s_mean", "step_s_min", "step_s_max"]
    assert head[-8:] == [
        "params_student", "params_teacher", "flop_ratio_mean", "flop_ratio_min", "flop_ratio_max",
        "teacher_over_train_mean", "teacher_over_train_min", "teacher_over_train_max",
    ]  # fmt: skip
    rkl = dict(zip(head, rows[1].split(",")))
    assert rkl["seeds"] == "0 1"  # as the summary table's csv writes them
    assert (rkl["step_s_mean"], rkl["step_s_min"], rkl["step_s_max"]) == ("1.5", "1", "2")
    assert (rkl["params_student"], rkl["params_teacher"], rkl["flop_ratio_mean"]) == ("1000", "6000", "2")
    assert float(rkl["generate_tokens_per_s_mean"]) == pytest.approx(250)


@pytest.mark.slow
def test_a_real_two_step_run_has_every_phase(tmp_path, capsys):
    run_dir = tmp_path / "run"
    args = ["trainer.max_steps=2", "logger=none", "trainer.progress=false", "scale.num_threads=1", f"hydra.run.dir={run_dir}"]
    env = dict(os.environ, WANDB_MODE="disabled")
    done = subprocess.run([sys.executable, "-m", "opd_exp.cli.train", *args], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    pair = json.loads((run_dir / "summary.json").read_text())["pair"]
    assert pair["student"]["params"] == 81984 and pair["teacher"]["params"] == 140032  # the embedded pair's manifests say so
    code, out, _ = compare(capsys, run_dir, "--phases")
    assert code == 0
    lines = out.splitlines()
    header, row = cells(lines[1]), cells(lines[3])
    values = dict(zip(header, row))
    for p in PHASES:
        assert math.isfinite(float(values[f"{p} s"])) and math.isfinite(float(values[f"{p} %"]))
    for p in ("generate", "teacher", "train"):
        assert float(values[f"{p} s"]) > 0 and float(values[f"{p} tok/s"]) > 0
    assert float(values["wait s"]) == 0.0  # the loop is synchronous
    assert sum(float(values[f"{p} %"]) for p in (*PHASES, "other")) == pytest.approx(100, abs=0.3)
    assert values["params S/T"] == "82.0k/140k" and values["N_T/(3 N_S)"] == "0.569"  # 140032 / (3 x 81984)
    assert float(values["teacher s/train s"]) > 0
