"""Exact checks of the per-token estimators on random categorical student/teacher pairs.

The estimators see only a token y sampled from the student S. Over a small vocabulary the
expectation over y is a finite sum, so the *expected* update of each estimator can be
computed exactly and compared with the true gradient of the divergence:

    expected REINFORCE gradient of a cost c:  E_{y~S}[c(y) grad_z log S(y)] = S*c - S*(S.c)

(z = student logits; grad_z log S(y) = e_y - S). The update is minus that; it should point
along -grad_z D. ``notebooks/estimator_check.py`` shows the tables; tests pin the numbers.

Also here: the cost that seed 001 describes as shipped before its fix (the value
beta*(t - log m) + (1-beta)*(s - log m) used as the cost) and the beta=1 branch (cost t - s),
and the exact mean and variance of each one-sample value estimator (``token_value``).

Pure torch (float64), no global state changed; imports only ``opd_exp.divergences``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from opd_exp.divergences.catalog import Divergence, get_divergence
from opd_exp.divergences.filtered import filtered_value
from opd_exp.divergences.topk import topk_estimate
from opd_exp.divergences.topk_variants import TOPK_ESTIMATORS, topk_estimator

DTYPE = torch.float64
Cost = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (s, t) over the vocabulary -> c


# -- pairs and exact expectations ---------------------------------------------


def random_pair(seed: int, vocab: int = 8, regime: str = "far", near_noise: float = 0.2) -> tuple[torch.Tensor, torch.Tensor]:
    """(student logits, teacher logits), standard normal. ``far``: independent (the seed's
    setting); ``near``: teacher = student + ``near_noise`` * noise (a student close to its teacher)."""
    g = torch.Generator().manual_seed(seed)
    zs = torch.randn(vocab, generator=g, dtype=DTYPE)
    if regime == "far":
        zt = torch.randn(vocab, generator=g, dtype=DTYPE)
    elif regime == "near":
        zt = zs + near_noise * torch.randn(vocab, generator=g, dtype=DTYPE)
    else:
        raise ValueError(f"regime {regime!r} is unknown; allowed: far, near")
    return zs, zt


def log_probs(zs: torch.Tensor, zt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(S, s, t): student probabilities and both log-probabilities."""
    s = zs.log_softmax(-1)
    return s.exp(), s, zt.log_softmax(-1)


def exact_grad(div: Divergence, zs: torch.Tensor, zt: torch.Tensor) -> torch.Tensor:
    """grad_z D(S, T) with respect to the student logits (autograd through the exact D)."""
    z = zs.detach().clone().requires_grad_(True)
    div.full(z, zt).backward()
    return z.grad


def expected_reinforce_grad(cost: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
    """E_{y~S}[c(y) grad_z log S(y)], enumerated over the vocabulary."""
    return S * cost - S * (S * cost).sum(-1, keepdim=True)


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0))


def cost_cosine(cost_fn: Cost, div: Divergence, zs: torch.Tensor, zt: torch.Tensor) -> float:
    """Cosine between the expected update of ``cost_fn`` and -grad D."""
    S, s, t = log_probs(zs, zt)
    return cosine(-expected_reinforce_grad(cost_fn(s, t), S), -exact_grad(div, zs, zt))


