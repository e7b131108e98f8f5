"""The embedded arithmetic task and the GSM8K-format verifier."""

from __future__ import annotations

import random

import pytest

from opd_exp.config.world import ModelPairConfig, TaskConfig, as_task_config
from opd_exp.runtime.errors import ConfigError
from opd_exp.tasks import build_task
from opd_exp.tasks.arithmetic import ArithmeticSpec, ArithmeticTask, make_problem, sample_problem
from opd_exp.tasks.base import Problem, Task, extract_answer, normalize_number, render_prompt, verify


def _value(prompt: str) -> int:
    # The prompt's parentheses must make Python's precedence equal the task's left-to-right order.
    return eval(prompt.replace("=?\n", ""))


def test_worked_solution_format():
    p = make_problem([9, 5, 2], ["-", "+"])
    assert p == Problem(prompt="9-5+2=?\n", answer="6", solution="9-5=4;4+2=6;#### 6")
    p = make_problem([3, 7, 5], ["-", "*"])
    assert (p.prompt, p.solution, p.answer) == ("(3-7)*5=?\n", "3-7=-4;-4*5=-20;#### -20", "-20")
    p = make_problem([5, 3, 3, 2, 4], ["+", "*", "-", "*"])
    assert p.prompt == "((5+3)*3-2)*4=?\n" and p.answer == "88"


def test_generated_problems_are_consistent_and_in_range():
    spec = ArithmeticSpec(min_operands=2, max_operands=4, max_digits=2, ops="+-*")
    rng = random.Random(0)
    counts = set()
    for _ in range(500):
        p = sample_problem(rng, spec)
        assert _value(p.prompt) == int(p.answer)
        assert verify(p.solution, p.answer)
        assert p.solution.endswith(f";#### {p.answer}")
        operands = p.solution.count("=")  # one step per operator
        counts.add(operands + 1)
    assert counts == {2, 3, 4}


def test_difficulty_knob_limits_digits_and_ops():
    task = ArithmeticTask(TaskConfig(max_digits=1, min_operands=3, max_operands=3, ops="+", n_train=200, n_eval=20))
    for p in task.train_problems() + task.eval_problems():
        numbers = p.prompt.replace("=?\n", "").split("+")
        assert len(numbers) == 3 and all(0 <= int(n) <= 9 for n in numbers)


def test_splits_are_deterministic_disjoint_and_eval_is_fixed_by_eval_seed():
    a = ArithmeticTask(TaskConfig(seed=0, n_train=3000, n_eval=100))
    b = ArithmeticTask(TaskConfig(seed=0, n_train=3000, n_eval=100))
    c = ArithmeticTask(TaskConfig(seed=1, n_train=3000, n_eval=100))
    assert a.train_problems() == b.train_problems() and a.eval_problems() == b.eval_problems()
    assert a.train_problems() != c.train_problems()
    assert a.eval_problems() == c.eval_problems()  # the eval set does not move with task.seed
    evals = {p.prompt for p in a.eval_problems()}
    assert len(evals) == 100  # distinct
    assert not evals & {p.prompt for p in a.train_problems() + c.train_problems()}
    d = ArithmeticTask(TaskConfig(eval_seed=7, n_train=10, n_eval=100))
    assert {p.prompt for p in d.eval_problems()} != evals


def test_too_small_a_problem_space_fails_with_one_line():
    task = ArithmeticTask(TaskConfig(max_digits=1, min_operands=2, max_operands=2, ops="+", n_eval=150, n_train=10))
    with pytest.raises(ConfigError, match=r"^task\.n_eval: 150 distinct problems requested") as err:
        task.eval_problems()
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("9-5=4;4+2=6;#### 6", "6"),
        ("#### -14", "-14"),
        ("steps\n#### 1,234", "1234"),
        ("#### $18.00", "18"),
        ("#### 2.50 dollars", "2.5"),
        ("####42", "42"),
        ("#### 7.", "7"),
        ("#### 6 #### 6", "6"),  # repeated, consistent
        ("#### 5 #### 6", None),  # hedging between answers
        ("#### 5 ####", None),  # a marker without a number
        ("no marker, 6", None),
        ("####", None),
        ("#### abc", None),
        ("#### 12abc", None),
        ("#### --3", None),
        ("", None),
        ("##### 3", "3"),
    ],
)
def test_extract_answer(completion, expected):
    class NoProblems(Task):  # the shared verifier, without a data source
        def train_problems(self):
            return []

        def eval_problems(self):
            return []

    assert extract_answer(completion) == expected
    assert NoProblems().extract_answer(completion) == expected


