"""opd-compare for papers: a common step, steps to a threshold, paired differences, the
statistic named, labels from the config, titles from the sweep; on a synthetic sweep=divergence
folder (3 variants x 3 seeds, one job stopped early) whose numbers are worked out by hand."""

import json
import math
from pathlib import Path

import pytest
import yaml

from opd_exp.analysis import (
    AnalysisError,
    curve,
    divergence_label,
    format_interval,
    group_by_variant,
    load_runs,
    mean_ci95,
    paper_labels,
    parse_reach,
    plot_curves,
    reach,
    run_name,
    value_at,
)
from opd_exp.cli.compare import main

T2 = 4.303  # Student's t, 97.5% quantile, 2 degrees of freedom (3 seeds)


ACC = {  # eval accuracy at steps 0, 2, 4, 6 per variant and seed
    "rkl": [[0.1, 0.3, 0.5, 0.6], [0.1, 0.2, 0.5, 0.7], [0.1, 0.4, 0.4, 0.5]],
    "fkl": [[0.1, 0.2, 0.3, 0.4], [0.1, 0.3, 0.3, 0.3], [0.1, 0.1, 0.2, 0.45]],
    "jsd_0.5": [[0.1, 0.5, 0.6, 0.7], [0.1, 0.4, 0.6, 0.8], [0.1, 0.5]],
}
DIV = {"rkl": {"name": "rkl"}, "fkl": {"name": "fkl", "clip": None}, "jsd_0.5": {"name": "jsd", "beta": 0.5}}


