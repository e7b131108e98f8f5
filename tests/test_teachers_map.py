"""Several teachers (``teachers.map``, multi-teacher OPD): one teacher through the map is the single
teacher bit for bit; each row is scored by its prompt's teacher; the per-teacher metrics add up to
the global ones; the teacher set is recorded and a resume with another set is refused; bad
configs are one line; two teachers (in process and served) run end to end."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from helpers import golden
from helpers.compose import compose_config
from helpers.fake_vllm import FakeVllm
from helpers.reliability import BASE, comparable, final_weights, one_error_line, pair_args, read_metrics, run_cli
from helpers.tiny import AddTask, build_model, small_config
from opd_exp.config.schema import TeacherConfig, TeacherName
from opd_exp.config.teachers import TeachersConfig
from opd_exp.config.world import TaskConfig
from opd_exp.pairs.teacher_map import load_map_teacher
from opd_exp.runtime import fingerprint
from opd_exp.runtime.errors import ConfigError
from opd_exp.training.ppo import select_rows
from opd_exp.training.routing import PER_TEACHER
from opd_exp.training.scoring import teacher_logits
from opd_exp.training.trainer import Trainer


@dataclass(frozen=True)
class Row:
    prompt: str
    answer: str
    solution: str
    domain: str  # a per-prompt column (teachers.route=field:domain)


class MixTask(AddTask):
    """'a+b=' and 'a-b=' prompts (column ``domain``: add / sub). The verifier accepts a completion
    by the parity of its characters and the answer, so the random tiny models' accuracies are
    neither 0 nor 1 and the per-teacher accuracies can be checked against the global one."""

    def __init__(self, n_train: int = 64):
        make = lambda a, op, b: Row(f"{a}{op}{b}=", str(a + b if op == "+" else a - b), "", "add" if op == "+" else "sub")
        every = [make(a, op, b) for a in range(10) for b in range(10) for op in "+-"]
        self._eval = every[-16:]
        self._train = (every[:-16] * 2)[:n_train]

    def verify(self, completion: str, answer: str) -> bool:
        return (sum(map(ord, completion)) + int(answer)) % 2 == 0


@pytest.fixture(scope="module")
def pair_root(tmp_path_factory):
    """The golden runs' tiny pair (float64-exact weights) and a second teacher beside it."""
    from transformers import AutoTokenizer

    root = golden.build_pair(tmp_path_factory.mktemp("mopd_pair"))
    V = len(AutoTokenizer.from_pretrained(root / "tokenizer"))
    model = build_model(root / "teacher_b", V + 8, hidden=32, layers=2, seed=7)
    golden.portable_weights(model, 7)
    model.save_pretrained(root / "teacher_b")
    return root


def two_teachers(root: Path, route: str = "operator") -> TeachersConfig:
    covers = (["+"], ["-"]) if route == "operator" else (["add"], ["sub"])
    return TeachersConfig(
        route=route,
        map={"add": {"path": str(root / "teacher"), "covers": covers[0]}, "sub": {"path": str(root / "teacher_b"), "covers": covers[1]}},
    )


def config(name: str = "default", teachers: TeachersConfig | None = None, **changes):
    groups = golden.golden_groups(name)
    for group, fields in changes.items():
        groups.setdefault(group, {}).update(fields)
    cfg = small_config(**groups)
    if teachers is None:
        return cfg
    task = TaskConfig(max_operands=2) if teachers.route == "operator" else cfg.task  # one operator per problem, as MixTask
    return dataclasses.replace(cfg, teachers=teachers, task=task)


def trainer_of(cfg, run_dir: Path, root: Path, task=None) -> Trainer:
    return Trainer(cfg, run_dir, pair=golden.load_pair(root), task=task or AddTask(), load_map_teacher=load_map_teacher)


def train(cfg, run_dir: Path, root: Path, task=None) -> Trainer:
    with golden.float64():
        trainer = trainer_of(cfg, run_dir, root, task)
        trainer.run()
    return trainer


def same(a, b) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


# -- one teacher through the map is today's single teacher, bit for bit --------------------------


