"""The live flywheel: ``hermes-lab flywheel --live``, one gateway that stays up while rounds start themselves.

Reads the params file and the traffic of the experiment it serves (``runs/live/<experiment>/``); writes
``runs/live/flywheel/`` (``state.json``: what it serves and what it has counted; ``status.json``: what it
waits for, as ``hermes-lab status`` and the page at ``/`` show it; ``round-NN.yaml``, the config each round
ran with; ``round-NN.log``, the round's output), and through the round runner, everything a round writes
(``runs/round-NN/``, MLflow runs, the champion alias, ``runs/state.json``).

    hermes-lab flywheel --live --params params/live.yaml                  # production: the real clock
    make live                                                             # the embedded default, x120 clock
    python -m hermes_lab.round.supervisor --params P --time-scale 120 --rounds 2

One process, one address: the gateway (``hermes_lab.live.switch.Switchboard``) runs on this process's event
loop; the loop also watches the traffic (a round's params file, its worker process, the traffic count and the
lines said of a round: ``hermes_lab.round.live_rounds``). The cycle, each transition printed:

1. collecting: the gateway serves the champion (at first an experiment of its own, ``collect-NN``; after a
   round, the decided experiment at its final share). A round is due when the experiment's conversations
   with feedback since the last training reach ``data.min_samples`` and the cooldown
   (``data.cooldown_hours``) has passed on the clock (the wall clock; ``serve.time_scale`` K > 1 runs it K
   times faster, the round's simulated clock kept in step).
2. training: the round's offline stages run in a worker process (``python -m hermes_lab.round.supervisor
   --worker``: the round runner, papermill kernels under it) with ``execute.source: live`` on that traffic
   and ``ab.mode: live``; the gateway keeps serving. Prep takes the traffic's string tasks (joined with their
   feedback) and its conversations (agent episodes with their tool calls, whole); train samples the string
   tasks, then every assistant turn of the conversations in a phase of their own (``grpo.turns: all``,
   ``grpo.turn_steps``, on the tokens the in-process arm logged), then whole episodes in the agent family's
   environment (``grpo.environment``, from the conversations' questions). The worker dies with the supervisor
   (PDEATHSIG), and its kernels with it, so a restart never races an orphaned training.
3. experiment: the round stops "awaiting live A/B" with its experiment prepared in ``runs/live/round-NN``
   (baseline the champion, candidate the new adapter); the switchboard swaps it in (the new adapter loaded
   beside the old, or into vLLM with ``serve.lora_upstream``) and the staged rollout of ``ab.stages`` runs
   on the clock.
4. deciding: once the rollout ended, the worker resumes the round: the live decision, compare, promotion
   (the champion alias: every later experiment's baseline) or roll back (the round's data marked
   negative). The round's line says the agent family's live success per arm (its conversations with
   feedback) beside its held-out episode success before and after training. Back to 1 on that experiment's
   traffic.

Crash safety: kill -9 at any point, then the same command: the round continues from its last completed
stage (the runner's progress in runs/state.json), the experiment from its experiment.json (a restart of
the gateway on the same log dir), the counts from state.json; every answered request was durable before
its answer's last byte. Deliberately left out: a round triggered by a timer (volume only, as the user's
flywheel), and draining a swapped-out experiment across a restart.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from hermes_lab.config.schema import ConfigError, load_config, set_overrides
from hermes_lab.core import quiet
from hermes_lab.core.jsonl import write_json_atomic
from hermes_lab.core.layout import RunsLayout, round_name
from hermes_lab.core.state import FlywheelState, parse_time, state_path
from hermes_lab.core.verdict import STOP_AWAITING_LIVE
from hermes_lab.live import log as L
from hermes_lab.live import round as live_round
from hermes_lab.round.live_rounds import (
    FeedbackCounter,
    describe,
    describe_agent,
    die_with_parent,
    live_params,
    next_stage,
    read_json_or_empty,
    worker,
)
from hermes_lab.round.outcome import agent_played
from hermes_lab.round.runner import RoundLock, RoundLocked

POLL_S = 1.0
QUIET_S, QUIET_MAX_S = 2.0, 60.0  # --rounds reached: the gateway closes after this long without traffic (at most)
AWAITING_REVIEW = "awaiting review"
LABELS_SETTLE_S = 10.0  # labels unchanged this long before a round awaiting review is resumed


def _now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


class Supervisor:
    """The live flywheel of one runs/ folder: its gateway (``run``), its watch (``step``, once a second), the
    round worker it starts, and what it writes for people (``status``; ``runs/live/flywheel/status.json``)."""

    def __init__(
        self,
        params: str | None,
        *,
        time_scale: float | None = None,
        port: int | None = None,
        rounds: int = 0,
        overrides: dict[str, Any] | None = None,
        say: Any = print,
    ):
        self.say_raw = say
        self.base_params = params
        first = load_config(params, overrides=overrides)
        self.K = float(time_scale if time_scale is not None else first.serve.time_scale)
        self.runs = Path(first.round.runs_dir)
        self.lay = RunsLayout(self.runs)
        self.fly = self.lay.flywheel
        self.extra = dict(overrides or {})  # --set: into every file a round runs with
        self.params = live_params(params, self.fly.params, self.K, **self.extra)
        self.cfg = load_config(self.params)
        if port is not None:
            self.cfg.serve.port = port
        self.rounds_wanted = rounds
        self.state = self._load_state()
        self.worker: asyncio.subprocess.Process | None = None
        self.worker_round = 0
        self.board: Any = None
        self.counter: FeedbackCounter | None = None
        self.phase = "starting"
        self.waiting: list[str] = []
        self.address = ""
        self.retried: set[int] = set()
        self._seen_stages: set[str] = set()
        self._labels: tuple[float, float] | None = None
        self._kinds: list[str] = []
        self._worker_since = ""
        self._stop_at: float | None = None  # --rounds reached: when; and (requests seen, when last changed)
        self._seen: tuple[int, float] = (0, 0.0)

    # ------------------------------------------------------------------------------------- state
    def say(self, msg: str) -> None:
        self.say_raw(f"[live {time.strftime('%H:%M:%S')}] {msg}")

    def _load_state(self) -> dict[str, Any]:
        p = self.fly.state
        st = json.loads(p.read_text(encoding="utf-8")) if p.is_file() else {}
        st.setdefault("serving", "")
        st.setdefault("consumed", 0)
        st.setdefault("rounds", [])
        st.setdefault("swaps", [])
        st.setdefault("started", _now_iso())
        st.setdefault("clock", None)
        st["restarts"] = int(st.get("restarts", -1)) + 1
        return st

    def _save(self) -> None:
        write_json_atomic(self.fly.state, self.state)

    def sim_now(self) -> datetime:
        """The flywheel's clock: the wall clock, or (K != 1) a simulated one running K times faster."""
        if self.K == 1:
            return datetime.now(timezone.utc)
        c = self.state["clock"]
        if c is None:
            fw = FlywheelState.load(state_path(self.runs))
            start = parse_time(fw.simulated_now) or datetime.now(timezone.utc)
            c = self.state["clock"] = {"wall": time.time(), "sim": start.isoformat()}
            self._save()
        return parse_time(c["sim"]) + timedelta(seconds=(time.time() - c["wall"]) * self.K)

    def flywheel_state(self) -> FlywheelState:
        return FlywheelState.load(state_path(self.runs))

    # ------------------------------------------------------------------------------------- gateways
    def _gateway(self, log_dir: Path) -> Any:
        """The gateway of one experiment dir: a round's (its recorded arms) or a collect dir (the champion)."""
        from hermes_lab.live.arms import ARMS, resolve_arm
        from hermes_lab.live.gateway import Gateway

        recorded = (L.load_experiment(log_dir) or {}).get("arm_specs")
        collect = log_dir.name.startswith("collect-")  # the champion alone at share 0: no rollout, no looks
        over = {"serve.port": self.cfg.serve.port} | ({"serve.rollout": False} if collect else {})
        cfg = load_config(self.params, overrides=over)
        if recorded:  # a round's experiment, or a restart: the arms it was opened with
            specs = {a: resolve_arm(cfg, a, r["spec"], r["model"], r["key_env"]) for a, r in recorded.items()}
        else:
            champion = live_round.baseline_spec(cfg)
            specs = {a: resolve_arm(cfg, a, champion) for a in ARMS}
        ratio = 0.0 if collect and not recorded else None
        return Gateway(
            cfg, specs, ratio=ratio, log_dir=log_dir, experiment=log_dir.name, say=self._gw_say, pool=self.pool
        )

    def _gw_say(self, msg: str) -> None:
        self.say_raw(f"  {msg.strip()}")

    def _serve_dir(self) -> Path:
        """What to serve at start: an awaiting round's experiment, else what was served, else a collect dir."""
        fw = self.flywheel_state()
        prog = fw.progress or {}
        n = fw.last_round + 1
        if prog.get("round") == n and prog.get("status") == STOP_AWAITING_LIVE:
            return live_round.experiment_dir(self.cfg, self.lay.round_dir(n))
        if self.state["serving"]:
            return Path(self.state["serving"])
        return self.lay.collect(n).root

    def _serving(self, log_dir: Path, consumed: int | None = None) -> None:
        if str(log_dir) != self.state["serving"]:
            self.state["serving"], self.state["consumed"] = str(log_dir), 0
        if consumed is not None:
            self.state["consumed"] = consumed
        self.counter = FeedbackCounter(log_dir)
        self._save()

    async def swap_to(self, log_dir: Path, n: int) -> None:
        t0 = time.time()
        gw = await self.board.swap(lambda: self._gateway(log_dir))
        self._serving(log_dir)
        b, c = gw.specs["baseline"], gw.specs["candidate"]
        rec = {"at": _now_iso(), "experiment": gw.name, "baseline": b.served_model, "candidate": c.served_model}
        self.state["swaps"].append(rec)
        self._save()
        plan = " -> ".join(f"{s[0]:.0%}" for s in gw.stages)
        self.say(
            f"round {n:02d}: candidate swapped in without a restart (pid {os.getpid()}, {self.address}): "
            f"experiment {gw.name}, baseline {b.slug} vs candidate {c.slug} ({c.kind}), rollout {plan}, "
            f"clock x{self.K:g}; loaded in {time.time() - t0:.1f} s"
        )

    # ------------------------------------------------------------------------------------- rounds
    async def start_worker(self, n: int, why: str) -> None:
        fw = self.flywheel_state()
        prog = fw.progress or {}
        resuming = prog.get("round") == n
        params = Path(prog["params"]) if resuming and prog.get("params") else self.fly.round_params(n)
        if not resuming:
            live_params(self.base_params, params, self.K, **self.extra, **{"execute.live_dir": self.state["serving"]})
            self.state["consumed"] = self.counter.count() if self.counter else 0
            self._save()
        if self.K != 1:  # the round's simulated clock reads the flywheel's
            try:
                with RoundLock(self.runs):
                    fw = self.flywheel_state()
                    fw.simulated_now = self.sim_now().isoformat()
                    fw.save(state_path(self.runs))
            except RoundLocked as e:  # someone runs a round by hand on these runs/: wait for it
                self.waiting = [str(e)]
                return
        logf = open(self.fly.round_log(n), "ab")  # noqa: SIM115 (the child holds it)
        self.worker = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "hermes_lab.round.supervisor",
            "--worker",
            str(params),
            stdout=logf,
            stderr=asyncio.subprocess.STDOUT,
            stdin=asyncio.subprocess.DEVNULL,
            preexec_fn=die_with_parent,
        )
        logf.close()
        self.worker_round, self._seen_stages = n, set(prog.get("completed", []) if resuming else [])
        self._worker_since = _now_iso()
        self.phase = "deciding" if prog.get("status") == STOP_AWAITING_LIVE else "training"
        self.say(f"round {n:02d}: {why}; worker pid {self.worker.pid}, log {self.fly.round_log(n)}")

    async def worker_done(self) -> None:
        rc = await self.worker.wait()
        n, self.worker = self.worker_round, None
        fw = self.flywheel_state()
        prog = fw.progress or {}
        if prog.get("round") == n and prog.get("status") == STOP_AWAITING_LIVE:
            await self.swap_to(live_round.experiment_dir(self.cfg, self.lay.round_dir(n)), n)
            self.phase = "experiment"
            return
        if prog.get("round") == n and prog.get("status") == AWAITING_REVIEW:
            self.phase, self._labels = "review", (self._labels_mtime(), -1.0)
            self.say(f"round {n:02d}: awaiting review labels (notebooks/review.ipynb); it resumes when they are in")
            return
        if fw.last_round >= n:
            summary = read_json_or_empty(self.lay.round(n).summary)
            ev = summary.get("eval") or {}
            row = {
                "round": n,
                "status": summary.get("status"),
                "decision": summary.get("decision"),
                "pass_rate": (ev.get("after") or {}).get("pass_rate"),
                "base_pass_rate": (ev.get("before") or {}).get("pass_rate"),
                "gain": (ev.get("gain") or {}).get("gain"),  # held-out, paired (the regression gate's eval)
                "experiment": round_name(n) if summary.get("ab") else None,
                "ended": _now_iso(),
            }
            row["agent"] = self._agent_figures(n, row["experiment"])
            self.state["rounds"].append(row)
            self._save()
            gain = f", held-out {describe(row)}" if row["gain"] is not None else ""
            self.say(f"round {n:02d}: {row['status']}{gain}; collecting for the next round")
            if row["agent"]:
                self.say(f"round {n:02d}: agent family: {describe_agent(row['agent'])}")
            self.phase = "collecting"
            return
        self.phase = "failed"
        self.say(
            f"round {n:02d}: the worker exited {rc} with the round unfinished ({prog.get('status')}): see "
            f"{self.fly.round_log(n)}; the gateway keeps serving, the same command again resumes it"
        )

    def _agent_figures(self, n: int, experiment: str | None) -> dict[str, Any] | None:
        """The agent family's figures of a decided round: held-out episode success before and after (train's
        eval.json), live success per arm (the experiment's agent conversations with feedback) and, with
        agent.runner hermes, validate's held-out tasks played by the real Hermes Agent per arm."""
        ev = read_json_or_empty(self.lay.round(n).train.eval).get("agent") or {}
        played = agent_played(self.lay.round(n).validate.regression)
        thr = self.cfg.reward.success_threshold
        live = L.agent_success(self.lay.experiment(experiment).root, thr) if experiment else {}
        if not ev and not live and not played:
            return None
        return {
            "heldout_before": (ev.get("before") or {}).get("episode_success"),
            "heldout_after": (ev.get("after") or {}).get("episode_success"),
            "live": live,
            "played": played,
        }

    def _labels_mtime(self) -> float:
        labels = self.lay.labels
        return labels.stat().st_mtime if labels.is_file() else 0.0

    def _stage_lines(self, prog: dict[str, Any]) -> None:
        """A line for each stage the worker's round completed since the last look."""
        if prog.get("round") != self.worker_round:
            return
        for name in prog.get("completed", []):
            if name not in self._seen_stages:
                self._seen_stages.add(name)
                secs = (prog.get("timings") or {}).get(name)
                self.say(f"round {self.worker_round:02d}: {name} done" + (f" ({secs:.0f} s)" if secs else ""))

    # ------------------------------------------------------------------------------------- the watch
    def due(self) -> tuple[bool, list[str], list[str]]:
        """Whether a new round is due; what it waits for otherwise, in words and as kinds (samples, cooldown)."""
        fw, d = self.flywheel_state(), self.cfg.data
        have = (self.counter.count() if self.counter else 0) - int(self.state["consumed"])
        reasons, kinds = [], []
        if have < d.min_samples:
            kinds.append("samples")
            reasons.append(
                f"{d.min_samples - have} more conversations with feedback ({have} of data.min_samples "
                f"{d.min_samples} in {Path(self.state['serving']).name})"
            )
        last = parse_time(fw.last_train_time)
        if last is not None:
            left = (last + timedelta(hours=d.cooldown_hours) - self.sim_now()).total_seconds()
            if left > 0:
                kinds.append("cooldown")
                wall = f", {left / self.K:.0f} s of wall clock" if self.K != 1 else ""
                reasons.append(f"cooldown: {left / 3600:.2f} h left (data.cooldown_hours {d.cooldown_hours:g}{wall})")
        return not reasons, reasons, kinds

    async def step(self) -> None:
        """One look at the world: the worker, the experiment, the data gate."""
        if self.worker is not None:
            prog = self.flywheel_state().progress or {}
            self._stage_lines(prog)
            if self.worker.returncode is not None:
                await self.worker_done()
            else:
                stage = next_stage(prog)
                self.waiting = [f"round {self.worker_round:02d} to finish its offline stages (now: {stage})"]
            return
        fw = self.flywheel_state()
        n = fw.last_round + 1
        prog = fw.progress if fw.progress and fw.progress.get("round") == n else None
        if prog and prog.get("status") == STOP_AWAITING_LIVE:
            gw = self.board.current
            exp_dir = live_round.experiment_dir(self.cfg, self.lay.round_dir(n))
            if gw.log_dir != exp_dir:
                await self.swap_to(exp_dir, n)
                gw = self.board.current
            self.phase = "experiment"
            if gw.state["status"] != "running" and gw.state.get("report"):
                await self.start_worker(n, f"rollout decided ({gw.state['status']}); the round takes the decision")
            else:
                self.waiting = [f"experiment {gw.name}: {gw.rollout.waiting_for()}"]
            return
        if prog and prog.get("status") == AWAITING_REVIEW:
            self.phase = "review"
            mtime = self._labels_mtime()
            if self._labels is None:  # (a restart) the labels as they are: it waits for new ones
                self._labels = (mtime, -1.0)
            elif mtime != self._labels[0]:  # someone labels: wait until they pause
                self._labels = (mtime, time.time())
            elif self._labels[1] > 0 and time.time() - self._labels[1] > LABELS_SETTLE_S:
                self._labels = (mtime, -1.0)  # resumed once per batch of new labels
                await self.start_worker(n, "new review labels: the round resumes at its review gate")
                return
            self.waiting = [f"review labels for round {n:02d} (notebooks/review.ipynb; the review gate's queue)"]
            return
        if prog:  # killed or failed mid-round: continue it from its last completed stage, once per process
            if n in self.retried:
                self.phase, self.waiting = "failed", [f"round {n:02d} failed: see {self.fly.round_log(n)}"]
                return
            self.retried.add(n)
            await self.start_worker(n, f"unfinished ({prog.get('status')}, done: {prog.get('completed')}): resuming")
            return
        if self.rounds_wanted and len(self.state["rounds"]) >= self.rounds_wanted:
            self.phase, self.waiting = "stopped", [f"nothing: {self.rounds_wanted} rounds done (--rounds)"]
            return
        ok, reasons, kinds = self.due()
        if ok:
            have = self.counter.count() - int(self.state["consumed"])
            await self.start_worker(
                n, f"due: {have} conversations with feedback in {Path(self.state['serving']).name}, cooldown passed"
            )
            return
        self.phase = "collecting"
        if kinds != self._kinds:  # a line when what it waits for changes, not every second
            self.say("waiting for " + "; ".join(reasons))
        self.waiting, self._kinds = reasons, kinds

    # ------------------------------------------------------------------------------------- status
    def status(self) -> dict[str, Any]:
        gw = self.board.current if self.board else None
        exp = None
        if gw is not None:
            st = gw.state
            exp = {
                "name": gw.name,
                "log_dir": str(gw.log_dir),
                "status": st["status"],
                "stage": int(st["stage"]),
                "ratio": float(gw.ratio),
                "stages": gw.stages if gw.rollout.enabled else [[gw.ratio, 0.0]],  # collecting: one fixed share
                "waiting_for": gw.rollout.waiting_for() if gw.rollout.enabled else "a fixed share (collecting)",
                "n_baseline": gw.tally.n[0],
                "n_candidate": gw.tally.n[1],
                "arms": {a: s.describe() for a, s in gw.specs.items()},
            }
        fw = self.flywheel_state()
        prog = fw.progress or {}
        rnd = None
        if self.worker is not None:
            rnd = {"number": self.worker_round, "stage": next_stage(prog), "pid": self.worker.pid}
            rnd["since"] = self._worker_since
        have = (self.counter.count() if self.counter else 0) - int(self.state["consumed"])
        last = parse_time(fw.last_train_time)
        left = (last + timedelta(hours=self.cfg.data.cooldown_hours) - self.sim_now()).total_seconds() if last else 0
        return {
            "updated": _now_iso(),
            "address": self.address,
            "pid": os.getpid(),
            "phase": self.phase,
            "waiting_for": list(self.waiting),
            "time_scale": self.K,
            "round": rnd,
            "experiment": exp,
            "counts": {
                "conversations": have,
                "min_samples": self.cfg.data.min_samples,
                "cooldown_left_s": max(left, 0.0),
            },
            "rounds": self.state["rounds"],
            "swaps": self.state["swaps"][-5:],
            "champion": fw.champion_adapter or "base",
            "mlflow_ui": os.environ.get("HERMES_MLFLOW_UI", "http://127.0.0.1:5000"),
            "answered_requests": gw.tally.n[0] + gw.tally.n[1] if gw is not None else 0,
            "failed_requests": sum(gw.tally.errors) if gw is not None else 0,
            "restarts": self.state["restarts"],
        }

    def _quiet(self) -> bool:
        """--rounds reached: whether the gateway may close now. It waits until its traffic has paused for QUIET_S
        (no request answered meanwhile; the server then finishes the ones in flight), at most QUIET_MAX_S: clients
        stop before the gateway does, so none of their requests is refused at the end."""
        gw, now = self.board.current, time.monotonic()
        seen = sum(gw.tally.n) + sum(gw.tally.errors)
        if self._stop_at is None:
            self._stop_at, self._seen = now, (seen, now)
            self.say(f"stopping: {self.waiting[0]}; the gateway closes once its traffic pauses")
        elif seen != self._seen[0]:
            self._seen = (seen, now)
        if now - self._seen[1] >= QUIET_S or now - self._stop_at >= QUIET_MAX_S:
            late = now - self._seen[1] < QUIET_S
            self.say("closing the gateway" + (f" (traffic still coming after {QUIET_MAX_S:.0f} s)" if late else ""))
            return True
        return False

    def write_status(self) -> None:
        if self.board is not None:
            write_json_atomic(self.fly.status, self.board.snapshot())

    # ------------------------------------------------------------------------------------- main
    async def run(self) -> int:
        from hermes_lab.live.local import ArmPool
        from hermes_lab.live.serve import bind
        from hermes_lab.live.server import Server
        from hermes_lab.live.switch import Switchboard

        s = self.cfg.serve
        try:
            sock = bind(s.host, s.port)
        except OSError as e:
            raise ConfigError(f"serve.port: cannot bind {s.host}:{s.port}: {e.strerror}") from None
        self.address = f"http://{s.host}:{sock.getsockname()[1]}"
        if not quiet.debug_enabled():  # no weight-loading bar at every swap
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
        self.pool = ArmPool()
        first = self._serve_dir()
        self.board = Switchboard(await asyncio.to_thread(self._gateway, first), self.pool, status=self.status)
        self._serving(first)
        # the gateway's own HTTP server (hermes_lab.live.server: what `hermes-lab serve` runs), the switchboard its
        # chat handler and its ASGI app for the other routes
        server = Server(self.board, self.board.chat, self.board.refuse, s.max_body_bytes, s.access_log)
        try:
            await self.board.startup()
        except Exception as e:
            self.say(f"the gateway did not start: {type(e).__name__}: {e}")
            return 1
        await server.start(sock)
        gw = self.board.current
        again = f", restart {self.state['restarts']}" if self.state["restarts"] else ""
        self.say(
            f"gateway {self.address}/v1 (pid {os.getpid()}{again}), status page {self.address}/ ; "
            f"serving {gw.name}: baseline {gw.specs['baseline'].slug}, candidate {gw.specs['candidate'].slug} "
            f"at {gw.ratio:.0%}; clock x{self.K:g}"
        )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        rc = 0
        try:
            while not stop.is_set():
                await self.step()
                self.write_status()
                if self.phase == "stopped" and self._quiet():
                    break
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), POLL_S)
        except Exception as e:
            self.say(f"stopped by {type(e).__name__}: {e}")
            rc = 1
        finally:
            if self.worker is not None and self.worker.returncode is None:
                self.say(f"round {self.worker_round:02d}: stopping its worker; the same command resumes it")
                self.worker.terminate()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.worker.wait(), 30)
            await server.stop()
            await self.board.shutdown()
            self.write_status()
        return rc


