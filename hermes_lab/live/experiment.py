"""The live experiment: ``experiment.json`` of a gateway log dir, and the staged rollout on the wall clock.

Stage: validate (live A/B). Reads the gateway's tally (``hermes_lab.live.log.Tally``); reads and writes
``<log_dir>/experiment.json`` (atomically, ``hermes_lab.live.log.save_experiment``); when the rollout ends it
has ``hermes_lab.live.report`` write ``<log_dir>/ab_report.json`` and ``plots/``. ``hermes-lab serve`` runs it:

    hermes-lab serve --params params/embedded.yaml --time-scale 120   # 10% for 2 h in one minute, and so on

State: what identifies the experiment (name, arms, public model, unit, salt, stages, time scale), the current
``stage`` and ``ratio``, ``stage_starts`` (one per stage entered), ``looks`` (every look's decision and
numbers), ``stage_results`` (each decided stage), the rollout ``decision``, ``status`` (running, promoted,
rolled back, held, inconclusive) and ``restarts``. A restart with other arms, unit, stages or time scale is
refused: it would mix two experiments in one log. A restart continues the stage it was in.

The clock: experiment seconds = (wall time - start) x ``serve.time_scale``; every time in the log dir is on
it. The rollout: every ``ab.look_every`` experiment seconds of the current stage (its planned end among
the looks, as in ab-run), ``hermes_lab.ab.rollout.look_step`` (``ab_analysis.stage_action``: the code ab-run calls)
decides on what the gateway knew at the look time T: the stage's requests complete by T, with the rewards
whose feedback had arrived by T. A request without feedback by T is left out of the reward's statistics
and counts in the error and latency guardrails, in SRM and in ``min_per_arm`` (units with a completed
request); a failed request (upstream error, timeout, 5xx) counts as an error of its arm and as reward 0,
as ab-run scores a failed answer. Feedback that arrives late still counts at later looks for the requests
it scores (rows keep their arrival time), so the always-valid guarantee assumes that whether and when
feedback comes does not depend on the reward; the log keeps every time to check that. Then: widen -> the
next stage starts at T with its ratio (the same md5 bucket under a larger threshold: units only move
baseline -> candidate); reaching 100% ends the experiment as promoted; roll back -> ratio 0 at once; hold
(SRM) or an undecided hard end -> the ratio stays (``ab_analysis.rollout_decision``'s final ratio), the experiment
ends. Looks missed while the gateway was down are taken at restart, each on what was known at its time.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hermes_lab.ab import analysis as ab_analysis
from hermes_lab.ab import rollout as ab_rollout
from hermes_lab.ab import stats as ab
from hermes_lab.config.schema import ConfigError, HermesConfig
from hermes_lab.live import log as L

log = logging.getLogger("hermes_lab.serve")
STATUS = {
    "promote": "promoted",
    "roll back": "rolled back",
    "hold": "held",
    "keep observing": "inconclusive",
    "widen": "widened",
}
GRACE_S = 0.25  # wall seconds a look waits past its time: records of that instant are in the tally by then


def live_stages(
    cfg: HermesConfig, log_dir: str | os.PathLike[str], ratio: float | None = None
) -> tuple[list[list[float]], float | None]:
    """(the experiment's stage list, the first ratio asked for): ``ab.stages`` (checked; errors name the
    key); ``--ratio R`` puts the first stage at R and drops later stages below R (ramps only rise). A
    restart without --ratio continues at the experiment's own first ratio."""
    from hermes_lab.config.schema import ab_stages

    stages = ab_stages(cfg)
    prior = L.load_experiment(log_dir)
    if ratio is None and prior and float(prior["stages"][0][0]) != stages[0][0]:
        ratio = float(prior["stages"][0][0])
    if ratio is not None:
        if not 0 <= ratio < 1:
            raise ConfigError(f"--ratio must lie in [0, 1) (a test needs a baseline), got {ratio}")
        stages = [[float(ratio), stages[0][1]]] + [x for x in stages[1:] if x[0] > ratio]
    return stages, ratio


