"""`opd-compare`: compare runs from their folders: several multiruns or single runs, side by side.

    opd-compare multirun/divergence/embedded_multimodal
    opd-compare base=outputs/2025-01-01/12-00-00 new=outputs/2025-01-02/09-00-00 --format markdown
    opd-compare multirun/a multirun/b --plot curves.png --log-y --metric eval/kl_forward
    opd-compare multirun/divergence/embedded_multimodal --at-step 500 --reach eval/accuracy=0.9 --base divergence=rkl
    opd-compare multirun/divergence/embedded_multimodal --plot curves.png --x tokens --stat minmax
    opd-compare multirun/divergence/embedded_multimodal --phases --format markdown

Prints one row per variant (named as W&B names the run: the overrides that tell the jobs of
its folder apart, minus the seed; with several folders, the folder's label first) with, per
metric, its value before training, after, and the change, as mean ± 95% interval over seeds
(``--stat``); then the variant's own eval divergence (``eval/<its divergence>``) the same way,
and training steps/s. ``--phases`` shows instead where each variant's step goes (seconds and share
per phase, tokens/s per phase, the FLOP ratio N_T/(3 N_S) beside the measured teacher share). ``--at-step N`` reads every run at one step instead, ``--reach
METRIC=VALUE`` gives the steps, sampled tokens and seconds to a threshold, ``--base KEY=VALUE``
each variant's per-seed difference from its base; those tables name variants in a paper's
words from the runs' config (``JSD β=0.5``). A value a run ended with as nan or inf is shown so
(a diverged run never looks unmoved). Jobs that have not reached ``trainer.max_steps`` (still
running, or stopped), jobs that wrote nothing, and runs whose every step was skipped (non-finite:
no update applied, their evals the start's) are listed apart. Errors are one line on stderr with
exit code 2.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from opd_exp.analysis import (
    CURVE_METRICS,
    OWN,
    STATS,
    TABLE_METRICS,
    X_AXES,
    AnalysisError,
    at_step_table,
    available_metrics,
    figure_title,
    find_failed_jobs,
    format_table,
    group_by_variant,
    load_sources,
    mean_std,
    metric_label,
    missing_line,
    paired_table,
    paper_labels,
    parse_reach,
    phase_table,
    plot_curves,
    reach_table,
    reached,
    stat_name,
    summary_table,
    sweep_title,
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="opd-compare",
        description="Compare opd-train runs: before/after/change per variant over seeds, the variant's own divergence, and curves.",
    )
    p.add_argument(
        "folders",
        nargs="+",
        metavar="FOLDER",
        help="a Hydra multirun folder or one run folder; several to compare them; NAME=FOLDER to label one",
    )
    p.add_argument(
        "--metric",
        action="append",
        default=None,
        metavar="NAME",
        help=f"table column, repeatable (default: {', '.join(TABLE_METRICS)}; the own divergence is always added)",
    )
    p.add_argument("--final-only", action="store_true", help="only the final value per metric (no before / change columns)")
    p.add_argument("--plot", type=Path, default=None, metavar="OUT.png", help="write curves per variant to this image (or .pdf/.svg)")
    p.add_argument(
        "--curve",
        action="append",
        default=None,
        metavar="NAME",
        help=f"curve panel for --plot, repeatable (default: {', '.join(CURVE_METRICS)}; '{OWN}': each variant's own eval divergence)",
    )
    p.add_argument(
        "--stat",
        choices=tuple(STATS),
        default=None,
        help="statistic over seeds in every table and figure band: ci95 (mean ± 95%% CI, Student's t; default), std, minmax",
    )
    p.add_argument("--band", choices=("range", "std"), default=None, help="older name of --stat for the figure: range (minmax) or std")
    p.add_argument("--at-step", type=int, default=None, metavar="N", help="read every run at step N (runs that never reached it are named)")
    p.add_argument(
        "--reach",
        action="append",
        default=None,
        metavar="METRIC=VALUE",
        help="steps, sampled tokens and seconds to a threshold per seed (= is >= for accuracy-like metrics, <= else; >=, <= to say so); repeatable",
    )
    p.add_argument(
        "--base",
        default=None,
        metavar="KEY=VALUE",
        help="per-seed paired differences of each variant from the variant with KEY=VALUE (or a variant's name)",
    )
    p.add_argument("--x", choices=X_AXES, default="steps", help="x axis of --plot: steps (default), tokens (sampled), seconds (training)")
    p.add_argument(
        "--labels",
        choices=("paper", "names"),
        default=None,
        help="variant labels: paper (from the config: 'JSD β=0.5'; default for --at-step/--reach/--base and --plot) or names (the run names W&B shows; default for the summary table)",
    )
    p.add_argument("--no-smooth", action="store_true", help="plot per-step training metrics raw (default: EMA-smoothed)")
    p.add_argument("--smooth", type=float, default=None, metavar="SPAN", help="EMA span in logged steps (default: ~1/25 of the run)")
    p.add_argument("--log-y", action="store_true", help="log scale on the y axes of --plot")
    p.add_argument(
        "--title",
        default=None,
        help="figure title (default: the sweep and the pair the runs' configs name, then the jobs and steps, e.g. "
        "'divergence sweep, embedded pair: 9 jobs, 250 steps'; several folders: their labels; runs that name no sweep: the folder)",
    )
    p.add_argument(
        "--phases",
        action="store_true",
        help="instead of the summary table: where each variant's step goes: seconds per step per phase (perf/<phase>_s: generate, "
        "teacher, train, sync, wait; the mean over the steps after the first), each phase's share, tokens/s per phase, and the "
        "FLOP ratio N_T/(3 N_S) beside the measured teacher s / train s",
    )
    p.add_argument("--format", choices=("text", "markdown", "csv"), default="text", help="table format (default: text)")
    return p


def _check_metrics(names, known, what):
    unknown = [m for m in names if m not in known and m != OWN]
    if unknown:
        raise AnalysisError(f"{what} {', '.join(map(repr, unknown))} not in any job's metrics.jsonl; allowed: {', '.join(known)}")


def _check_plot_args(args) -> None:
    """Refuse a --plot path or --smooth span before any work (a savefig error after the table is a traceback)."""
    if args.smooth is not None and not (math.isfinite(args.smooth) and args.smooth >= 1):
        raise AnalysisError(f"--smooth {args.smooth:g} is not an EMA span; allowed: a finite number >= 1 (logged steps; 1: no smoothing)")
    if args.plot is None:
        return
    from matplotlib.figure import Figure

    formats = Figure().canvas.get_supported_filetypes()
    suffix = args.plot.suffix.lower().lstrip(".")
    if suffix not in formats:
        raise AnalysisError(f"--plot {args.plot}: format {suffix or '(none)'!r} is unknown; allowed: {', '.join(sorted(formats))}")
    for parent in (args.plot.parent, *args.plot.parent.parents):
        if parent.exists():
            if not parent.is_dir():
                raise AnalysisError(f"--plot {args.plot}: {parent} is a file, not a folder; allowed: a path in a folder")
            break
    if args.plot.is_dir():
        raise AnalysisError(f"--plot {args.plot} is a folder; allowed: a file name such as curves.png")


def _stat(args) -> str:
    if args.stat is not None:
        return args.stat
    return {"range": "minmax", "std": "std"}.get(args.band, "ci95")


def run(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _check_plot_args(args)
    if args.at_step is not None and args.at_step < 0:
        raise AnalysisError(f"--at-step {args.at_step}: a step is >= 0; allowed: a logged step such as 100")
    reaches = [parse_reach(spec) for spec in args.reach or []]
    stat = _stat(args)
    everything, sources = load_sources(args.folders)
    # a run whose every step was skipped applied no update: its evals are the start's, not a result
    skipped = [r for r in everything if every_step_skipped(r)]
    loaded = [r for r in everything if not any(r is x for x in skipped)]
    runs = [r for r in loaded if r.finished]
    unfinished = [r for r in loaded if not r.finished]
    known = available_metrics(everything)
    metrics = args.metric or list(TABLE_METRICS)
    if args.metric:  # asked-for columns must exist; default ones may be missing (shown n/a)
        _check_metrics(metrics, known, "metric")
    _check_metrics([m for m, _, _ in reaches], known, "--reach metric")
    curves = args.curve or [m for m in CURVE_METRICS if m in known or m == OWN] or list(CURVE_METRICS)
    if args.curve:
        _check_metrics(curves, known, "curve")

    paper = args.at_step is not None or reaches or args.base is not None
    # the table's rows: the finished runs, or at a common step every run that reached it
    table_runs = runs if args.at_step is None else reached(loaded, args.at_step)[0]
    groups = group_by_variant(loaded)
    labels = paper_labels(groups) if args.labels != "names" else {v: v for v in groups}
    csv = args.format == "csv"
    out: list[str] = []
    if args.phases:
        title, table, notes = phase_table(runs, stat=stat, fmt=args.format, labels=labels if args.labels == "paper" else None)
        head = f"{_where(sources, runs, args)}: {len(runs)} jobs, {len({r.variant for r in runs})} variants; {title}"
        out.append(table if csv else f"{head}\n{table}" + "".join(f"note: {n}\n" for n in notes))
    elif not paper:
        before = not args.final_only
        rows = summary_table(runs, metrics, stat=stat)
        if args.labels == "paper":
            for row in rows:
                row["variant"] = labels.get(row["variant"], row["variant"])
        table = format_table(rows, metrics, fmt=args.format, before=before)
        what = "before training -> final, and the change" if before else "final values"
        out.append(
            table
            if csv
            else f"{_where(sources, runs, args)}: {len(runs)} jobs, {len({r.variant for r in runs})} variants; {what}, {stat_name(stat)}\n{table}"
        )
    else:
        n_var = len({r.variant for r in loaded})
        if not csv:
            out.append(f"{_where(sources, loaded, args)}: {len(loaded)} jobs, {n_var} variants\n")
        if args.at_step is not None:
            title, table, missing = at_step_table(loaded, args.at_step, metrics, stat=stat, fmt=args.format, labels=labels)
            out.append(table if csv else f"{title}\n{table}" + (missing_line(args.at_step, missing, labels) + "\n" if missing else ""))
        for metric, op, value in reaches:
            title, table = reach_table(loaded, metric, op, value, stat=stat, fmt=args.format, labels=labels)
            out.append(table if csv else f"{title}\n{table}")
        if args.base is not None:
            if len({r.variant for r in table_runs}) < 2:
                raise AnalysisError(f"--base {args.base}: one variant only; allowed: a folder (or folders) with two variants or more")
            title, table, notes = paired_table(
                table_runs,
                args.base,
                metrics,
                step=args.at_step,
                stat=stat,
                fmt=args.format,
                labels=labels,
                reach_spec=reaches[0] if reaches else None,
            )
            out.append(table if csv else f"{title}\n{table}" + "".join(f"note: {n}\n" for n in notes))
    sys.stdout.write(("\n" if csv else "").join(out))
    failed = [(label, d) for label, folder in sources for d in find_failed_jobs(folder)]
    if skipped:  # with csv on stderr: the table stays a table
        print(
            "\n".join([SKIPPED_NOTICE.format(n=len(skipped)), *(f"  run {r.path}: every step skipped (no update applied): "
                                                               f"{r.variant}, {r.last_step()} steps" for r in skipped)]),
            file=sys.stderr if csv else sys.stdout,
        )  # fmt: skip
    if not csv:
        for label, _ in sources:
            teacher = mean_std(r.final("eval/teacher_accuracy") for r in loaded if r.source == label)
            if teacher[2]:
                print(f"teacher eval accuracy{f' ({label})' if len(sources) > 1 else ''}: {teacher[0]:.4g}")
        for r in loaded:
            if r.bad_lines:
                print(f"note: {r.path}: skipped {r.bad_lines} unreadable metrics.jsonl line(s)")
            if r.truncated:
                print(f"note: {r.path}: metrics.jsonl is larger than {r.truncated:,} bytes; only those were read")
        for r in runs:
            odd = [f"{metric_label(m)} {r.final(m)}" for m in [*metrics, OWN] if r.final(m) is not None and not math.isfinite(r.final(m))]
            if odd:
                print(f"note: {r.path}: ended non-finite at step {r.last_step()}: {', '.join(odd)}")
        if unfinished and args.at_step is None and (not paper or args.phases or args.base is not None):
            print(f"jobs that have not reached trainer.max_steps, left out of the table: {len(unfinished)}")
            for r in unfinished:
                print(f"  {r.path}: {r.variant} ({r.status()})")
        if failed:
            print(f"jobs that wrote no metrics.jsonl (failed at start, or still starting), left out: {len(failed)}")
            for _, d in failed:
                print(f"  {d}")

    if args.plot is not None:
        smooth = False if args.no_smooth else (args.smooth if args.smooth is not None else True)
        # every job's curve, unfinished ones too (a running sweep is watched this way)
        fig = plot_curves(
            everything,
            curves,
            stat=stat,
            x=args.x,
            labels=labels if args.labels != "names" else None,
            smooth=smooth,
            logy=args.log_y,
            title=args.title or figure_title(sources, everything),
        )
        try:
            args.plot.parent.mkdir(parents=True, exist_ok=True)
            fig.savefig(args.plot, dpi=150)
        except OSError as ex:
            raise AnalysisError(f"--plot {args.plot} cannot be written ({ex.strerror or ex}); allowed: a writable path") from None
        if not csv:
            print(f"curves written to {args.plot}")
    return 0


SKIPPED_NOTICE = "runs whose every step was skipped (non-finite loss or gradient: no update applied), left out of the tables: {n}"


def every_step_skipped(run) -> bool:
    """Every training step of the run was skipped (the trainer's all-skipped stop, exit 3, or a
    stop after ``trainer.max_bad_steps`` bad steps from the first): ``guard/skipped_steps`` at its
    last step counts them all; runs that log no such count: ``grad/skipped`` is 1 on every step."""
    last = run.last_step()
    if not last:
        return False
    counted = run.get("guard/skipped_steps")
    if counted:
        step, n = counted[-1]
        return step == last and n >= last
    flags = [v for s, v in run.get("grad/skipped") if s > 0]
    return bool(flags) and all(v == 1.0 for v in flags)


def _where(sources, runs, args) -> str:
    """The table's title: the sweep the runs come from (else the folder), or the folders' labels."""
    if len(sources) > 1:
        return f"{len(sources)} folders ({', '.join(lbl for lbl, _ in sources)})"
    return sweep_title(sources, runs)


def main(argv: list[str] | None = None) -> None:
    """Console entry point."""
    try:
        code = run(argv)
    except AnalysisError as ex:
        print(f"opd-compare: error: {ex}", file=sys.stderr)
        code = 2
    sys.exit(code)


if __name__ == "__main__":
    main()