def make(root):
    """multirun/divergence/embedded: variant=rkl,fkl,jsd_0.5 x seed=0,1,2; 10 sampled tokens and
    0.5 s per step; jsd_0.5 seed 2 stopped at step 3 of 6."""
    folder = Path(root) / "multirun" / "divergence" / "embedded"
    job = 0
    for variant, seeds in ACC.items():
        for seed, accs in enumerate(seeds):
            d = folder / f"{job}_{variant}_seed{seed}"
            (d / ".hydra").mkdir(parents=True, exist_ok=True)
            (d / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(["sweep=divergence", f"variant={variant}", f"seed={seed}"]))
            div = {"beta": 0.5, "alpha": 0.1, "temperature": 1.0, "clip": None, **DIV[variant]}
            cfg = {"seed": seed, "trainer": {"max_steps": 6}, "divergence": div, "logger": {"group": "divergence"}}
            (d / ".hydra" / "config.yaml").write_text(yaml.safe_dump(cfg))
            (d / ".hydra" / "hydra.yaml").write_text(
                yaml.safe_dump(
                    {
                        "hydra": {
                            "mode": "MULTIRUN",
                            "runtime": {"choices": {"sweep": "divergence", "model_pair": "embedded", "variant": variant}},
                        }
                    }
                )
            )
            rows = []
            last = 2 * (len(accs) - 1) + (1 if len(accs) < 4 else 0)  # the stopped job ran one step past its last eval
            for step in range(0, last + 1):
                row = {"step": step}
                if step:
                    row.update({"loss": 1.0 / step, "jsd/mean": 0.3 / step, "perf/step_s": 0.5, "perf/tokens_per_s": 20.0})
                if step % 2 == 0 and step // 2 < len(accs):
                    row.update({"eval/accuracy": accs[step // 2], "eval/kl_reverse": 1.0 - accs[step // 2], "eval/teacher_accuracy": 0.9})
                rows.append(row)
            (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
            job += 1
    return folder


def compare(capsys, *args):
    with pytest.raises(SystemExit) as ex:
        main([str(a) for a in args])
    out = capsys.readouterr()
    return ex.value.code, out.out, out.err


def cells(line):
    return [c.strip() for c in line.split("  ") if c.strip()]


def test_the_interval_of_known_values_for_each_statistic():
    xs = [0.5, 0.5, 0.4]  # sd 0.0577: 95% half-width 4.303 * 0.0577 / sqrt(3) = 0.1434
    m, h, n = mean_ci95(xs)
    assert (m, n) == (pytest.approx(0.4667, abs=1e-4), 3) and h == pytest.approx(T2 * 0.057735 / math.sqrt(3), rel=1e-4)
    assert format_interval(xs, "ci95") == "0.467 ± 0.143"
    assert format_interval(xs, "std") == "0.467 ± 0.058"
    assert format_interval(xs, "minmax") == "0.467 (0.400..0.500)"
    assert format_interval([-0.2, -0.4, -0.05], "ci95", signed=True) == "-0.217 ± 0.436"
    assert format_interval([0.25], "ci95") == "0.250" and format_interval([], "std") == "—"
    assert format_interval([0.1, float("nan")], "ci95") == "nan"  # a diverged seed is never averaged away
    with pytest.raises(AnalysisError, match="--stat 'sem' is unknown; allowed: ci95, std, minmax"):
        format_interval(xs, "sem")


def test_at_step_reads_every_run_at_one_step_and_names_the_missing_in_one_line(tmp_path, capsys):
    folder = make(tmp_path)
    code, out, err = compare(capsys, folder, "--at-step", 4, "--metric", "eval/accuracy")
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0] == "divergence sweep, embedded pair: 9 jobs, 3 variants"  # the sweep, not the folder
    assert lines[1] == "at step 4: 8 jobs, 3 variants; mean ± 95% CI over seeds (Student's t)"
    assert cells(lines[2]) == ["variant", "seeds", "eval accuracy", "eval: own divergence"]
    assert cells(lines[4]) == ["reverse KL", "0,1,2", "0.467 ± 0.143", "0.533 ± 0.143"]  # 0.5, 0.5, 0.4
    assert cells(lines[5]) == ["forward KL", "0,1,2", "0.267 ± 0.143", "—"]  # 0.3, 0.3, 0.2
    assert cells(lines[6]) == ["JSD β=0.5", "0,1", "0.600 ± 0.000", "—"]
    stopped = folder / "8_jsd_0.5_seed2"
    assert lines[7] == f"not at step 4, left out: 1: {stopped} (JSD β=0.5, seed 2, last step 3)"
    # between evals a run is read at its last eval before the step; past every run: one line
    (rkl0,) = [r for r in load_runs(folder) if r.path.name == "0_rkl_seed0"]
    assert value_at(rkl0, "eval/accuracy", 5) == 0.5 and value_at(rkl0, "eval/accuracy", 7) is None
    code, out, err = compare(capsys, folder, "--at-step", 9)
    assert (code, out) == (2, "")
    assert err == "opd-compare: error: --at-step 9: no run reached step 9; allowed: a step <= 6 (the furthest run's last step)\n"


def test_reach_gives_steps_tokens_and_seconds_per_seed_and_counts_the_runs_that_never_do(tmp_path, capsys):
    folder = make(tmp_path)
    code, out, _ = compare(capsys, folder, "--reach", "eval/accuracy=0.5")
    assert code == 0
    lines = out.splitlines()
    assert lines[1] == ("to eval accuracy >= 0.5: the first logged step per seed; mean ± 95% CI over seeds (Student's t) that reached it")
    assert cells(lines[2]) == ["variant", "seeds", "reached", "steps", "sampled tokens", "training s", "step per seed"]
    # rkl reaches 0.5 at steps 4, 4, 6: mean 4.67 ± 4.303 * 1.155 / sqrt(3) = 2.87; 10 tokens and 0.5 s per step
    assert cells(lines[4]) == ["reverse KL", "0,1,2", "3/3", "5 ± 3", "47 ± 29", "2.3 ± 1.4", "4, 4, 6"]
    assert cells(lines[5]) == ["forward KL", "0,1,2", "0/3", "—", "—", "—", "— (by 6), — (by 6), — (by 6)"]
    assert cells(lines[6]) == ["JSD β=0.5", "0,1,2", "3/3", "3 ± 3", "27 ± 29", "1.3 ± 1.4", "2, 4, 2"]  # the stopped seed reached it
    runs = {r.path.name: r for r in load_runs(folder)}
    assert reach(runs["2_rkl_seed2"], "eval/accuracy", ">=", 0.5) == {"step": 6.0, "tokens": 60.0, "seconds": 3.0}
    assert reach(runs["3_fkl_seed0"], "eval/accuracy", ">=", 0.5) == {"step": None, "tokens": None, "seconds": None}
    # = is >= for accuracy, <= for a divergence; >= and <= say it outright
    assert parse_reach("eval/accuracy=0.5") == ("eval/accuracy", ">=", 0.5)
    assert parse_reach("eval/kl_reverse=0.1") == ("eval/kl_reverse", "<=", 0.1)
    assert parse_reach("eval/kl_reverse>=2") == ("eval/kl_reverse", ">=", 2.0)
    for bad in ("eval/accuracy", "eval/accuracy=high", "eval/accuracy=nan"):
        code, out, err = compare(capsys, folder, "--reach", bad)
        assert (code, out) == (2, "") and err == (
            f"opd-compare: error: --reach {bad!r} is not METRIC=VALUE; allowed: e.g. eval/accuracy=0.5, eval/kl_reverse<=0.1 (a finite number)\n"
        )
    code, _, err = compare(capsys, folder, "--reach", "eval/acc=0.5")
    assert code == 2 and err.startswith("opd-compare: error: --reach metric 'eval/acc' not in any job's metrics.jsonl; allowed: ")


def test_base_gives_paired_per_seed_differences_with_intervals(tmp_path, capsys):
    folder = make(tmp_path)
    # divergence=rkl is read from the config (the sweep picks it through variant=rkl)
    code, out, err = compare(capsys, folder, "--base", "divergence=rkl", "--metric", "eval/accuracy")
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[1] == (
        "difference from the base (divergence=rkl), paired by seed, at the final step;"
        " mean difference ± 95% CI over seeds (Student's t), then per seed"
    )
    assert cells(lines[2]) == ["variant", "base", "seeds", "Δ eval accuracy"]
    # fkl - rkl at step 6: 0.4-0.6, 0.3-0.7, 0.45-0.5; sd 0.1756 -> 4.303 * 0.1756 / sqrt(3) = 0.436
    assert cells(lines[4]) == ["forward KL", "reverse KL", "0,1,2", "-0.217 ± 0.436 (-0.200, -0.400, -0.050)"]
    assert cells(lines[5]) == ["JSD β=0.5", "reverse KL", "0,1", "+0.100 ± 0.000 (+0.100, +0.100)"]  # seed 2 unfinished
    assert "jobs that have not reached trainer.max_steps, left out of the table: 1" in lines
    # at a common step, the stopped seed is in if it got there; a variant's name works as a base too
    code, out, _ = compare(capsys, folder, "--base", "variant=rkl", "--at-step", 2, "--metric", "eval/accuracy")
    lines = out.splitlines()[out.splitlines().index(next(ln for ln in out.splitlines() if ln.startswith("difference from"))) :]
    assert lines[0].startswith("difference from the base (variant=rkl), paired by seed, at step 2;")
    assert cells(lines[3]) == ["forward KL", "reverse KL", "0,1,2", "-0.100 ± 0.497 (-0.100, +0.100, -0.300)"]
    assert cells(lines[4]) == ["JSD β=0.5", "reverse KL", "0,1,2", "+0.167 ± 0.143 (+0.200, +0.200, +0.100)"]
    code, out, err = compare(capsys, folder, "--base", "divergence=tvd")
    assert (code, out) == (2, "") and err == (
        "opd-compare: error: --base divergence=tvd: no variant sets divergence=tvd; allowed: KEY=VALUE of a variant,"
        " or one of variant=rkl, variant=fkl, variant=jsd_0.5\n"
    )


def test_stat_is_named_in_every_table_and_the_figure_legend(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    folder = make(tmp_path)
    code, out, _ = compare(capsys, folder, "--final-only", "--metric", "eval/accuracy")  # the default: ci95
    assert (
        out.splitlines()[0] == "divergence sweep, embedded pair: 8 jobs, 3 variants; final values, mean ± 95% CI over seeds (Student's t)"
    )
    # rkl final: 0.6, 0.7, 0.5 -> 0.6 ± 4.303 * 0.1 / sqrt(3) = 0.248
    assert cells(out.splitlines()[3])[:4] == ["variant=rkl", "0,1,2", "rkl", "0.6 ± 0.25"]
    code, out, _ = compare(capsys, folder, "--final-only", "--metric", "eval/accuracy", "--stat", "minmax", "--format", "csv")
    assert out.splitlines()[0].startswith("variant,seeds,n,divergence,eval/accuracy_mean,eval/accuracy_min,eval/accuracy_max,")
    assert out.splitlines()[1].startswith("variant=rkl,0 1 2,3,rkl,0.6,0.5,0.7,")
    code, out, err = compare(capsys, folder, "--stat", "sem")
    assert code == 2 and "argument --stat: invalid choice: 'sem'" in err
    runs = load_runs(folder)
    fig = plot_curves(runs, ["eval/accuracy"], stat="ci95", x="tokens", labels="paper", smooth=False)
    (legend,) = fig.legends  # one panel: the legend under it
    assert legend.get_title().get_text() == "mean over seeds; band: 95% CI (Student's t)"
    assert [t.get_text() for t in legend.get_texts()] == [
        "reverse KL (3 seeds)",
        "forward KL (3 seeds)",
        "JSD β=0.5 (3 seeds)",
        "teacher (0.90)",
    ]
    ax = fig.get_axes()[0]
    assert ax.get_xlabel() == "sampled tokens (mean over seeds)"
    assert list(ax.lines[0].get_xdata()) == [0.0, 20.0, 40.0, 60.0]  # evals at steps 0, 2, 4, 6; 10 tokens a step
    assert ax.xaxis.get_major_formatter()(250000, 0) == "250k"  # token counts in k / M, not 250000
    lo, hi = ax.collections[0].get_paths()[0].vertices[:, 1].min(), ax.collections[0].get_paths()[0].vertices[:, 1].max()
    assert hi == pytest.approx(0.6 + T2 * 0.1 / math.sqrt(3), rel=1e-3) and lo < 0.1 + 1e-9  # rkl's band at its last eval
    fig = plot_curves(runs, ["eval/accuracy"], band="std")
    assert fig.legends[0].get_title().get_text() == "mean over seeds; band: mean ± std"


def test_x_axis_in_seconds_and_tokens(tmp_path):
    rs = group_by_variant(load_runs(make(tmp_path)))["variant=rkl"]
    c = curve(rs, "eval/accuracy", x="seconds")
    assert c["step"] == [0, 2, 4, 6] and c["x"] == [0.0, 1.0, 2.0, 3.0]  # 0.5 s per step
    assert curve(rs, "eval/accuracy", x="tokens")["x"] == [0.0, 20.0, 40.0, 60.0]
    assert c["ci95"][2] == pytest.approx(T2 * 0.057735 / math.sqrt(3), rel=1e-4)
    with pytest.raises(AnalysisError, match="--x 'epochs' is unknown; allowed: steps, tokens, seconds"):
        curve(rs, "eval/accuracy", x="epochs")


def test_labels_come_from_the_config_not_the_folder_or_option_name(tmp_path):
    groups = group_by_variant(load_runs(make(tmp_path)))
    assert paper_labels(groups) == {"variant=rkl": "reverse KL", "variant=fkl": "forward KL", "variant=jsd_0.5": "JSD β=0.5"}
    assert divergence_label({"name": "jsd", "beta": 0.3, "alpha": 0.1, "clip": None}) == "JSD β=0.3"  # only the parameters it takes
    assert divergence_label({"name": "fkl", "clip": 5.0}) == "forward KL clip=5"
    assert divergence_label({"name": "skl", "alpha": 0.2}) == "skew KL α=0.2"
    assert divergence_label({"name": "rkl", "temperature": 2.0}) == "reverse KL τ=2"
    assert divergence_label({"beta": 0.5}) is None


def test_a_reward_only_run_is_not_named_by_its_eval_divergence(tmp_path):
    from helpers.synthetic_runs import metrics_rows, write_run

    for job, coef in enumerate((1.0, 0.0)):
        run = write_run(tmp_path / "g" / str(job), [f"loss.kl_coef={coef}", "seed=0"], metrics_rows(0.5, 0.02, 0))
        cfg = {"seed": 0, "divergence": {"name": "fkl"}, "loss": {"kl_coef": coef}}
        (run / ".hydra" / "config.yaml").write_text(yaml.safe_dump(cfg))
    labels = paper_labels(group_by_variant(load_runs(tmp_path / "g")))
    assert list(labels.values()) == ["forward KL, kl_coef=1.0", "reward-only RL, kl_coef=0.0"]


def test_axis_units_rates_are_shares_divergences_nats():
    from opd_exp.analysis.labels import y_label

    assert y_label("eval/tools/result_used_rate") == "tools/result_used_rate (share)"
    assert y_label("eval/tools/calls_mean") == "tools/calls_mean"
    assert y_label("eval/kl_reverse") == "KL(S‖T) (nats)"
    assert y_label("eval/accuracy") == "accuracy (share of problems)"


def test_a_grid_keeps_what_else_a_variant_overrides_in_its_label(tmp_path):
    from helpers.synthetic_runs import metrics_rows, write_run

    job = 0
    for div in ("rkl", "jsd"):
        for frac in ("0.0", "1.0"):
            run = write_run(
                tmp_path / "g" / str(job), [f"divergence={div}", f"rollout.on_policy_fraction={frac}", "seed=0"], metrics_rows(0.5, 0.02, 0)
            )
            (run / ".hydra" / "config.yaml").write_text(yaml.safe_dump({"seed": 0, "divergence": {"name": div, "beta": 0.5}}))
            job += 1
    groups = group_by_variant(load_runs(tmp_path / "g"))
    assert list(paper_labels(groups).values()) == [
        "reverse KL, on-policy=0.0", "reverse KL, on-policy=1.0", "JSD β=0.5, on-policy=0.0", "JSD β=0.5, on-policy=1.0"
    ]  # fmt: skip
    from opd_exp.analysis import base_variants

    # each divergence against its own off-policy arm: the base that shares the most overrides
    assert base_variants(groups, "rollout.on_policy_fraction=0.0") == {
        "divergence=rkl,rollout.on_policy_fraction=1.0": "divergence=rkl,rollout.on_policy_fraction=0.0",
        "divergence=jsd,rollout.on_policy_fraction=1.0": "divergence=jsd,rollout.on_policy_fraction=0.0",
    }


def test_a_single_run_has_the_name_wandb_gives_it(tmp_path):
    """One owner for run names: W&B's variant and opd-compare's row for the same single run."""
    from opd_exp.sinks import tracking

    overrides = ["divergence=jsd", "divergence.beta=0.3", "eval.every=25", "trainer.max_steps=100", "seed=1", "logger.mode=offline"]
    run = tmp_path / "outputs" / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n")
    wandb_name = tracking.variant_name(tracking.variant_overrides(overrides, tracking.JobInfo(overrides=overrides)))
    (r,) = load_runs(run)
    assert r.variant == wandb_name == run_name(overrides) == "divergence=jsd,divergence.beta=0.3"
    # a multirun's jobs: the swept overrides, as W&B's tags and variant say
    job = tracking.JobInfo(overrides=overrides, multirun=True, swept=frozenset({"divergence.beta", "seed"}))
    assert (
        tracking.variant_name(tracking.variant_overrides(overrides, job))
        == run_name(overrides, {"divergence.beta"})
        == "divergence.beta=0.3"
    )


def _skip_every_step(job: Path) -> None:
    """The job as the trainer leaves a run whose every step was non-finite (its all-skipped stop,
    exit 3): grad/skipped=1 on each training step, guard/skipped_steps counting them, the evals
    unmoved (no update was ever applied), no summary.json."""
    rows = [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines()]
    first = next(r["eval/accuracy"] for r in rows if "eval/accuracy" in r)
    for r in rows:
        if r["step"]:
            r.update({"loss": None, "grad/skipped": 1.0, "guard/skipped_steps": float(r["step"])})
        if "eval/accuracy" in r:
            r.update({"eval/accuracy": first, "eval/kl_reverse": 1.0 - first})
    (job / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_a_run_whose_every_step_was_skipped_is_left_out_of_every_table_and_named(tmp_path, capsys):
    folder = make(tmp_path)
    _skip_every_step(folder / "1_rkl_seed1")
    for job in sorted(folder.iterdir()):  # the other jobs trained every step, one skipped a single step
        rows = [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines()]
        if job.name != "1_rkl_seed1":
            for r in rows[1:]:
                r.update({"grad/skipped": float(job.name == "0_rkl_seed0" and r["step"] == 1), "guard/skipped_steps": 0.0})
            (job / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, out, err = compare(capsys, folder)
    assert code == 0 and err == ""
    row = next(ln for ln in out.splitlines() if ln.startswith("variant=rkl"))
    assert cells(row)[1] == "0,2"  # seed 1 is not averaged in as an unmoved run
    notice = "runs whose every step was skipped (non-finite loss or gradient: no update applied), left out of the tables: 1"
    assert notice in out.splitlines()
    assert f"  run {folder / '1_rkl_seed1'}: every step skipped (no update applied): variant=rkl, 6 steps" in out.splitlines()
    # the paper tables leave it out too: at a common step, and as a base of paired differences
    code, out, _ = compare(capsys, folder, "--at-step", 4, "--base", "variant=rkl")
    assert code == 0 and notice in out.splitlines()
    assert [cells(ln)[:2] for ln in out.splitlines() if ln.startswith("reverse KL  ")] == [["reverse KL", "0,2"]]
    assert "note: forward KL: seed(s) 1 have no run of reverse KL, left out" in out
    # csv stays a table: the notice goes to stderr
    code, out, err = compare(capsys, folder, "--format", "csv")
    assert code == 0 and "skipped" not in out and notice in err.splitlines()
