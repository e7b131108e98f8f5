"""`opd-compare` on synthetic multiruns (and, marked slow, on a real tiny opd-train multirun)."""

import json
import os
import subprocess
import sys

import pytest

from helpers.synthetic_runs import metrics_rows, write_multirun, write_run
from opd_exp.cli.compare import main

RKL = "divergence=rkl"
JSD = "divergence=jsd,divergence.beta=0.5"


def compare(capsys, *args):
    with pytest.raises(SystemExit) as ex:
        main([str(a) for a in args])
    out = capsys.readouterr()
    return ex.value.code, out.out, out.err


def _cells(line):
    return [c.strip() for c in line.split("  ") if c.strip()]


def test_prints_the_comparison_table(tmp_path, capsys):
    folder = write_multirun(tmp_path)
    write_run(folder / "6", ["divergence=fkl", "seed=0", "trainer.max_steps=4"], None)  # a job that failed at start
    code, out, err = compare(capsys, folder, "--stat", "std")  # the default, ci95: test_compare_paper.py
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0] == f"{folder}: 6 jobs, 2 variants; before training -> final, and the change, mean ± std over seeds"
    assert _cells(lines[1]) == [
        "variant", "seeds", "divergence",
        "eval accuracy before", "eval accuracy after", "Δ eval accuracy",
        "eval JSD before", "eval JSD after", "Δ eval JSD",
        "eval KL(S‖T) before", "eval KL(S‖T) after", "Δ eval KL(S‖T)",
        "eval: own divergence before", "eval: own divergence after", "Δ eval: own divergence",
        "steps/s",
    ]  # fmt: skip
    # accuracy 0.1 -> 0.50/0.51/0.52; the own divergence of rkl is its eval KL(S||T), of jsd its eval JSD
    assert _cells(lines[3]) == [RKL, "0,1,2", "rkl", "0.1 ± 0", "0.51 ± 0.01", "+0.41 ± 0.01", "0.5 ± 0", "0.04 ± 0.02", "-0.46 ± 0.02",
                                "1 ± 0", "0.11 ± 0.01", "-0.89 ± 0.01", "1 ± 0", "0.11 ± 0.01", "-0.89 ± 0.01", "3.33 ± 1.2"]  # fmt: skip
    assert _cells(lines[4])[:3] == [JSD, "0,1,2", "jsd"] and _cells(lines[4])[-4:] == [
        "0.5 ± 0",
        "0.02 ± 0.01",
        "-0.48 ± 0.01",
        "3.33 ± 1.2",
    ]
    assert lines[5] == "teacher eval accuracy: 0.9"
    assert lines[6:] == ["jobs that wrote no metrics.jsonl (failed at start, or still starting), left out: 1", f"  {folder / '6'}"]


def test_several_folders_single_runs_and_labels(tmp_path, capsys):
    a = write_run(tmp_path / "outputs" / "a", ["divergence=rkl"], metrics_rows(0.5, 0.02, 0))
    b = write_run(tmp_path / "outputs" / "b", ["divergence=tvd"], metrics_rows(0.7, 0.01, 0))
    (b / "metrics.jsonl").write_text(
        (b / "metrics.jsonl").read_text().replace('"eval/kl_forward": 1.2', '"eval/kl_forward": 1.2, "eval/tvd": 0.4')
        .replace('"eval/kl_forward": 0.12}', '"eval/kl_forward": 0.12, "eval/tvd": 0.1}')
    )  # fmt: skip
    multi = write_multirun(tmp_path)
    code, out, _ = compare(capsys, f"base={a}", f"new={b}", multi, "--final-only", "--metric", "eval/accuracy", "--stat", "std")
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == "3 folders (base, new, 12-00-00): 8 jobs, 4 variants; final values, mean ± std over seeds"
    assert _cells(lines[1]) == ["variant", "seeds", "divergence", "eval accuracy", "eval: own divergence", "steps/s"]
    assert _cells(lines[3]) == ["base", "0", "rkl", "0.5", "0.1", "2"]
    assert _cells(lines[4]) == ["new", "0", "tvd", "0.7", "0.1", "2"]  # eval/tvd: its own divergence
    assert _cells(lines[5])[:3] == [f"12-00-00: {RKL}", "0,1,2", "rkl"]
    code, _, err = compare(capsys, f"x={a}", f"x={b}")
    assert code == 2 and err == "opd-compare: error: two folders have the label ['x', 'x']; allowed: distinct name=path labels\n"


