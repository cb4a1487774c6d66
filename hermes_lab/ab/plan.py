"""Sizing the simulated A/B for the gain it must detect (``ab.plan_power``): the request rate of ``ab-run``.

Stage: validate (A/B). Reads this round's ``train/eval.json`` when it exists (the held-out mean reward before
and after training: the gain to detect unless ``ab.plan_effect`` sets it; the baseline's pass rate and
partial credit per family and level); writes nothing. ``hermes_lab.ab.run`` simulates its traffic at the
planned rate, prints ``Plan.line()`` and puts the plan into ``ab_report.json`` ("plan") and MLflow
(``ab/plan_*``); the round's summary repeats the line when the plan is underpowered.

    hermes-lab ab-run --params P.yaml --baseline ... --candidate ... --plan-eval runs/round-02/train/eval.json

What is planned: the smallest request rate at which the staged rollout promotes a candidate that is
``effect`` points of reward share better with probability ``power``, capped at ``ab.plan_max_rate`` (a
simulated rollout costs generating rate x stage length responses). When the cap binds and falls short, the
plan is *underpowered* and says so instead of running silently: "needs ~N requests in stage 0 for +X points
at 95% power, the budget allows M" (N by the normal approximation below, calibrated by the simulation at
the cap). The stages' lengths stay as configured: docs/SPEC.md's "10% for 2 h" is an exposure minimum, so
the rate is what moves. Later rounds gain less, so they get more requests; a large gain gets fewer.

How the power is computed: by simulating the test the rollout uses, not a textbook formula, because the
decision is sequential (a confidence sequence read at every look, widening only from the stage's planned
end, extensions, ``min_per_arm``, SRM: ``hermes_lab.ab.stats``) and a fixed-sample z-test would misstate it.
Each stage decides on its own data only, so the rollout's power is the product of the tested stages'
chances to widen. A stage's chance is the share of ``REPS`` seeded simulated experiments in which
``ab.look_path`` + ``ab.rule_codes`` + ``ab.first_action`` (the rule of ``ab.rule``) widen, on arms built
from the eval (``plan_arms``): with ``family_level`` among ``ab.covariates``, one cell per family and level
with the baseline's pass rate and the reward share a miss scores there, a request's reward two-point (a
pass scores the scale, a miss the cell's partial credit), the cell its covariate, so the simulated rule is
the regression-adjusted one and the plan uses the variance the cells leave (the prompts' own repeats and
the history, which narrow the real CS further, are not counted: conservative). Without covariates, the
same eval as one cell; without an eval, one pass/fail cell at ``FALLBACK_SHARE``. Poisson arrivals at the
rate, the stage's candidate share, no errors and one latency (the guardrails are not what is planned for);
request units (``ab.unit: user`` counts users, whose requests are correlated: then the plan is optimistic).

The search: a normal approximation of the betting CS (half-width at n units with bets tuned at n*:
sqrt(L V / 2 n*) (n*/n + 1), L = log(2/alpha), V = the pseudo-outcome variance the cells leave,
``Arms.variance``) gives a starting rate; bisection on log rate then uses the simulation, with common random
numbers (the same seeded draws at every rate, so the simulated power is monotone in the rate). A stage whose
approximate power exceeds ``SKIP_ABOVE`` (a 30% stage once the 10% one is sized) is not simulated: its
approximation is used, and the plan says so per stage.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hermes_lab.ab import rollout as ab_rollout
from hermes_lab.ab import stats as ab
from hermes_lab.ab.traffic import plays_agent
from hermes_lab.core.reports import EvalReport

REPS = 200  # simulated experiments per stage and rate: a power of 0.8 to +-0.03 (one standard error)
SKIP_ABOVE = 0.995  # a stage this sure to widen is not worth simulating
FALLBACK_SHARE = 0.5  # no eval.json: the success share of largest Bernoulli variance (a conservative plan)
BISECT_STEPS = 6  # over a 4x bracket: the planned rate to ~5%


@dataclass
class Plan:
    """A planned simulated A/B: the rate, and what it was planned for (``stages``: one dict per tested stage)."""

    effect_points: float
    effect_source: str
    baseline_share: float
    power_target: float
    rate: float
    max_rate: float
    capped: bool
    power: float
    stages: list[dict[str, Any]]
    rule: str
    alpha: float
    reps: int
    seed: int
    seconds: float
    cells: int = 1  # the outcome model's cells the plan simulates (1: no covariate known, the plain CS)
    variance_ratio: float = 1.0  # the pseudo-outcome variance the cells leave, as a share of the plain one
    needed_rate: float | None = None  # capped: the rate the target power needs (normal approximation)
    method: str = "simulation of the rollout's own test on two-point arms per cell (hermes_lab.ab.plan)"

    @property
    def underpowered(self) -> bool:
        return self.capped and self.power < self.power_target

    def needed_requests(self) -> int | None:
        """Stage 0's requests through its planned end at the rate the target power needs (None: not capped)."""
        s = self.stages[0]
        return None if self.needed_rate is None else int(round(self.needed_rate * s["seconds"]))

    def line(self) -> str:
        s = self.stages[0]
        adj = (
            f"; {self.cells} covariate cells leave {self.variance_ratio:.0%} of the variance"
            if self.cells > 1
            else "; no covariates"
        )
        if self.underpowered:
            need = self.needed_requests()
            return (
                f"ab: UNDERPOWERED plan: needs ~{need} requests in stage {s['index']} ({s['ratio']:.0%} candidate) "
                f"for a +{self.effect_points:.1f}-point gain at {self.power_target:.0%} power, the budget "
                f"(ab.plan_max_rate {self.max_rate:g}/s) allows {s['requests']}: simulated power {self.power:.2f}"
                f"{adj} (effect from {self.effect_source}, baseline success {self.baseline_share:.0%}). "
                f"A held candidate is likely; raise ab.plan_max_rate or see round.on_held"
            )
        return (
            f"ab: planned for a +{self.effect_points:.1f}-point gain at power {self.power_target:.2f}: "
            f"{s['requests_candidate']} candidate / {s['requests_baseline']} baseline requests in stage {s['index']} "
            f"(rate {self.rate:.3g}/s over {s['seconds']:g} s; simulated power {self.power:.2f}{adj}; "
            f"effect from {self.effect_source}, baseline success {self.baseline_share:.0%})"
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def plan_metrics(plan: dict[str, Any]) -> dict[str, float]:
    """``ab/plan_*`` of a plan (``Plan.as_dict``, as ab_report.json keeps it): what was planned for, the rate,
    the power reached, the first stage's requests per arm."""
    s = plan["stages"][0]
    m = {f"plan_{k}": plan[k] for k in ("effect_points", "baseline_share", "power_target", "power", "rate")}
    m |= {"plan_capped": float(plan["capped"]), "plan_max_rate": plan["max_rate"]}
    m |= {"plan_variance_ratio": plan.get("variance_ratio", 1.0)}
    if plan.get("needed_rate"):
        m["plan_needed_rate"] = plan["needed_rate"]
    m |= {"plan_requests_candidate": s["requests_candidate"], "plan_requests_baseline": s["requests_baseline"]}
    return m | {f"plan_stage{x['index']}_power": x["power"] for x in plan["stages"]}


def effect_from_eval(path: str | Path | None, scale: float | None = None) -> tuple[float, float] | None:
    """(held-out gain in points, the starting policy's share) from train's eval.json, or None.

    With ``scale`` and the eval's mean rewards: the gain of the mean reward as a share of the scale, and
    the starting mean as the share. The rollout tests the mean reward, and partial credit makes that move
    less than the pass rate (round 1 of the embedded flywheel: +17 points of pass rate, +8 of mean reward;
    a plan on the pass rate left that A/B undecided). Bernoulli arms on {0, scale} with those means have
    the largest variance any reward on the scale can have, so the plan stays conservative."""
    if not path or not Path(path).is_file():
        return None
    try:
        ev = EvalReport.read(path)
        if ev is None:
            return None
        b, a = ev.before, ev.after or {}
        if scale and "mean_reward" in b and "mean_reward" in a:
            return 100 * (float(a["mean_reward"]) - float(b["mean_reward"])) / scale, float(b["mean_reward"]) / scale
        return float(ev.gain_points), float(b["pass_rate"])
    except (ValueError, KeyError, TypeError):
        return None


def resolve_effect(cfg: Any, eval_path: str | Path | None) -> tuple[float, float, str]:
    """(effect in points, baseline success share, where the effect came from)."""
    a = cfg.ab
    ev = effect_from_eval(eval_path, cfg.reward.scale)
    share = ev[1] if ev else FALLBACK_SHARE
    if a.plan_effect > 0:
        return a.plan_effect, share, "ab.plan_effect"
    if ev and ev[0] > 0:
        return round(ev[0], 2), share, f"the held-out gain of {Path(str(eval_path)).name}"
    why = "no held-out gain known" if ev is None else f"held-out gain {ev[0]:+.1f} not positive"
    return a.plan_fallback_effect, share, f"ab.plan_fallback_effect ({why})"


@dataclass(frozen=True)
class Arms:
    """The simulated arms, per covariate cell: its share of the traffic, the baseline's and the candidate's
    pass rates, and the reward share a miss scores (partial credit). A reward is then two-point per cell:
    1 on a pass, ``miss`` otherwise, with the cell's pass rate and mean reward. One cell: no covariate."""

    weight: np.ndarray
    pass_b: np.ndarray
    pass_c: np.ndarray
    miss: np.ndarray

    @property
    def cells(self) -> int:
        return len(self.weight)

    @property
    def share_b(self) -> float:
        """The baseline's mean reward share."""
        return float(np.dot(self.weight, self.pass_b + (1 - self.pass_b) * self.miss))

    def variance(self, ratio: float, adjusted: bool) -> float:
        """Var of the pseudo-outcome: with the cells' means known (adjusted: what the covariates leave) or not."""
        w, m = self.weight, self.miss
        mean_c, mean_b = self.pass_c + (1 - self.pass_c) * m, self.pass_b + (1 - self.pass_b) * m
        var_c, var_b = self.pass_c * (1 - self.pass_c) * (1 - m) ** 2, self.pass_b * (1 - self.pass_b) * (1 - m) ** 2
        if adjusted:
            tau = mean_c - mean_b
            return float(np.dot(w, var_c) / ratio + np.dot(w, var_b) / (1 - ratio) + np.dot(w, (tau - w @ tau) ** 2))
        tot_c = np.dot(w, var_c + mean_c**2) - np.dot(w, mean_c) ** 2
        tot_b = np.dot(w, var_b + mean_b**2) - np.dot(w, mean_b) ** 2
        return float(tot_c / ratio + tot_b / (1 - ratio))


def plan_arms(cfg: Any, eval_path: str | Path | None, share: float, delta: float) -> Arms:
    """The arms the plan simulates, from train's eval.json (the baseline, "before", on the held-out mix the
    A/B draws from). With ``family_level`` among ``ab.covariates``: one cell per family and level, weighted
    as the eval's tasks are (the traffic's round-robin mix), with its pass rate and the share a miss scores.
    Without: the same eval as one cell. No eval: one pass/fail cell at ``share`` (``FALLBACK_SHARE``). The
    candidate gains ``delta`` of reward share overall, spread over the cells in proportion to what they miss
    (a better policy fixes failures; a cell at 100% cannot gain)."""
    cells = _eval_cells(eval_path, cfg.reward.scale, agent=plays_agent(cfg))
    if cells is None:
        w, pb, miss = np.ones(1), np.array([min(share, 1 - delta)]), np.zeros(1)
    elif "family_level" not in cfg.ab.covariates or len(cells[0]) < 2:
        w0, p0, m0 = cells
        P, mean = float(w0 @ p0), float(w0 @ (p0 + (1 - p0) * m0))
        w, pb, miss = np.ones(1), np.array([P]), np.array([(mean - P) / (1 - P) if P < 1 else 0.0])
    else:
        w, pb, miss = cells
    mean = pb + (1 - pb) * miss
    room = 1 - mean
    gain = delta * room / max(float(np.dot(w, room)), 1e-9)  # reward share per cell, averaging to delta
    pc = np.minimum(pb + gain / np.maximum(1 - miss, 1e-9), 1.0)
    return Arms(w, pb, pc, miss)


def _eval_cells(
    path: str | Path | None, scale: float, agent: bool = False
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(weights, pass rates, miss shares) per level of eval.json's "before" (its overall numbers as one
    level when it has none), or None. ``agent``: the traffic has the agent family's episodes (one family's
    share, ``ab.traffic.Traffic.simulate``), one more cell from eval.json's ``agent`` "before"."""
    if not path or not Path(path).is_file():
        return None
    try:
        ev = EvalReport.read(path)
        if ev is None:
            return None
        before = ev.before
        levels = before.get("per_level") or {"all": before}
        rows = [(float(v["n"]), float(v["pass_rate"]), float(v["mean_reward"]) / scale) for v in levels.values()]
        if agent and rows and isinstance(ev.agent, dict):
            ag = ev.agent["before"]
            families = len({k.split(":")[0] for k in levels})
            total = sum(n for n, _, _ in rows)
            rows.append((total / families, float(ag["episode_success"]), float(ag["mean_reward"]) / scale))
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    if not rows:
        return None
    n, pr, mr = (np.array(x) for x in zip(*rows))
    miss = np.clip(np.where(pr < 1, (mr - pr) / np.maximum(1 - pr, 1e-9), 0.0), 0.0, 1.0)
    return n / n.sum(), pr, miss


