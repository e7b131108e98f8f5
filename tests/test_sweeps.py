"""Sweep definitions: every Hydra sweep in sweeps/sweep/ composes its first job into a valid
config with a readable job folder, and every W&B spec in sweeps/wandb/ calls opd_exp.cli.train
with keys that exist in the config schema."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf, open_dict

import opd_exp.cli.train as T

SWEEPS = Path(T.__file__).resolve().parents[2] / "sweeps"
HYDRA_SWEEPS = sorted((SWEEPS / "sweep").glob("*.yaml"))
WANDB_SPECS = sorted((SWEEPS / "wandb").glob("*.yaml"))


def compose_job(overrides, job_num=0):
    """The job config opd-train would run (hydra node kept), and the validated TrainConfig."""
    with initialize_config_dir(config_dir=T.CONF_DIR, version_base="1.3"):
        cfg = compose("train", overrides=list(overrides), return_hydra_config=True)
    OmegaConf.set_readonly(cfg.hydra, False)
    with open_dict(cfg):
        cfg.hydra.job.num = job_num
    h = cfg.hydra  # the parts a sweep sets, resolved while the job's keys (seed, ...) exist
    hydra_cfg = OmegaConf.create(
        {
            "mode": str(h.mode),
            "sweep": {"dir": h.sweep.dir, "subdir": h.sweep.subdir},
            "sweeper": {"params": OmegaConf.to_container(h.sweeper.params) if h.sweeper.get("params") else {}},
            "launcher": OmegaConf.to_container(h.launcher),
            "choices": OmegaConf.to_container(h.runtime.choices),
        }
    )
    with open_dict(cfg):
        del cfg["hydra"]
    return hydra_cfg, T.to_train_config(cfg)


def first_values(params) -> list[str]:
    return [f"{k}={str(v).split(',')[0].strip()}" for k, v in params.items()]


def test_the_issue_sweeps_exist():
    assert {p.stem for p in HYDRA_SWEEPS} >= {"divergence", "jsd_beta", "estimator", "on_policy"}
    assert any(yaml.safe_load(p.read_text())["method"] == "grid" for p in WANDB_SPECS)
    assert any(yaml.safe_load(p.read_text())["method"] == "bayes" for p in WANDB_SPECS)


@pytest.mark.parametrize("path", HYDRA_SWEEPS, ids=lambda p: p.stem)
def test_hydra_sweep_composes_its_first_job(path):
    name = path.stem
    hc, _ = compose_job([f"sweep={name}"])
    assert hc.mode.endswith("MULTIRUN")
    params = OmegaConf.to_container(hc.sweeper.params)
    assert params, "a sweep sets hydra.sweeper.params"
    hc, cfg = compose_job([f"sweep={name}", *first_values(params)])
    assert cfg.logger.group == name  # W&B group = the sweep's name
    # an embedded pair (the default, or a lab world's): a laptop sweep
    assert hc.sweep.dir == f"multirun/{name}/{hc.choices.model_pair}" and hc.choices.model_pair.startswith("embedded")
    sub = hc.sweep.subdir
    assert sub.startswith("0_") and "${" not in sub and "/" not in sub and f"seed{cfg.seed}" in sub
    # each job gets its own folder: the first values of every swept key give the first folder
    n_jobs = 1
    for v in params.values():
        n_jobs *= len(str(v).split(","))
    assert n_jobs >= 3


def test_divergence_sweep_is_the_race_on_the_multimodal_world():
    """sweep=divergence: rkl, fkl, jsd beta 0.5 x 3 seeds on a world where accuracy moves within
    its steps (the multimodal lab world), a constant lr, evals dense enough to time a threshold."""
    hc, cfg = compose_job(["sweep=divergence"])
    params = OmegaConf.to_container(hc.sweeper.params)
    assert params == {"variant": "rkl,fkl,jsd_0.5", "seed": "0,1,2"}
    assert (hc.choices.model_pair, hc.choices.task) == ("embedded_multimodal", "multimodal")
    assert cfg.trainer.max_steps == 1000 and cfg.trainer.schedule.value == "constant"
    assert (cfg.eval.every, cfg.eval.size, cfg.checkpoint.every) == (25, 200, 0)
    for v in params["variant"].split(","):
        hc, cfg = compose_job(["sweep=divergence", f"variant={v}", "seed=2"], job_num=5)
        name, _, beta = v.partition("_")
        assert cfg.divergence.name.value == name and cfg.seed == 2
        if beta:
            assert cfg.divergence.beta == float(beta)
        assert hc.sweep.subdir == f"5_{v}_seed2"
    assert hc.sweep.dir == "multirun/divergence/embedded_multimodal" and cfg.logger.group == "divergence"


def test_divergence_all_sweep_variants():
    """sweep=divergence_all: rkl, fkl, jsd at beta 0.1/0.5/0.9, skl, srkl, 3 seeds, on the default
    world at its defaults: each variant picks what it says."""
    hc, cfg = compose_job(["sweep=divergence_all"])
    params = OmegaConf.to_container(hc.sweeper.params)
    variants = params["variant"].split(",")
    assert variants == ["rkl", "fkl", "jsd_0.1", "jsd_0.5", "jsd_0.9", "skl", "srkl"]
    assert params["seed"] == "0,1,2"
    assert hc.choices.model_pair == "embedded" and cfg.trainer.max_steps == 2500
    for v in variants:
        hc, cfg = compose_job(["sweep=divergence_all", f"variant={v}", "seed=2"], job_num=5)
        name, _, beta = v.partition("_")
        assert cfg.divergence.name.value == name and cfg.seed == 2
        if beta:
            assert cfg.divergence.beta == float(beta)
        assert hc.sweep.subdir == f"5_{v}_seed2"


def test_sweep_folders_are_distinct():
    """Each sweep writes under multirun/<its own name>/: two sweeps never share a folder, whatever
    pair they run on (divergence, the race, and divergence_all, every divergence, included)."""
    dirs = [yaml.safe_load(p.read_text())["hydra"]["sweep"]["dir"] for p in HYDRA_SWEEPS]
    assert [d.split("/")[1] for d in dirs] == [p.stem for p in HYDRA_SWEEPS]
    assert len(set(dirs)) == len(dirs)


def test_sweep_accepts_overrides_and_a_real_pair():
    hc, _ = compose_job(["sweep=estimator"])
    cli = ["estimator=topk", "seed=1", "trainer.max_steps=7"]  # the command line beats the sweep's params
    given = {o.split("=")[0] for o in cli}
    params = [o for o in first_values(hc.sweeper.params) if o.split("=")[0] not in given]
    _, cfg = compose_job(["sweep=estimator", *params, *cli])
    assert (cfg.estimator.name.value, cfg.loss.name.value, cfg.divergence.name.value) == ("topk", "reinforce", "jsd")
    assert cfg.trainer.max_steps == 7
    hc, cfg = compose_job(["sweep=divergence_all", "experiment=opd_gsm8k_jsd", "variant=srkl"])
    assert cfg.model_pair.student.startswith("Qwen/") and cfg.divergence.name.value == "srkl"
    assert cfg.logger.group == "divergence_all"  # the sweep's group beats the experiment's
    assert hc.sweep.dir == "multirun/divergence_all/qwen2.5_1.5b_math7b"


def _spec_overrides(spec) -> list[str]:
    fixed = [a for a in spec["command"] if "=" in str(a) and not str(a).startswith("$")]
    swept = []
    for key, p in spec["parameters"].items():
        if "value" in p:
            v = p["value"]
        elif "values" in p:
            v = p["values"][0]
        else:
            v = p["min"]
        swept.append(f"{key}={v}")
    return fixed + swept


@pytest.mark.parametrize("path", WANDB_SPECS, ids=lambda p: p.stem)
def test_wandb_spec_calls_the_entry_point_with_schema_keys(path):
    spec = yaml.safe_load(path.read_text())
    assert spec["method"] in ("grid", "random", "bayes")
    assert spec["command"] == ["${env}", "python", "-m", "opd_exp.cli.train", "logger.mode=online", "${args_no_hyphens}"]
    if spec["method"] == "bayes":
        assert spec["metric"]["goal"] in ("minimize", "maximize")
    assert spec["metric"]["name"].startswith(("final/", "eval/"))
    for key in spec["parameters"]:
        path_ = key.lstrip("+")
        with initialize_config_dir(config_dir=T.CONF_DIR, version_base="1.3"):
            cfg = compose("train", overrides=[f"{key}={_first(spec['parameters'][key])}"])
        if path_ != "variant":  # a sweep-local group: it sets divergence.*
            assert OmegaConf.select(cfg, path_, throw_on_missing=False) is not None, f"{path.name}: {key} not in the config"
    _, cfg = compose_job(_spec_overrides(spec))  # the whole first job is valid
    assert cfg.logger.mode == "online"


def _first(p):
    return p["value"] if "value" in p else p["values"][0] if "values" in p else p["min"]


def test_a_sweep_with_its_own_world_is_refused_beside_an_experiment():
    """sweep=divergence (the multimodal race) is applied after experiment=... and would replace the
    experiment's pair without a word; a sweep over the chosen pair is accepted with it."""
    from opd_exp.cli.compose import check_sweep_world
    from opd_exp.runtime.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^sweep=divergence is not allowed with experiment=opd_gsm8k_jsd \(the sweep brings"):
        check_sweep_world("divergence", "opd_gsm8k_jsd")
    check_sweep_world("divergence_all", "opd_gsm8k_jsd")
    check_sweep_world("divergence", None)