def experiment_ident(cfg: HermesConfig, arms: dict[str, Any], name: str) -> dict[str, Any]:
    """What identifies an experiment (a restart must match it): the arms (``ArmSpec.describe()``), the
    public model, the unit, the salt, the time scale."""
    return {
        "experiment": name,
        "arms": arms,
        "public_model": cfg.serve.public_model,
        "unit": cfg.ab.unit,
        "salt": cfg.ab.salt,
        "time_scale": float(cfg.serve.time_scale),
    }


def arm_specs(specs: dict[str, Any]) -> dict[str, dict[str, str]]:
    """How the arms were given (spec, model id, key env var NAME): a gateway started on the log dir without
    arm flags serves these."""
    return {n: {"spec": a.spec, "model": a.model, "key_env": a.key_env} for n, a in specs.items()}


def open_experiment(
    log_dir: str | os.PathLike[str],
    ident: dict[str, Any],
    stages: list[list[float]],
    ratio: float | None,
    arm_specs: dict[str, Any] | None = None,
    restart: bool = True,
) -> dict[str, Any]:
    """The experiment of ``log_dir``: created at the first start, continued (and checked) at a restart.
    ``restart`` False: only check and return it (the round attaching to its experiment)."""
    log_dir = Path(log_dir)
    st = L.load_experiment(log_dir)
    if st is None:
        now = time.time()
        st = {
            **ident,
            "created": L.now_iso(now),
            "start_unix": now,
            "status": "running",
            "stages": stages,
            "stage": 0,
            "ratio": stages[0][0],
            "stage_starts": [0.0],
            "looks": [],
            "stage_results": [],
            "decision": None,
            "restarts": 0,
        }
    else:
        st.setdefault("time_scale", 1.0)  # experiments from before the live rollout
        st.setdefault("stage_results", [])
        if ratio is not None and float(ratio) != float(st["stages"][0][0]):
            raise ConfigError(
                f"--ratio {ratio}: the experiment in {log_dir} started at ratio {st['stages'][0][0]} (stage and "
                "ratio live in experiment.json); omit --ratio to continue it"
            )
        for k, v in [*ident.items(), ("stages", stages)]:
            if k != "experiment" and st.get(k) != v:
                raise ConfigError(
                    f"{log_dir / L.EXPERIMENT}: this log dir holds experiment {st.get('experiment')!r} with {k} "
                    f"{st.get(k)!r}; this start has {v!r}. Continue it with the same settings, or pass another "
                    "--log-dir / --experiment"
                )
        if not restart:
            return st
        st["restarts"] = int(st.get("restarts", 0)) + 1
    if arm_specs:
        st["arm_specs"] = arm_specs
    L.save_experiment(log_dir, st)
    return st


def warm_up() -> None:
    """Import what a look needs (scipy, statsmodels): seconds on a busy machine, better spent at start."""
    import scipy.stats  # noqa: F401
    import statsmodels.stats.proportion  # noqa: F401


def _num(x: Any, digits: int = 4) -> float | None:
    return None if x is None else round(float(x), digits)


def duration(seconds: float) -> str:
    """Experiment seconds in words: 2 h, 30 min, 45 s."""
    s = float(seconds)
    return f"{s / 3600:.3g} h" if s >= 3600 else f"{s / 60:.3g} min" if s >= 60 else f"{s:.3g} s"


