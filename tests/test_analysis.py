"""Loading run folders back, and summaries over seeds, on synthetic multiruns with known numbers."""

import json
import math
import statistics
from pathlib import Path

import pytest

from helpers.synthetic_runs import SEEDS, STEPS, write_multirun, write_run
from opd_exp.analysis import (
    AnalysisError,
    curve,
    ema,
    find_failed_jobs,
    format_table,
    group_by_variant,
    latest_multirun,
    load_runs,
    load_wandb,
    mean_std,
    parse_overrides,
    parse_source,
    plot_curves,
    read_metrics,
    short_label,
    summary_table,
    variant_label,
)

RKL = "divergence=rkl"
JSD = "divergence=jsd,divergence.beta=0.5"


def test_parse_overrides_and_labels():
    o = parse_overrides(["divergence=jsd", "+divergence.beta=0.5", "++x.y=a=b", "~logger", "seed=2"])
    assert o == {"divergence": "jsd", "divergence.beta": "0.5", "x.y": "a=b", "seed": "2"}
    assert list(o) == ["divergence", "divergence.beta", "x.y", "seed"]  # order kept
    assert variant_label(o) == "divergence=jsd,divergence.beta=0.5,x.y=a=b"
    assert variant_label(o, drop={"x.y"}) == JSD


def test_multirun_loads_one_run_per_job_with_variants_and_seeds(tmp_path):
    runs = load_runs(write_multirun(tmp_path))
    assert [r.path.name for r in runs] == [str(i) for i in range(6)]
    # the shared trainer.max_steps override does not tell variants apart: dropped from labels
    assert [r.variant for r in runs] == [RKL] * 3 + [JSD] * 3
    assert [r.seed for r in runs] == [0, 1, 2] * 2
    assert runs[0].overrides == {"divergence": "rkl", "seed": "0", "trainer.max_steps": str(STEPS)}
    groups = group_by_variant(runs)
    assert list(groups) == [RKL, JSD]
    r = runs[4]  # jsd, seed 1
    assert r.steps("eval/accuracy") == [0, 2, 4]
    assert r.steps("jsd/mean") == [1, 2, 3, 4]
    assert r.final("eval/accuracy") == pytest.approx(0.61)
    assert r.final("eval/teacher_accuracy") == 0.9
    assert r.final("no/such") is None
    assert r.steps_per_s() == pytest.approx(4.0)


def test_summary_table_means_and_stds_over_seeds(tmp_path):
    rows = summary_table(load_runs(write_multirun(tmp_path)))
    by = {row["variant"]: row for row in rows}
    assert by[RKL]["seeds"] == list(SEEDS) and by[RKL]["n"] == 3
    m, s, n = by[RKL]["eval/accuracy"]
    assert (m, s, n) == (pytest.approx(0.51), pytest.approx(0.01), 3)
    m, s, n = by[JSD]["eval/accuracy"]
    assert (m, s) == (pytest.approx(0.61), pytest.approx(0.01))
    m, s, _ = by[RKL]["eval/jsd"]  # 0.02 * (1 + seed)
    assert (m, s) == (pytest.approx(0.04), pytest.approx(0.02))
    m, s, _ = by[JSD]["eval/kl_reverse"]
    assert (m, s) == (pytest.approx(0.11), pytest.approx(0.01))
    m, s, _ = by[JSD]["steps/s"]  # 2, 4, 4 steps/s
    assert (m, s) == (pytest.approx(10 / 3), pytest.approx(math.sqrt(4 / 3)))


def test_curve_aligns_seeds_on_steps(tmp_path):
    rs = group_by_variant(load_runs(write_multirun(tmp_path)))[RKL]
    c = curve(rs, "jsd/mean")
    assert c["step"] == [1, 2, 3, 4]
    assert c["n"] == [3, 3, 3, 3]
    # jsd/mean = 0.4 (1 - step/4) + 0.01 seed
    assert c["mean"][0] == pytest.approx(0.3 + 0.01)
    assert c["min"][0] == pytest.approx(0.3) and c["max"][0] == pytest.approx(0.32)
    assert c["std"][0] == pytest.approx(0.01)


def test_single_run_folder_and_seed_from_config(tmp_path):
    run = write_run(tmp_path / "run", ["divergence=jsd", "divergence.beta=0.9"], [{"step": 1, "jsd/mean": 0.2, "perf/step_s": 0.5}], seed=7)
    (runs,) = load_runs(run)
    assert runs.seed == 7  # not overridden: read from .hydra/config.yaml
    assert runs.variant == "divergence=jsd,divergence.beta=0.9"
    assert runs.steps_per_s() == pytest.approx(2.0)