def test_verify_compares_numbers_not_strings():
    assert verify("x;#### 6", "6")
    assert verify("#### 6.0", "6")
    assert verify("#### 1,000", "1000")
    assert not verify("#### 7", "6")
    assert not verify("6", "6")  # no marker: no credit
    assert not verify("#### 6 #### 7", "6")
    assert normalize_number("+3") == "3" and normalize_number("-0") == "0" and normalize_number("x") is None


class _ChatTokenizer:
    chat_template = "{{ messages }}"

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        assert tokenize is False and add_generation_prompt is True
        return f"<user>{messages[0]['content']}</user><assistant>"


def test_render_prompt_uses_the_chat_template_only_when_present():
    p = make_problem([1, 2], ["+"])
    assert render_prompt(p.prompt, _ChatTokenizer()) == "<user>1+2=?\n</user><assistant>"
    plain = type("Plain", (), {"chat_template": None})()
    assert ArithmeticTask().render_prompt(p, plain) == "1+2=?\n"


def test_build_task_and_config_errors():
    assert isinstance(build_task(None), ArithmeticTask)
    assert isinstance(build_task({"name": "arithmetic", "n_train": 5, "n_eval": 5}), ArithmeticTask)
    cases = [
        (dict(name="math"), "task.name='math' is not allowed; allowed: arithmetic | gsm8k"),
        (dict(ops="+/"), "task.ops='+/' is not allowed; allowed: a non-empty subset of '+-*', e.g. '+-'"),
        (dict(max_digits=0), "task.max_digits=0 is not allowed; allowed: an integer in [1, 6]"),
        (dict(min_operands=1), "task.min_operands=1 is not allowed; allowed: an integer >= 2"),
        (dict(min_operands=3, max_operands=2), "task.max_operands=2 is not allowed; allowed: an integer in [min_operands=3, 8]"),
        (dict(n_eval=0), "task.n_eval=0 is not allowed; allowed: an integer >= 1 for arithmetic"),
        (dict(name="gsm8k"), "task.path=None is not allowed; allowed:"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ConfigError) as err:
            as_task_config(kwargs)
        assert str(err.value).startswith(message), str(err.value)
    with pytest.raises(ConfigError, match=r"^model_pair\.dtype='fp8' is not allowed; allowed: float32 \| bfloat16 \| float16 \| auto$"):
        ModelPairConfig(dtype="fp8")


def test_batched_greedy_eval_equals_one_by_one():
    # Left padding must not change what a prompt generates; completions stop at EOS.
    import torch

    from opd_exp.config.world import EmbeddedModelConfig
    from opd_exp.pairs.embedded.models import build_model
    from opd_exp.pairs.embedded.tokenizer import build_tokenizer
    from opd_exp.training.evaluate import evaluate_accuracy

    tok = build_tokenizer()
    model = build_model(EmbeddedModelConfig(hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=32), tok, 0)
    with torch.no_grad():  # make EOS likely after a few tokens, so some rows stop early
        model.lm_head.weight[tok.eos_token_id] += 0.3 * model.lm_head.weight[3 + ord("1")]
    task = ArithmeticTask(TaskConfig(n_train=1, n_eval=12))
    problems = task.eval_problems()
    prompts = [task.render_prompt(p, tok) for p in problems]
    assert len({len(p) for p in prompts}) > 1  # really different lengths

    def completions(batch_size):
        return evaluate_accuracy(model, tok, task, problems, batch_size=batch_size, max_new_tokens=12, return_completions=True)[
            "completions"
        ]

    batched, single = completions(12), completions(1)
    assert batched == single
    assert all("<eos>" not in c and "<pad>" not in c for c in batched)
    model.train()
    result = evaluate_accuracy(model, tok, task, problems, batch_size=5, max_new_tokens=12, return_completions=True)
    assert model.training  # mode restored
    assert result["n"] == 12 and result["completions"] == batched
    assert result["accuracy"] == sum(task.verify(c, p.answer) for c, p in zip(batched, problems)) / 12


def test_evaluate_accuracy_counts_answers_and_format(monkeypatch):
    from opd_exp.training import evaluate as ev

    task = ArithmeticTask(TaskConfig(n_train=1, n_eval=4))
    problems = task.eval_problems()
    outs = [problems[0].solution, "#### " + problems[1].answer, "#### 99999", "no answer"]
    monkeypatch.setattr(ev, "greedy_batches", lambda engine, tok, task, problems, bs: iter([(list(problems), None)]))
    monkeypatch.setattr(ev, "decode_responses", lambda tok, batch: outs)  # score fixed completions
    assert ev.accuracy(None, None, task, problems, 64) == {"accuracy": 0.5, "format_rate": 0.75, "n": 4}
