"""A teacher-free signal written as a divergence: a fixed cost on low-probability sampled tokens.

The lab's ``lab_fixed_negative`` claim (arXiv 2608.31046): much of what sampled reverse-KL
OPD buys in accuracy comes from pushing down the student's own unlikely tokens, which needs
no teacher; a constant negative advantage on every sampled token with S(y) < ``threshold``
matches its accuracy, but not its KL to the teacher.

With ``estimator=sampled loss=reinforce`` the advantage of a sampled token is
``-kl_coef * token_cost``, so a cost of 1 below the threshold and 0 above is that constant
negative advantage (its size is ``loss.kl_coef``). In the divergence interface it is exact:
its per-entry term phi = S * [S < threshold] sums to the student's mass below the threshold,
D(S) = sum_v S_v [S_v < threshold], whose REINFORCE score dphi/dS = [S < threshold] is the
cost (almost everywhere: the step at S = threshold has measure zero). It is not a divergence
between S and T: it ignores the teacher, and D(S, S) > 0. So it is not a built-in (the
suite's checks on every registered divergence require D(S, S) = 0); ``opd_exp.divergences.lab``
registers it for the lab only:

    OPD_PLUGINS=opd_exp.divergences.lab opd-train -m sweep=lab_fixed_negative
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch

from .catalog import Divergence


class FixedNegative(Divergence):
    """Cost 1 on a sampled token whose student probability is below ``threshold``, else 0."""

    name = "fixed_negative"
    # teacher-free by design: the start-up check that the loss reads the teacher's scores skips it
    reads_teacher: ClassVar[bool] = False
    # a class attribute, not a config key (the schema stays the built-ins'); a subclass changes it
    threshold: ClassVar[float] = 0.02

    def _below(self, s: torch.Tensor) -> torch.Tensor:
        return (s < math.log(self.threshold)).to(s.dtype)

    def pointwise(self, s, t):
        # phi = S [S < threshold]: the student's mass on its unlikely entries (S = 0 gives 0)
        return s.exp() * self._below(s) + torch.zeros_like(t)

    def pointwise_grad(self, s, t):
        return self.pointwise(s, t)  # d/ds of S [S < threshold] = S [S < threshold]

    def token_score(self, s, t):
        return self._below(s) + torch.zeros_like(t)

    def pointwise_over_prob(self, s, t):
        return self.token_score(s, t)

    def outside_value(self, t):
        return torch.zeros_like(t)  # an entry with S = 0 has no mass to count
