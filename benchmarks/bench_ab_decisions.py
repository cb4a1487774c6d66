"""Benchmark: decision quality of the staged rollout under realistic traffic, the user's rule vs ours.

Stage: validate (A/B). Reads and writes nothing under runs/. Simulates complete rollouts of each
scenario's plan (default 10% for 2 h -> 30% for 4 h -> 100%, a look every 15 min, an inconclusive stage
extended once) through the project's own decision path:
- units get their arm from the md5 router (``ab.buckets``, the SPEC's formula; a salt per simulated
  rollout, the same across its stages, so ramps are monotone): request ids, or user ids;
- each stage's looks go through ``ab.look_path`` / ``ab.rule_codes`` / ``ab.first_action``, the code the
  runner's ``ab_analysis.stage_action`` calls at every look (tests/ab/test_ab.py checks that calling it look by look
  gives the same decision); the next stage runs only where a stage widened;
- the rollout's outcome is ``ab_analysis.rollout_decision`` ("promote" only at 100%).

Scenarios (each with an identical candidate, A/A, and a stated effect):
- benchmark: i.i.d. requests at 0.25/s, 45% pass (a pass scores 5, a miss partial credit < 3, 3% empty
  answers score 0 and count as errors); effect +12 points of pass rate (and the same harm);
- heavy users: ``ab.unit: user``, Zipf-distributed requests over 2000 users whose pass rates differ;
- rare successes: 3% pass, scores 0 or 5 only; effect +6 points;
- small arm: 5% then 30% at 0.1 requests/s (~36 candidate requests by the first stage's planned end);
- rare + small: 3% pass, 0/5 scores, 0.1 requests/s at 10%;
- latency only: rewards identical, candidate latency x2 (a p95 ratio of ~2): the guardrail must roll back;
- embedded mix: the embedded suite's 17 family:level cells of a late round (``EMBEDDED``: measured shares,
  partial credit, prompt pools and spreads; pass rates moved to a ~82% champion), +3 points of pass rate, at
  the rate ``make flywheel`` plans within (params/embedded.yaml's ``ab.plan_max_rate``). ``--eval`` takes
  the cells' pass rates and partial credit from a real round's train/eval.json instead (its "before": e.g.
  ``runs/round-04/train/eval.json`` after ``make flywheel``);
- skewed mix: 70% easy requests (97% pass), 30% hard (45%), +3 points at the same rate.
The two mixes run the sequential rule twice on the same simulated requests: plain (no covariates) and
regression-adjusted (``hermes_lab.ab.adjust``: each request's cell, its prompt and their history as
``hermes_lab.ab.covariates`` gives them); "variance left" is the adjusted pseudo-outcomes' variance as a
share of the plain ones' in the first stage. A third row, "adjusted, held continued", is what the embedded
flywheel does with a stage that reaches its hard end undecided (``round.on_held: continue``): the next round
carries the same sequence on for another stage length, once per experiment (its power spends two rounds'
A/B budget on one candidate; its A/A row shows the continuation keeps the guarantee).

Printed per scenario and rule: A/A false widen (passed the first stage), false promotion (100%), false
roll back, false hold, their total (wrong actions), and the power on the stated effect (promoted to 100%;
for harm and latency: rolled back). Goal (ours): <= 5% wrong actions on A/A in every scenario and >= 80%
power on the benchmark's stated lift; with the adjustment, >= 80% power at +3 points on the embedded mix.
Monte Carlo s.e. at 5%: ~1% with the default 500 rollouts, ~0.7% with
1000 (about 5 and 10 minutes on 2 loaded cores; a third of it is md5 routing).

    .venv/bin/python benchmarks/bench_ab_decisions.py [--reps 1000] [--only benchmark,"heavy users"] \
        [--eval runs/round-04/train/eval.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import yaml

from hermes_lab.ab import analysis as ab_analysis
from hermes_lab.ab import stats as ab

LOOK, EXT, MISS_ERR, USERS = 900.0, 1.0, 0.03, 2000
PLAN = [[0.1, 7200], [0.3, 14400], [1.0, 0]]
RULES = {"user": "user rule, every look", "user_end": "user rule, stage end", "sequential": "ours (sequential)"}
MIX_RULES = {
    "sequential_plain": "ours, plain",
    "sequential": "ours, adjusted",
    "sequential_held": "adjusted, held continued",  # round.on_held: continue, once: the next round's budget too
}
# params/embedded.yaml's ab.plan_max_rate: the budget `make flywheel` plans within (read, not copied: --rate
# tries another)
FLYWHEEL_RATE = float(
    yaml.safe_load((Path(__file__).resolve().parents[1] / "params" / "embedded.yaml").read_text())["ab"][
        "plan_max_rate"
    ]
)
REPEATED = 3000  # a cell with at most this many held-out prompts repeats them within a stage at that rate
EXEC_LOG = 1080  # samples in a round's execution log (the baseline's; `make round` logs ~1081): the cells' history


@dataclass(frozen=True)
class Cell:
    """One family:level of the embedded task mix: its share of the traffic, the baseline's pass rate, the
    reward share a miss scores on average (partial credit), how many distinct held-out prompts it has (a
    small number repeats within a stage), and the spread of pass rates between its prompts (sd)."""

    name: str
    weight: float
    p: float
    miss: float
    prompts: int
    sd: float


# The embedded task mix of a late round, where the gains are a few points (the rounds 4-5: a champion at
# ~82%). Measured, not guessed, where it can be: every family:level of the suite with its traffic share
# (tasks.suite's round-robin), the reward share a miss scores (partial credit) and the between-prompt spread
# (sd: from the paired samples, two per prompt, of a real round's held-out eval: `make round`'s train/eval.json,
# round 1's candidate at 53.9%), and each cell's pool of held-out prompts (distinct prompts among 32400 drawn by
# ab-run's traffic: tool and small sums repeat, words do not; large pools by capture-recapture). Only the pass
# rates are moved: the measured ones (right-hand comment), shifted on the logit scale by one constant to the
# late round's 81.7%, keeping their order and spread; a late champion's cells differ at least this much. The code
# family came with policy v10: its three cells are measured the same way on v10's round 1 and take the same
# shift; the shares are the six families' round-robin (tool's two levels 1/12 each, the others' 1/18); the mix
# is then at 83.2%.
EMBEDDED = (
    Cell("add:1", 1 / 18, 0.713, 0.204, 18, 0.000),  # measured 0.381
    Cell("add:2", 1 / 18, 0.771, 0.277, 110, 0.234),  # measured 0.455
    Cell("add:3", 1 / 18, 0.711, 0.243, 220, 0.248),  # measured 0.379
    Cell("reverse:1", 1 / 18, 0.837, 0.375, 2609, 0.000),  # measured 0.560
    Cell("reverse:2", 1 / 18, 0.885, 0.394, 69969, 0.000),  # measured 0.657
    Cell("reverse:3", 1 / 18, 0.846, 0.410, 10**6, 0.000),  # measured 0.576
    Cell("sort:1", 1 / 18, 0.806, 0.359, 149, 0.163),  # measured 0.507
    Cell("sort:2", 1 / 18, 0.853, 0.396, 1520, 0.000),  # measured 0.590
    Cell("sort:3", 1 / 18, 0.833, 0.397, 14823, 0.000),  # measured 0.553
    Cell("tool:1", 1 / 12, 0.737, 0.442, 7, 0.206),  # measured 0.410
    Cell("tool:2", 1 / 12, 0.927, 0.476, 3, 0.037),  # measured 0.760
    Cell("upper:1", 1 / 18, 0.860, 0.368, 2560, 0.060),  # measured 0.605
    Cell("upper:2", 1 / 18, 0.841, 0.387, 67890, 0.073),  # measured 0.567
    Cell("upper:3", 1 / 18, 0.801, 0.415, 10**6, 0.000),  # measured 0.500
    # the code family (policy v10, since): measured on v10's round-1 candidate (55.4% held-out then), same shift
    Cell("code:1", 1 / 18, 0.895, 0.000, 4, 0.215),  # measured 0.679
    Cell("code:2", 1 / 18, 0.905, 0.012, 260, 0.000),  # measured 0.702
    Cell("code:3", 1 / 18, 0.915, 0.014, 3900, 0.037),  # measured 0.727
)
# A skewed-difficulty mix: most traffic easy, a hard minority (live traffic's long tail of hard prompts).
SKEWED = (
    Cell("easy", 0.7, 0.97, 0.30, 10**6, 0.05),
    Cell("hard", 0.3, 0.45, 0.30, 10**6, 0.15),
)


@dataclass
class Scenario:
    name: str
    p_base: float = 0.45
    rate: float = 0.25
    plan: list = field(default_factory=lambda: PLAN)
    unit: str = "request"
    binary: bool = False  # scores 0/5 only (no partial credit, no errors)
    effect: str = "lift"  # lift | latency
    size: float = 0.12  # the stated effect: points of pass rate (lift) or latency factor
    harm: bool = False  # also simulate the same harm
    mix: tuple[Cell, ...] = ()  # a task mix with covariates: the adjusted rule beside the plain one


SCENARIOS = [
    Scenario("benchmark", harm=True),
    Scenario("heavy users", unit="user"),
    Scenario("rare successes", p_base=0.03, binary=True, size=0.06),
    Scenario("small arm", rate=0.1, plan=[[0.05, 7200], [0.3, 14400], [1.0, 0]]),
    Scenario("rare + small", p_base=0.03, binary=True, size=0.06, rate=0.1),
    Scenario("latency only", effect="latency", size=2.0),
    Scenario("embedded mix", rate=FLYWHEEL_RATE, size=0.03, mix=EMBEDDED),
    Scenario("skewed mix", rate=FLYWHEEL_RATE, size=0.03, mix=SKEWED),
]


def cells_from_eval(path: str) -> tuple[Cell, ...]:
    """The embedded mix with a real round's cells: each family:level's share, pass rate and partial credit
    from eval.json's "before" (the round's baseline); the prompt pools from ``EMBEDDED``, and the spread
    between prompts as the same share of the pass/fail variance as there."""
    before = json.loads(Path(path).read_text(encoding="utf-8"))["before"]
    known = {c.name: c for c in EMBEDDED}
    levels = before.get("per_level") or {}
    unknown = sorted(set(levels) - set(known))
    if not levels or unknown:
        raise SystemExit(f"{path}: 'before' needs per_level with the embedded cells ({unknown or 'none'})")
    total = sum(float(v["n"]) for v in levels.values())
    out = []
    for name, v in sorted(levels.items()):
        c, p = known[name], min(max(float(v["pass_rate"]), 0.005), 0.995)
        miss = min(max((float(v["mean_reward"]) / 5 - p) / (1 - p), 0.0), 1.0)
        sd = c.sd * math.sqrt(p * (1 - p) / (c.p * (1 - c.p)))
        out.append(dataclasses.replace(c, weight=float(v["n"]) / total, p=p, miss=miss, sd=sd))
    return tuple(out)


class Router:
    """md5 buckets of user ids and of each stage's request ids, one salt per simulated rollout; hashed once
    and reused by every scenario (the arms are then shared, the outcomes are not)."""

    def __init__(self, reps: int):
        self.reps, self.req = reps, {}
        t0 = time.perf_counter()
        self.users = np.stack([ab.buckets([f"user-{k}" for k in range(USERS)], f"rollout-{r}") for r in range(reps)])
        self.seconds = time.perf_counter() - t0

    def requests(self, stage: int, n: int) -> np.ndarray:
        have = self.req.get(stage, np.zeros((self.reps, 0)))
        if have.shape[1] < n:  # request ids s<stage>-<i>, unique across the rollout's stages
            t0 = time.perf_counter()
            ids = [f"req-s{stage}-{i:08d}" for i in range(have.shape[1], n)]
            more = np.stack([ab.buckets(ids, f"rollout-{r}") for r in range(self.reps)])
            self.req[stage] = have = np.concatenate([have, more], axis=1)
            self.seconds += time.perf_counter() - t0
        return have[:, :n]


def simulate_stage(
    sc: Scenario, stage: ab.Stage, cand: str, router: Router, rng: np.random.Generator, st: ab.Settings
) -> dict[str, np.ndarray]:
    """Every rollout's decision code in one stage, per rule; ``cand``: same | better | worse."""
    reps = router.reps
    counts = rng.poisson(sc.rate * stage.seconds * (1 + stage.max_extension), reps)
    n_max = int(counts.max())
    keep = np.arange(n_max)[None, :] < counts[:, None]
    t = stage.start + np.sort(rng.uniform(0, stage.hard_end - stage.start, (reps, n_max)), axis=1)
    g = np.broadcast_to(np.arange(reps)[:, None], (reps, n_max))
    p_user = None
    if sc.unit == "user":
        w = 1 / np.arange(1, USERS + 1) ** 0.8
        unit = rng.choice(USERS, (reps, n_max), p=w / w.sum())
        arm = (np.take_along_axis(router.users, unit, 1) < stage.ratio).astype(np.int8)
        p_user = np.take_along_axis(rng.beta(2.25 * 2, 2.75 * 2, (reps, USERS)), unit, 1)  # mean 45%
    else:
        unit = None
        arm = (router.requests(stage.index, n_max) < stage.ratio).astype(np.int8)
    p = np.full((reps, n_max), sc.p_base) if p_user is None else p_user
    lift = {"better": sc.size, "worse": -sc.size}.get(cand, 0.0) if sc.effect == "lift" else 0.0
    p = np.clip(np.where(arm == 1, p + lift, p), 0, 1)
    passed = rng.random((reps, n_max)) < p
    if sc.binary:
        reward, error = np.where(passed, 5.0, 0.0), np.zeros((reps, n_max), bool)
    else:
        reward = np.where(passed, 5.0, np.round(2.5 * rng.beta(2, 2, (reps, n_max)), 4))
        error = ~passed & (rng.random((reps, n_max)) < MISS_ERR / (1 - sc.p_base))
        reward[error] = 0.0
    lat = np.exp(rng.normal(np.log(120), 0.35, (reps, n_max))) + 4.0 * np.where(error, 0, 5)
    if sc.effect == "latency" and cand == "slower":
        lat = np.where(arm == 1, lat * sc.size, lat)
    cols = {
        "t": t[keep],
        "arm": arm[keep],
        "reward": reward[keep],
        "error": error[keep],
        "latency_ms": lat[keep],
    }
    if unit is not None:
        cols["unit"] = unit[keep]
    looks = stage.look_times()
    S = ab.look_path(cols, looks, stage.ratio, stage.tune_n, st, g[keep], reps)
    C = ab.rule_codes(S, st)
    out = {rule: ab.first_action(C[rule], looks, stage.planned_end)[0] for rule in ("sequential", "user")}
    end = int(np.searchsorted(looks, stage.planned_end))  # the user's table read once, at the planned end
    out["user_end"] = C["user"][:, end]
    return out