def approx_power(stage: ab.Stage, rate: float, arms: Arms, delta: float, alpha: float, min_per_arm: int = 0) -> float:
    """The normal approximation of a stage's chance to widen, read at its hard end (the last look), with the
    variance the covariate cells leave (all of it with one cell), times the chance that both arms' Poisson counts
    reach ``min_per_arm`` by then (the rule decides nothing before: a large gain at a low rate is no decision)."""
    from scipy.stats import norm, poisson

    v = arms.variance(stage.ratio, adjusted=arms.cells > 1)
    n = rate * stage.seconds * (1 + stage.max_extension)
    n_star = max(stage.tune_n, 2.0)
    half = math.sqrt(math.log(2 / alpha) * v / (2 * n_star)) * (n_star / n + 1)
    enough = poisson.sf(min_per_arm - 1, n * stage.ratio) * poisson.sf(min_per_arm - 1, n * (1 - stage.ratio))
    return float(norm.cdf((delta - half) * math.sqrt(n / v)) * enough)


def stage_power(stage: ab.Stage, st: ab.Settings, rate: float, arms: Arms, reps: int = REPS, seed: int = 0) -> float:
    """The share of ``reps`` simulated experiments in which the stage widens (the rollout's own decision;
    with several cells, on the regression-adjusted CS, the cell as the covariate it learns from)."""
    hard = stage.hard_end - stage.start
    lam = rate * hard
    n = int(lam + 6 * math.sqrt(lam) + 10)
    # shape (n, reps), filled row by row: the first k arrivals of every experiment are the same draws at any
    # rate (common random numbers), only their times scale with 1 / rate
    gens = [np.random.default_rng([seed, stage.index, k]) for k in range(4)]
    t = (np.cumsum(gens[0].standard_exponential((n, reps)), axis=0) / rate).T
    cand = (gens[1].random((n, reps)) < stage.ratio).T
    cell = np.minimum(np.searchsorted(np.cumsum(arms.weight), gens[3].random((n, reps)).T), arms.cells - 1)
    success = gens[2].random((n, reps)).T < np.where(cand, arms.pass_c[cell], arms.pass_b[cell])
    keep = t <= hard
    cols = {
        "t": stage.start + t[keep],
        "arm": cand[keep].astype(np.int8),
        "reward": np.where(success[keep], 1.0, arms.miss[cell[keep]]) * st.scale,
        "error": np.zeros(int(keep.sum()), bool),
        "latency_ms": np.full(int(keep.sum()), 100.0),
    }
    if arms.cells > 1:
        cols["cell"] = cell[keep]
    group = np.repeat(np.arange(reps), keep.sum(1))
    looks = stage.look_times()
    S = ab.look_path(cols, looks, stage.ratio, stage.tune_n, st, group, reps)
    code, _ = ab.first_action(ab.rule_codes(S, st)[st.rule], looks, stage.planned_end)
    return float(np.mean(code == ab.WIDEN))


