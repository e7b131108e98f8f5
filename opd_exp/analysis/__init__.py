"""Reading run folders (and W&B runs) back: tables over seeds, curves, plots."""

from opd_exp.analysis.runs import (
    CURVE_METRICS,
    METRICS_FILE,
    SEED_KEYS,
    TABLE_METRICS,
    AnalysisError,
    Run,
    assign_variants,
    available_metrics,
    curve,
    find_failed_jobs,
    find_run_dirs,
    format_stat,
    format_table,
    group_by_variant,
    latest_multirun,
    load_runs,
    load_wandb,
    mean_std,
    parse_overrides,
    plot_curves,
    read_metrics,
    read_run,
    summary_table,
    variant_label,
)

__all__ = [
    "CURVE_METRICS", "METRICS_FILE", "SEED_KEYS", "TABLE_METRICS", "AnalysisError", "Run", "assign_variants",
    "available_metrics", "curve", "find_failed_jobs", "find_run_dirs", "format_stat", "format_table",
    "group_by_variant", "latest_multirun", "load_runs", "load_wandb", "mean_std", "parse_overrides", "plot_curves",
    "read_metrics", "read_run", "summary_table", "variant_label",
]
