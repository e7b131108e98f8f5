"""One file that adds a divergence and a task to opd-exp (docs/extending.md).

    OPD_PLUGINS=docs/examples/my_extensions.py opd-train divergence=jeffreys \
        task.name=qa_jsonl task.path=my_questions.jsonl ...
    python docs/examples/my_extensions.py      # runs check_divergence on Jeffreys
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from opd_exp.divergences import Divergence, check_divergence, register_divergence
from opd_exp.runtime.errors import ConfigError
from opd_exp.tasks import Problem, Task, register_task

NEG_INF = float("-inf")


@register_divergence
class Jeffreys(Divergence):
    """Jeffreys divergence KL(S||T) + KL(T||S) = sum_v (S_v - T_v)(s_v - t_v)."""

    name = "jeffreys"  # divergence=jeffreys on the command line; logged as eval/jeffreys
    baseline = 1.0  # token_cost = token_score - 1: same expected gradient, smaller costs

    def pointwise(self, s, t):
        # phi = (S - T)(s - t); an entry with S = T = 0 contributes nothing
        both_zero = (s == NEG_INF) & (t == NEG_INF)
        return torch.where(both_zero, 0.0, (s.exp() - t.exp()) * (s - t))

    def pointwise_grad(self, s, t):
        # d phi / d s = S (s - t) + (S - T)
        S = s.exp()
        return torch.where(S == 0, 0.0, S * (s - t) + S - t.exp())

    def token_score(self, s, t):
        # d phi / d S = (s - t) + 1 - T/S: the exact REINFORCE score of a sampled token
        return s - t + 1.0 - (t - s).exp()

    def pointwise_over_prob(self, s, t):
        # phi / S = (1 - T/S)(s - t): unbiased for D when y ~ S
        return (1.0 - (t - s).exp()) * (s - t)


class QAJsonl(Task):
    """Question/answer pairs from a .jsonl file ({"question": ..., "answer": ...} per line),
    verified by a case- and space-insensitive match of the completion's first line."""

    name = "qa_jsonl"

    def __init__(self, cfg):
        path = Path(cfg.path or "")
        if not path.is_file():
            raise ConfigError(f"task.path={cfg.path!r} is not a file; allowed: a .jsonl file of question/answer rows")
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        problems = [Problem(prompt=f"Q: {r['question']}\nA: ", answer=str(r["answer"]), solution=str(r["answer"])) for r in rows]
        random.Random(cfg.eval_seed).shuffle(problems)
        n_eval = cfg.n_eval or max(1, len(problems) // 5)
        self._eval, self._train = problems[:n_eval], problems[n_eval:]

    def train_problems(self):
        return self._train

    def eval_problems(self):
        return self._eval

    def render_prompt(self, problem, tokenizer):
        return problem.prompt  # plain text: no chat template

    def extract_answer(self, completion):
        lines = completion.strip().splitlines()
        return " ".join(lines[0].lower().split()) if lines else None

    def verify(self, completion, answer):
        return self.extract_answer(completion) == " ".join(answer.lower().split())


register_task("qa_jsonl", QAJsonl)


def kl(p, q):
    return (p * (p / q).log()).sum(-1)


if __name__ == "__main__":
    # The exactness checks (gradient, unbiased value, zero at S = T), plus the definition
    # from probabilities as a reference.
    print(check_divergence(Jeffreys(), reference=lambda S, T: kl(S, T) + kl(T, S)))