def plan_rate(
    cfg: Any,
    stage_list: list[list[float]],
    st: ab.Settings,
    eval_path: str | Path | None = None,
    reps: int = REPS,
    seed: int = 0,
) -> Plan:
    """The rate for ``ab.plan_power`` (see the module docstring), capped at ``ab.plan_max_rate``."""
    t0 = time.time()
    a = cfg.ab
    effect, share, source = resolve_effect(cfg, eval_path)
    delta = effect / 100
    arms = plan_arms(cfg, eval_path, share, delta)
    target = a.plan_power
    cache: dict[float, list[tuple[float, str]]] = {}

    def stages_at(rate: float) -> list[ab.Stage]:
        planned = ab.plan_stages(stage_list, rate, a.look_every, a.max_extension)
        return [ab_rollout.start_stage(s, 0.0) for s in planned]

    def per_stage(rate: float) -> list[tuple[float, str]]:
        if rate not in cache:
            out = []
            for s in stages_at(rate):
                ap = approx_power(s, rate, arms, delta, st.alpha, st.min_per_arm)
                if ap > SKIP_ABOVE:
                    out.append((ap, "approximation"))
                else:
                    out.append((stage_power(s, st, rate, arms, reps, seed), "simulated"))
            cache[rate] = out
        return cache[rate]

    def power(rate: float) -> float:
        return float(np.prod([p for p, _ in per_stage(rate)]))

    def approx(rate: float) -> float:
        return float(np.prod([approx_power(s, rate, arms, delta, st.alpha, st.min_per_arm) for s in stages_at(rate)]))

    def approx_rate(power_wanted: float) -> float:  # a geometric bisection, no simulation
        lo, hi = 1e-4, 1e4
        for _ in range(60):
            mid = math.sqrt(lo * hi)
            lo, hi = (lo, mid) if approx(mid) >= power_wanted else (mid, hi)
        return hi

    hi = approx_rate(target)
    lo, hi = min(hi / 2, a.plan_max_rate), min(hi * 2, a.plan_max_rate)
    capped = False
    if power(hi) < target:  # widen the bracket up to the cap
        while hi < a.plan_max_rate and power(hi) < target:
            lo, hi = hi, min(hi * 2, a.plan_max_rate)
        capped = power(hi) < target
    if not capped:
        while lo > 1e-4 and power(lo) >= target:  # the approximation was pessimistic
            lo, hi = lo / 2, lo
        for _ in range(BISECT_STEPS):
            mid = math.sqrt(lo * hi)
            lo, hi = (lo, mid) if power(mid) >= target else (mid, hi)
    rate = hi
    stages = []
    for s, (p, how) in zip(stages_at(rate), per_stage(rate)):
        n = rate * s.seconds
        stages.append(
            {
                "index": s.index,
                "ratio": s.ratio,
                "seconds": s.seconds,
                "requests": int(round(n)),
                "requests_candidate": int(round(n * s.ratio)),
                "requests_baseline": int(round(n * (1 - s.ratio))),
                "requests_with_extension": int(round(n * (1 + s.max_extension))),
                "power": round(p, 4),
                "power_by": how,
            }
        )
    ratio0 = stages_at(rate)[0].ratio if stages else 0.5
    return Plan(
        effect_points=round(effect, 2),
        effect_source=source,
        baseline_share=round(arms.share_b, 4),
        power_target=target,
        rate=rate,
        max_rate=a.plan_max_rate,
        capped=capped,
        power=round(power(rate), 4),
        stages=stages,
        rule=st.rule,
        alpha=st.alpha,
        reps=reps,
        seed=seed,
        seconds=round(time.time() - t0, 2),
        cells=arms.cells,
        variance_ratio=round(arms.variance(ratio0, True) / arms.variance(ratio0, False), 4) if arms.cells > 1 else 1.0,
        needed_rate=_needed_rate(approx_rate, target, power(rate), rate) if capped else None,
    )


def _needed_rate(approx_rate: Any, target: float, power_at_cap: float, cap: float) -> float:
    """The rate the target power needs, when the cap falls short: the approximation's, calibrated by the
    simulation at the cap (the approximation's rate for the power simulated there, scaled to the cap)."""
    if power_at_cap <= 0.0:
        return round(float(approx_rate(target)) * 4, 4)  # nothing to calibrate on: the approximation, padded
    scale = cap / approx_rate(min(power_at_cap, 0.999))
    return round(max(float(approx_rate(target)) * scale, cap), 4)
