"""Sizing the simulated A/B for the gain it must detect (``ab.plan_power``): the request rate of ``ab-run``.

Stage: validate (A/B). Reads this round's ``train/eval.json`` when ``ab.plan_effect`` is 0 (the held-out
pass rate before and after training: the gain to detect, and the baseline's success share); writes nothing.
``hermes_lab.ab.run`` simulates its traffic at the planned rate, prints ``Plan.line()`` and puts the plan
into ``ab_report.json`` ("plan") and MLflow (``ab/plan_*``).

    hermes-lab ab-run --params P.yaml --baseline ... --candidate ... --plan-eval runs/round-02/train/eval.json

What is planned: the smallest request rate at which the staged rollout promotes a candidate that is
``effect`` points of success share better than a baseline at ``baseline_share`` with probability ``power``,
capped at ``ab.plan_max_rate`` (a simulated rollout costs generating rate x stage length responses; when the
cap binds, the plan says which power the cap reaches). The stages' lengths stay as configured: docs/SPEC.md's
"10% for 2 h" is an exposure minimum, so the rate is what moves. Later rounds gain less, so they get more
requests; a large gain gets fewer (a cheaper round).

How the power is computed: by simulating the test the rollout uses, not a textbook formula, because the
decision is sequential (a confidence sequence read at every look, widening only from the stage's planned
end, extensions, ``min_per_arm``, SRM: ``hermes_lab.ab.stats``) and a fixed-sample z-test would misstate it. Each
stage decides on its own data only, so the rollout's power is the product of the tested stages' chances to
widen. A stage's chance is the share of ``REPS`` seeded simulated experiments in which ``ab.look_path`` +
``ab.rule_codes`` + ``ab.first_action`` (the rule of ``ab.rule``) widen, on Bernoulli arms: Poisson
arrivals at the rate, the stage's candidate share, reward = scale on a success and 0 otherwise (the success
share is then the reward's mean), no errors and one latency (the guardrails are not what is planned for).
Rewards with partial credit move their mean by less than the success share but vary less too: the plan is
exact for pass/fail rewards and approximate otherwise; with request units (``ab.unit: user`` counts users,
whose requests are correlated: then the plan is optimistic).

The search: a normal approximation of the betting CS (half-width at n units with bets tuned at n*:
sqrt(L V / 2 n*) (n*/n + 1), L = log(2/alpha), V = the pseudo-outcome variance p_c(1-p_c)/r + p_b(1-p_b)/(1-r))
gives a starting rate; bisection on log rate then uses the simulation, with common random numbers (the same
seeded draws at every rate, so the simulated power is monotone in the rate). A stage whose approximate power
exceeds ``SKIP_ABOVE`` (a 30% stage once the 10% one is sized) is not simulated: its approximation is used,
and the plan says so per stage.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hermes_lab.ab import rollout as ab_rollout
from hermes_lab.ab import stats as ab

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
    method: str = "simulation of the rollout's own test on Bernoulli arms (hermes_lab.ab.plan)"

    def line(self) -> str:
        s = self.stages[0]
        cap = f"; capped by ab.plan_max_rate {self.max_rate:g}/s" if self.capped else ""
        return (
            f"ab: planned for a +{self.effect_points:.1f}-point gain at power {self.power_target:.2f}: "
            f"{s['requests_candidate']} candidate / {s['requests_baseline']} baseline requests in stage {s['index']} "
            f"(rate {self.rate:.3g}/s over {s['seconds']:g} s; simulated power {self.power:.2f}{cap}; "
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
        ev = json.loads(Path(path).read_text(encoding="utf-8"))
        b, a = ev["before"], ev.get("after") or {}
        if scale and "mean_reward" in b and "mean_reward" in a:
            return 100 * (float(a["mean_reward"]) - float(b["mean_reward"])) / scale, float(b["mean_reward"]) / scale
        return float(ev["gain_points"]), float(b["pass_rate"])
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


def approx_power(stage: ab.Stage, rate: float, p_b: float, delta: float, alpha: float) -> float:
    """The normal approximation of a stage's chance to widen, read at its hard end (the last look)."""
    from scipy.stats import norm

    p_c = p_b + delta
    v = p_c * (1 - p_c) / stage.ratio + p_b * (1 - p_b) / (1 - stage.ratio)
    n = rate * stage.seconds * (1 + stage.max_extension)
    n_star = max(stage.tune_n, 2.0)
    half = math.sqrt(math.log(2 / alpha) * v / (2 * n_star)) * (n_star / n + 1)
    return float(norm.cdf((delta - half) * math.sqrt(n / v)))


def stage_power(
    stage: ab.Stage, st: ab.Settings, rate: float, p_b: float, delta: float, reps: int = REPS, seed: int = 0
) -> float:
    """The share of ``reps`` simulated experiments in which the stage widens (the rollout's own decision)."""
    hard = stage.hard_end - stage.start
    lam = rate * hard
    n = int(lam + 6 * math.sqrt(lam) + 10)
    # shape (n, reps), filled row by row: the first k arrivals of every experiment are the same draws at any
    # rate (common random numbers), only their times scale with 1 / rate
    gens = [np.random.default_rng([seed, stage.index, k]) for k in range(3)]
    t = (np.cumsum(gens[0].standard_exponential((n, reps)), axis=0) / rate).T
    cand = (gens[1].random((n, reps)) < stage.ratio).T
    success = gens[2].random((n, reps)).T < np.where(cand, p_b + delta, p_b)
    keep = t <= hard
    cols = {
        "t": stage.start + t[keep],
        "arm": cand[keep].astype(np.int8),
        "reward": np.where(success[keep], st.scale, 0.0),
        "error": np.zeros(int(keep.sum()), bool),
        "latency_ms": np.full(int(keep.sum()), 100.0),
    }
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
    p_b = min(share, 1 - delta)  # the candidate's success share stays a probability
    target = a.plan_power
    cache: dict[float, list[tuple[float, str]]] = {}

    def stages_at(rate: float) -> list[ab.Stage]:
        planned = ab.plan_stages(stage_list, rate, a.look_every, a.max_extension)
        return [ab_rollout.start_stage(s, 0.0) for s in planned]

    def per_stage(rate: float) -> list[tuple[float, str]]:
        if rate not in cache:
            out = []
            for s in stages_at(rate):
                ap = approx_power(s, rate, p_b, delta, st.alpha)
                if ap > SKIP_ABOVE:
                    out.append((ap, "approximation"))
                else:
                    out.append((stage_power(s, st, rate, p_b, delta, reps, seed), "simulated"))
            cache[rate] = out
        return cache[rate]

    def power(rate: float) -> float:
        return float(np.prod([p for p, _ in per_stage(rate)]))

    def approx(rate: float) -> float:
        return float(np.prod([approx_power(s, rate, p_b, delta, st.alpha) for s in stages_at(rate)]))

    lo, hi = 1e-4, 1e4  # the approximation's rate: a geometric bisection, no simulation
    for _ in range(60):
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if approx(mid) >= target else (mid, hi)
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
    return Plan(
        effect_points=round(effect, 2),
        effect_source=source,
        baseline_share=round(p_b, 4),
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
    )