@pytest.mark.parametrize("name", sorted(golden.GOLDEN_RUNS))
def test_one_teacher_through_the_map_is_the_single_teacher_bit_for_bit(name, pair_root, tmp_path):
    """The golden runs (default; sampled + ppo + jsd with sequence credit; half the steps sampled by
    the teacher) with the pair's teacher given as a one-entry map: every per-step and eval value and
    the final weights are equal (==, float64), and the teacher's own metrics are the global ones."""
    solo = TeachersConfig(map={"solo": {"path": str(pair_root / "teacher")}})
    train(config(name), tmp_path / "single", pair_root)
    trainer = train(config(name, solo), tmp_path / "map", pair_root)
    assert trainer.teachers.active and trainer.teacher_scorer.names == ("solo",)
    a, b = comparable(read_metrics(tmp_path / "single")), comparable(read_metrics(tmp_path / "map"))
    assert [r["step"] for r in a] == [r["step"] for r in b] == [0, 1, 2, 3, 4]
    for ra, rb in zip(a, b):
        unequal = {k: (v, rb.get(k)) for k, v in ra.items() if not same(v, rb.get(k))}
        assert unequal == {}, (ra["step"], unequal)
        extra = set(rb) - set(ra)
        if "loss" in ra:
            assert rb["teacher/solo/token_share"] == 1.0
            for global_name, (short, _) in PER_TEACHER.items():
                assert rb[f"teacher/solo/{short}"] == ra[global_name], (ra["step"], short)
            extra -= {"teacher/solo/token_share", *(f"teacher/solo/{s}" for s, _ in PER_TEACHER.values())}
        if "eval/accuracy" in ra:
            assert rb["eval/teacher/solo/accuracy"] == ra["eval/accuracy"]
            extra -= {"eval/teacher/solo/accuracy", "eval/teacher/solo/teacher_accuracy"}
        assert extra == set(), extra
    wa, wb = final_weights(tmp_path / "single"), final_weights(tmp_path / "map")
    assert sorted(wa) == sorted(wb) and all(torch.equal(wa[k], wb[k]) for k in wa)


# -- routing ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("route", ["operator", "field:domain"])
def test_each_row_is_scored_by_its_prompts_teacher(route, pair_root, tmp_path):
    """The teacher logits the objective receives, row by row, are those of the row's own teacher
    (its forward of exactly those rows: equal), far from the other teacher's."""
    with golden.float64():
        trainer = trainer_of(config("default", two_teachers(pair_root, route)), tmp_path, pair_root, MixTask())
        seen = []
        objective, scorer = trainer.head.objective, trainer.teacher_scorer
        submit = scorer.submit

        class Recorder:
            def __getattr__(self, name):
                return getattr(objective, name)

            def __call__(self, student_z, teacher, *args, **kw):
                seen.append(teacher)
                return objective(student_z, teacher, *args, **kw)

        batches = []
        scorer.submit = lambda batch: batches.append(batch) or submit(batch)
        trainer.head.objective = Recorder()
        for _ in range(3):
            trainer.train_step()
        models = trainer.teachers.models
        assert len(seen) == len(batches) == 3
        counts = [0, 0]
        for batch, scores in zip(batches, seen):
            want = torch.tensor([0 if "+" in trainer.tokenizer.decode(ids) else 1 for ids in batch.input_ids[:, : batch.prompt_len]])
            assert torch.equal(batch.route.cpu(), want)  # '+' prompts to add, '-' prompts to sub
            assert torch.equal(scores.route, batch.route)
            for k in (0, 1):
                rows = (batch.route == k).nonzero().squeeze(-1)
                counts[k] += rows.numel()
                if not rows.numel():
                    continue
                sub = select_rows(batch, rows)
                own = teacher_logits(models[k], sub, trainer.vocab_size, temperature=1.0)
                other = teacher_logits(models[1 - k], sub, trainer.vocab_size, temperature=1.0)
                assert torch.equal(scores.logits[rows], own)
                assert (scores.logits[rows] - other).abs().max() > 1e-2
        assert min(counts) > 0, counts


PPO_UPDATES = dict(estimator={"name": "sampled"}, loss={"name": "ppo", "ppo_epochs": 2, "ppo_mini_batches": 2})


