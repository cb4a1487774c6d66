"""Benchmark of the live gateway (issue 12): what `hermes-lab serve` adds on top of calling an upstream directly.

Not a test. An instant OpenAI-compatible stub (aiohttp.web, one fixed pre-encoded answer) runs in its own
process on 127.0.0.1; the gateway runs as `python -m hermes_lab.serve` with both arms on that stub (ratio
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


async def load(url: str, n: int, concurrency: int, warmup: int) -> dict[str, float]:
    """n requests, `concurrency` in flight; latencies in ms and throughput (after `warmup` requests)."""
    import aiohttp

    lat: list[float] = []
    conn = aiohttp.TCPConnector(limit=concurrency)
    headers = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession(connector=conn) as s:
        for _ in range(warmup):
            async with s.post(url, data=REQUEST, headers=headers) as r:
                await r.read()
        todo = iter(range(n))
        errors = 0

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
        wall = time.perf_counter() - t0
    lat.sort()
    return {
        "p50": lat[len(lat) // 2],
        "p99": lat[int(len(lat) * 0.99)],
        "rps": n / wall,
        "errors": errors,
    }


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (/proc; 0 where there is none)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def measure(url: str, n1: int, n64: int, pid: int) -> dict[str, dict[str, float]]:
    """Both concurrencies; ``cpu_us``: CPU the process ``pid`` spent per request at concurrency 64."""
    out = {"c1": asyncio.run(load(url, n1, 1, 100))}
    before = cpu_seconds(pid)
    out["c64"] = asyncio.run(load(url, n64, 64, 500))
    out["c64"]["cpu_us"] = (cpu_seconds(pid) - before) / (n64 + 500) * 1e6
    return out


def start_gateway(stub_url: str, client: str, durability: str, log_dir: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for k in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY", "all_proxy"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "hermes_lab.serve", "--port", str(port), "--log-dir", log_dir, "--ratio", "0.5"]
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
        direct = measure(stub_url + "/v1/chat/completions", n1, n64, stub.pid)
        rows = []
        for variant in args.variants.split(","):
            client, durability = variant.split(":")
            with tempfile.TemporaryDirectory() as tmp:
                gw, url = start_gateway(stub_url, client, durability, tmp)
                try:
                    m = measure(url, n1, n64, gw.pid)
                finally:
                    gw.terminate()
                    gw.wait(30)
                logged = len((Path(tmp) / "requests.jsonl").read_bytes().splitlines())
            rows.append((variant, m, logged))
        d1, d64 = direct["c1"], direct["c64"]
        print(
            f"\ndirect to the stub: c=1 p50 {d1['p50']:.3f} ms p99 {d1['p99']:.3f} ms; c=64 {d64['rps']:,.0f} req/s, "
            f"p99 {d64['p99']:.1f} ms; stub CPU {d64['cpu_us']:.0f} us/request"
        )
        hdr = f"{'variant':16s} {'+p50 c1':>9s} {'+p99 c1':>9s} {'req/s c64':>10s} {'of direct':>9s} {'p99 c64':>9s}"
        hdr += f" {'CPU/req':>8s} logged"
        print(hdr)
        for variant, m, logged in rows:
            g1, g64 = m["c1"], m["c64"]
            print(
                f"{variant:16s} {g1['p50'] - d1['p50']:8.3f}ms {g1['p99'] - d1['p99']:8.3f}ms {g64['rps']:10,.0f} "
                f"{g64['rps'] / d64['rps']:9.0%} {g64['p99']:7.1f}ms {g64['cpu_us']:6.0f}us {logged} "
                f"(errors {g1['errors'] + g64['errors']})"
            )
        g = rows[0][1]
        goals = [
            ("added p50 at c=1 <= 0.5 ms", g["c1"]["p50"] - d1["p50"] <= 0.5),
            ("throughput at c=64 >= 3,000 req/s", g["c64"]["rps"] >= 3000),
            ("throughput at c=64 >= 50% of direct", g["c64"]["rps"] >= 0.5 * d64["rps"]),
            ("p99 at c=64 <= 40 ms", g["c64"]["p99"] <= 40),
        ]
        print(f"\ngoals for the default ({rows[0][0]}); measured on a shared machine, so compare the ratios:")
        for name, ok in goals:
            print(f"  {'met   ' if ok else 'missed'} {name}")
        best = max(rows, key=lambda r: r[1]["c64"]["rps"])
        print(f"fastest variant at c=64: {best[0]}")
    finally:
        stub.terminate()
        stub.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
