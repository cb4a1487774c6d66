"""The gateway benchmark's processes (benchmarks/bench_gateway.py): the gateways it starts, the CPU they and the
machine spend, and the runs over several gateways.

``start_gateway``: a checkout's gateway as ``hermes-lab serve`` runs it, on the stub, optionally under cProfile or
on a port several share (SO_REUSEPORT); ``wait_up`` / ``wait_idle``: until it answers and its start-up is over.
``cpu_seconds`` / ``thread_cpu``: a process' CPU (/proc); ``stolen`` / ``steal_share``: the host's steal;
``calibrate``: how fast the cores are now. Then the runs after the table: ``profile`` (``--profile``),
``processes`` (``--processes N``) and ``interleave`` (``--interleave DIR``). Each gateway logs into a temporary
folder, removed after it; nothing else is written. Not a script: bench_gateway.py imports it.

    python benchmarks/bench_gateway.py --no-conversations --generator raw --processes 2
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # gateway_load, beside it, however this is imported
from gateway_load import CLIENT, TURNS, burst, conv_burst, pct, run

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_up(url: str, proc: subprocess.Popen, timeout: float = 60) -> None:
    """Until ``url`` answers; a gateway's /healthz until it says warm (its start-up imports in a thread would
    share the GIL with the first measurements: the figures are the steady state's)."""
    import urllib.request

    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: process exited {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if json.loads(r.read() or b"{}").get("warm", True):
                    return
        except Exception as e:  # not up yet; a 405 from the stub's POST-only route means it is
            if getattr(e, "code", None):
                return
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (/proc; 0 where there is none)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def stolen() -> tuple[int, int]:
    """(steal, all) CPU ticks of the machine so far (/proc/stat; (0, 0) where there is none). In a VM, steal is time
    the host gave the machine's cores to something else: the share of it while a figure was measured says how
    far to trust that figure."""
    try:
        ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
        return ticks[7], sum(ticks)
    except (OSError, IndexError, ValueError):
        return 0, 0


def calibrate() -> float:
    """ms of one fixed piece of Python work (dicts, bytes, JSON: a request's kind of work), the fastest of 5. A
    VM's cores slow down without any steal when the host's other guests share what they share (a sibling
    hyperthread, the caches): the same gateway measured 156 and 280 us of CPU a request twenty minutes apart.
    Figures taken at about the same calibration compare."""
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * 200}] * 4}).encode()
    best = math.inf
    for _ in range(5):
        t = time.perf_counter()
        for i in range(2000):
            d = json.loads(body)
            d["n"] = i
            json.dumps(d).encode().split(b",")
        best = min(best, time.perf_counter() - t)
    return best * 1000


def steal_share(before: tuple[int, int]) -> float:
    now = stolen()
    return (now[0] - before[0]) / max(now[1] - before[1], 1)


# the gateway under cProfile from its start: SIGUSR2 notes each function's internal time so far (the start-up's,
# taken off later), SIGUSR1 writes both and exits (uvicorn keeps SIGTERM for itself)
PROFILED = """
import cProfile, marshal, os, runpy, signal, sys
pr, warm = cProfile.Profile(), {}
def label(code):  # as cProfile's own
    return ("~", 0, code) if isinstance(code, str) else (code.co_filename, code.co_firstlineno, code.co_name)
def note(*_):
    warm.update({label(e.code): e.inlinetime for e in pr.getstats()})
def dump(*_):
    pr.disable()
    pr.dump_stats(OUT)
    with open(OUT + ".warm", "wb") as f:
        marshal.dump(warm, f)
    os._exit(0)
signal.signal(signal.SIGUSR2, note)
signal.signal(signal.SIGUSR1, dump)
sys.argv = ["serve", *sys.argv[1:]]
pr.enable()
runpy.run_module("hermes_lab.live.serve", run_name="__main__")
"""


# the gateway on a port several processes share (SO_REUSEPORT: the kernel spreads connections over them)
REUSE = """
import functools, sys
import hermes_lab.live.serve as S
S.bind = functools.partial(S.bind, reuse_port=True)
sys.exit(S.main(sys.argv[1:]))
"""


