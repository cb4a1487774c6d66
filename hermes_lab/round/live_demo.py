"""``make live-demo``: the live flywheel on the embedded default, on a fast clock: two rounds start themselves.

Reads ``params/embedded.yaml``; writes its own runs folder, ``runs/live-demo/`` (emptied at the start, so the
demo runs the same whatever ran before it: rounds, flywheels, an earlier demo), with everything a live
flywheel writes there (``live/flywheel/``, ``live/collect-01``, ``live/round-NN``, ``round-NN/``, MLflow).

    make live-demo                      # = python -m hermes_lab.round.live_demo
    python -m hermes_lab.round.live_demo --time-scale 360 --rounds 2

What happens, a line at each transition (the supervisor's ``[live ...]`` lines, the gateway's looks):
1. ``hermes-lab flywheel --live`` starts: one gateway on one address, serving the base policy;
2. a stand-in agent (``hermes_lab.live.agent``: the openai SDK, the verifier's score posted as feedback)
   sends traffic; once ``data.min_samples`` conversations have feedback and the cooldown has passed, round 1
   starts by itself in a worker process (prep on that traffic, review, train, validate) while the gateway
   keeps answering (the agent slows down to leave the training its core);
3. its candidate is swapped into the same gateway and the staged rollout decides it on the clock; the round
   takes the decision (promotion: the candidate is the next experiment's baseline);
4. round 2 starts the same way on the experiment's traffic, is swapped in and decided.
At the end it checks what the demo is for: the gateway's pid and address never changed, no request failed.
The clock: x360 (``--time-scale``): the 30% stage of 2 h takes 20 s (up to 40 s extended), the 1 h cooldown 10 s.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import yaml

DEMO_KEYS: dict[str, dict[str, Any]] = {
    "round": {"runs_dir": "runs/live-demo"},  # the demo's own runs/: nothing else is touched
    "data": {"min_samples": 300, "cooldown_hours": 1},  # 300 conversations; the cooldown shown, not waited out
    # one tested stage at 30% (2 h = 20 s at x360), then 100%: at the ~30 requests/s the tiny policy serves here,
    # a 10% first stage sees ~120 candidate requests, too few to decide a +14-point round 2 before its hard end
    "ab": {"request_rate": 0.1, "stages": [[0.3, 7200], [1.0, 0]]},
    "validate": {"eval_tasks_per_family": 48},  # half the held-out set: the regression gate in half the time
}


def say(msg: str) -> None:
    print(f"=== live-demo: {msg}", flush=True)


def demo_params(base: str, out: Path) -> Path:
    cfg = yaml.safe_load(Path(base).read_text(encoding="utf-8")) or {}
    for sec, kv in DEMO_KEYS.items():
        cfg.setdefault(sec, {}).update(kv)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(f"# written by hermes_lab.round.live_demo: {base} + {json.dumps(DEMO_KEYS)}\n" + yaml.safe_dump(cfg))
    return out


def get(url: str) -> dict[str, Any] | None:
    import httpx

    try:
        return httpx.get(url, timeout=10, trust_env=False).json()
    except (httpx.HTTPError, ValueError):
        return None


def run(base_params: str, time_scale: float, rounds: int, port: int) -> int:
    from hermes_lab.core import paths
    from hermes_lab.live.agent import run_agent

    runs = paths.resolve(DEMO_KEYS["round"]["runs_dir"])
    if runs.exists():
        shutil.rmtree(runs)
    params = demo_params(base_params, runs.parent / "live-demo.yaml")
    url = f"http://127.0.0.1:{port}"
    t0 = time.time()
    say(f"{params} = {base_params} + {json.dumps(DEMO_KEYS)}; clock x{time_scale:g}; gateway {url}")
    cmd = [sys.executable, "-m", "hermes_lab.round.supervisor", "--live", "--params", str(params)]
    cmd += ["--time-scale", str(time_scale), "--port", str(port), "--rounds", str(rounds)]
    sup = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    threading.Thread(target=lambda: [print(line, end="", flush=True) for line in sup.stdout], daemon=True).start()
    pid, answered, failed, batch = None, 0, 0, 0
    try:
        while sup.poll() is None:
            h = get(url + "/healthz")
            if h is None:
                if pid is not None:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        sup.wait(30)  # --rounds reached: the supervisor closes its gateway and exits
                    if sup.poll() is not None:
                        break
                    raise SystemExit(f"live-demo: the gateway at {url} stopped answering")
                time.sleep(0.5)
                continue
            if pid is None:
                pid = h["pid"]
            elif h["pid"] != pid:
                raise SystemExit(f"live-demo: the gateway's pid changed ({pid} -> {h['pid']})")
            fw = get(url + "/v1/flywheel") or {}
            busy = fw.get("phase") in ("training", "deciding")  # leave the worker its core
            batch += 1
            n, conc = (8, 2) if busy else (120, 8)  # a trickle while a round trains: it still gets answers
            try:
                s = run_agent(url, n, conc, seed=10_000 + batch, progress=False)
            except Exception as e:  # the supervisor stopping after its last round closes the gateway
                if sup.poll() is not None:
                    break
                raise SystemExit(f"live-demo: the agent could not reach {url}: {type(e).__name__}: {e}") from None
            answered, failed = answered + s["answered"], failed + s["errors"]
            if s["errors"] and sup.poll() is None:
                say(f"{s['errors']} failed requests: {s['first_errors']}")
            if busy:
                time.sleep(2.0)
        rc = sup.wait()
    finally:
        if sup.poll() is None:
            sup.terminate()
            sup.wait(60)
    status = json.loads((runs / "live" / "flywheel" / "status.json").read_text(encoding="utf-8"))
    done = status.get("rounds") or []
    say(f"{len(done)} rounds in {time.time() - t0:.0f} s, one gateway: pid {pid}, {url} throughout")
    for r in done:
        gain = "" if r.get("gain") is None else f", held-out {r['gain'] * 100:+.1f} points"
        say(f"  round {r['round']:02d}: {r['status']}{gain} (experiment {r.get('experiment')})")
    say(f"  the agent: {answered} requests answered, {failed} failed; swaps in the gateway: {len(status['swaps'])}")
    ok = rc == 0 and len(done) >= rounds and failed == 0 and len(status["swaps"]) >= rounds
    if not ok:
        say(f"FAILED: supervisor exit {rc}, {len(done)} of {rounds} rounds, {failed} failed requests")
    return 0 if ok else 1


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--params", default="params/embedded.yaml", help="base config (the demo keys are added to it)")
    p.add_argument("--time-scale", type=float, default=360.0, help="clock speed (stages, looks, cooldown)")
    p.add_argument("--rounds", type=int, default=2, help="self-triggered rounds to run")
    p.add_argument("--port", type=int, default=8700, help="the gateway's port")


def run_cli(args: argparse.Namespace) -> int:
    return run(args.params, args.time_scale, args.rounds, args.port)


def main(argv: list[str] | None = None) -> int:
    from hermes_lab.core.command import run_module

    return run_module("hermes_lab.round.live_demo", add_arguments, run_cli, argv, description=__doc__.split("\n")[0])


if __name__ == "__main__":
    sys.exit(main())
