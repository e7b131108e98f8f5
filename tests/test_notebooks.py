"""The notebooks: paired with their jupytext sources, stored without outputs, and executed.

Every test id here contains 'notebook' (and no other test id does), so `pytest -k notebook`
runs exactly these.
"""

import json
import sys
import time
from pathlib import Path

import pytest

from helpers.synthetic_runs import SEEDS, VARIANTS, metrics_rows, write_multirun, write_run

nbformat = pytest.importorskip("nbformat")
jupytext = pytest.importorskip("jupytext")

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
NAMES = ("compare_variants", "estimator_check", "lab")


def cells(nb):
    return [(c.cell_type, c.source.strip()) for c in nb.cells]


@pytest.mark.parametrize("name", NAMES)
def test_notebook_source_and_ipynb_in_sync(name):
    py = jupytext.read(NOTEBOOKS / f"{name}.py")
    ipynb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    assert cells(py) == cells(ipynb), f"run `jupytext --sync notebooks/{name}.py` (or --to ipynb) and commit both"
    assert ipynb.metadata.get("jupytext", {}).get("formats") == "ipynb,py:percent"


@pytest.mark.parametrize("name", NAMES)
def test_notebook_stored_without_outputs(name):
    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    for c in nb.cells:
        if c.cell_type == "code":
            assert c.outputs == [] and c.execution_count is None, f"{name}.ipynb holds outputs: clear them"


def execute(name, cwd: Path, monkeypatch, timeout: float = 120):
    """Run the stored .ipynb in a kernel on this very interpreter; return (nb, seconds)."""
    from nbclient import NotebookClient

    # A kernelspec pointing at sys.executable, found first on JUPYTER_PATH: the kernel imports
    # the same opd_exp as the tests, whatever `python` on PATH is.
    kernel_dir = cwd / "jupyter"
    spec = kernel_dir / "kernels" / "python3"
    spec.mkdir(parents=True, exist_ok=True)
    (spec / "kernel.json").write_text(
        json.dumps(
            {
                "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                "display_name": "Python 3 (tests)",
                "language": "python",
            }
        )
    )
    monkeypatch.setenv("JUPYTER_PATH", str(kernel_dir))
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")  # images into the outputs
    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    t0 = time.perf_counter()
    NotebookClient(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(cwd)}}).execute()
    return nb, time.perf_counter() - t0


def text_outputs(nb) -> str:
    out = []
    for c in nb.cells:
        for o in c.get("outputs", []):
            if o.output_type == "stream":
                out.append(o.text)
            elif "data" in o:
                out.append(o.data.get("text/markdown", "") or o.data.get("text/plain", ""))
    return "\n".join(out)


def images(nb) -> int:
    return sum("image/png" in o.get("data", {}) for c in nb.cells for o in c.get("outputs", []))


def test_notebook_compare_variants_runs_on_a_tiny_multirun(tmp_path, monkeypatch):
    pytest.importorskip("nbclient")
    folder = write_multirun(tmp_path / "data")
    monkeypatch.setenv("OPD_MULTIRUN", str(folder))
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    nb, seconds = execute("compare_variants", tmp_path, monkeypatch)
    text = text_outputs(nb)
    assert f"{folder}: 6 jobs, 4 steps" in text
    # the reader's names: labels in a paper's words and metric names, before / after / change,
    # mean ± 95% CI (Student's t: 4.303 * 0.01 / sqrt(3) = 0.025)
    assert "final values, mean ± 95% CI over seeds (Student's t)" in text
    assert "| variant | seeds | divergence | eval accuracy before | eval accuracy after | Δ eval accuracy |" in text
    assert "| JSD β=0.5 | 0,1,2 | jsd | 0.1 ± 0 | 0.61 ± 0.025 | +0.51 ± 0.025 |" in text
    # the paper tables: at the last common step, steps to eval accuracy 0.5, differences from the first variant
    assert "at step 4: 6 jobs, 2 variants; mean ± 95% CI over seeds (Student's t)" in text
    assert "| JSD β=0.5 | 0,1,2 | 3/3 | 4 ± 0 |" in text
    assert "| JSD β=0.5 | reverse KL | 0,1,2 | +0.100 ± 0.000 (+0.100, +0.100, +0.100) |" in text
    assert "divergence=" not in text.split("teacher eval accuracy")[0].split("| variant |")[1]
    assert "teacher eval accuracy: 0.9" in text
    assert images(nb) == 2
    assert seconds < 30


def test_notebook_estimator_check_reproduces_the_seed_table(tmp_path, monkeypatch):
    pytest.importorskip("nbclient")
    nb, seconds = execute("estimator_check", tmp_path, monkeypatch)
    text = text_outputs(nb)
    # seed 001's table: before (shipped) negative, after (ours) +1.000, per beta
    assert "+0.300  -0.593 .. -0.151  +1.000" in text
    assert "+0.500  -0.787 .. -0.423  +1.000" in text
    assert "+0.900  -0.937 .. -0.758  +1.000" in text
    assert "Trinity-RFT beta=1 (t - s) vs rkl" in text and "skl alpha=0.1" in text and "top-4 + sampled tail" in text
    assert "rel_std" in text
    assert images(nb) == 1
    assert seconds < 30


def test_notebook_lab_tables_and_figures_from_a_lab_sweep_folder(tmp_path, monkeypatch):
    """One lab sweep folder of synthetic runs: the table gives mean ± 95% CI (Student's t over
    3 seeds) and the figure is saved; the other claims, with no folder, are skipped."""
    pytest.importorskip("nbclient")
    root = tmp_path / "multirun"
    job = 0
    for variant, (acc, jsd) in VARIANTS.items():
        for seed in SEEDS:
            write_run(
                root / "lab_legacy_jsd" / "embedded_multimodal" / f"{job}_seed{seed}",
                [*variant, f"seed={seed}"],
                metrics_rows(acc, jsd, seed),
                seed,
            )
            job += 1
    monkeypatch.setenv("OPD_LAB_ROOT", str(root))
    monkeypatch.setenv("OPD_LAB_FIGURES", str(tmp_path / "figures"))
    nb, _ = execute("lab", tmp_path, monkeypatch)
    text = text_outputs(nb)
    assert "lab_legacy_jsd" in text and "6 jobs" in text
    # eval/accuracy of rkl: 0.50, 0.51, 0.52 -> 0.510 ± 4.303 * 0.01 / sqrt(3) = 0.025
    assert "| divergence=rkl | 0,1,2 |" in text and "0.510 ± 0.025" in text
    assert "lab_kl_direction: no runs under" in text
    assert (tmp_path / "figures" / "lab_legacy_jsd.png").is_file()
    assert images(nb) == 1