def start_gateway(
    stub_url: str,
    client: str,
    durability: str,
    log_dir: str,
    repo: Path = REPO,
    profile: str = "",
    port: int = 0,
) -> tuple[subprocess.Popen, str]:
    """The gateway as ``hermes-lab serve`` runs it; ``profile``: with cProfile, on from SIGUSR2, its stats written
    to that file on SIGUSR1; ``port``: on that port, shared with the other gateways started on it (SO_REUSEPORT)."""
    shared, port = bool(port), port or free_port()
    env = {**os.environ, "PYTHONPATH": str(repo)}
    for k in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY", "all_proxy"):
        env.pop(k, None)
    args = ["--port", str(port), "--log-dir", log_dir, "--ratio", "0.5"]
    args += [
        "--baseline",
        stub_url,
        "--baseline-model",
        "stub-b",
        "--candidate",
        stub_url,
        "--candidate-model",
        "stub-c",
    ]
    args += ["--set", f"serve.upstream_client={client}", "--set", f"serve.durability={durability}"]
    if profile:
        wrapper = PROFILED.replace("OUT", repr(profile))
        cmd = [sys.executable, "-c", wrapper, *args]
    elif shared:
        cmd = [sys.executable, "-c", REUSE, *args]
    else:
        cmd = [sys.executable, "-m", "hermes_lab.live.serve", *args]
    # cwd: `python -m` puts it first on sys.path, before PYTHONPATH (a variant's other checkout must win)
    proc = subprocess.Popen(cmd, env=env, cwd=repo, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wait_up(f"http://127.0.0.1:{port}/healthz", proc)
    wait_idle(proc.pid)
    return proc, f"http://127.0.0.1:{port}/v1/chat/completions"


def wait_idle(pid: int, timeout: float = 60) -> None:
    """Until the process' start-up work is over (under 5% of a core over half a second): a checkout whose
    /healthz does not say when it is warm is measured in its steady state too."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        before = cpu_seconds(pid)
        time.sleep(0.5)
        if cpu_seconds(pid) - before < 0.025:
            return


# where a profile's time is counted: the first rule a function's file or name matches
GROUPS = (
    ("JSON (orjson)", ("orjson",)),
    ("conversation digest (xxhash)", ("xxhash", "live/conversations.py")),
    ("server (live/server.py, httptools; uvicorn before)", ("live/server.py", "uvicorn", "httptools", "starlette")),
    ("upstream client", ("live/upstream.py", "aiohttp", "httpx", "httpcore", "live/arms.py")),
    ("log (records, tally, writes)", ("live/records.py", "live/log.py", "posix.write", "ab/covariates", "tasks/suite")),
    (
        "routing and request handling",
        ("live/handling.py", "live/routes.py", "live/gateway.py", "ab/stats", "hashlib", "live/experiment"),
    ),
    ("event loop (uvloop's C: epoll, socket reads, tasks)", ("uvloop", "asyncio", "runners.py")),
)


def profile(stub_url: str, client: str, n: int) -> None:
    """The gateway under cProfile for single-turn requests and agent conversations (streamed and not) at c=64:
    where its CPU goes (internal time of each function, grouped; cProfile slows Python code, not C, down)."""
    import marshal
    import pstats

    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "gateway.prof")
        gw, url = start_gateway(stub_url, client, "write", tmp, profile=out)
        try:
            run(burst(url, 300, 64))  # start-up and warm-up: not counted
            gw.send_signal(signal.SIGUSR2)
            time.sleep(0.5)
            run(burst(url, n, 64))
            run(conv_burst(url, max(n // TURNS // 2, 64), 64, False, 300_000))
            run(conv_burst(url, max(n // TURNS // 2, 64), 64, True, 400_000))
        finally:
            gw.send_signal(signal.SIGUSR1)
            gw.wait(60)
        st = pstats.Stats(out)
        warm = marshal.loads(Path(out + ".warm").read_bytes())
    rows = []
    for (file, line, name), (_, _, tt, _, _) in st.stats.items():  # type: ignore[attr-defined]
        tt -= warm.get((file, line, name), 0.0)
        rows.append((tt, f"{file}:{line}({name})" if file != "~" else name))
    total = sum(tt for tt, _ in rows) or 1.0
    shares: dict[str, float] = {}
    for tt, where in rows:
        group = next((g for g, keys in GROUPS if any(k in where for k in keys)), "other")
        shares[group] = shares.get(group, 0.0) + tt
    print(f"\nprofile of the gateway ({client}; {n} single-turn requests + conversations, c=64): CPU by part")
    for group, tt in sorted(shares.items(), key=lambda x: -x[1]):
        print(f"  {100 * tt / total:5.1f}%  {group}")
    print("  top functions (internal time):")
    for tt, where in sorted(rows, reverse=True)[:TOP]:
        print(f"  {100 * tt / total:5.1f}%  {where.replace(str(REPO) + '/', '')[-110:]}")


TOP = 15


def processes(stub_url: str, n: int, n64: int) -> None:
    """One gateway process, then ``n`` on one port (SO_REUSEPORT), alternating twice, with the raw load generator:
    single-turn and 20-turn conversations at c=64. The arm of a conversation whose turns reach two processes is not
    kept (each process links only the turns it saw): a measure of capacity, not a way to serve."""
    CLIENT["kind"] = "raw"
    direct = stub_url + "/v1/chat/completions"
    print(f"\nprocesses behind one port (raw load generator, c=64; 1 and {n} alternating):")
    for k in (1, n, 1, n):
        port = free_port()
        with tempfile.TemporaryDirectory() as tmp:
            gws = [start_gateway(stub_url, "httptools", "write", f"{tmp}/{i}", port=port) for i in range(k)]
            url = gws[0][1]
            try:
                run(burst(url, 500, 64))
                cpu0 = sum(cpu_seconds(g.pid) for g, _ in gws)
                lat, wall, _ = run(burst(url, n64, 64))
                conv = [run(conv_burst(url, max(n64 // TURNS, 64), 64, st, 500_000 + 1_000 * k + st)) for st in (0, 1)]
                cores = (sum(cpu_seconds(g.pid) for g, _ in gws) - cpu0) / (wall + sum(c[1] for c in conv))
                d = run(burst(direct, n64, 64))
            finally:
                for g, _ in gws:
                    g.terminate()
                    g.wait(30)
        print(
            f"  {k} process{'es' if k > 1 else '  '}: single-turn {n64 / wall:6,.0f} req/s,"
            f" p99 {pct(lat, 0.99):5.1f} ms"
            f" (direct {n64 / d[1]:6,.0f}); conversations {conv[0][0] / conv[0][1]:6,.0f} req/s not streamed,"
            f" {conv[1][0] / conv[1][1]:6,.0f} streamed; gateways' CPU {cores:.2f} cores"
        )


def thread_cpu(pid: int) -> float:
    """CPU seconds of a process' threads so far, in ns steps (/proc/<pid>/task/*/schedstat: a clock tick, 10 ms, is
    too coarse for a burst's share of it)."""
    total = 0
    for t in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError, IndexError, ValueError):  # a thread that ended meanwhile
            total += int(Path(f"/proc/{pid}/task/{t}/schedstat").read_text().split()[0])
    return total / 1e9