class LiveRollout:
    """The experiment's rollout on the (scaled) wall clock; the gateway routes with ``state['ratio']``."""

    def __init__(
        self,
        cfg: HermesConfig,
        state: dict[str, Any],
        log_dir: str | os.PathLike[str],
        tally: L.Tally,
        say: Callable[[str], None] = print,
    ):
        self.cfg, self.state, self.log_dir, self.tally, self.say = cfg, state, Path(log_dir), tally, say
        a = cfg.ab
        self.st = ab.Settings.from_config(cfg)
        self.stages = [list(map(float, s)) for s in state["stages"]]
        self.plan = ab.plan_stages(self.stages, a.request_rate, a.look_every, a.max_extension)
        self.K = float(state["time_scale"])
        self.enabled = cfg.serve.rollout
        self.reporting = False  # the final report is being written: a shutdown waits for it

    @property
    def t0(self) -> float:
        return float(self.state["start_unix"])

    def start_clock(self) -> None:
        """A new experiment's clock starts when the gateway is ready to serve, not when it began loading."""
        if not self.state["looks"] and self.tally.n == [0, 0]:  # (also an experiment a round prepared)
            self.state["start_unix"] = time.time()
            self.state["created"] = L.now_iso(self.state["start_unix"])
            L.save_experiment(self.log_dir, self.state)

    # ------------------------------------------------------------------------------------------ clock
    def clock(self, now: float | None = None) -> float:
        """Experiment seconds since the start."""
        return ((time.time() if now is None else now) - self.t0) * self.K

    def wall_at(self, t: float) -> float:
        """The unix time of experiment time ``t``."""
        return self.t0 + t / self.K

    @property
    def running(self) -> bool:
        return self.state["status"] == "running" and int(self.state["stage"]) < len(self.plan)

    def stage(self) -> ab.Stage:
        """The current tested stage, timed from its start."""
        i = int(self.state["stage"])
        return ab_rollout.start_stage(self.plan[i], float(self.state["stage_starts"][i]))

    def next_look(self) -> float | None:
        """Experiment time of the current stage's next look (its grid, after the looks already taken)."""
        if not (self.enabled and self.running):
            return None
        stg, i = self.stage(), int(self.state["stage"])
        last = max((lk["t"] for lk in self.state["looks"] if lk["stage"] == i), default=stg.start)
        grid = stg.look_times()
        later = grid[grid > last + ab_rollout.EPS]
        return float(later[0]) if len(later) else None

    # ------------------------------------------------------------------------------------------ looks
    def columns(self, stage: int, known_by: float) -> dict[str, Any]:
        cols = self.tally.columns(stage, known_by)
        if self.cfg.ab.unit == "request":
            cols.pop("unit")
        return cols

    def look(self, t: float) -> tuple[dict[str, Any], ab_rollout.Step]:
        """The look at ``t`` (run in a thread): the decision and the numbers behind it, and the step."""
        stg, i = self.stage(), int(self.state["stage"])
        cols = self.columns(i, t)
        action, step = ab_rollout.look_step(self.plan, stg, cols, self.st, t)
        res = ab_analysis.analyse_stage(cols, stg, self.st, until=t) if len(cols["t"]) else {}
        seq = res.get("sequential") or {}
        decision = action[0] if action else "keep observing"
        return {
            "n": len(self.state["looks"]) + 1,
            "t": round(t, 3),
            "at": L.now_iso(),
            "stage": i,
            "ratio": stg.ratio,
            "decision": decision,
            "acted_at_look": action[1] if action else None,
            "step": step.kind,
            "requests": {"baseline": int((cols["arm"] == 0).sum()), "candidate": int((cols["arm"] == 1).sum())},
            "rewarded": {"baseline": res.get("n_baseline", 0), "candidate": res.get("n_candidate", 0)},
            "units": {"baseline": seq.get("units_baseline", 0), "candidate": seq.get("units_candidate", 0)},
            "delta": _num(res.get("delta")),
            "p_value": _num(res.get("p_value"), 6),
            "cs": [_num(seq.get("cs_lower")), _num(seq.get("cs_upper"))],
            "error_rate": {
                k: _num((res.get("guardrails") or {}).get(f"error_rate_{k}")) for k in ("baseline", "candidate")
            },
            "reasons": res.get("reasons") or ["no request of this stage was complete yet"],
        }, step

    def apply(self, rec: dict[str, Any], step: ab_rollout.Step) -> None:
        """Record a look and take its step (on the event loop: the gateway's next request sees the new ratio)."""
        s, i, t = self.state, int(rec["stage"]), float(rec["t"])
        s["looks"].append(rec)
        self.say(self.progress(rec))
        if step.kind == "stay":
            return
        decided = "widen" if step.kind == "next" or step.stopped_by is None else rec["decision"]
        s["stage_results"].append(
            {"index": i, "ratio": rec["ratio"], "start": s["stage_starts"][i], "until": t, "decision": decided}
        )
        s["stage_starts"].append(t)
        if step.kind == "next":
            s["stage"], s["ratio"] = step.stage.index, step.stage.ratio
            self.say(f"  -> widen: stage {step.stage.index + 1} starts, candidate at {step.stage.ratio:.0%}")
            return
        key = f"{self.st.rule}_decision"
        results = [{"index": r["index"], "ratio": r["ratio"], key: r["decision"]} for r in s["stage_results"]]
        out = ab_analysis.rollout_decision(results, self.stages, self.st.rule)
        s.update(
            decision=out,
            status=STATUS.get(out["decision"], out["decision"]),
            ratio=float(out["final_ratio"]),
            stage=len(self.plan),  # after the tested stages: its requests are not analysed
            stopped_by=step.stopped_by,
            ended=round(t, 3),
            ended_at=L.now_iso(),
        )
        self.say(f"  -> {s['status']}: candidate at {s['ratio']:.0%} ({out['decision']})")

    def progress(self, rec: dict[str, Any]) -> str:
        """One line per look: when, where, the counts, delta and its interval, the decision."""
        q, rw, cs = rec["requests"], rec["rewarded"], rec["cs"]
        into = duration(rec["t"] - float(self.state["stage_starts"][rec["stage"]]))
        iv = "" if cs[0] is None else f", CS [{cs[0]:+.2f}, {cs[1]:+.2f}]"
        delta = "" if rec["delta"] is None else f"  delta {rec['delta']:+.3f}{iv}"
        return (
            f"[look {rec['n']:3d} {time.strftime('%H:%M:%S')}] stage {rec['stage'] + 1} ({rec['ratio']:.0%}) "
            f"{into} in: "
            f"baseline {q['baseline']} req ({rw['baseline']} scored), candidate {q['candidate']} "
            f"({rw['candidate']}){delta} -> {rec['decision']}"
        )

    def waiting_for(self, now: float | None = None) -> str:
        """What the rollout waits for, in words (``hermes-lab status``, ``GET /v1/experiment``)."""
        s = self.state
        if not self.running:
            return f"nothing: the rollout ended ({s['status']}, candidate at {float(s['ratio']):.0%})"
        if not self.enabled:
            return "nothing: serve.rollout is false (a fixed share, no looks)"
        i, stg, now_t = int(s["stage"]), self.stage(), self.clock(now)
        last = next((lk for lk in reversed(s["looks"]) if lk["stage"] == i), None)
        if last is None:
            return f"the stage's first look at {stg.start + stg.look_every:.0f} s (now {now_t:.0f} s)"
        need = self.st.min_per_arm
        units, rw = last["units"], last["rewarded"]
        short = {a: max(need - min(units[a], rw[a]), 0) for a in ("baseline", "candidate")}
        if any(short.values()):
            return (
                ", ".join(f"{k} more {a} units with feedback" for a, k in short.items() if k) + f" (min_per_arm {need})"
            )
        cs = last["cs"]
        if cs[0] is not None and cs[0] > 0 and now_t < stg.planned_end:
            return f"the stage's planned end (in {(stg.planned_end - now_t) / 3600:.2f} h): widening waits for it"
        if cs[0] is None:
            return "feedback: no interval yet"
        return (
            f"the interval [{cs[0]:+.2f}, {cs[1]:+.2f}] to leave 0, or the stage's hard end "
            f"(in {(stg.hard_end - now_t) / 3600:.2f} h)"
        )

    def current(self) -> dict[str, Any]:
        """The current stage's analysis now (``GET /v1/experiment``), by ``hermes_lab.ab.analysis.analyse_stage``; once
        the rollout ended, its decision and the last look."""
        s = self.state
        if not self.running:
            last = s["looks"][-1] if s["looks"] else {}
            dec = (s.get("decision") or {}).get("decision", "keep observing")
            return {
                "decision": dec,
                "reasons": last.get("reasons", []),
                "look": last or None,
                "delta": last.get("delta"),
                "p_value": last.get("p_value"),
                "interval": last.get("cs", [None, None]),
            }
        stg, i, now_t = self.stage(), int(s["stage"]), self.clock()
        cols = self.columns(i, now_t)
        arm = cols["arm"]
        if not len(arm) or arm.all() or not arm.any():
            return {"decision": "keep observing", "look": None, "reasons": ["no completed requests in an arm yet"]}
        res = ab_analysis.analyse_stage(cols, stg, self.st, until=min(max(now_t, float(cols["t"].max())), stg.hard_end))
        last = ((res.get("sequential") or {}).get("looks") or [{}])[-1]
        rule = self.st.rule
        keys = ("t", "n_baseline", "n_candidate", "requests_baseline", "requests_candidate", "delta", "cs_lower")
        return {
            "decision": res[f"{rule}_decision"],
            "reasons": res.get("reasons") if rule == "sequential" else [res.get("user_rule_reason")],
            "look": {k: last.get(k) for k in (*keys, "cs_upper", "p_value")},
            "delta": res.get("delta"),
            "p_value": res.get("p_value"),
            "interval": [last.get("cs_lower"), last.get("cs_upper")],
        }

    def status_line(self) -> str:
        """One line for ``hermes-lab status``: the stage (counted from 1), since when, the next look, what it
        waits for."""
        s = self.state
        if not self.running:
            rep = f", report {s['report']}" if s.get("report") else ""
            return f"ab: live rollout {s['status']}, candidate at {float(s['ratio']):.0%}{rep}"
        i = int(s["stage"])
        req = self.log_dir / L.REQUESTS
        if not s["looks"] and not (req.is_file() and req.stat().st_size):
            return f"ab: live experiment {self.log_dir} prepared, not served yet: waiting for hermes-lab serve on it"
        since = time.strftime("%H:%M", time.localtime(self.wall_at(float(s["stage_starts"][i]))))
        nxt = self.next_look()
        when = (
            "no looks (serve.rollout: false)"
            if nxt is None
            else f"next look in {duration(max(self.wall_at(nxt) - time.time(), 0))} (wall)"
        )
        return (
            f"ab: live stage {i + 1} ({float(s['ratio']):.0%}) since {since}, {when}, waiting for {self.waiting_for()}"
        )

    # ------------------------------------------------------------------------------------------ loop
    async def run(self, on_change: Callable[[], None]) -> None:
        """Look at every look time until the rollout ends; ``on_change`` after every step; the report at the end."""
        try:
            while (t := self.next_look()) is not None:
                await asyncio.sleep(max(self.wall_at(t) - time.time(), 0.0) + GRACE_S)
                rec, step = await asyncio.to_thread(self.look, t)
                self.apply(rec, step)
                on_change()
                self.reporting = step.kind == "end"
                await asyncio.to_thread(L.save_experiment, self.log_dir, copy.deepcopy(self.state))
                if step.kind == "end":
                    from hermes_lab.live.report import REPORT, write_live_report

                    rep, _ = await asyncio.to_thread(write_live_report, self.cfg, self.log_dir)
                    self.state["report"] = str(self.log_dir / REPORT)
                    await asyncio.to_thread(L.save_experiment, self.log_dir, copy.deepcopy(self.state))
                    self.reporting = False
                    why = "; ".join(rep["reasons"][-2:])
                    self.say(f"  report {self.log_dir / REPORT}: {rep['decision']}; {why}")
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a look that fails must not take the gateway down; a restart retries it
            log.exception("live rollout stopped")
            self.say(
                f"hermes-lab serve: the live rollout stopped at a failed look ({type(e).__name__}: {e}); "
                "the gateway keeps serving at the current share, a restart retries the look"
            )
