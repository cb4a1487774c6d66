"""The review gate's statistics: agreement between the reward model and the reviewers, its interval, kappa.

Stage: human review (``hermes_lab.review.gate``, which re-exports every name here and explains the rules in its
docstring). Pure functions over paired (reward, label) lists; reads and writes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

Z95 = 1.959963984540054


@dataclass
class AgreementStats:
    n: int
    agreement: float | None  # threshold agreement: same side of the success threshold
    ci: tuple[float, float] | None  # Wilson interval of ``agreement``
    within1: float | None  # |reward - label| <= 1, score labels only
    within1_ci: tuple[float, float] | None  # Wilson interval of ``within1`` (n_scored labels)
    n_scored: int
    kappa: float | None  # unweighted, pass/fail
    kappa_weighted: float | None  # on integer-binned scores, score labels only
    confusion: list[list[int]]  # pass/fail: rows reward fail/pass, columns reviewer fail/pass
    confusion_scores: list[list[int]]  # binned scores: rows reward 0..scale, columns reviewer 0..scale


def kappa_from_table(table: Any, wt: str | None = None) -> float | None:
    """Cohen's kappa of a square confusion matrix (statsmodels); None when undefined."""
    import numpy as np
    from statsmodels.stats.inter_rater import cohens_kappa

    t = np.asarray(table, dtype=float)
    if t.sum() == 0:
        return None
    k = t.shape[0]
    dist = np.subtract.outer(np.arange(k), np.arange(k))
    w = {None: dist != 0, "linear": np.abs(dist), "quadratic": dist**2}[wt]
    p = t / t.sum()
    if (w * np.outer(p.sum(1), p.sum(0))).sum() == 0:  # chance disagreement is 0: kappa is 0/0
        return None
    return float(cohens_kappa(t, wt=wt, return_results=False))  # no variance: it warns on tiny tables


def wilson(k: float, n: int, alpha: float = 0.05) -> tuple[float, float] | None:
    """Wilson score interval of k successes in n (statsmodels); None without data."""
    from statsmodels.stats.proportion import proportion_confint

    if n <= 0:
        return None
    lo, hi = proportion_confint(k, n, alpha=alpha, method="wilson")
    return float(lo), float(hi)


def labels_for_halfwidth(p: float, halfwidth: float, z: float = Z95) -> int:
    """Fewest labels whose Wilson 95% interval at agreement rate ``p`` is at most +-halfwidth wide."""
    import numpy as np

    n = np.arange(1, 200_001, dtype=np.float64)
    hw = z / (1 + z * z / n) * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n))  # Wilson's half-width
    return int(n[np.argmax(hw <= halfwidth)]) if (hw <= halfwidth).any() else int(n[-1])


def labels_to_settle(k: int, n: int, threshold: float, cap: int = 100_000) -> int | None:
    """More labels needed until the Wilson interval clears ``threshold`` (lies entirely on one side),
    if agreement stays at its current rate k/n; None when it never would (the rate is the threshold)."""
    if n == 0:
        return None
    p = k / n

    def settled(m: int) -> bool:
        lo, hi = wilson(p * (n + m), n + m)
        return lo >= threshold or hi < threshold

    if settled(0):
        return 0
    if abs(p - threshold) < 1e-12 or not settled(cap):
        return None
    lo_m, hi_m = 0, cap  # settled() is monotone in m at a fixed rate: bisect
    while hi_m - lo_m > 1:
        mid = (lo_m + hi_m) // 2
        lo_m, hi_m = (lo_m, mid) if settled(mid) else (mid, hi_m)
    return hi_m


def agreement_stats(
    rewards: list[float],
    labels: list[float],
    scored: list[bool] | None = None,
    *,
    scale: float = 5.0,
    threshold: float = 3.0,
    weights: str = "quadratic",
    alpha: float = 0.05,
) -> AgreementStats:
    """Reward model vs reviewer on paired items. ``scored[i]``: label i is a 0..scale score (not pass/fail)."""
    import numpy as np

    r, h = np.asarray(rewards, dtype=float), np.asarray(labels, dtype=float)
    s = np.ones(len(r), bool) if scored is None else np.asarray(scored, bool)
    n, k = len(r), int(scale) + 1
    rp, hp = r >= threshold, h >= threshold
    confusion = np.zeros((2, 2), int)
    np.add.at(confusion, (rp.astype(int), hp.astype(int)), 1)
    agree = int((rp == hp).sum())
    first_pass_bin = int(np.ceil(threshold))

    def binned(x: Any) -> Any:
        # round half up, as a reviewer reads 3.5 on a 0..5 scale, but never across the success threshold:
        # a 2.5 is a fail and must not land in the first success bin (issue #14)
        b = np.clip(np.floor(x + 0.5), 0, k - 1).astype(int)
        return np.where(x >= threshold, np.maximum(b, first_pass_bin), np.minimum(b, first_pass_bin - 1))

    scores = np.zeros((k, k), int)
    np.add.at(scores, (binned(r[s]), binned(h[s])), 1)
    w1 = int((np.abs(r[s] - h[s]) <= 1 + 1e-9).sum())
    n_s = int(s.sum())
    return AgreementStats(
        n=n,
        agreement=agree / n if n else None,
        ci=wilson(agree, n, alpha),
        within1=w1 / n_s if n_s else None,
        within1_ci=wilson(w1, n_s, alpha),
        n_scored=n_s,
        kappa=kappa_from_table(confusion),
        kappa_weighted=kappa_from_table(scores, weights),
        confusion=confusion.tolist(),
        confusion_scores=scores.tolist(),
    )