@pytest.mark.parametrize("groups", [{}, PPO_UPDATES], ids=["full_direct", "ppo_4_updates"])
def test_per_teacher_metrics_add_up_to_the_global_ones(groups, pair_root, tmp_path):
    """Per step: the token shares sum to 1 and sum_k share_k * teacher/k/<value> is the global
    estimate (jsd/mean, kl/reverse, kl/forward); per eval: the teachers' accuracies weighted by their
    prompts are eval/accuracy and eval/teacher_accuracy; the run record and the checkpoint hold the
    teacher set with content hashes."""
    cfg = config("default", two_teachers(pair_root), trainer={"max_steps": 6}, eval={"size": 0}, **groups)  # all 16 eval prompts
    trainer = train(cfg, tmp_path, pair_root, MixTask())
    record = trainer.pair_record["teachers"]
    assert record["add"]["prompts"] == {"training": 32, "eval": 8} and record["sub"]["prompts"] == {"training": 32, "eval": 8}
    rows = read_metrics(tmp_path)
    steps = [r for r in rows if "loss" in r]
    assert len(steps) == 6
    both = 0
    for r in steps:
        shares = [r["teacher/add/token_share"], r["teacher/sub/token_share"]]
        assert sum(shares) == pytest.approx(1.0, abs=1e-12)
        both += all(s > 0 for s in shares)
        for global_name, (short, _) in PER_TEACHER.items():
            parts = sum(s * r[f"teacher/{n}/{short}"] for n, s in zip(("add", "sub"), shares) if s > 0)
            assert parts == pytest.approx(r[global_name], rel=1e-12, abs=1e-15), (r["step"], global_name)
        for n, s in zip(("add", "sub"), shares):  # a teacher without tokens in a step logs no values
            assert (f"teacher/{n}/jsd" in r) == (s > 0)
    assert both >= 3
    evals = [r for r in rows if "eval/accuracy" in r]
    eval_problems = trainer.evaluator.problems
    n = {"add": sum(p.domain == "add" for p in eval_problems), "sub": sum(p.domain == "sub" for p in eval_problems)}
    assert n == {"add": 8, "sub": 8} and len(evals) == 4
    accuracies = set()
    for r in evals:
        got = sum(n[k] * r[f"eval/teacher/{k}/accuracy"] for k in n) / 16
        assert got == pytest.approx(r["eval/accuracy"], abs=1e-12)
        accuracies.add(r["eval/accuracy"])
    first = evals[0]
    teacher = sum(n[k] * first[f"eval/teacher/{k}/teacher_accuracy"] for k in n) / 16
    assert teacher == pytest.approx(first["eval/teacher_accuracy"], abs=1e-12)
    assert 0 < first["eval/teacher_accuracy"] < 1
    assert all(0 < a < 1 for a in accuracies)
    state = json.loads(next((tmp_path / "checkpoints").glob("step_*/state.json")).read_text())["config"]
    for name, folder in (("add", "teacher"), ("sub", "teacher_b")):
        assert state[f"teachers.map.{name}.path"] == str(pair_root / folder)
        assert state[f"teachers.loaded.{name}.sha256"] == fingerprint.teacher_content(str(pair_root / folder))
    assert state["teachers.loaded.add.sha256"] != state["teachers.loaded.sub.sha256"]
    assert state["teachers.route"] == "operator"


# -- the teacher set on resume ------------------------------------------------------------------------


@pytest.fixture
def cli_pair(local_pair_dir, tmp_path) -> Path:
    """The reliability tests' local pair (embedded tokenizer, task=arithmetic) and a second teacher."""
    from opd_exp.pairs.embedded.tokenizer import load_tokenizer, save_tokenizer

    pair = tmp_path / "pair"
    shutil.copytree(local_pair_dir, pair)
    save_tokenizer(pair / "teacher_b")
    build_model(pair / "teacher_b", len(load_tokenizer(pair / "student")), hidden=32, layers=2, seed=5)
    shutil.copytree(pair / "teacher", pair / "teacher_a")
    return pair


def map_args(a: Path, b: Path | None = None) -> list[str]:
    if b is None:
        return [f"+teachers.map.a.path={a}"]
    return [f"+teachers.map.a={{path:'{a}',covers:[+]}}", f"+teachers.map.b={{path:'{b}'}}", "teachers.route=operator"]


