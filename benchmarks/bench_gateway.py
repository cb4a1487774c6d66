"""Benchmark of the live gateway (issue 12): what `hermes-lab serve` adds on top of calling an upstream directly.

Not a test. An instant OpenAI-compatible stub (aiohttp.web, one fixed pre-encoded answer) runs in its own
process on 127.0.0.1; the gateway runs as `python -m hermes_lab.live.serve` with both arms on that stub (ratio
0.5, logging on: the full request path, routing, durable log record, arm headers); an aiohttp load
generator in this process sends the same chat completion either directly to the stub or through the
gateway. Load generator, stub and gateway share the machine's cores, so the figures are relative:
each run prints the ratios it measured.

Measured per gateway variant (upstream client x durability):
- concurrency 1 (1,000 requests): added p50 / p99 latency, gateway minus direct;
- concurrency 64 (5,000 requests): throughput and p99, and throughput as a share of direct.
Goal on 2 cores: added p50 <= 0.5 ms at concurrency 1; >= 3,000 req/s, >= 50% of direct and p99 <= 40 ms
at concurrency 64.

    python benchmarks/bench_gateway.py [--quick] [--variants aiohttp:write,aiohttp:fsync,httpx:write]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BODY = json.dumps(
    {
        "id": "cmpl-stub",
        "object": "chat.completion",
        "created": 0,
        "model": "stub",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "CAT"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10},
    }
).encode()
REQUEST = json.dumps({"model": "hermes", "messages": [{"role": "user", "content": "up cat="}]}).encode()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_stub(port: int) -> None:
    """The instant upstream: one fixed answer, no parsing of the request beyond reading it."""
    from aiohttp import web

    async def chat(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=BODY, content_type="application/json")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def wait_up(url: str, proc: subprocess.Popen, timeout: float = 60) -> None:
    import urllib.request

    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: process exited {proc.returncode}")
        try:
            urllib.request.urlopen(url, timeout=1)
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


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(int(len(xs) * q), len(xs) - 1)]


async def sequential(direct: str, gateway: str, n: int) -> dict[str, list[float]]:
    """Concurrency 1, direct and gateway requests alternating (order flipped every other pair), so that
    both series see the same machine load."""
    import aiohttp

    lat: dict[str, list[float]] = {"direct": [], "gateway": []}
    headers = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=2)) as s:
        for i in range(n + 50):
            for name in ("direct", "gateway") if i % 2 else ("gateway", "direct"):
                t = time.perf_counter()
                async with s.post(direct if name == "direct" else gateway, data=REQUEST, headers=headers) as r:
                    await r.read()
                    assert r.status == 200, r.status
                if i >= 50:  # warm-up pairs are not counted
                    lat[name].append((time.perf_counter() - t) * 1000)
    return lat


async def burst(url: str, n: int, concurrency: int) -> tuple[list[float], float, int]:
    """n requests, `concurrency` in flight: (latencies ms, wall seconds, errors)."""
    import aiohttp

    lat: list[float] = []
    errors = 0
    headers = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as s:
        todo = iter(range(n))

        async def worker() -> None:
            nonlocal errors
            for _ in todo:
                t = time.perf_counter()
                async with s.post(url, data=REQUEST, headers=headers) as r:
                    await r.read()
                    errors += r.status != 200
                lat.append((time.perf_counter() - t) * 1000)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return lat, time.perf_counter() - t0, errors


def measure(direct: str, gateway: str, n1: int, n64: int, pids: dict[str, int], blocks: int = 5) -> dict:
    """Concurrency 1 interleaved; concurrency 64 in alternating blocks (direct, gateway, ...) of n64/blocks
    requests each. ``cpu_us``: CPU per request of the gateway and of the stub in the gateway blocks."""
    seq = asyncio.run(sequential(direct, gateway, n1))
    asyncio.run(burst(gateway, 500, 64))  # warm-up: connections, caches
    asyncio.run(burst(direct, 500, 64))
    res = {k: {"lat": [], "wall": 0.0, "errors": 0} for k in ("direct", "gateway")}
    cpu = dict.fromkeys(pids, 0.0)
    for _ in range(blocks):
        for name, url in (("direct", direct), ("gateway", gateway)):
            before = {k: cpu_seconds(pid) for k, pid in pids.items()}
            lat, wall, err = asyncio.run(burst(url, n64 // blocks, 64))
            if name == "gateway":
                for k, pid in pids.items():
                    cpu[k] += cpu_seconds(pid) - before[k]
            res[name]["lat"] += lat
            res[name]["wall"] += wall
            res[name]["errors"] += err
    out = {}
    for name in ("direct", "gateway"):
        r = res[name]
        out[name] = {
            "p50_c1": pct(seq[name], 0.5),
            "p99_c1": pct(seq[name], 0.99),
            "rps": len(r["lat"]) / r["wall"],
            "p99_c64": pct(r["lat"], 0.99),
            "errors": r["errors"],
        }
    n = (n64 // blocks) * blocks
    out["cpu_us"] = {k: v / n * 1e6 for k, v in cpu.items()}
    return out


def start_gateway(stub_url: str, client: str, durability: str, log_dir: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for k in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY", "all_proxy"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "hermes_lab.live.serve", "--port", str(port), "--log-dir", log_dir, "--ratio", "0.5"]
    cmd += [
        "--baseline",
        stub_url,
        "--baseline-model",
        "stub-b",
        "--candidate",
        stub_url,
        "--candidate-model",
        "stub-c",
    ]
    cmd += ["--set", f"serve.upstream_client={client}", "--set", f"serve.durability={durability}"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wait_up(f"http://127.0.0.1:{port}/healthz", proc)
    return proc, f"http://127.0.0.1:{port}/v1/chat/completions"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer requests (200 / 1,000): a smoke run")
    ap.add_argument("--variants", default="aiohttp:write,aiohttp:fsync,httpx:write", help="client:durability list")
    ap.add_argument("--stub", type=int, default=0, help=argparse.SUPPRESS)  # internal: run the stub on this port
    args = ap.parse_args()
    if args.stub:
        run_stub(args.stub)
        return 0
    n1, n64 = (200, 1000) if args.quick else (1000, 5000)
    sport = free_port()
    stub = subprocess.Popen([sys.executable, __file__, "--stub", str(sport)], stdout=subprocess.DEVNULL)
    stub_url = f"http://127.0.0.1:{sport}"
    try:
        wait_up(stub_url + "/v1/chat/completions", stub)
        print(f"gateway benchmark: {n1} requests at concurrency 1, {n64} at 64; cores: {os.cpu_count()} (shared)")
        print("direct and gateway requests alternate (c=1) or alternate in blocks (c=64): same machine load")
        rows = []
        for variant in args.variants.split(","):
            client, durability = variant.split(":")
            with tempfile.TemporaryDirectory() as tmp:
                gw, url = start_gateway(stub_url, client, durability, tmp)
                try:
                    m = measure(stub_url + "/v1/chat/completions", url, n1, n64, {"gateway": gw.pid, "stub": stub.pid})
                finally:
                    gw.terminate()
                    gw.wait(30)
                m["logged"] = len((Path(tmp) / "requests.jsonl").read_bytes().splitlines())
            rows.append((variant, m))
        print(
            f"\n{'variant':14s} {'direct p50':>10s} {'+p50 c1':>8s} {'+p99 c1':>8s} {'direct/s':>9s} {'gw req/s':>9s}"
            f" {'of direct':>9s} {'p99 c64':>8s} {'gw CPU':>7s} {'stub CPU':>8s} logged"
        )
        for variant, m in rows:
            d, g, c = m["direct"], m["gateway"], m["cpu_us"]
            print(
                f"{variant:14s} {d['p50_c1']:8.3f}ms {g['p50_c1'] - d['p50_c1']:6.3f}ms"
                f" {g['p99_c1'] - d['p99_c1']:6.2f}ms"
                f" {d['rps']:9,.0f} {g['rps']:9,.0f} {g['rps'] / d['rps']:9.0%} {g['p99_c64']:6.1f}ms"
                f" {c['gateway']:5.0f}us {c['stub']:6.0f}us {m['logged']} (errors {d['errors'] + g['errors']})"
            )
        variant, m = rows[0]
        d, g = m["direct"], m["gateway"]
        goals = [
            ("added p50 at c=1 <= 0.5 ms", g["p50_c1"] - d["p50_c1"] <= 0.5),
            ("throughput at c=64 >= 3,000 req/s", g["rps"] >= 3000),
            ("throughput at c=64 >= 50% of direct", g["rps"] >= 0.5 * d["rps"]),
            ("p99 at c=64 <= 40 ms", g["p99_c64"] <= 40),
        ]
        print(f"\ngoals for the default ({variant}); on a shared machine the ratios are the figures to compare:")
        for name, ok in goals:
            print(f"  {'met   ' if ok else 'missed'} {name}")
        best = max(rows, key=lambda r: r[1]["gateway"]["rps"])
        print(
            f"fastest variant at c=64: {best[0]}; gw CPU = the gateway process' CPU per request (load-independent-ish)"
        )
    finally:
        stub.terminate()
        stub.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
