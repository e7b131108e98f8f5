"""A plugin rollout engine in one file: the lean sampler over a copy of the student that receives
the student's weights through ``sync`` before every on-policy step (the shape of any engine that
lives outside the training module, as vLLM does), so the sampled distribution is the trained one.

    OPD_PLUGINS=docs/examples/my_rollout_engine.py opd-train rollout.engine=lean_copy

A builder gets ``(cfg, student, tokenizer, vocab_size, *, autocast, synced_gpus, warn)`` and
returns a ``RolloutEngine``: ``generate(prompts, seeds, n_samples=, greedy=)`` lays the responses out
as a ``Batch`` (``Batch.from_responses`` does it for token lists), ``sync(model, version)`` makes
the engine sample ``model``'s current weights. ``rollout/logprob_gap`` (the trainer's log-probs
of the sampled tokens against the engine's) shows at every step whether it does.
"""

import copy

import torch

from opd_exp.training.engines import register_rollout_engine
from opd_exp.training.rollout import ModuleRollout, RolloutEngine
from opd_exp.training.sampler import lean_generate


class CopyRollout(RolloutEngine):
    def __init__(self, cfg, student, tokenizer, vocab_size, autocast):
        self.copy = copy.deepcopy(student).eval().requires_grad_(False)
        self.sampler = ModuleRollout(self.copy, tokenizer, cfg.rollout, vocab_size, autocast=autocast, decoder=lean_generate)
        self.version = -1  # the trainer step whose weights the copy holds

    def generate(self, prompts, seeds=None, *, n_samples=1, greedy=False):
        return self.sampler.generate(prompts, seeds, n_samples=n_samples, greedy=greedy)

    @torch.no_grad()
    def sync(self, model, version):
        for mine, theirs in zip(self.copy.parameters(), model.parameters(), strict=True):
            mine.copy_(theirs)
        self.version = version


@register_rollout_engine("lean_copy")
def lean_copy(cfg, student, tokenizer, vocab_size, *, autocast, synced_gpus, warn):
    return CopyRollout(cfg, student, tokenizer, vocab_size, autocast)