def interleave(stub_url: str, other: Path, rounds: int) -> None:
    """This checkout's gateway and ``other``'s, both up on one stub, bursts alternating between them (ABBA order),
    ``rounds`` times per kind: CPU per request of each, and the median of the per-round ratios. A host that
    changes the machine's speed from one minute to the next moves both alike, where the variants of a run, one
    after the other, each meet another speed."""
    CLIENT["kind"] = "raw"
    with tempfile.TemporaryDirectory() as tmp:
        gws = [start_gateway(stub_url, "httptools", "write", f"{tmp}/{i}", r) for i, r in enumerate((REPO, other))]
        try:
            print(f"\ninterleaved (raw load generator, c=64): this checkout (A) and {other} (B), {rounds} rounds")
            for kind in ("single-turn", "not streamed", "streamed"):
                cpu: list[list[float]] = [[], []]
                for k in range(rounds):
                    for i in (0, 1) if k % 2 == 0 else (1, 0):
                        pid, url = gws[i][0].pid, gws[i][1]
                        before = thread_cpu(pid)
                        if kind == "single-turn":
                            n = 1000
                            run(burst(url, n, 64))
                        else:
                            n = run(conv_burst(url, 64, 64, kind == "streamed", 700_000 + 1_000 * (2 * k + i)))[0]
                        cpu[i].append((thread_cpu(pid) - before) / n * 1e6)
                ratios = sorted(b / a for a, b in zip(*cpu, strict=True))
                med = [sorted(c)[len(c) // 2] for c in cpu]
                print(
                    f"  {kind:13s} A {med[0]:5.0f} us, B {med[1]:5.0f} us a request (medians); A/B per round:"
                    f" median {1 / ratios[len(ratios) // 2]:.3f} ({1 / ratios[-1]:.3f}..{1 / ratios[0]:.3f})"
                )
        finally:
            for g, _ in gws:
                g.terminate()
                g.wait(30)