def topk_expectations(
    div: Divergence, zs: torch.Tensor, zt: torch.Tensor, k: int, renormalize: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k estimator, exactly over y ~ S: (E[grad surrogate], E[value], E[value^2])."""
    V = zs.shape[-1]
    t_all = zt.log_softmax(-1)
    t_k, ids = t_all.topk(k)
    ys = torch.arange(V)
    z = zs.detach().clone().requires_grad_(True)
    # one row per possible sampled token y; the rows share z, so backward sums over y
    surrogate, value = topk_estimate(div, z.expand(V, V), t_k.expand(V, k), ids.expand(V, k), ys, t_all[ys], renormalize=renormalize)
    S = zs.detach().softmax(-1)
    (S * surrogate).sum().backward()
    value = value.detach()
    return z.grad, (S * value).sum(), (S * value**2).sum()


def filtered_value_error(div: Divergence, zs: torch.Tensor, zt: torch.Tensor, top_k: int) -> float:
    """Under a top-k filter of the student (S = 0 outside its top-k): E_{y~S}[token_value(y)]
    + ``filtered_value`` - D, enumerated; 0 when a divergence's ``outside_value`` matches its
    ``token_value`` (inf - inf = NaN for fkl, which is infinite under a filter)."""
    zs, zt = zs.to(DTYPE), zt.to(DTYPE)
    keep = torch.zeros_like(zs, dtype=torch.bool).scatter_(-1, zs.topk(top_k).indices, True)
    zf = zs.masked_fill(~keep, float("-inf"))
    S, s, t = zf.softmax(-1), zf.log_softmax(-1), zt.log_softmax(-1)
    estimate = (S[keep] * div.token_value(s[keep], t[keep])).sum() + filtered_value(div, zf, zt)
    return float(estimate - div.pointwise(s, t).sum())


# -- the costs seed 001 describes as shipped ----------------------------------


def shipped_jsd_cost(beta: float) -> Cost:
    """Seed 001, before its fix: the JSD *value* beta*(t - log m) + (1-beta)*(s - log m),
    m = beta*T + (1-beta)*S, used as the REINFORCE cost."""

    def cost(s, t):
        lm = torch.logaddexp(t + math.log(beta), s + math.log1p(-beta))
        return beta * (t - lm) + (1 - beta) * (s - lm)

    return cost


def shipped_beta1_cost(s: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Seed 001's beta = 1 branch, documented as KL(teacher||student): cost t - s."""
    return t - s


# -- tables -------------------------------------------------------------------


def seed_table(betas: Sequence[float] = (0.3, 0.5, 0.9), seeds: Sequence[int] = (0, 1, 2), vocab: int = 8) -> list[dict]:
    """Seed 001's table: per beta, the cosine with -grad JSD_beta per seed, for the shipped
    cost (``before``) and this project's ``token_cost`` (``after``)."""
    rows = []
    for beta in betas:
        d = get_divergence("jsd", beta=beta)
        before, after = [], []
        for seed in seeds:
            zs, zt = random_pair(seed, vocab)
            before.append(cost_cosine(shipped_jsd_cost(beta), d, zs, zt))
            after.append(cost_cosine(d.token_cost, d, zs, zt))
        rows.append({"beta": beta, "before": before, "after": after})
    return rows


@dataclass(frozen=True)
class Estimator:
    """One row of the cosine table: an estimator of the gradient of ``target``."""

    label: str
    target: tuple[str, dict]  # the divergence whose -gradient the update should follow
    kind: str = "cost"  # cost | topk | topk_renorm | shipped_jsd | shipped_beta1
    params: tuple = ()  # (k,) for top-k; (beta,) for shipped_jsd
    ours: bool = True  # an estimator this project ships as unbiased

    def divergence(self) -> Divergence:
        return get_divergence(self.target[0], **self.target[1])

    def expected_update_cosine(self, zs: torch.Tensor, zt: torch.Tensor) -> float:
        d = self.divergence()
        if self.kind == "cost":
            return cost_cosine(d.token_cost, d, zs, zt)
        if self.kind in ("topk", "topk_renorm"):
            grad, _, _ = topk_expectations(d, zs, zt, self.params[0], renormalize=self.kind == "topk_renorm")
            return cosine(-grad, -exact_grad(d, zs, zt))
        if self.kind == "shipped_jsd":
            return cost_cosine(shipped_jsd_cost(self.params[0]), d, zs, zt)
        if self.kind == "shipped_beta1":
            return cost_cosine(shipped_beta1_cost, d, zs, zt)
        raise ValueError(f"estimator kind {self.kind!r} is unknown")


ESTIMATORS: tuple[Estimator, ...] = (
    Estimator("rkl: s - t", ("rkl", {})),
    Estimator("fkl: -r", ("fkl", {})),
    Estimator("fkl: -min(r, 2) (clip=2)", ("fkl", {"clip": 2.0}), ours=False),
    *(Estimator(f"jsd beta={b}: (1-beta)(s - log m)", ("jsd", {"beta": b})) for b in (0.1, 0.3, 0.5, 0.9)),
    Estimator("skl alpha=0.1", ("skl", {"alpha": 0.1})),
    Estimator("srkl alpha=0.1", ("srkl", {"alpha": 0.1})),
    Estimator("tvd: sign(s - t)/2", ("tvd", {})),
    *(
        Estimator(f"top-{k} + sampled tail, {n}", (n, p), "topk", (k,))
        for n, p in (("rkl", {}), ("fkl", {}), ("jsd", {"beta": 0.5}))
        for k in (1, 4)
    ),
    *(
        Estimator(f"top-{k} renormalised (biased), {n}", (n, p), "topk_renorm", (k,), ours=False)
        for n, p in (("rkl", {}), ("jsd", {"beta": 0.5}))
        for k in (2, 4)
    ),
    *(Estimator(f"Trinity-RFT as shipped, beta={b}", ("jsd", {"beta": b}), "shipped_jsd", (b,), ours=False) for b in (0.3, 0.5, 0.9)),
    Estimator("Trinity-RFT beta=1 (t - s) vs rkl", ("rkl", {}), "shipped_beta1", ours=False),
    Estimator("Trinity-RFT beta=1 (t - s) vs fkl", ("fkl", {}), "shipped_beta1", ours=False),
)


def cosine_table(
    estimators: Sequence[Estimator] = ESTIMATORS,
    seeds: Sequence[int] = (0, 1, 2),
    vocab: int = 8,
    regimes: Sequence[str] = ("far", "near"),
) -> list[dict]:
    """Per estimator and regime: the cosines (one per seed) of the exact expected update with -grad D."""
    rows = []
    for est in estimators:
        for regime in regimes:
            cos = [est.expected_update_cosine(*random_pair(seed, vocab, regime)) for seed in seeds]
            rows.append({"estimator": est.label, "regime": regime, "ours": est.ours, "cosines": cos})
    return rows


@dataclass(frozen=True)
class ValueEstimator:
    """A one-sample estimate of D(S, T) from y ~ S."""

    label: str
    target: tuple[str, dict]
    kind: str = "value"  # value | rkl_k3 | shipped_jsd | topk
    k: int = 0

    def moments(self, zs: torch.Tensor, zt: torch.Tensor) -> tuple[float, float, float]:
        """(D, E[estimate], Var[estimate]) exactly over y ~ S."""
        d = get_divergence(self.target[0], **self.target[1])
        D = float(d.full(zs, zt))
        if self.kind == "topk":
            _, m1, m2 = topk_expectations(d, zs, zt, self.k)
            return D, float(m1), float(m2 - m1**2)
        S, s, t = log_probs(zs, zt)
        if self.kind == "value":
            v = d.token_value(s, t)
        elif self.kind == "rkl_k3":
            log_r = t - s
            v = log_r.exp() - 1 - log_r  # r - 1 - log r: also unbiased for KL(S||T), and >= 0
        elif self.kind == "shipped_jsd":
            v = shipped_jsd_cost(self.target[1]["beta"])(s, t)
        else:
            raise ValueError(f"value estimator kind {self.kind!r} is unknown")
        mean = (S * v).sum()
        return D, float(mean), float((S * (v - mean) ** 2).sum())


VALUE_ESTIMATORS: tuple[ValueEstimator, ...] = (
    ValueEstimator("rkl: s - t", ("rkl", {})),
    ValueEstimator("rkl: r - 1 - log r", ("rkl", {}), "rkl_k3"),
    ValueEstimator("fkl: r (t - s)", ("fkl", {})),
    *(ValueEstimator(f"jsd beta={b}", ("jsd", {"beta": b})) for b in (0.1, 0.5, 0.9)),
    ValueEstimator("jsd beta=0.5, Trinity-RFT as shipped (biased)", ("jsd", {"beta": 0.5}), "shipped_jsd"),
    ValueEstimator("jsd beta=0.5, top-4 + tail", ("jsd", {"beta": 0.5}), "topk", 4),
    ValueEstimator("skl alpha=0.1", ("skl", {"alpha": 0.1})),
    ValueEstimator("srkl alpha=0.1", ("srkl", {"alpha": 0.1})),
    ValueEstimator("tvd: max(0, 1 - r)", ("tvd", {})),
)


def variance_table(
    estimators: Sequence[ValueEstimator] = VALUE_ESTIMATORS,
    seeds: Sequence[int] = (0, 1, 2),
    vocab: int = 8,
    regimes: Sequence[str] = ("near", "far"),
) -> list[dict]:
    """Per value estimator and regime, averaged over seeds: D, bias = E[estimate] - D, the
    one-sample std, and the relative std std/D (how many samples a given precision costs)."""
    rows = []
    for est in estimators:
        for regime in regimes:
            stats = [est.moments(*random_pair(seed, vocab, regime)) for seed in seeds]
            D = [x[0] for x in stats]
            std = [math.sqrt(max(x[2], 0.0)) for x in stats]
            rows.append(
                {
                    "estimator": est.label,
                    "regime": regime,
                    "D": sum(D) / len(D),
                    "bias": sum(x[1] - x[0] for x in stats) / len(stats),
                    "std": sum(std) / len(std),
                    "rel_std": sum(sd / d for sd, d in zip(std, D)) / len(D),
                }
            )
    return rows


def format_rows(rows: Sequence[dict], columns: Sequence[str], digits: int = 3) -> str:
    """Aligned text for a notebook or a terminal; lists print as min..max."""

    def cell(v):
        if isinstance(v, bool) or not isinstance(v, (float, list, tuple)):
            return str(v)
        if isinstance(v, float):
            if abs(v) < 1e-12:  # float round-off of an exact zero
                return "0"
            return f"{v:+.{digits}f}" if abs(v) >= 10**-digits else f"{v:+.1e}"
        if isinstance(v, (list, tuple)) and v and all(isinstance(x, float) for x in v):
            lo, hi = min(v), max(v)
            return cell(lo) if abs(hi - lo) < 0.5 * 10**-digits else f"{cell(lo)} .. {cell(hi)}"
        return str(v)

    body = [[cell(r[c]) for c in columns] for r in rows]
    widths = [max(len(x) for x in col) for col in zip(columns, *body)]
    fmt = lambda cells: "  ".join(x.ljust(w) for x, w in zip(cells, widths)).rstrip()
    return "\n".join([fmt(columns), fmt(["-" * w for w in widths]), *map(fmt, body)])


# -- check_divergence: the exactness checks, for any divergence ------------------

REGIMES = ("peaked-near", "peaked-far", "flat-near", "flat-far")


class DivergenceCheckError(AssertionError):
    """A divergence failed one of ``check_divergence``'s checks; the message is one line."""


@dataclass(frozen=True)
class CheckResult:
    check: str  # what was compared
    worst: float  # the largest error over regimes and seeds (relative where it says so)
    tol: float
    where: str  # regime and seed of the worst case

    @property
    def ok(self) -> bool:
        return math.isfinite(self.worst) and self.worst <= self.tol


@dataclass(frozen=True)
class CheckReport:
    """What ``check_divergence`` measured: one row per check (all passed if it returned)."""

    divergence: str
    results: tuple[CheckResult, ...]
    function: str = "check_divergence"  # the check that made it, named in its table and errors

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.results)

    def raise_first_failure(self) -> None:
        for r in self.results:
            if not r.ok:
                raise DivergenceCheckError(
                    f"{self.function}({self.divergence}): '{r.check}' fails: error {r.worst:.3g} > {r.tol:.0e} ({r.where})"
                )

    def __str__(self) -> str:
        lines = [f"{self.function}({self.divergence}):"]
        for r in self.results:
            lines.append(f"  {'ok  ' if r.ok else 'FAIL'} {r.check:<58} worst {r.worst:.2e} (tol {r.tol:.0e}, {r.where})")
        return "\n".join(lines)