def test_steps_per_s_falls_back_to_summary(tmp_path):
    run = write_run(tmp_path / "run", [], [{"step": 10, "loss": 1.0}])
    (run / "summary.json").write_text(json.dumps({"steps": 10, "elapsed_s": 4.0}))
    (r,) = load_runs(run)
    assert r.variant == "default" and r.steps_per_s() == pytest.approx(2.5)


def test_truncated_and_null_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 1.0, "kl/reverse": null}\n{"step": 2, "loss": 0.5}\n{"step": 3, "lo')
    series, bad = read_metrics(path)
    assert bad == 1
    assert series["loss"] == [(1, 1.0), (2, 0.5)]
    assert math.isnan(series["kl/reverse"][0][1])


def test_missing_folder_and_folder_without_metrics(tmp_path):
    with pytest.raises(AnalysisError, match="no such folder"):
        load_runs(tmp_path / "nope")
    (tmp_path / "empty" / "0" / ".hydra").mkdir(parents=True)
    with pytest.raises(AnalysisError, match="no metrics.jsonl under"):
        load_runs(tmp_path / "empty")
    assert find_failed_jobs(tmp_path / "empty") == [tmp_path / "empty" / "0"]


def test_mean_std_edge_cases():
    assert mean_std([]) == (pytest.approx(math.nan, nan_ok=True), pytest.approx(math.nan, nan_ok=True), 0)
    assert mean_std([2.0, None, math.nan]) == (2.0, 0.0, 1)


def test_the_95_percent_interval_of_a_mean_over_seeds():
    """Student's t with n - 1 degrees of freedom: seeds 1, 2, 3 have sd 1, so the half-width is
    t(0.975, 2) / sqrt(3) = 4.303 / 1.732; 40 values fall back to the normal quantile."""
    from opd_exp.analysis import format_ci95, mean_ci95

    assert mean_ci95([1.0, 2.0, 3.0, None, math.nan]) == (2.0, pytest.approx(4.303 / math.sqrt(3)), 3)
    assert mean_ci95([0.0, 2.0]) == (1.0, pytest.approx(12.706 * math.sqrt(2) / math.sqrt(2)), 2)
    m, h, n = mean_ci95([0.0, 1.0] * 20)
    assert (m, n) == (0.5, 40) and h == pytest.approx(1.960 * statistics.stdev([0.0, 1.0] * 20) / math.sqrt(40))
    assert mean_ci95([5.0])[2] == 1 and math.isnan(mean_ci95([5.0])[1])
    assert format_ci95([1.0, 2.0, 3.0]) == "2.000 ± 2.484" and format_ci95([0.25]) == "0.250" and format_ci95([]) == "—"


def test_format_table_text_markdown_csv(tmp_path):
    rows = summary_table(load_runs(write_multirun(tmp_path)))
    # rkl, seeds 0..2: accuracy 0.1 before, 0.50/0.51/0.52 after
    assert rows[0]["eval/accuracy before"][:2] == (pytest.approx(0.1), 0.0)
    assert rows[0]["eval/accuracy"][0] == pytest.approx(0.51) and rows[0]["eval/accuracy delta"][0] == pytest.approx(0.41)
    assert rows[0]["divergence"] == "rkl" and rows[0]["own"][0] == pytest.approx(0.11)  # its eval/kl_reverse
    text = format_table(rows, before=False)
    lines = text.splitlines()
    assert [c.strip() for c in lines[0].split("  ") if c.strip()] == [
        "variant", "seeds", "divergence", "eval accuracy", "eval JSD", "eval KL(S‖T)", "eval: own divergence", "steps/s"
    ]  # fmt: skip
    assert lines[2].split() == [
        RKL,
        "0,1,2",
        "rkl",
        "0.51",
        "±",
        "0.01",
        "0.04",
        "±",
        "0.02",
        "0.11",
        "±",
        "0.01",
        "0.11",
        "±",
        "0.01",
        "3.33",
        "±",
        "1.2",
    ]
    md = format_table(rows, fmt="markdown").splitlines()
    assert md[0].startswith(
        "| variant | seeds | divergence | eval accuracy before | eval accuracy after | Δ eval accuracy | eval JSD before |"
    )
    assert md[3].startswith(f"| {JSD} | 0,1,2 | jsd | 0.1 ± 0 | 0.61 ± 0.01 | +0.51 ± 0.01 |")
    csv = format_table(rows, fmt="csv").splitlines()
    assert csv[0].startswith(
        "variant,seeds,n,divergence,eval/accuracy before_mean,eval/accuracy before_std,eval/accuracy_mean,eval/accuracy_std,"
    )
    assert csv[1].startswith(f"{RKL},0 1 2,3,rkl,0.1,0,0.51,0.01,0.41,")


def test_a_teacher_far_above_the_students_does_not_squash_their_curves(tmp_path):
    """Students at 0.10-0.15 and a teacher at 0.9: the accuracy panel keeps the students' range
    and the legend says the teacher is above it; a teacher within reach is drawn inside."""
    pytest.importorskip("matplotlib")
    from helpers.synthetic_runs import metrics_rows, write_run

    for name, base in (("far", 0.15), ("near", 0.6)):
        folder = tmp_path / name
        for seed in (0, 1):
            rows = metrics_rows(base, 0.01, seed)
            for r in rows:  # a flat student: every eval at the start's level up to the last
                if "eval/accuracy" in r and r["step"] != rows[-1]["step"]:
                    r["eval/accuracy"] = 0.1
            write_run(folder / str(seed), ["divergence=rkl", f"seed={seed}"], rows, seed)
        fig = plot_curves(load_runs(folder), metrics=["eval/accuracy"], smooth=False, title="t")
        ax = fig.get_axes()[0]
        label = [t.get_text() for t in fig.legends[0].get_texts()][-1]
        if name == "far":
            assert label == "teacher (0.90, above the panel)"
            assert ax.get_ylim()[1] < 0.3  # the students' 0.10-0.16 fill the panel
        else:
            assert label == "teacher (0.90)" and ax.get_ylim()[1] > 0.9


def test_latest_multirun(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert latest_multirun() is None
    folder = write_multirun(tmp_path)
    (tmp_path / "multirun" / "2024-12-31" / "23-59-59").mkdir(parents=True)  # older, and empty
    (tmp_path / "multirun" / "2025-01-02" / "00-00-00").mkdir(parents=True)  # newer, but no metrics
    assert latest_multirun().resolve() == folder.resolve()


def test_plot_curves_draws_a_line_and_band_per_variant(tmp_path):
    pytest.importorskip("matplotlib")
    runs = load_runs(write_multirun(tmp_path))
    fig = plot_curves(runs, smooth=False, title="t")
    axes = [ax for ax in fig.get_axes() if ax.get_visible()]
    assert [ax.get_title() for ax in axes] == [
        "train JSD",
        "train KL(S‖T)",
        "eval accuracy",
        "eval JSD",
        "eval KL(S‖T)",
        "eval: own divergence (log scale)",  # rkl's from 1 to 0.1, jsd's from 0.5 to 0.01
    ]
    assert [len(ax.lines) for ax in axes] == [2, 2, 3, 2, 2, 2]  # eval accuracy: + the teacher line
    assert [len(ax.collections) for ax in axes] == [2] * 6  # one seed band per variant
    line = axes[2].lines[1]  # jsd variant, eval accuracy: steps 0, 2, 4
    assert list(line.get_xdata()) == [0, 2, 4]
    assert line.get_ydata()[-1] == pytest.approx(0.61)
    teacher = axes[2].lines[2]
    assert list(teacher.get_ydata()) == [0.9, 0.9] and teacher.get_linestyle() == "--"
    own = axes[5].lines[1].get_ydata()  # jsd's own divergence is its eval JSD
    assert list(own) == pytest.approx(list(axes[3].lines[1].get_ydata()))
    legend = fig.legends[0]
    assert [t.get_text() for t in legend.get_texts()] == ["rkl (3 seeds)", "jsd, β=0.5 (3 seeds)", "teacher (0.90)"]
    assert fig.get_suptitle() == "t"
    fig.savefig(tmp_path / "c.png")
    assert (tmp_path / "c.png").stat().st_size > 1000


def test_plot_smooths_training_metrics_only_and_takes_log_y(tmp_path):
    pytest.importorskip("matplotlib")
    runs = load_runs(write_multirun(tmp_path, steps=100))
    fig = plot_curves(runs, ["jsd/mean", "eval/accuracy"], logy=["jsd/mean"])
    train, ev = fig.get_axes()[:2]
    assert train.get_title() == "train JSD (EMA, span 4 steps)" and ev.get_title() == "eval accuracy"
    assert len(train.lines) == 4  # raw (faint) + smoothed, per variant
    raw, smoothed = train.lines[0].get_ydata(), train.lines[1].get_ydata()
    assert list(smoothed) == pytest.approx(ema(list(raw), 4.0))  # span: 100 points / 25
    assert train.get_yscale() == "log" and ev.get_yscale() == "linear"


def test_ema_is_bias_corrected():
    assert ema([1.0, 1.0, 1.0], 3) == pytest.approx([1.0, 1.0, 1.0])
    assert ema([0.0, 1.0], 3) == pytest.approx([0.0, 0.5 / 0.75])  # weight 0.5
    assert ema([3.0, 1.0], 1) == [3.0, 1.0]


def test_short_labels_and_sources(tmp_path):
    assert short_label("divergence=jsd,divergence.beta=0.5") == "jsd, β=0.5"
    assert short_label("variant=jsd_0.5") == "jsd_0.5"
    assert short_label("base: trainer.lr=1e-3,rollout.on_policy_fraction=0.5") == "base: lr=1e-3, on-policy=0.5"
    hydra_named = tmp_path / "div=rkl"
    hydra_named.mkdir()
    assert parse_source(str(hydra_named)) == (None, hydra_named)  # an existing path holding '='
    assert parse_source("base=outputs/x") == ("base", Path("outputs/x"))


def test_load_wandb_reads_tags_config_and_history():
    class FakeRun:
        def __init__(self, id, tags, seed, accs):
            self.id, self.tags, self.config, self.summary = id, tags, {"seed": seed}, {}
            self._rows = [{"_step": i, "eval/accuracy": a, "_runtime": 1.0, "note": "x"} for i, a in enumerate(accs)]

        def scan_history(self):
            return iter(self._rows)

    class FakeApi:
        def runs(self, path, filters=None):
            assert path == "me/opd" and filters == {"group": "sweep1"}
            return [
                FakeRun("a", ["divergence=rkl", "seed=0", "opd"], 0, [0.1, 0.5]),
                FakeRun("b", ["divergence=rkl"], 1, [0.2, 0.7]),
                FakeRun("c", ["divergence=fkl"], 0, [0.3, 0.4]),
            ]

    runs = load_wandb("opd", entity="me", group="sweep1", api=FakeApi())
    assert [r.variant for r in runs] == ["divergence=rkl", "divergence=rkl", "divergence=fkl"]
    assert [r.seed for r in runs] == [0, 1, 0]
    assert runs[1].series == {"eval/accuracy": [(0, 0.2), (1, 0.7)]}
    row = summary_table(runs, ["eval/accuracy"])[0]
    assert row["eval/accuracy"][0] == pytest.approx(0.6)


def _grid(root):
    """3 divergences x 2 estimators, 1 seed: the own divergences on scales 10x apart."""
    from helpers.synthetic_runs import metrics_rows

    folder = root / "grid"
    scale = {"rkl": ("eval/kl_reverse", 1.0), "fkl": ("eval/kl_forward", 0.1), "jsd": ("eval/jsd", 0.01)}
    job = 0
    for div, (own_key, s) in scale.items():
        for est in ("full", "topk"):
            rows = metrics_rows(0.5, 0.02, 0)
            for r in rows:
                if own_key in r:
                    r[own_key] = s * (2.0 if r["step"] == 0 else 1.0)
            run = write_run(folder / str(job), [f"divergence={div}", f"estimator={est}", "seed=0"], rows)
            (run / ".hydra" / "config.yaml").write_text(
                f"seed: 0\ntrainer: {{max_steps: 4}}\ndivergence: {{name: {div}}}\nestimator: {{name: {est}}}\n"
            )
            job += 1
    return folder


def test_plot_reads_as_a_figure(tmp_path):
    pytest.importorskip("matplotlib")
    runs = load_runs(_grid(tmp_path))
    fig = plot_curves(runs, ["jsd/mean", "eval/accuracy", "eval/tvd", "own", "kl/forward", "eval/kl_forward"], smooth=False)
    axes = [ax for ax in fig.get_axes() if ax.get_visible() and ax.axison]
    # eval/tvd was logged by no job: no empty panel for it; five panels, the legend in the sixth cell
    assert [ax.get_title() for ax in axes] == [
        "train JSD",
        "eval accuracy",
        "eval: own divergence (log scale)",
        "train KL(T‖S)",
        "eval KL(T‖S)",
    ]
    assert [ax.get_ylabel() for ax in axes] == [
        "JSD (nats)", "accuracy (share of problems)", "own divergence (nats)", "KL(T‖S) (nats)", "KL(T‖S) (nats)"
    ]  # fmt: skip
    legend_cell = [ax for ax in fig.get_axes() if ax.get_visible() and not ax.axison]
    assert len(legend_cell) == 1 and not fig.legends
    texts = [t.get_text() for t in legend_cell[0].get_legend().get_texts()]
    assert texts[:2] == ["rkl, full (1 seed)", "rkl, topk (1 seed)"] and texts[-1] == "teacher (0.90)"
    # colour = divergence, line style = estimator
    lines = axes[0].lines
    assert [ln.get_color() for ln in lines] == ["C0", "C0", "C1", "C1", "C2", "C2"]
    assert [ln.get_linestyle() for ln in lines] == ["-", "--"] * 3
    # the own panel holds rkl, fkl and jsd at 1, 0.1, 0.01: one log axis
    own = axes[2]
    assert own.get_yscale() == "log" and axes[4].get_yscale() == "linear"
    assert [ln.get_ydata()[-1] for ln in own.lines] == pytest.approx([1.0, 1.0, 0.1, 0.1, 0.01, 0.01])