def _mix_traffic(sc: Scenario, n: tuple[int, int], cand_arm: np.ndarray, lift: float, rng: np.random.Generator):
    """Rewards and covariates of requests from the task mix: each request's cell, its prompt (drawn from the
    cell's held-out prompts: a repeated prompt keeps its pass rate within a rollout), a pass with the
    prompt's rate (+ the candidate's lift, spread over the cells in proportion to what they miss), partial
    credit on a miss; and the history a round has: the cell's share in the baseline's execution log
    (``EXEC_LOG`` samples) and, for repeated prompts, their share in the previous round's A/B log (a champion 7 points
    worse), as ``hermes_lab.ab.covariates`` gives them."""
    reps, m = n
    cells = sc.mix
    w = np.array([c.weight for c in cells])
    w = w / w.sum()
    p = np.array([c.p for c in cells])
    miss = np.array([c.miss for c in cells])
    share = p + (1 - p) * miss
    cell = rng.choice(len(cells), (reps, m), p=w)
    q = np.empty((reps, m))
    task = np.full((reps, m), -1, np.int64)
    hist_task_dev, hist_task_n = np.zeros((reps, m)), np.zeros((reps, m))
    prev_gain = 0.07 * (1 - p) / float(w @ (1 - p))
    offset = 0
    for c, cl in enumerate(cells):
        sel = cell == c
        if cl.prompts <= REPEATED:  # a prompt that recurs: its own pass rate, learnable, with a history
            k = rng.integers(0, cl.prompts, int(sel.sum()))
            dev = rng.normal(0, cl.sd, (reps, cl.prompts))
            rows = np.nonzero(sel)[0]
            q[sel] = np.clip(cl.p + dev[rows, k], 0.005, 0.995)
            task[sel] = offset + k
            offset += cl.prompts
            repeats = max(1, int(round(FLYWHEEL_RATE * 21600 * w[c] / cl.prompts)))  # a round's A/B per prompt
            q_prev = np.clip(q[sel] - prev_gain[c], 0.0, 1.0)
            prev = rng.binomial(repeats, q_prev) / repeats
            prev_share = prev + (1 - prev) * cl.miss
            hist_task_dev[sel] = prev_share - (np.clip(cl.p - prev_gain[c], 0, 1) * (1 - cl.miss) + cl.miss)
            hist_task_n[sel] = repeats
        else:  # words: a prompt seen once, its own rate unknowable in advance
            q[sel] = np.clip(cl.p + rng.normal(0, cl.sd, int(sel.sum())), 0.005, 0.995)
    gain = lift * (1 - p) / float(w @ (1 - p))
    q = np.clip(q + cand_arm * gain[cell], 0, 1)
    passed = rng.random((reps, m)) < q
    partial = np.clip(miss[cell] + rng.normal(0, 0.08, (reps, m)), 0.0, 0.5)
    reward = np.where(passed, 5.0, np.round(5 * partial, 4))
    n_log = EXEC_LOG * w  # the execution log's samples per cell: its estimate of the cell's mean reward share
    est = share + rng.normal(0, 1, (reps, len(cells))) * np.sqrt(share * (1 - share) / n_log)  # per rollout
    cov = {
        "cell": cell,
        "task": task,
        "hist_cell_dev": np.take_along_axis(est - (est @ w)[:, None], cell, 1),
        "hist_cell_n": n_log[cell],
        "hist_task_dev": hist_task_dev,
        "hist_task_n": hist_task_n,
    }
    return reward, cov


