"""``make live-demo``: a live 10% -> 30% -> 100% rollout decided in minutes, then a round trains on that traffic.

Reads and writes ``runs/`` like any round: ``runs/round-NN/``, the round's live experiment
``runs/live/round-NN/`` (requests, feedback, experiment.json, ab_report.json, plots/) and the demo's config
``runs/live/demo.yaml`` (``params/embedded.yaml`` with the live keys below: it is printed at the start).

    make live-demo                         # = python -m hermes_lab.round.live_demo
    python -m hermes_lab.round.live_demo --params params/embedded.yaml --time-scale 120

The steps, each said as it starts:
1. the round whose candidate goes live: ``hermes-lab round`` up to its A/B stage, which (``ab.mode: live``)
   prepares the round's experiment and stops the round, "awaiting live A/B". A round already awaiting its
   live A/B is taken as it is (``make live-demo`` again continues where the last one stopped).
2. ``hermes-lab serve`` serves that experiment on the scaled wall clock (``--time-scale``: 10% for 2 h is a
   minute) and a stand-in agent (``hermes_lab.live.agent``: the openai SDK, the task verifier's score posted as
   feedback) sends traffic until the rollout is decided; the gateway prints a line at every look and
   writes ``ab_report.json``.
3. ``hermes-lab round --resume``: the round takes the live decision (the champion moves only when the rollout
   reached 100%).
4. the next round trains on that traffic (``execute.source: live``; the simulated clock first moves past the
   24 h cooldown, as ``make flywheel`` does); its own A/B is live again and waits for the next demo.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import yaml

# the keys that make the embedded default a live one (README "Live traffic")
LIVE_KEYS: dict[str, dict[str, Any]] = {
    "execute": {"source": "live"},  # round 2 on: the previous round's live traffic (round 1: the tasks)
    "ab": {"mode": "live", "request_rate": 0.2},  # ~25 requests/s of wall clock at x120: tunes the bets only
    "serve": {"time_scale": 120.0},  # 10% for 2 h -> 1 min, 30% for 4 h -> 2 min, a look every 7.5 s
}


def say(msg: str) -> None:
    print(f"\n=== live-demo: {msg}", flush=True)


def demo_params(base: str | os.PathLike[str], out: Path, time_scale: float) -> Path:
    """``base`` with LIVE_KEYS (and the time scale) written to ``out``: the config every step uses."""
    cfg = yaml.safe_load(Path(base).read_text(encoding="utf-8")) or {}
    for sec, kv in LIVE_KEYS.items():
        cfg.setdefault(sec, {}).update(kv)
    cfg["serve"]["time_scale"] = float(time_scale)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        f"# written by hermes_lab.round.live_demo: {base} + the live keys\n" + yaml.safe_dump(cfg, sort_keys=False)
    )
    return out


def hermes(*args: str, check: bool = True) -> int:
    """A ``hermes-lab`` command in a child process, its output passed through."""
    r = subprocess.run([sys.executable, "-m", "hermes_lab.cli.main", *args])
    if check and r.returncode not in (0,):
        raise SystemExit(f"live-demo: hermes-lab {' '.join(args)} exited {r.returncode}")
    return r.returncode


def awaiting_round(params: Path) -> tuple[int, Path] | None:
    """(round number, its live experiment dir) of an unfinished round awaiting its live A/B, or None."""
    from hermes_lab.config.schema import load_config
    from hermes_lab.core.state import FlywheelState, state_path
    from hermes_lab.live import round as live_round

    cfg = load_config(params)
    runs = Path(cfg.round.runs_dir)
    state = FlywheelState.load(state_path(runs))
    n = state.last_round + 1
    prog = state.progress or {}
    if prog.get("round") == n and prog.get("status") == live_round.AWAITING:
        return n, live_round.experiment_dir(cfg, runs / f"round-{n:02d}")
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_until_decided(params: Path, log_dir: Path, concurrency: int) -> dict[str, Any]:
    """The gateway on the experiment and the agent's traffic until the rollout is decided; the final state."""
    import httpx

    from hermes_lab.live.agent import run_agent

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    gw = subprocess.Popen(
        [sys.executable, "-m", "hermes_lab.live.serve", "--params", str(params), "--log-dir", str(log_dir)]
        + ["--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    threading.Thread(target=lambda: [print(line, end="", flush=True) for line in gw.stdout], daemon=True).start()
    try:
        for _ in range(600):
            if gw.poll() is not None:
                raise SystemExit(f"live-demo: the gateway exited {gw.returncode}")
            try:
                if httpx.get(url + "/healthz", timeout=1, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        exp: dict[str, Any] = {}
        batch = 0
        while not exp.get("report"):
            batch += 1  # a fresh task seed per batch: the next round gets new prompts, not repeats
            run_agent(url, 200, concurrency, seed=1000 + batch, progress=False)
            exp = httpx.get(url + "/v1/experiment", timeout=30, trust_env=False).json()
        return exp
    finally:
        gw.terminate()  # the gateway finishes writing its report first
        gw.wait(120)


def run(base_params: str, time_scale: float, concurrency: int) -> int:
    from hermes_lab.config.schema import load_config

    runs = Path(load_config(base_params).round.runs_dir)
    params = demo_params(base_params, runs / "live" / "demo.yaml", time_scale)
    print(f"live-demo: config {params} = {base_params} + {json.dumps(LIVE_KEYS)} (time scale {time_scale:g})")
    waiting = awaiting_round(params)
    if waiting is None:
        say("1/4 the round whose candidate goes live: hermes-lab round, up to its live A/B stage")
        hermes("round", "--params", str(params), check=False)
        waiting = awaiting_round(params)
        if waiting is None:
            raise SystemExit("live-demo: the round did not reach its live A/B stage (its summary above says why)")
    else:
        say(f"1/4 round {waiting[0]} is awaiting its live A/B: taking it from there")
    n, log_dir = waiting
    say(f"2/4 hermes-lab serve on {log_dir} (clock x{time_scale:g}) + the stand-in agent, until the rollout is decided")
    exp = serve_until_decided(params, log_dir, concurrency)
    say(f"the live rollout of round {n}: {exp['status']}, candidate at {exp['ratio']:.0%}; report {exp['report']}")
    say(f"3/4 hermes-lab round --resume: round {n} takes the live decision")
    hermes("round", "--params", str(params), "--resume", check=False)
    say(f"4/4 round {n + 1} trains on that traffic (execute.source: live; the simulated clock skips the cooldown)")
    hermes("flywheel", "--params", str(params), "--rounds", "1", check=False)  # moves the clock past the cooldown
    hermes("status", "--params", str(params), check=False)
    say(f"done: round {n + 1} trained on {log_dir}; `make live-demo` again serves its own live A/B")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--params", default="params/embedded.yaml", help="base config (the live keys are added to it)")
    p.add_argument("--time-scale", type=float, default=LIVE_KEYS["serve"]["time_scale"], help="experiment clock speed")
    p.add_argument("--concurrency", type=int, default=16, help="the agent's requests in flight")


def run_cli(args: argparse.Namespace) -> int:
    return run(args.params, args.time_scale, args.concurrency)


def main(argv: list[str] | None = None) -> int:
    from hermes_lab.core.command import run_module

    return run_module("hermes_lab.round.live_demo", add_arguments, run_cli, argv, description=__doc__.split("\n")[0])


if __name__ == "__main__":
    sys.exit(main())