def test_a_resume_with_another_teacher_set_is_refused_naming_the_key(cli_pair, tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    base = [*BASE, *pair_args(cli_pair), f"hydra.run.dir={run}"]
    code, _out, err = run_cli(
        [*base, *map_args(cli_pair / "teacher_a", cli_pair / "teacher_b"), "trainer.max_steps=1"], monkeypatch, capsys
    )
    assert code == 0, err[-3000:]
    summary = json.loads(next(ln for ln in (run / "train.log").read_text().splitlines() if " summary: " in ln).split(" summary: ", 1)[1])
    record = summary["pair"]["teachers"]
    assert record["route"] == "operator" and record["a"]["covers"] == ["+"] and record["b"]["covers"] == []
    assert record["a"]["sha256"] == fingerprint.teacher_content(str(cli_pair / "teacher_a")) != record["b"]["sha256"]
    more = "trainer.max_steps=1"  # the same settings but the teachers
    refusal = (
        "opd-train: error: hydra.run.dir: {run} holds a run made with other settings ({diff}); allowed: the same settings to resume it, "
    )
    refusal += "checkpoint.extend=true to continue it with these (recorded in history.yaml), or a new hydra.run.dir"
    # another teacher under the same name: refused before any model loads
    code, _, err = run_cli([*base, *map_args(cli_pair / "teacher_b", cli_pair / "teacher_b"), more], monkeypatch, capsys)
    assert code == 2
    diff = f"teachers.map.a.path: '{cli_pair / 'teacher_a'}' -> '{cli_pair / 'teacher_b'}'"
    assert one_error_line(err) == refusal.format(run=run, diff=diff)
    # the same folder with other weights in it: refused once the teachers load, naming their hash
    before = fingerprint.teacher_content(str(cli_pair / "teacher_a"))
    weights = cli_pair / "teacher_a" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    after = fingerprint.teacher_content(str(cli_pair / "teacher_a"))
    code, _, err = run_cli([*base, *map_args(cli_pair / "teacher_a", cli_pair / "teacher_b"), more], monkeypatch, capsys)
    assert code == 2
    assert one_error_line(err) == refusal.format(run=run, diff=f"teachers.loaded.a.sha256: {before!r} -> {after!r}")
    # the single teacher again (no map): refused, naming the map's keys
    code, _, err = run_cli([*base, more], monkeypatch, capsys)
    assert code == 2 and "teachers.map.a.path: " in one_error_line(err)


# -- bad configs: one line each, before any model loads ------------------------------------------------


MIX = [
    "+teachers.map.a.path=x",
    "+teachers.map.a.covers=[+]",
    "+teachers.map.b.path=y",
    "+teachers.map.b.covers=[-]",
    "teachers.route=operator",
]


@pytest.mark.parametrize(
    "overrides,line",
    [
        (
            ["teachers.route=domain"],
            "teachers.route='domain' is not allowed; allowed: operator, field:<name> (a per-prompt column, e.g. field:domain), or null",
        ),
        (
            ["teachers.route=operator"],
            "teachers.route='operator' is not allowed; allowed: null with an empty teachers.map (no teachers to route to)",
        ),
        (
            ["+teachers.map.a.path=x", "+teachers.map.b.path=y"],
            "teachers.route=None is not allowed; allowed: operator or field:<name> with 2 teachers (which prompt goes where)",
        ),
        (
            ["+teachers.map.a.path=x", "+teachers.map.a.depth=2"],
            "teachers.map.a.depth: unknown key; allowed: pair, path, covers, url, model",
        ),
        (
            ["+teachers.map.a.path=x", "+teachers.map.a.pair=embedded"],
            "teachers.map.a.pair='embedded' is not allowed; allowed: exactly one of teachers.map.a.pair (a model_pair option) and "
            "teachers.map.a.path (a model)",
        ),
        (
            ["+teachers.map.Big.path=x"],
            "teachers.map.Big='Big' is not allowed; allowed: a lower-case identifier like 'addsub', other than entropy, logprob_mean",
        ),
        (
            [*MIX[:3], "+teachers.map.b.covers=[/]", "teachers.route=operator"],
            "teachers.map.b.covers=['/'] is not allowed; allowed: operators among ['+', '-', '*']",
        ),
        (
            [*MIX, "task.ops=+-*", "task.max_operands=2"],
            "teachers.route='operator' is not allowed; allowed: teachers that cover every problem the task draws (none covers one "
            "with operators '*': task.ops='+-*', up to task.max_operands=2 operands); add a teacher with covers=['*'], a catch-all "
            "teacher (covers=[]), or task.max_operands=2",
        ),
        (
            MIX,
            "teachers.route='operator' is not allowed; allowed: teachers that cover every problem the task draws (none covers one "
            "with operators '+-': task.ops='+-', up to task.max_operands=3 operands); add a teacher with covers=['+', '-'], a "
            "catch-all teacher (covers=[]), or task.max_operands=2",
        ),
        (
            [*MIX, "task.max_operands=2", "rollout.on_policy_fraction=0.5"],
            "rollout.on_policy_fraction=0.5 is not allowed; allowed: 1.0 with 2 teachers (teachers.map): a teacher-sampled step "
            "would need one teacher to sample every prompt",
        ),
        (
            [*MIX, "task.max_operands=2", "scale.fused_lm_head=on"],
            "scale.fused_lm_head='on' is not allowed; allowed: auto or off with 2 teachers (teachers.map): the fused head holds one teacher",
        ),
        (
            [*MIX, "task=gsm8k"],
            "teachers.route='operator' is not allowed; allowed: field:<name> with task=gsm8k (operator reads arithmetic, "
            "chat_arithmetic prompts)",
        ),
        (
            ["+teachers.map.a.pair=nope"],
            "teachers.map.a.pair='nope' is not allowed; allowed: a conf/model_pair option (",
        ),
        (
            ["+teachers.map.a.path=x", "+teachers.map.a.covers=+-"],
            "teachers.map.a.covers='+-' is not allowed; allowed: a list of values, e.g. ['+', '-'] ([] takes every prompt no "
            "other teacher covers)",
        ),
        (
            ["+teachers.map.a.path=x", "teacher=served"],
            "teachers.map.a.url=None is not allowed; allowed: http://HOST:PORT of this teacher's vLLM server with teacher=served "
            "(opd-serve-teacher prints it)",
        ),
        (
            ["+teachers.map.a.path=x", "+teachers.map.a.url=http://127.0.0.1:1"],
            "teachers.map.a.url='http://127.0.0.1:1' is not allowed; allowed: null with teacher=in_process (or teacher=served)",
        ),
    ],
)
def test_bad_teacher_maps_are_one_line(overrides, line):
    with pytest.raises(ConfigError) as ex:
        compose_config(*overrides)
    assert str(ex.value).startswith(line), str(ex.value)
    assert "\n" not in str(ex.value)


def test_a_problem_without_the_routed_column_is_refused_before_the_map_loads(pair_root, tmp_path):
    teachers = TeachersConfig(route="field:topic", map={"a": {"path": str(tmp_path / "not_loaded"), "covers": ["x"]}})
    with golden.float64(), pytest.raises(ConfigError) as ex:
        trainer_of(config("default", teachers), tmp_path, pair_root, MixTask())
    assert str(ex.value) == (
        "teachers.route='field:topic': a problem has no 'topic' ('0+0='); allowed: a column every problem of the task carries, "
        "or teachers.route=operator for arithmetic"
    )
    teachers = TeachersConfig(route="field:domain", map={"a": {"path": str(tmp_path / "not_loaded"), "covers": ["add"]}})
    with golden.float64(), pytest.raises(ConfigError) as ex:
        trainer_of(config("default", teachers), tmp_path, pair_root, MixTask())
    assert str(ex.value) == (
        "teachers.route='field:domain': no teacher covers a problem with ['sub'] ('0-0='); allowed: teachers.map entries whose "
        "covers include ['sub'], or a catch-all teacher (covers=[])"
    )


# -- two teachers end to end ---------------------------------------------------------------------------


def test_two_teachers_on_the_embedded_world(tmp_path, monkeypatch, capsys):
    """opd-train on the shipped arithmetic world: '+'-only prompts to the lab's chain teacher (a
    model_pair option's teacher, prepared for its own task), the rest to the default teacher."""
    run = tmp_path / "run"
    args = [
        "+teachers.map.plus={pair:embedded_chain,covers:[+]}",
        "+teachers.map.rest={path:'embedded:teacher'}",
        "teachers.route=operator",
        "trainer.max_steps=2",
        "trainer.batch_size=8",
        "eval.size=16",
        "eval.every=0",
        "scale.device=cpu",
        "trainer.progress=false",
        "logger=none",
        f"hydra.run.dir={run}",
    ]
    code, _out, err = run_cli(args, monkeypatch, capsys)
    assert code == 0, err[-3000:]
    rows = read_metrics(run)
    steps = [r for r in rows if "loss" in r]
    assert len(steps) == 2
    for r in steps:
        assert r["teacher/plus/token_share"] + r["teacher/rest/token_share"] == pytest.approx(1.0, abs=1e-9)
    assert any(r["teacher/plus/token_share"] > 0 for r in steps) and any(r["teacher/rest/token_share"] > 0 for r in steps)
    first = rows[0]
    assert {"eval/teacher/plus/accuracy", "eval/teacher/rest/accuracy", "eval/teacher/plus/teacher_accuracy"} <= set(first)
    # the default teacher on its own task's '-' and mixed prompts; the chain teacher (one-digit chains) on two-digit sums
    assert first["eval/teacher/rest/teacher_accuracy"] > 0.5 > first["eval/teacher/plus/teacher_accuracy"]
    state = json.loads(next((run / "checkpoints").glob("step_*/state.json")).read_text())["config"]
    assert state["teachers.map.plus.pair"] == "embedded_chain" and state["teachers.map.rest.path"] == "embedded:teacher"
    assert len(state["teachers.loaded.plus.sha256"]) == len(state["teachers.loaded.rest.sha256"]) == 64
    assert state["teachers.loaded.plus.sha256"] != state["teachers.loaded.rest.sha256"]


def test_two_served_teachers_match_the_in_process_run(pair_root, tmp_path):
    """teacher=served with a server per teacher (the stand-in server scoring each one's model):
    per-step losses equal the in-process two-teacher run's, and each server scored its rows."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(pair_root / "tokenizer")
    servers = {
        n: FakeVllm(AutoModelForCausalLM.from_pretrained(pair_root / f), tok, len(tok))
        for n, f in (("add", "teacher"), ("sub", "teacher_b"))
    }
    try:
        base = config("default", two_teachers(pair_root), estimator={"name": "topk", "k": 6}, divergence={"name": "rkl"})
        local = Trainer(base, tmp_path / "local", pair=_float32_pair(pair_root), task=MixTask(), load_map_teacher=load_map_teacher)
        local.run()
        te = TeacherConfig(name=TeacherName.served, k=6, retries=0, backoff_s=0.0, timeout_s=30.0)
        entries = {n: {**dataclasses.asdict(base.teachers.map[n]), "url": s.url} for n, s in servers.items()}
        served = dataclasses.replace(base, teacher=te, teachers=TeachersConfig(route="operator", map=entries))
        trainer = Trainer(served, tmp_path / "served", pair=_float32_pair(pair_root), task=MixTask(), load_map_teacher=load_map_teacher)
        trainer.run()
        a = [r["loss"] for r in read_metrics(tmp_path / "local") if "loss" in r]
        b = [r["loss"] for r in read_metrics(tmp_path / "served") if "loss" in r]
        assert len(a) == len(b) == 4 and b == pytest.approx(a, rel=1e-5, abs=1e-6)
        assert all(s.completions > 0 for s in servers.values())
        state = json.loads(next((tmp_path / "served" / "checkpoints").glob("step_*/state.json")).read_text())["config"]
        assert state["teachers.loaded.add.server.model"] == "teacher" and "teachers.map.add.url" not in state
    finally:
        for s in servers.values():
            s.stop()


def _float32_pair(root: Path):
    pair = golden.load_pair(root)
    pair.student, pair.teacher = pair.student.float(), pair.teacher.float()
    return pair


def test_the_default_fingerprint_has_no_teacher_set():
    """Without a map the run's settings fingerprint as before the group existed, but for the new key at its default."""
    cfg = small_config()
    values = fingerprint.config_fingerprint(cfg)
    assert [k for k in values if k.startswith("teachers")] == ["teachers.route"] and values["teachers.route"] is None
    assert (
        fingerprint.differences({k: v for k, v in values.items() if k != "teachers.route"}, values, fingerprint.schema_defaults(cfg)) == {}
    )