def simulate_mix(
    sc: Scenario, stage: ab.Stage, cand: str, router: Router, rng: np.random.Generator, st: ab.Settings
) -> dict[str, np.ndarray]:
    """A stage of a task-mix scenario: every rollout's decision code per rule, the adjusted sequential rule
    and the plain one deciding on the same simulated requests. The stage is simulated as a held one continued
    (``round.on_held: continue``: another stage length with extension on the same sequence, ``Stage.continued``):
    the rules decide on the looks up to the stage's own hard end, "sequential_held" on all of them (a
    confidence sequence at a look depends on the requests before it only, so the first part is the stage)."""
    reps = router.reps
    longer = dataclasses.replace(stage, continued=stage.seconds * (1 + stage.max_extension))
    span = longer.hard_end - stage.start
    counts = rng.poisson(sc.rate * span, reps)
    n_max = int(counts.max())
    keep = np.arange(n_max)[None, :] < counts[:, None]
    t = stage.start + np.sort(rng.uniform(0, span, (reps, n_max)), axis=1)
    g = np.broadcast_to(np.arange(reps)[:, None], (reps, n_max))
    arm = (router.requests(stage.index, n_max) < stage.ratio).astype(np.int8)
    lift = {"better": sc.size, "worse": -sc.size}.get(cand, 0.0)
    reward, cov = _mix_traffic(sc, (reps, n_max), arm, lift, rng)
    cols = {
        "t": t[keep],
        "arm": arm[keep],
        "reward": reward[keep],
        "error": np.zeros(int(keep.sum()), bool),
        "latency_ms": np.exp(rng.normal(np.log(120), 0.35, int(keep.sum()))),
    }
    looks = longer.look_times()
    own = int(np.searchsorted(looks, stage.hard_end)) + 1  # the stage's own looks: through its hard end
    out = {}
    for rule, extra in (("sequential_plain", {}), ("sequential", {k: v[keep] for k, v in cov.items()})):
        S = ab.look_path({**cols, **extra}, looks, stage.ratio, stage.tune_n, st, g[keep], reps)
        C = ab.rule_codes(S, st)["sequential"]
        out[rule] = ab.first_action(C[:, :own], looks[:own], stage.planned_end)[0]
        if rule == "sequential":
            out["sequential_held"] = ab.first_action(C, looks, stage.planned_end)[0]
            out["var_ratio"] = S["var_ratio"]
    return out


