"""Benchmark: what one held-out `hermes` task costs played by the real Hermes Agent, against the built-in loop.

Issue 56 asks for execute and validate to play the `hermes` family with the real Hermes Agent in a round of <= 6
minutes. This measures, in one run on the same tasks and the same policy (the embedded tiny one):
1. the built-in loop (``policy.episodes.run_episodes``: the policy in process, ``WorkspaceEnv``'s tools), the way
   execute and validate play the family today;
2. the real Hermes Agent's own loop (``agents.hermes_loop.HermesLoop``: the pinned hermes-agent's ``AIAgent`` in one
   sandboxed process, a workspace per task) against ``hermes-lab serve`` on the same policy, started here on a free
   127.0.0.1 port.
It prints seconds per task, the machine's CPU seconds per task (the real agent's, at each ``--parallel``, split into
the gateway's and the rest: Hermes's sandboxed processes and this one's forwarding), the success rate each way, and
what a validate stage playing N tasks per arm would cost at that rate.

Not a test: run it by hand or via ``make bench`` (the pinned hermes-agent's virtualenv is made once, ~40 s).

    .venv/bin/python benchmarks/bench_hermes_loop.py [--tasks 40]
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]


def cpu_seconds() -> float:
    """The whole machine's busy CPU seconds so far (/proc/stat: user, nice, system, irq, softirq): the gateway and
    the sandboxed Hermes processes are not this process's waited-for children, so on a quiet machine this is the
    honest count of what a task costs."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in fields[:7])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def proc_cpu(pid: int) -> float:
    """One running process's CPU seconds, its threads included (/proc/PID/stat: utime + stime)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_gateway(tmp: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "hermes_lab.live.serve", "--params", str(REPO / "params" / "embedded.yaml")]
    cmd += ["--baseline", "embedded:tiny", "--candidate", "embedded:tiny", "--ratio", "0", "--port", str(port)]
    cmd += ["--log-dir", str(tmp / "log"), "--set", "serve.rollout=false", "--set", f"round.runs_dir={REPO / 'runs'}"]
    out = open(tmp / "gateway.out", "w")  # noqa: SIM115 - the child holds it
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    t0 = time.time()
    with httpx.Client(timeout=1, trust_env=False) as poll:
        while time.time() - t0 < 300:
            if proc.poll() is not None:
                raise RuntimeError(f"the gateway exited: {(tmp / 'gateway.out').read_text()[-2000:]}")
            try:
                if poll.get(url + "/healthz").status_code == 200:
                    return proc, url
            except httpx.HTTPError:
                time.sleep(0.3)
    proc.kill()
    raise RuntimeError("the gateway did not start in 300 s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tasks", type=int, default=40, help="held-out hermes tasks each way")
    ap.add_argument("--validate-tasks", type=int, default=96, help="tasks per arm of the projected validate stage")
    ap.add_argument(
        "--parallel", type=int, nargs="+", default=[1, 2], help="the real agent's tasks at once, one run each"
    )
    args = ap.parse_args(argv)

    from hermes_lab.agents import hermes_loop as HL
    from hermes_lab.config.schema import load_config
    from hermes_lab.policy import episodes as E
    from hermes_lab.policy import formats
    from hermes_lab.policy.model import load_policy
    from hermes_lab.tasks import hermes as H

    cfg = load_config(REPO / "params" / "embedded.yaml")
    tasks = H.generate_tasks(args.tasks, split="heldout", seed=11)
    rows = []

    pol = load_policy(cfg.model.base_model, runs_dir=REPO / "runs")
    formats.prepare(pol.tokenizer, cfg.model.tool_parser)
    c0, t0 = cpu_seconds(), time.perf_counter()
    eps = E.run_episodes(pol, tasks, temperature=0.9, seed=0, max_turns=cfg.grpo.max_turns)
    rows.append(
        (
            "built-in loop",
            time.perf_counter() - t0,
            cpu_seconds() - c0,
            sum(e.reward >= cfg.reward.success_threshold for e in eps),
        )
    )

    HL.install_hermes()
    gateway_cpu: list[float] = []
    with tempfile.TemporaryDirectory(prefix="bench-hermes-") as tmp:
        gw, url = start_gateway(Path(tmp))
        try:
            for par in args.parallel:
                root = Path(tmp) / f"ws-{par}"
                with HL.HermesLoop(f"{url}/v1", "hermes", workspace_root=root, max_turns=6, parallel=par) as loop:
                    loop.run(tasks[:1])  # warm: Hermes's imports and the gateway's first request
                    c0, g0, t0 = cpu_seconds(), proc_cpu(gw.pid), time.perf_counter()
                    runs = loop.run(tasks)
                    gateway_cpu.append(proc_cpu(gw.pid) - g0)
                    wall, cpu = time.perf_counter() - t0, cpu_seconds() - c0
                    rows.append((f"real Hermes, {par} at once", wall, cpu, sum(r.success for r in runs)))
        finally:
            gw.terminate()
            gw.wait(60)

    n = len(tasks)
    print(f"{n} held-out hermes tasks each way, the embedded tiny policy, temperature 0.9 (Hermes: its own sampling)")
    for name, wall, cpu, ok in rows:
        print(f"  {name:24s} {wall / n:6.2f} s/task  {cpu / n:6.2f} CPU s/task  done {ok}/{n} ({ok / n:.0%})")
    for (name, wall, cpu, _), gw_cpu in zip(rows[1:], gateway_cpu, strict=True):
        rest = (cpu - gw_cpu) / n
        print(f"  {name}: CPU s/task of the gateway {gw_cpu / n:.2f}, of Hermes and the rest {rest:.2f}")
        print(
            f"    wall ratio to the built-in loop {wall / rows[0][1]:.1f}x; a validate stage of {args.validate_tasks} "
            f"tasks per arm, two arms: {2 * args.validate_tasks * wall / n:.0f} s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