# ----------------------------------------------------------------------------------------------- CLI


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``hermes-lab flywheel``: the offline flywheel (``hermes_lab.round.runner.flywheel``) or, with ``--live``,
    this supervisor."""
    p.add_argument("--params", default="params/embedded.yaml", help="config YAML (--live: the live keys are added)")
    p.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="rounds to run (default 3); --live: stop after this many rounds ended (default: run until stopped)",
    )
    p.add_argument("--live", action="store_true", help="one gateway that stays up; rounds start on data volume")
    p.add_argument("--time-scale", type=float, default=None, help="--live: clock speed (default serve.time_scale)")
    p.add_argument("--port", type=int, default=None, help="--live: gateway port (default serve.port; 0: any free)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="--live: config override")
    p.add_argument("--worker", default=None, metavar="PARAMS", help=argparse.SUPPRESS)


def run_cli(args: argparse.Namespace) -> int:
    if args.worker:
        return worker(args.worker)
    if not args.live:
        from hermes_lab.round.runner import run_cli_flywheel

        args.rounds = 3 if args.rounds is None else args.rounds
        return run_cli_flywheel(args)
    sup = Supervisor(
        args.params,
        time_scale=args.time_scale,
        port=args.port,
        rounds=args.rounds or 0,
        overrides=set_overrides(args.set),
    )
    return asyncio.run(sup.run())


def main(argv: list[str] | None = None) -> int:
    from hermes_lab.core.command import run_module

    return run_module("hermes_lab.round.supervisor", add_arguments, run_cli, argv, description=__doc__.split("\n")[0])


if __name__ == "__main__":
    sys.exit(main())