def _check_pair(seed: int, regime: str, vocab: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    scale = 4.0 if regime.startswith("peaked") else 0.5
    zs = scale * torch.randn(rows, vocab, generator=g, dtype=DTYPE)
    noise = 0.2 * torch.randn(rows, vocab, generator=g, dtype=DTYPE)
    zt = zs + noise if regime.endswith("near") else scale * torch.randn(rows, vocab, generator=g, dtype=DTYPE)
    return zs, zt


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = max(float(want.abs().max()), 1e-12)
    return float((got - want).abs().max()) / scale


def check_divergence(
    div: Divergence,
    *,
    vocab: int = 11,
    rows: int = 4,
    seeds: Sequence[int] = (0, 1, 2),
    regimes: Sequence[str] = REGIMES,
    tol: float = 1e-6,
    reference: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    raise_on_failure: bool = True,
) -> CheckReport:
    """Run the enumeration checks this project holds its own divergences to, on ``div``.

    Over a small vocabulary (float64, student/teacher logits near and far, peaked and flat):

    * ``full`` equals the sum of ``pointwise`` over the vocabulary;
    * the gradient of ``full`` (its chunked backward from ``pointwise_grad``/``rows_grad``)
      equals autograd through the sum of ``pointwise`` over ``log_softmax``;
    * the expected REINFORCE gradient of ``token_cost`` (and of ``token_score``),
      E_{y~S}[c(y) grad log S(y)] enumerated, equals that exact gradient;
    * ``token_value`` is unbiased: E_{y~S}[token_value] = D;
    * identical distributions give 0 (``full`` and ``token_value``), and D >= 0 on every draw;
    * with ``reference`` (a function of the probabilities ``(S, T) -> D``, written from the
      definition): ``full`` equals it, and its autograd gradient equals that of ``full``.

    Returns a ``CheckReport`` (print it for the table); on a failure raises
    ``DivergenceCheckError`` with one line naming the check, the error and where.
    """
    results: dict[str, tuple[float, str]] = {}
    tols = {}

    def record(check: str, err: float, where: str, tolerance: float = tol) -> None:
        tols[check] = tolerance
        if not math.isfinite(err):
            err = math.inf
        if check not in results or err > results[check][0]:
            results[check] = (err, where)

    for regime in regimes:
        for seed in seeds:
            where = f"{regime}, seed {seed}"
            zs, zt = _check_pair(seed, regime, vocab, rows)
            s, t = zs.log_softmax(-1), zt.log_softmax(-1)
            S = s.exp()
            z = zs.clone().requires_grad_(True)
            value = div.full(z, zt)
            value.sum().backward()
            grad_full = z.grad
            z_ref = zs.clone().requires_grad_(True)
            ref = div.pointwise(z_ref.log_softmax(-1), t).sum(-1)
            ref.sum().backward()
            record("full = sum_v pointwise", _rel(value.detach(), ref.detach()), where)
            record("grad of full = autograd of sum_v pointwise", _rel(grad_full, z_ref.grad), where)
            record("E_y[token_cost * grad log S] = grad D", _rel(expected_reinforce_grad(div.token_cost(s, t), S), grad_full), where)
            record("E_y[token_score * grad log S] = grad D", _rel(expected_reinforce_grad(div.token_score(s, t), S), grad_full), where)
            record("E_y[token_value] = D (unbiased)", _rel((S * div.token_value(s, t)).sum(-1), value.detach()), where)
            if reference is not None:
                z_def = zs.clone().requires_grad_(True)
                want = reference(z_def.softmax(-1), zt.softmax(-1))
                want.sum().backward()
                record("full = reference(S, T)", _rel(value.detach(), want.detach()), where)
                record("grad of full = autograd of reference(S, T)", _rel(grad_full, z_def.grad), where)
            record("D >= 0", float((-value.detach()).clamp(min=0).max()), where, 1e-12)
            record("D(S, S) = 0 (full)", float(div.full(zs, zs.clone()).abs().max()), where, 1e-10)
            record("token_value(s, s) = 0", float(div.token_value(s, s).abs().max()), where, 1e-10)
    report = CheckReport(repr(div), tuple(CheckResult(k, e, tols[k], w) for k, (e, w) in results.items()))
    if raise_on_failure:
        report.raise_first_failure()
    return report


def topk_enumeration(
    name: str, div: Divergence, zs: torch.Tensor, zt: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k estimator ``name`` exactly over y ~ S, per row of ``[rows, V]`` logits:
    (E_y[grad_z surrogate], E_y[value], P_y(clamped))."""
    rows, V = zs.shape
    t_all = zt.log_softmax(-1)
    z = zs.detach().clone().requires_grad_(True)
    # one row per (row, sampled token y); the copies share z, so backward sums over y
    out = topk_estimator(name).estimate(
        div, z.unsqueeze(1).expand(rows, V, V), t_all.unsqueeze(1).expand(rows, V, V), torch.arange(V).expand(rows, V), k=k
    )
    S = zs.detach().softmax(-1)
    (S * out.surrogate).sum().backward()
    return z.grad, (S * out.value).sum(-1), (S * out.clamped).sum(-1)


def check_topk_estimators(
    div: Divergence,
    *,
    estimators: Sequence[str] | None = None,
    ks: Sequence[int] | None = None,
    vocab: int = 7,
    rows: int = 3,
    seeds: Sequence[int] = (0, 1, 2),
    regimes: Sequence[str] = REGIMES,
    tol: float = 1e-6,
    raise_on_failure: bool = True,
) -> CheckReport:
    """The enumeration checks of the top-k estimators on ``div``: for each estimator (default: every
    one in ``TOPK_ESTIMATORS`` that claims unbiasedness) and each k (default 1, 2, vocab // 2 and
    vocab), E_{y~S}[value] = D and E_{y~S}[grad surrogate] = grad D (autograd of ``full``),
    enumerated over a small vocabulary in float64, as ``check_divergence`` does for the sampled
    cost. Returns a ``CheckReport``; on a failure raises ``DivergenceCheckError`` with one line."""
    names = [n for n, e in TOPK_ESTIMATORS.items() if e.unbiased] if estimators is None else list(estimators)
    ks = sorted({1, 2, vocab // 2, vocab}) if ks is None else list(ks)
    results: dict[str, tuple[float, str]] = {}

    def record(check: str, err: float, where: str) -> None:
        err = err if math.isfinite(err) else math.inf
        if check not in results or err > results[check][0]:
            results[check] = (err, where)

    for regime in regimes:
        for seed in seeds:
            zs, zt = _check_pair(seed, regime, vocab, rows)
            z = zs.clone().requires_grad_(True)
            D = div.full(z, zt)
            D.sum().backward()
            for name in names:
                for k in ks:
                    grad, value, _ = topk_enumeration(name, div, zs, zt, k)
                    where = f"{regime}, seed {seed}, k={k}"
                    record(f"{name}: E_y[value] = D (unbiased)", _rel(value, D.detach()), where)
                    record(f"{name}: E_y[grad surrogate] = grad D", _rel(grad, z.grad), where)
    report = CheckReport(repr(div), tuple(CheckResult(c, e, tol, w) for c, (e, w) in results.items()), function="check_topk_estimators")
    if raise_on_failure:
        report.raise_first_failure()
    return report


BIASED_TOPK = tuple(n for n, e in TOPK_ESTIMATORS.items() if not e.unbiased)


def topk_bias_table(
    estimators: Sequence[str] = BIASED_TOPK,
    targets: Sequence[tuple[str, dict]] = (("rkl", {}), ("fkl", {}), ("jsd", {"beta": 0.5})),
    ks: Sequence[int] = (1, 2, 4),
    seeds: Sequence[int] = (0, 1, 2),
    vocab: int = 8,
    regimes: Sequence[str] = ("near", "far"),
) -> list[dict]:
    """Per top-k estimator, divergence, k and regime (``random_pair``), exactly over y ~ S and
    averaged over seeds: D, bias = E[value] - D, rel_bias = mean bias / mean D, the cosine of the expected
    gradient with grad D (the worst seed) and the share of pairs where a clamp acts. Pairs of an
    estimator and a divergence it refuses (the generalised KL is KL-only) are left out."""
    rows = []
    for name in estimators:
        for target, params in targets:
            d = get_divergence(target, **params)
            label = target + "".join(f" {k}={v}" for k, v in params.items())
            for k in ks:
                for regime in regimes:
                    D, bias, cos, clamp = [], [], [], []
                    try:
                        for seed in seeds:
                            zs, zt = (x.unsqueeze(0) for x in random_pair(seed, vocab, regime))
                            z = zs.clone().requires_grad_(True)
                            exact = d.full(z, zt)
                            exact.sum().backward()
                            grad, value, clamped = topk_enumeration(name, d, zs, zt, k)
                            D.append(float(exact.detach()))
                            bias.append(float(value) - D[-1])
                            cos.append(cosine(grad, z.grad))
                            clamp.append(float(clamped))
                    except ValueError:
                        break
                    n = len(seeds)
                    rows.append(
                        {
                            "estimator": name,
                            "divergence": label,
                            "k": k,
                            "regime": regime,
                            "D": sum(D) / n,
                            "bias": sum(bias) / n,
                            "rel_bias": sum(bias) / sum(D),
                            "grad_cos": min(cos),
                            "clamp_rate": sum(clamp) / n,
                        }
                    )
    return rows