def test_metric_option_and_markdown(tmp_path, capsys):
    code, out, _ = compare(
        capsys,
        write_multirun(tmp_path),
        "--metric",
        "eval/kl_forward",
        "--metric",
        "jsd/mean",
        "--format",
        "markdown",
        "--final-only",
        "--stat",
        "std",
    )
    assert code == 0
    lines = out.splitlines()
    assert lines[1] == "| variant | seeds | divergence | eval KL(T‖S) | train JSD | eval: own divergence | steps/s |"
    assert lines[3] == f"| {RKL} | 0,1,2 | rkl | 0.12 ± 0 | 0.01 ± 0.01 | 0.11 ± 0.01 | 3.33 ± 1.2 |"


def test_plot_writes_an_image(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out_png = tmp_path / "figs" / "curves.png"
    code, out, _ = compare(capsys, write_multirun(tmp_path), "--plot", out_png, "--curve", "kl/forward")
    assert code == 0 and out.splitlines()[-1] == f"curves written to {out_png}"
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_one_line_errors(tmp_path, capsys):
    code, out, err = compare(capsys, tmp_path / "nope")
    assert (code, out) == (2, "")
    assert err == f"opd-compare: error: no such folder: {tmp_path / 'nope'}\n"
    (tmp_path / "empty").mkdir()
    code, _, err = compare(capsys, tmp_path / "empty")
    assert code == 2 and err.startswith(f"opd-compare: error: no metrics.jsonl under {tmp_path / 'empty'}")
    assert err.count("\n") == 1
    code, _, err = compare(capsys, write_multirun(tmp_path), "--metric", "eval/acc")
    assert code == 2 and err.startswith("opd-compare: error: metric 'eval/acc' not in any job's metrics.jsonl; allowed: ")
    assert "eval/accuracy" in err and err.count("\n") == 1


# A tiny embedded recipe in a cache of its own: seconds to build, and no test waits on (or
# writes into) the real embedded teacher in the user's cache.
TINY_WORLD = [
    *(
        f"model_pair.embedded.{who}.{k}={v}"
        for who in ("teacher", "student")
        for k, v in dict(hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=32, sft_steps=2, batch_size=4).items()
    ),
    "model_pair.embedded.n_sft=64",
    "model_pair.embedded.n_check=4",
    "task.n_train=64",
    "task.n_eval=4",
]


@pytest.mark.slow
def test_compare_on_a_real_tiny_multirun(tmp_path):
    """opd-train -m on a tiny embedded pair, 2 variants x 2 seeds x 2 steps, then opd-compare."""
    sweep = tmp_path / "sweep"
    env = {**os.environ, "WANDB_MODE": "offline", "OPD_EXP_CACHE": str(tmp_path / "cache")}
    cmd = [
        sys.executable,
        "-m",
        "opd_exp.cli.train",
        "-m",
        "divergence=rkl,jsd",
        "seed=0,1",
        "logger=none",
        "trainer.max_steps=2",
        "trainer.batch_size=2",
        "eval.size=4",
        "eval.batch_size=4",
        "trainer.progress=false",
        "rollout.max_new_tokens=8",
        *TINY_WORLD,
        f"hydra.sweep.dir={sweep}",
    ]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    # the prepared pair is recorded: its cache hash and the accuracies measured when it was built
    import json

    summary = json.loads((sweep / "0" / "summary.json").read_text())
    manifest = json.loads((next((tmp_path / "cache").glob("embedded-teacher-*")) / "opd-exp-manifest.json").read_text())
    assert summary["pair"]["teacher"] == {
        "hash": manifest["hash"], "accuracy": manifest["info"]["accuracy"], "format_rate": manifest["info"]["format_rate"], "n_check": 4,
        "params": manifest["info"]["params"],  # counted on the loaded model: what the cache entry says it built
    }  # fmt: skip
    assert set(summary["pair"]["student"]) == {"hash", "accuracy", "format_rate", "n_check", "params"}
    assert "opd-exp: building the embedded teacher once" in done.stderr  # announced, once: the other jobs reuse it
    assert done.stderr.count("opd-exp: building the embedded teacher once") == 1
    done = subprocess.run(
        [sys.executable, "-m", "opd_exp.cli.compare", str(sweep), "--plot", str(tmp_path / "c.png")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == f"{sweep}: 4 jobs, 2 variants; before training -> final, and the change, mean ± 95% CI over seeds (Student's t)"
    rows = {_cells(ln)[0]: _cells(ln) for ln in lines[3:5]}
    assert set(rows) == {"divergence=rkl", "divergence=jsd"}
    for cells in rows.values():
        assert cells[1] == "0,1" and cells[2] in ("rkl", "jsd")
        assert 0.0 <= float(cells[4].split()[0]) <= 1.0
        assert not any("n/a" in c for c in cells)
        # the own divergence (rkl: eval/kl_reverse = eval/rkl; jsd: eval/jsd) after training
        assert cells[-3] == (cells[10] if cells[2] == "rkl" else cells[7])
    assert (tmp_path / "c.png").stat().st_size > 1000


def _rewrite(run_dir, rows):
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_unfinished_jobs_are_listed_apart_with_their_step(tmp_path, capsys):
    from filelock import FileLock

    folder = write_multirun(tmp_path)
    _rewrite(folder / "2", metrics_rows(0.5, 0.02, 2)[:3])  # rkl seed 2 stopped after step 2 of 4
    _rewrite(folder / "5", metrics_rows(0.6, 0.01, 2)[:3])  # jsd seed 2 still running at step 2
    with FileLock(str(folder / "5" / ".opd-train.lock")):
        code, out, err = compare(capsys, folder, "--stat", "std")
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].startswith(f"{folder}: 4 jobs, 2 variants;")
    assert _cells(lines[3])[:5] == [RKL, "0,1", "rkl", "0.1 ± 0", "0.505 ± 0.0071"]
    assert _cells(lines[4])[:2] == [JSD, "0,1"]
    assert lines[-3:] == [
        "jobs that have not reached trainer.max_steps, left out of the table: 2",
        f"  {folder / '2'}: {RKL} (stopped at step 2/4)",
        f"  {folder / '5'}: {JSD} (running, step 2/4)",
    ]


def test_a_run_that_ended_nonfinite_shows_so(tmp_path, capsys):
    folder = write_multirun(tmp_path)
    rows = metrics_rows(0.5, 0.02, 1)
    rows[-1]["eval/accuracy"] = None  # nan, as the trainer logs it
    rows[-1]["eval/kl_reverse"] = float("inf")
    _rewrite(folder / "1", rows)
    code, out, _ = compare(capsys, folder)
    assert code == 0
    lines = out.splitlines()
    cells = _cells(lines[3])
    assert cells[:6] == [RKL, "0,1,2", "rkl", "0.1 ± 0", "nan", "nan"]
    assert cells[9:12] == ["1 ± 0", "inf", "inf"]  # eval KL(S||T) before, after, change
    assert f"note: {folder / '1'}: ended non-finite at step 4: eval accuracy nan, eval KL(S‖T) inf, eval: own divergence inf" in lines


def _own_run(run_dir, divergence, rows):
    write_run(run_dir, [f"divergence={divergence}"], rows)
    (run_dir / ".hydra" / "config.yaml").write_text(f"seed: 0\ntrainer: {{max_steps: 4}}\ndivergence: {{name: {divergence}}}\n")
    return run_dir


def test_own_divergence_before_an_extension_that_switched_to_it(tmp_path, capsys):
    # fkl for steps 1-2, then extended with rkl: eval/rkl is logged from the switch on only
    rows = metrics_rows(0.5, 0.02, 0)
    rows[-1]["eval/rkl"] = rows[-1]["eval/kl_reverse"]
    a = _own_run(tmp_path / "a", "rkl", rows)
    rows = metrics_rows(0.5, 0.02, 0)
    rows[-1]["eval/tvd"] = 0.3  # no fixed-name twin: its value before training was never measured
    b = _own_run(tmp_path / "b", "tvd", rows)
    code, out, _ = compare(capsys, f"a={a}", f"b={b}")
    assert code == 0
    lines = out.splitlines()
    assert _cells(lines[3])[-4:] == ["1", "0.1", "-0.9", "2"]  # own before = its eval KL(S||T) at step 0
    assert _cells(lines[4])[-4:] == ["n/a", "0.3", "n/a", "2"]


def test_damaged_inputs_are_notes_or_one_line_errors(tmp_path, capsys):
    folder = write_multirun(tmp_path)
    with (folder / "0" / "metrics.jsonl").open("a") as fh:
        fh.write('{"step": 1e999, "eval/accuracy": 1.0}\n')
    (folder / "1" / ".hydra" / "overrides.yaml").write_text("5\n")
    (folder / "2" / ".hydra" / "overrides.yaml").write_bytes(b"- divergence=\xff\xfe\n")
    (folder / "3" / "metrics.jsonl").unlink()
    (folder / "3" / "metrics.jsonl").mkdir()
    code, out, err = compare(capsys, folder)
    assert code == 0 and err == ""
    assert f"note: {folder / '0'}: skipped 1 unreadable metrics.jsonl line(s)" in out
    assert out.splitlines()[-2:] == [
        "jobs that wrote no metrics.jsonl (failed at start, or still starting), left out: 1",
        f"  {folder / '3'}",
    ]
    (tmp_path / "file").write_text("")
    for args, message in [
        (["--plot", tmp_path / "x.xyz"], f"--plot {tmp_path / 'x.xyz'}: format 'xyz' is unknown; allowed: "),
        (["--plot", tmp_path / "file" / "x.png"], f"--plot {tmp_path / 'file' / 'x.png'}: {tmp_path / 'file'} is a file, not a folder"),
        (["--smooth", "-1"], "--smooth -1 is not an EMA span; allowed: a finite number >= 1"),
        (["--smooth", "nan"], "--smooth nan is not an EMA span; allowed: a finite number >= 1"),
    ]:
        code, out, err = compare(capsys, folder, *args)
        assert (code, out) == (2, "") and err.startswith(f"opd-compare: error: {message}") and err.count("\n") == 1, err
    assert not (tmp_path / "x.xyz").exists()


def test_metrics_are_streamed_and_bounded(tmp_path, capsys, monkeypatch):
    from opd_exp.analysis import runs as runs_mod

    run_dir = write_run(tmp_path / "run", ["divergence=rkl"], metrics_rows(0.5, 0.02, 0, steps=40))
    size = (run_dir / "metrics.jsonl").stat().st_size
    first_lines = (run_dir / "metrics.jsonl").read_bytes().splitlines(keepends=True)[:5]
    monkeypatch.setattr(runs_mod, "MAX_METRICS_BYTES", len(b"".join(first_lines)))
    code, out, _ = compare(capsys, run_dir, "--metric", "jsd/mean")
    assert code == 0
    assert size > runs_mod.MAX_METRICS_BYTES
    assert f"note: {run_dir}: metrics.jsonl is larger than {runs_mod.MAX_METRICS_BYTES:,} bytes; only those were read" in out
    assert runs_mod.read_run(run_dir).last_step() == 4  # 5 lines read: step 0..4
    # one line longer than MAX_LINE_BYTES (a link to a file that is no metrics.jsonl) is skipped unread
    monkeypatch.setattr(runs_mod, "MAX_LINE_BYTES", 64)
    path = tmp_path / "long.jsonl"
    path.write_bytes(b'{"step": 1, "loss": 2.0}\n' + b"0" * 1000 + b'\n{"step": 2, "loss": 3.0}\n')
    assert runs_mod.read_metrics(path) == ({"loss": [(1, 2.0), (2, 3.0)]}, 1)
