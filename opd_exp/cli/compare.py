"""`opd-compare`: compare the variants of a multirun sweep from its run folders.

    opd-compare multirun/2025-01-01/12-00-00
    opd-compare multirun/2025-01-01/12-00-00 --plot curves.png --format markdown
    opd-compare outputs/2025-01-01/12-00-00 --metric eval/kl_forward --metric jsd/mean

Prints one row per variant (a job's overrides minus the seed and minus the overrides all jobs
share) with the final value of each metric as mean ± sample std over seeds, and training
steps/s. Errors are one line on stderr with exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from opd_exp.analysis import (
    CURVE_METRICS,
    TABLE_METRICS,
    AnalysisError,
    available_metrics,
    find_failed_jobs,
    format_table,
    load_runs,
    mean_std,
    plot_curves,
    summary_table,
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="opd-compare",
        description="Compare the variants of an opd-train multirun: final metrics over seeds, and curves.",
    )
    p.add_argument("folder", type=Path, help="a Hydra multirun folder (multirun/<date>/<time>) or one run folder")
    p.add_argument(
        "--metric",
        action="append",
        default=None,
        metavar="NAME",
        help=f"table column, repeatable (default: {', '.join(TABLE_METRICS)})",
    )
    p.add_argument("--plot", type=Path, default=None, metavar="OUT.png", help="write curves per variant to this image")
    p.add_argument(
        "--curve",
        action="append",
        default=None,
        metavar="NAME",
        help=f"curve panel for --plot, repeatable (default: {', '.join(CURVE_METRICS)})",
    )
    p.add_argument("--band", choices=("range", "std"), default="range", help="seed band: min..max (default) or mean ± std")
    p.add_argument("--format", choices=("text", "markdown", "csv"), default="text", help="table format (default: text)")
    return p


def _check_metrics(names, known, what):
    unknown = [m for m in names if m not in known]
    if unknown:
        raise AnalysisError(f"{what} {', '.join(map(repr, unknown))} not in any job's metrics.jsonl; allowed: {', '.join(known)}")


def run(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    runs = load_runs(args.folder)
    known = available_metrics(runs)
    metrics = args.metric or list(TABLE_METRICS)
    if args.metric:  # asked-for columns must exist; default ones may be missing (shown n/a)
        _check_metrics(metrics, known, "metric")
    curves = args.curve or list(CURVE_METRICS)
    if args.curve:
        _check_metrics(curves, known, "curve")

    table = format_table(summary_table(runs, metrics), metrics, fmt=args.format)
    if args.format == "csv":
        sys.stdout.write(table)
    else:
        n_var = len({r.variant for r in runs})
        print(f"{args.folder}: {len(runs)} jobs, {n_var} variants; final values, mean ± std over seeds")
        sys.stdout.write(table)
        teacher = mean_std(r.final("eval/teacher_accuracy") for r in runs)
        if teacher[2]:
            print(f"teacher eval accuracy: {teacher[0]:.4g}")
        for r in runs:
            if r.bad_lines:
                print(f"note: {r.path}: skipped {r.bad_lines} unreadable metrics.jsonl line(s)")
        for d in find_failed_jobs(args.folder):
            print(f"note: {d}: job wrote no metrics.jsonl (failed or still starting); left out")

    if args.plot is not None:
        fig = plot_curves(runs, curves, band=args.band)
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.plot, dpi=120)
        if args.format != "csv":
            print(f"curves written to {args.plot}")
    return 0


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
