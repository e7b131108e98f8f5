"""The divergences, written once per token.

Notation (per response position): s = log S(v), t = log T(v) for a vocabulary entry v;
every divergence here is a sum over the vocabulary D = sum_v phi(s_v, t_v).
Each class states, in closed form:

* ``pointwise(s, t)``       phi, the contribution of one vocabulary entry to D;
* ``pointwise_grad(s, t)``  d phi / d s, used by the exact full-vocab backward;
* ``token_score(s, t)``     d phi / d S = pointwise_grad / S, the exact REINFORCE score:
                            E_{y~S}[score(y) grad log S(y)] = grad D;
* ``token_cost(s, t)``      the score minus a constant baseline (the familiar forms, e.g.
                            s - t for rkl); E_{y~S}[grad log S(y)] = 0, so the gradient is
                            the same;
* ``token_value(s, t)``     an unbiased estimate of D from one sample y ~ S.

s and t may be -inf (a token with zero probability); 0 * log 0 terms are taken as 0.
"""

from __future__ import annotations

import math
import re
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar

import torch

from .full import full_divergence

_NEG_INF = float("-inf")


def _zero_where(cond: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    # 0 * log 0 = 0: entries with zero mass contribute nothing (avoids 0 * inf = NaN).
    return torch.where(cond, torch.zeros((), dtype=x.dtype, device=x.device), x)


class Divergence(ABC):
    """A divergence D(S, T) between student S and teacher T over the vocabulary."""

    name: ClassVar[str]
    # False for a lab signal that ignores the teacher on purpose (fixed_negative): the step-1
    # check that the loss reads the teacher's scores (training/advice.py) does not apply to it
    reads_teacher: ClassVar[bool] = True
    baseline: ClassVar[float] = 0.0  # token_cost = token_score - baseline
    # E_{y~S}[token_cost(y) grad log S(y)] = grad D; False only for jsd_legacy (kept wrong, for reproduction)
    exact_cost: ClassVar[bool] = True
    # constructor parameters, as config keys under ``divergence.`` (the one table of them)
    param_names: ClassVar[tuple[str, ...]] = ()
    # pointwise_grad jumps where s = t (tvd's sign): the full path's backward decides entries
    # within fp32 rounding of s = t in float64
    grad_jumps_at_equality: ClassVar[bool] = False

    def params(self) -> dict[str, float]:
        return {}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v}" for k, v in self.params().items())
        return f"{type(self).__name__}({args})"

    # -- per vocabulary entry -------------------------------------------------
    @abstractmethod
    def pointwise(self, s: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """phi(s, t): the contribution of one vocabulary entry, D = sum_v phi."""

    @abstractmethod
    def pointwise_grad(self, s: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """d phi / d s (s = log S of the entry, taken as a free coordinate)."""

    # -- per sampled token y ~ S ----------------------------------------------
    @abstractmethod
    def token_score(self, s: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """d phi / d S: the exact REINFORCE score of a sampled token."""

    def token_cost(self, s: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """Per-token REINFORCE cost; advantage = -kl_coef * cost."""
        return self.token_score(s, t) - self.baseline

    def token_value(self, s: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """Unbiased estimate of D from y ~ S: phi(y) / S(y)."""
        return self.pointwise_over_prob(s, t)

    @abstractmethod
    def pointwise_over_prob(self, s: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """phi(s, t) / S in closed form (the importance-weighted single-entry term)."""

    def outside_value(self, t: torch.Tensor) -> torch.Tensor:
        """What an entry with S = 0 adds to D beyond what ``token_value`` sees from y ~ S (under
        top-k / top-p such entries are never sampled): phi(-inf, t), unless ``token_value`` is
        built to account for it (tvd). Summed exactly by ``filtered_value``."""
        return self.pointwise(torch.full_like(t, _NEG_INF), t)

    def clipped(self, s: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """Where the cost was clipped (only fkl with ``clip`` set clips)."""
        return torch.zeros(torch.broadcast_shapes(s.shape, t.shape), dtype=torch.bool, device=s.device)

    # -- exact over the vocabulary --------------------------------------------
    def rows_value(self, s: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """D per row of a [n, V] chunk of log-probs; may overwrite s and t (full path only)."""
        return self.pointwise(s, t).sum(-1)

    def rows_value_close(self, S: torch.Tensor, delta: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """D per row of a chunk from S, delta = log T/S and u = T/S - 1 = expm1(delta), formed from
        the logits' difference (``full.log_ratio``): the full path's value wherever they are finite;
        overwrites none of them. A divergence that is sum_v S_v f(T_v/S_v) writes f with f(1) = 0
        and f'(1) = 0 (adding a multiple of u, which sums to 0 under S), every term second order in
        delta, so fp32 values near convergence keep their digits. This default goes through
        ``rows_value`` (t = log S + delta shares the student's normaliser)."""
        s = S.log()
        return self.rows_value(s, s + delta)

    def rows_grad(self, s: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(G, S) for a chunk: G = d phi / d s per entry and S = exp(s); may overwrite s and t."""
        return self.pointwise_grad(s, t), s.exp()

    def full(
        self,
        student_logits: torch.Tensor,
        teacher_logits: torch.Tensor,
        *,
        temperature: float = 1.0,
        mask: torch.Tensor | None = None,
        chunk_size: int | None = None,
    ) -> torch.Tensor:
        """Exact D per position, ``[..., V] -> [...]``, differentiable w.r.t. the student.

        Both logit tensors are divided by ``temperature`` before the softmax. Positions
        where ``mask`` is false give 0 (and no gradient). Works through positions in
        chunks, producing the gradient chunk by chunk (see ``full.py``).
        """
        return full_divergence(self, student_logits, teacher_logits, temperature, mask, chunk_size)


class ReverseKL(Divergence):
    """KL(S || T) = sum_v S_v (s_v - t_v)."""

    name = "rkl"
    baseline = 1.0

    def pointwise(self, s, t):
        return _zero_where(s == _NEG_INF, s.exp() * (s - t))

    def pointwise_grad(self, s, t):
        return _zero_where(s == _NEG_INF, s.exp() * (s - t + 1.0))

    def token_score(self, s, t):
        return s - t + 1.0

    def pointwise_over_prob(self, s, t):
        return s - t

    def rows_value_close(self, S, delta, u):
        # f(r) = r - 1 - log r
        return torch.linalg.vecdot(S, u - delta)


class ForwardKL(Divergence):
    """KL(T || S) = sum_v T_v (t_v - s_v).

    Its score is -r = -T(y)/S(y), an unbounded importance weight; ``clip`` (off unless
    given) caps r at ``clip`` and ``clipped`` reports where it bit (then biased).
    """

    name = "fkl"
    param_names = ("clip",)

    def __init__(self, clip: float | None = None):
        if clip is not None and not (isinstance(clip, (int, float)) and clip > 0 and math.isfinite(clip)):
            raise ValueError(f"divergence 'fkl': clip={clip!r} is out of range; allowed: None or a finite number > 0")
        self.clip = None if clip is None else float(clip)

    def params(self):
        return {} if self.clip is None else {"clip": self.clip}

    def pointwise(self, s, t):
        return _zero_where(t == _NEG_INF, t.exp() * (t - s))

    def pointwise_grad(self, s, t):
        return -t.exp() + torch.zeros_like(s)

    def token_score(self, s, t):
        r = (t - s).exp()
        if self.clip is not None:
            r = r.clamp(max=self.clip)
        return -r

    def pointwise_over_prob(self, s, t):
        return _zero_where(t == _NEG_INF, (t - s).exp() * (t - s))

    def rows_value_close(self, S, delta, u):
        # f(r) = r log r - r + 1
        return torch.linalg.vecdot(S, (u + 1.0).mul_(delta).sub_(u))

    def clipped(self, s, t):
        if self.clip is None:
            return super().clipped(s, t)
        return (t - s).exp() > self.clip


class JensenShannon(Divergence):
    """Generalized JSD: beta*KL(T||M) + (1-beta)*KL(S||M), M = beta*T + (1-beta)*S.

    TRL / ms-swift / Liger / GKD convention: beta=0 is exactly forward KL and beta=1 exactly
    reverse KL (the mixture formula itself vanishes at the endpoints; JSD/beta -> KL(T||S)
    as beta -> 0 and JSD/(1-beta) -> KL(S||T) as beta -> 1). Trinity-RFT documents the
    reverse endpoints.
    """

    name = "jsd"
    param_names = ("beta",)

    def __init__(self, beta: float = 0.5):
        if not (isinstance(beta, (int, float)) and 0.0 <= beta <= 1.0):
            raise ValueError(f"divergence 'jsd': beta={beta!r} is out of range; allowed: 0 <= beta <= 1")
        self.beta = float(beta)
        # The endpoints are the plain KLs (exactly, not as a limit of the mixture).
        self._endpoint: Divergence | None = ForwardKL() if self.beta == 0.0 else ReverseKL() if self.beta == 1.0 else None
        if self._endpoint is not None:
            self.baseline = self._endpoint.baseline

    def params(self):
        return {"beta": self.beta}

    def _log_m(self, s, t):
        # log M(v) = log(beta e^t + (1-beta) e^s), stable for -inf entries
        return torch.logaddexp(t + math.log(self.beta), s + math.log1p(-self.beta))

    def pointwise(self, s, t):
        if self._endpoint is not None:
            return self._endpoint.pointwise(s, t)
        lm = self._log_m(s, t)
        teacher_part = _zero_where(t == _NEG_INF, t.exp() * (t - lm))
        student_part = _zero_where(s == _NEG_INF, s.exp() * (s - lm))
        return self.beta * teacher_part + (1.0 - self.beta) * student_part

    def pointwise_grad(self, s, t):
        if self._endpoint is not None:
            return self._endpoint.pointwise_grad(s, t)
        # d/ds: the beta*T/M and (1-beta)*S/M terms cancel, leaving (1-beta) S log(S/M)
        return (1.0 - self.beta) * _zero_where(s == _NEG_INF, s.exp() * (s - self._log_m(s, t)))

    def token_score(self, s, t):
        if self._endpoint is not None:
            return self._endpoint.token_score(s, t)
        return (1.0 - self.beta) * (s - self._log_m(s, t))

    def rows_value(self, s, t):
        if self._endpoint is not None:
            return self._endpoint.rows_value(s, t)
        # phi = beta*T*t + (1-beta)*S*s - M*log M, in place on the chunk buffers (the hot path
        # of the full-vocab loss); clamping -inf log-probs keeps 0 * log 0 at 0.
        s.clamp_(min=torch.finfo(s.dtype).min)
        t.clamp_(min=torch.finfo(t.dtype).min)
        S, T = s.exp(), t.exp()
        out = self.beta * (T * t).sum(-1) + (1.0 - self.beta) * (S * s).sum(-1)
        M = T.mul_(self.beta).add_(S, alpha=1.0 - self.beta).clamp_(min=torch.finfo(s.dtype).tiny)
        return out - torch.xlogy(M, M).sum(-1)

    def rows_value_close(self, S, delta, u):
        if self._endpoint is not None:
            return self._endpoint.rows_value_close(S, delta, u)
        # f(r) = beta r log r - m log m, m = M/S = 1 + beta (r - 1); f'(1) = 0 already
        m = u * self.beta
        log_m = torch.log1p(m)
        f = (u + 1.0).mul_(delta).mul_(self.beta).sub_(m.add_(1.0).mul_(log_m))
        return torch.linalg.vecdot(S, f)

    def rows_grad(self, s, t):
        if self._endpoint is not None:
            return self._endpoint.rows_grad(s, t)
        S = s.exp()
        lm = t.exp_().mul_(self.beta).add_(S, alpha=1.0 - self.beta).log_()
        G = s.sub_(lm).mul_(S).mul_(1.0 - self.beta)  # (1-beta) S (s - log M)
        return torch.where(S == 0, 0.0, G), S

    def pointwise_over_prob(self, s, t):
        if self._endpoint is not None:
            return self._endpoint.pointwise_over_prob(s, t)
        lm = self._log_m(s, t)
        r = (t - s).exp()
        return self.beta * _zero_where(t == _NEG_INF, r * (t - lm)) + (1.0 - self.beta) * (s - lm)


class JensenShannonLegacy(JensenShannon):
    """WRONG on purpose, for reproduction only: the JSD advantage as it shipped before its fix.

    Its sampled cost is the JSD *value* beta*(t - log m) + (1-beta)*(s - log m),
    m = beta*e^t + (1-beta)*e^s, used as the REINFORCE/PPO cost. Under y ~ S its expected
    update does not follow -grad JSD_beta. Measured exactly (the expectation enumerated) on the
    random pairs of ``check.random_pair`` (seeds 0-999, vocabulary 8), its cosine with
    -grad JSD_beta is negative on (independent pairs / close pairs, teacher = student + 0.2 noise)
    beta=0.1: 49% / 51%, beta=0.5: 89% / 58%, beta=0.9: 97% / 64%; at vocabulary 64 on 84-100%
    of independent pairs and 48-75% of close ones. So training with it mostly drives the student
    away from the teacher, more so the larger beta and the farther apart; not on every step.
    Everything else (the exact value, the full-vocabulary gradient, ``token_value``) is the
    correct JSD, so the logged ``jsd/mean`` and eval divergences measure what it does. Only
    ``estimator=sampled`` uses the cost, and the config refuses any other estimator.
    """

    name = "jsd_legacy"
    exact_cost: ClassVar[bool] = False

    def __init__(self, beta: float = 0.5):
        if not (isinstance(beta, (int, float)) and 0.0 < beta < 1.0):
            raise ValueError(f"divergence 'jsd_legacy': beta={beta!r} is out of range; allowed: 0 < beta < 1")
        super().__init__(beta)

    def token_score(self, s, t):
        # the value of the mixture, not its derivative: the shipped mistake
        lm = self._log_m(s, t)
        return self.beta * (t - lm) + (1.0 - self.beta) * (s - lm)


def _check_alpha(name: str, alpha) -> float:
    if not (isinstance(alpha, (int, float)) and 0.0 < alpha < 1.0):
        raise ValueError(f"divergence '{name}': alpha={alpha!r} is out of range; allowed: 0 < alpha < 1")
    return float(alpha)


class SkewForwardKL(Divergence):
    """Skew KL (DistiLLM): KL(T || alpha*T + (1-alpha)*S)."""

    name = "skl"
    param_names = ("alpha",)

    def __init__(self, alpha: float = 0.1):
        self.alpha = _check_alpha(self.name, alpha)

    def params(self):
        return {"alpha": self.alpha}

    def _log_m(self, s, t):
        return torch.logaddexp(t + math.log(self.alpha), s + math.log1p(-self.alpha))

    def pointwise(self, s, t):
        return _zero_where(t == _NEG_INF, t.exp() * (t - self._log_m(s, t)))

    def pointwise_grad(self, s, t):
        # -(1-alpha) T S / M; 0 where either has no mass (both -inf would give exp(NaN))
        none = (s == _NEG_INF) | (t == _NEG_INF)
        return _zero_where(none, -(1.0 - self.alpha) * (t + s - self._log_m(s, t)).exp())

    def token_score(self, s, t):
        return _zero_where(t == _NEG_INF, -(1.0 - self.alpha) * (t - self._log_m(s, t)).exp())

    def pointwise_over_prob(self, s, t):
        return _zero_where(t == _NEG_INF, (t - s).exp() * (t - self._log_m(s, t)))

    def rows_value_close(self, S, delta, u):
        # f(r) = r (log r - log m) - (1-alpha)(r - 1), m = M/S = 1 + alpha (r - 1)
        f = (u + 1.0).mul_(delta - torch.log1p(u * self.alpha)).sub_(u, alpha=1.0 - self.alpha)
        return torch.linalg.vecdot(S, f)


class SkewReverseKL(Divergence):
    """Skew reverse KL (DistiLLM): KL(S || alpha*S + (1-alpha)*T)."""

    name = "srkl"
    param_names = ("alpha",)
    baseline = 1.0

    def __init__(self, alpha: float = 0.1):
        self.alpha = _check_alpha(self.name, alpha)

    def params(self):
        return {"alpha": self.alpha}

    def _log_m(self, s, t):
        return torch.logaddexp(s + math.log(self.alpha), t + math.log1p(-self.alpha))

    def pointwise(self, s, t):
        return _zero_where(s == _NEG_INF, s.exp() * (s - self._log_m(s, t)))

    def pointwise_grad(self, s, t):
        lm = self._log_m(s, t)
        return _zero_where(s == _NEG_INF, s.exp() * (s - lm + 1.0 - self.alpha * (s - lm).exp()))

    def token_score(self, s, t):
        lm = self._log_m(s, t)
        return s - lm + 1.0 - self.alpha * (s - lm).exp()

    def pointwise_over_prob(self, s, t):
        return s - self._log_m(s, t)

    def rows_value_close(self, S, delta, u):
        # f(r) = (1-alpha)(r - 1) - log m', m' = M'/S = 1 + (1-alpha)(r - 1)
        w = u * (1.0 - self.alpha)
        return torch.linalg.vecdot(S, w - torch.log1p(w))


class TotalVariation(Divergence):
    """Total variation 0.5 * sum_v |S_v - T_v|."""

    name = "tvd"
    grad_jumps_at_equality = True

    def pointwise(self, s, t):
        return 0.5 * (s.exp() - t.exp()).abs()

    def pointwise_grad(self, s, t):
        return 0.5 * torch.sign(s - t) * s.exp()

    def token_score(self, s, t):
        return 0.5 * torch.sign(s - t)

    def pointwise_over_prob(self, s, t):
        return 0.5 * (1.0 - (t - s).exp()).abs()

    def rows_value_close(self, S, delta, u):
        return 0.5 * torch.linalg.vecdot(S, u.abs())

    def token_value(self, s, t):
        # sum_v (S-T)_+ = TVD too (sum_v (S-T) = 0); one-sided, so bounded in [0, 1].
        return (1.0 - (t - s).exp()).clamp(min=0.0)

    def outside_value(self, t):
        # (S-T)_+ = 0 where S = 0: the one-sided value already sums to the whole TVD
        return torch.zeros_like(t)


_REGISTRY: dict[str, type[Divergence]] = {}
_LISTENERS: list = []  # called with each newly registered class (the config schema's choices)


class _Names(Sequence):
    """The registered divergence names, in registration order; a live view of the registry."""

    def __getitem__(self, i):
        return tuple(_REGISTRY)[i]

    def __len__(self) -> int:
        return len(_REGISTRY)

    def __contains__(self, name) -> bool:
        return name in _REGISTRY

    def __eq__(self, other) -> bool:
        return tuple(self) == tuple(other) if isinstance(other, Sequence) else NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return repr(tuple(_REGISTRY))


DIVERGENCES: Sequence[str] = _Names()
_NAME_RE = re.compile(r"^[a-z][a-z0-9_]*$")


def register_divergence(cls: type[Divergence] | None = None, *, replace: bool = False):
    """Add a ``Divergence`` subclass to the registry under its ``name``; usable as a decorator.

    After this, ``get_divergence(name)``, ``divergence.name=<name>`` on the command line, the
    tests that loop over the registry and ``check_divergence`` all see it. A name already taken
    fails unless ``replace=True`` (the built-ins can be shadowed only on purpose).
    """

    def add(c: type[Divergence]) -> type[Divergence]:
        if not (isinstance(c, type) and issubclass(c, Divergence)):
            raise TypeError(f"register_divergence: {c!r} is not a Divergence subclass")
        name = getattr(c, "name", None)
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise ValueError(f"register_divergence: {c.__name__}.name={name!r}; allowed: a lower-case identifier like 'jeffreys'")
        if getattr(c, "__abstractmethods__", None):
            raise TypeError(f"register_divergence: {c.__name__} leaves {', '.join(sorted(c.__abstractmethods__))} unimplemented")
        if name in _REGISTRY and _REGISTRY[name] is not c and not replace:
            raise ValueError(
                f"register_divergence: {name!r} is already registered ({_REGISTRY[name].__name__}); allowed: a new name, or replace=True"
            )
        for listener in _LISTENERS:
            listener(c)  # may refuse (e.g. a parameter the config has no key for) before it is added
        _REGISTRY[name] = c
        return c

    return add if cls is None else add(cls)


def on_register(listener) -> None:
    """Call ``listener(cls)`` for every divergence registered from now on (and every one so far)."""
    _LISTENERS.append(listener)
    for c in _REGISTRY.values():
        listener(c)


for _cls in (ReverseKL, ForwardKL, JensenShannon, SkewForwardKL, SkewReverseKL, TotalVariation, JensenShannonLegacy):
    register_divergence(_cls)


def parameter_names(name: str) -> tuple[str, ...]:
    """The parameters divergence ``name`` takes (e.g. ``("beta",)`` for jsd)."""
    return _REGISTRY[name].param_names


def divergence_class(name: str) -> type[Divergence]:
    if name not in _REGISTRY:
        raise ValueError(f"unknown divergence {name!r}; allowed: {', '.join(DIVERGENCES)}")
    return _REGISTRY[name]


def get_divergence(name: str, **params) -> Divergence:
    """Build a registered divergence by name: rkl, fkl (clip), jsd (beta), skl (alpha), srkl (alpha), tvd, and any added with ``register_divergence``."""
    cls = divergence_class(name)
    allowed = cls.param_names
    for key in params:
        if key not in allowed:
            raise ValueError(f"divergence {name!r} takes no parameter {key!r}; allowed: {', '.join(allowed) or 'none'}")
    return cls(**params)