def rollout(sc: Scenario, cand: str, router: Router, rng: np.random.Generator, st: ab.Settings) -> dict:
    """Chain the stages per rule; each rollout's outcome from ab_analysis.rollout_decision."""
    stages = ab.plan_stages(sc.plan, sc.rate, LOOK, EXT)
    sim = simulate_mix if sc.mix else simulate_stage
    sims = [sim(sc, s, cand, router, rng, st) for s in stages]
    res = {}
    for rule in MIX_RULES if sc.mix else RULES:
        outcomes = []
        for r in range(router.reps):
            results, continued = [], False
            for s, sim in zip(stages, sims):
                code = int(sim["sequential" if rule == "sequential_held" else rule][r])
                if rule == "sequential_held" and code == ab.KEEP and not continued:  # held: continued, once
                    code, continued = int(sim[rule][r]), True
                d = ab.DECISIONS[code]
                results.append({"index": s.index, "ratio": s.ratio, "sequential_decision": d})
                if d != "widen":  # the runner stops the rollout at a stage that did not widen
                    break
            dec = ab_analysis.rollout_decision(results, sc.plan, "sequential")
            outcomes.append((dec["decision"], results[0]["sequential_decision"] == "widen"))
        d = np.array([o[0] for o in outcomes])
        res[rule] = {
            "widen": float(np.mean([o[1] for o in outcomes])),
            "promote": float(np.mean(d == "promote")),
            "rollback": float(np.mean(d == "roll back")),
            "hold": float(np.mean(d == "hold")),
        }
    if sc.mix:  # what the covariates left of the pseudo-outcomes' variance, in the first stage
        res["var_ratio"] = float(np.nanmedian(sims[0]["var_ratio"]))
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=500, help="simulated rollouts per scenario and candidate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", default="", help="comma-separated scenario names (default: all)")
    p.add_argument(
        "--rate", type=float, default=FLYWHEEL_RATE, help="the two mixes' request rate (default: the flywheel's)"
    )
    p.add_argument("--eval", default="", help="a round's train/eval.json: the embedded mix's cells from its baseline")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    st, rng, router = ab.Settings(), np.random.default_rng(args.seed), Router(args.reps)
    chosen = [s for s in SCENARIOS if not args.only or s.name in args.only.split(",")]
    chosen = [dataclasses.replace(s, rate=args.rate) if s.mix else s for s in chosen]
    if args.eval:
        mix = cells_from_eval(args.eval)
        chosen = [dataclasses.replace(s, mix=mix) if s.mix is EMBEDDED else s for s in chosen]
        print(f"embedded mix: the cells of {args.eval} (baseline pass {sum(c.weight * c.p for c in mix):.1%})")
    print(
        f"{args.reps} rollouts per scenario and candidate; looks every {LOOK:.0f} s, extension x{EXT:g}; "
        f"alpha {st.alpha}, guardrail alpha {st.guardrail_alpha}, srm alpha {st.srm_alpha}"
    )
    head = (
        f"{'scenario':15s} {'rule':24s} {'A/A widen':>9s} {'A/A 100%':>8s} {'A/A rollbk':>10s} {'A/A hold':>8s}"
        f" {'A/A wrong':>9s} {'power':>7s}  effect"
    )
    print(head)
    print("-" * len(head))
    ok, bench_power, mix_power = True, None, {}
    for sc in chosen:
        aa = rollout(sc, "same", router, rng, st)
        kind = "slower" if sc.effect == "latency" else "better"
        eff = rollout(sc, kind, router, rng, st)
        harm = rollout(sc, "worse", router, rng, st) if sc.harm else None
        what = (
            f"latency x{sc.size:g}: rolled back"
            if sc.effect == "latency"
            else f"pass {sc.p_base:.0%} -> {sc.p_base + sc.size:.0%}: promoted to 100%"
        )
        if sc.mix:
            what = f"pass +{100 * sc.size:.0f} points at {sc.rate:g} req/s: promoted to 100%"
        for rule, label in (MIX_RULES if sc.mix else RULES).items():
            a, e = aa[rule], eff[rule]
            wrong = a["widen"] + a["rollback"] + a["hold"]  # widen includes every promotion
            power = e["rollback"] if sc.effect == "latency" else e["promote"]
            line = (
                f"{sc.name:15s} {label:24s} {a['widen']:9.1%} {a['promote']:8.1%} {a['rollback']:10.1%} "
                f"{a['hold']:8.1%} {wrong:9.1%} {power:7.1%}  {what}"
            )
            if harm:
                line += f"; harm rolled back {harm[rule]['rollback']:.1%}"
            if sc.mix and rule == "sequential":
                line += f"; variance left {eff['var_ratio']:.0%}"
            print(line)
            if rule.startswith("sequential"):
                ok &= wrong <= 0.05
            if rule == "sequential" and sc.name == "benchmark":
                bench_power = power
                ok &= power >= 0.80
            if sc.mix:
                mix_power[(sc.name, rule)] = power
    print(
        f"goal (ours): A/A wrong actions (widen/promote, roll back, hold) <= 5% in every scenario, and power on the "
        f"benchmark's stated lift >= 80% (measured {bench_power if bench_power is None else f'{bench_power:.1%}'}): "
        f"{'PASS' if ok else 'FAIL'}"
    )
    for name in dict.fromkeys(n for n, _ in mix_power):
        adj, plain = mix_power[(name, "sequential")], mix_power[(name, "sequential_plain")]
        held = mix_power[(name, "sequential_held")]
        good = adj >= 0.80
        ok &= good or name != "embedded mix"
        print(
            f"goal ({name}): power >= 80% at +3 points with the regression adjustment: adjusted {adj:.1%}, "
            f"plain {plain:.1%} on the same traffic ({adj / max(plain, 1e-9):.2f}x): {'PASS' if good else 'FAIL'}; "
            f"with a held stage continued once by the next round (round.on_held: continue): {held:.1%}"
        )
    print(f"time: {time.perf_counter() - t0:.1f} s (md5 routing {router.seconds:.1f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
