"""Benchmark of the live gateway (issue 12): what `hermes-lab serve` adds on top of calling an upstream directly.

Not a test. An instant OpenAI-compatible stub (aiohttp.web, one fixed pre-encoded answer) runs in its own
process on 127.0.0.1; the gateway runs as `python -m hermes_lab.live.serve` with both arms on that stub (ratio
0.5, logging on: the full request path, routing, durable log record, arm headers); a load generator in this
process sends the same chat completion either directly to the stub or through the gateway. Load generator, stub
and gateway share the machine's cores, so the figures are relative: each run prints the ratios it measured.

Two load generators measure every variant in the same run (``--generator``): ``raw``, each request's bytes encoded
once and written whole on kept-alive connections on uvloop (wrk's approach: ~55 us of CPU a single-turn request), and
``aiohttp``, its client (~300 us: the one the issue's figures were taken with). With aiohttp the load
generator used more of the 2 cores than the gateway, so a cheaper gateway barely moved its throughput; with raw
the cores go to the stub and the gateway, and "of direct" compares the gateway with a stub that answers ~2x faster
(a stricter ratio) while its latency is the gateway's own. The done-when lines are printed for each.

Measured per gateway variant (upstream client x durability):
- concurrency 1 (1,000 requests): added p50 / p99 latency, gateway minus direct;
- concurrency 64 (5,000 requests): throughput and p99 (direct's p99 beside it), throughput as a share of direct,
  the gateway's CPU per request.

Agent conversations (issue 28; the first variant, streamed and not): 20-turn tool-calling conversations whose
requests carry the whole history (a 30 KB system prompt and tool schemas, then one tool call and a 1 KB tool
result per turn: 31 KB at turn 1, 52 KB at turn 20), each answered with the same tool call, so the gateway links
every turn by its message prefix, logs only the new messages and the assembled tool call. Lines: added p50 at
concurrency 1 next to the single-turn request's measured in the same run, and throughput with 64 conversations in
flight.

Done when (issue 45), printed at the end with met / missed: at c=64 single-turn >= 50% of direct with p99 <= 40
ms; 20-turn conversations >= 2,500 req/s, streamed and not. ``--before DIR``: the same lines for another checkout
of the package (its default client, aiohttp) in the same run; ``--profile``: then the gateway under cProfile,
its CPU by part (server, upstream client, JSON, log, routing, event loop) and its top functions; ``--processes N``:
one gateway, then N on one port (SO_REUSEPORT), alternating, single-turn and conversations at c=64 (capacity only:
a conversation whose turns reach two processes is not kept on one arm); ``--interleave DIR``: this checkout's
gateway and DIR's both up, bursts alternating between them, each one's CPU a request and the median of the
per-round ratios (on a VM whose host changes its speed, a before/after that the variants' lines, taken one after
the other, cannot give).

    python benchmarks/bench_gateway.py                      # the goals' figures
    git worktree add /tmp/gw-before <commit>                # before / after in one run, and where the time goes
    python benchmarks/bench_gateway.py --before /tmp/gw-before --profile
    python benchmarks/bench_gateway.py --variants httptools:write,httptools:write@/tmp/gw-head --conversations-all
    python benchmarks/bench_gateway.py --no-conversations --generator raw --processes 2
    python benchmarks/bench_gateway.py --no-conversations --generator raw --interleave /tmp/gw-before
    python benchmarks/bench_gateway.py --quick --variants httptools:write,httptools:fsync,aiohttp:write,httpx:write
"""

from __future__ import annotations

import argparse
import asyncio
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
from typing import Any

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
CALL = {"id": "call_1", "type": "function", "function": {"name": "terminal", "arguments": '{"command": "ls -la"}'}}
TOOL_BODY = json.dumps(
    {
        "id": "cmpl-stub",
        "object": "chat.completion",
        "created": 0,
        "model": "stub",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": None, "tool_calls": [CALL]},
                "finish_reason": "tool_calls",
            }
        ],
        "usage": {"prompt_tokens": 9000, "completion_tokens": 12, "total_tokens": 9012},
    }
).encode()


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


_CHUNK = {"id": "cmpl-stub", "object": "chat.completion.chunk", "created": 0, "model": "stub"}
TOOL_STREAM = b"".join(
    [
        _sse({**_CHUNK, "choices": [{"index": 0, "delta": {"role": "assistant", "content": None}}]}),
        _sse(
            {
                **_CHUNK,
                "choices": [
                    {
                        "index": 0,
                        "delta": {
                            "tool_calls": [
                                {**CALL, "index": 0, "function": {"name": "terminal", "arguments": '{"comm'}}
                            ]
                        },
                    }
                ],
            }
        ),
        _sse(
            {
                **_CHUNK,
                "choices": [
                    {"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": 'and": "ls -la"}'}}]}}
                ],
            }
        ),
        _sse({**_CHUNK, "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}),
        _sse(
            {**_CHUNK, "choices": [], "usage": {"prompt_tokens": 9000, "completion_tokens": 12, "total_tokens": 9012}}
        ),
        b"data: [DONE]\n\n",
    ]
)
TURNS = 20
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": f"tool_{i}",
            "description": "A tool of the agent. " * 10,
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
        },
    }
    for i in range(30)
]


def conversation(k: int, stream: bool) -> list[bytes]:
    """The request bodies of conversation k: turn t holds the history (t tool calls and results) and asks again."""
    system = {"role": "system", "content": "You are Hermes, an agent. " * 900}  # ~23 KB, tools ~7 KB more
    msgs: list = [system, {"role": "user", "content": f"conversation {k}: inspect the directory"}]
    out = []
    for t in range(TURNS):
        body = {"model": "hermes", "messages": msgs, "tools": TOOLS}
        if stream:
            body["stream"] = True
        out.append(json.dumps(body).encode())
        msgs = [*msgs, {"role": "assistant", "content": None, "tool_calls": [CALL]}]
        msgs.append({"role": "tool", "tool_call_id": "call_1", "content": f"turn {t}: " + "x" * 1000})
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_stub(port: int) -> None:
    """The instant upstream: one fixed answer, no parsing of the request beyond reading it."""
    from aiohttp import web

    async def chat(request: web.Request) -> web.Response:
        body = await request.read()
        if b'"tools"' not in body:
            return web.Response(body=BODY, content_type="application/json")
        if b'"stream": true' in body or b'"stream":true' in body:
            return web.Response(body=TOOL_STREAM, content_type="text/event-stream")
        return web.Response(body=TOOL_BODY, content_type="application/json")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


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


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(int(len(xs) * q), len(xs) - 1)]


class _Reply(asyncio.Protocol):
    """One kept-alive connection of the raw load generator: a response is complete at its Content-Length, or
    at the end chunk of a chunked one (the gateway's SSE answers)."""

    def __init__(self) -> None:
        self.buf, self.waiter, self.transport = bytearray(), None, None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if self.waiter is not None and not self.waiter.done():
            got = self._complete()
            if got is not None:
                self.waiter.set_result(got)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError("closed"))

    def _complete(self) -> tuple[int, bytes] | None:
        buf = self.buf
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            return None
        head = bytes(buf[:end]).lower()
        at = head.find(b"content-length:")
        if at >= 0:
            n = int(head[at + 15 : head.find(b"\r\n", at) if head.find(b"\r\n", at) > 0 else None])
            if len(buf) < end + 4 + n:
                return None
            body, self.buf = bytes(buf[end + 4 : end + 4 + n]), buf[end + 4 + n :]
        else:  # chunked: the bench's bodies are SSE (\n only), so CRLF 0 CRLF CRLF is the end chunk
            stop = buf.find(b"\r\n0\r\n\r\n", end) if not buf.startswith(b"0\r\n\r\n", end + 4) else end
            if stop < 0:
                return None
            cut = stop + 7 if stop > end else end + 9
            body, self.buf = bytes(buf[end + 4 : cut]), buf[cut:]
        return int(head[9:12]), body

    async def post(self, request: bytes) -> tuple[int, bytes]:
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(request)  # type: ignore[union-attr]
        return await self.waiter


class RawSession:
    """The load generator the figures use (``--client raw``): each request's bytes encoded once, ahead, and
    written whole on a kept-alive connection; its answer read to its end without parsing its headers beyond
    the status and length. It costs a fraction of aiohttp's client, so the machine's CPU goes to what is
    measured (wrk's approach; with aiohttp the load generator used more CPU than the gateway)."""

    def __init__(self, limit: int):
        self.idle: dict[str, list[_Reply]] = {}

    async def post(self, url: str, body: bytes) -> tuple[int, bytes]:
        host, _, rest = url.removeprefix("http://").partition("/")
        pool = self.idle.setdefault(host, [])
        conn = pool.pop() if pool else None
        if conn is None:
            h, _, port = host.partition(":")
            _, conn = await asyncio.get_running_loop().create_connection(_Reply, h, int(port))
        req = REQ_HEAD % (rest.encode(), host.encode(), len(body)) + body
        status, data = await conn.post(req)
        pool.append(conn)
        return status, data

    async def close(self) -> None:
        for pool in self.idle.values():
            for c in pool:
                c.transport.close()  # type: ignore[union-attr]


REQ_HEAD = b"POST /%s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"


class AiohttpSession:
    """aiohttp's client as the load generator (``--client aiohttp``: the one the figures used before)."""

    def __init__(self, limit: int):
        import aiohttp

        self.s = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=limit))

    async def post(self, url: str, body: bytes) -> tuple[int, bytes]:
        async with self.s.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
            return r.status, await r.read()

    async def close(self) -> None:
        await self.s.close()


CLIENT = {"kind": "raw"}


def session(limit: int) -> RawSession | AiohttpSession:
    return (RawSession if CLIENT["kind"] == "raw" else AiohttpSession)(limit)


def run(coro: Any) -> Any:
    """A measurement on its own event loop (uvloop for the raw load generator: it is part of its low cost)."""
    if CLIENT["kind"] == "raw":
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as r:
            return r.run(coro)
    return asyncio.run(coro)


async def sequential(direct: str, gateway: str, n: int) -> dict[str, list[float]]:
    """Concurrency 1, direct and gateway requests alternating (order flipped every other pair), so that
    both series see the same machine load."""
    lat: dict[str, list[float]] = {"direct": [], "gateway": []}
    s = session(2)
    for i in range(n + 50):
        for name in ("direct", "gateway") if i % 2 else ("gateway", "direct"):
            t = time.perf_counter()
            status, _ = await s.post(direct if name == "direct" else gateway, REQUEST)
            assert status == 200, status
            if i >= 50:  # warm-up pairs are not counted
                lat[name].append((time.perf_counter() - t) * 1000)
    await s.close()
    return lat


async def burst(url: str, n: int, concurrency: int) -> tuple[list[float], float, int]:
    """n requests, `concurrency` in flight: (latencies ms, wall seconds, errors)."""
    lat: list[float] = []
    errors = 0
    s = session(concurrency)
    todo = iter(range(n))

    async def worker() -> None:
        nonlocal errors
        for _ in todo:
            t = time.perf_counter()
            status, _ = await s.post(url, REQUEST)
            errors += status != 200
            lat.append((time.perf_counter() - t) * 1000)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    await s.close()
    return lat, wall, errors


def measure(direct: str, gateway: str, n1: int, n64: int, pids: dict[str, int], blocks: int = 5) -> dict:
    """Concurrency 1 interleaved; concurrency 64 in alternating blocks (direct, gateway, ...) of n64/blocks
    requests each. ``cpu_us``: CPU per request of the gateway and of the stub in the gateway blocks."""
    seq = run(sequential(direct, gateway, n1))
    run(burst(gateway, 500, 64))  # warm-up: connections, caches
    run(burst(direct, 500, 64))
    res = {k: {"lat": [], "wall": 0.0, "errors": 0} for k in ("direct", "gateway")}
    cpu = dict.fromkeys(pids, 0.0)
    cal, steal0 = calibrate(), stolen()
    for _ in range(blocks):
        for name, url in (("direct", direct), ("gateway", gateway)):
            before = {k: cpu_seconds(pid) for k, pid in pids.items()}
            lat, wall, err = run(burst(url, n64 // blocks, 64))
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
    out["gw_cores"] = cpu["gateway"] / res["gateway"]["wall"]  # one process: at most 1.0
    out["steal"], out["cal"] = steal_share(steal0), (cal + calibrate()) / 2
    return out


async def conv_sequential(direct: str, gateway: str, n_conv: int, stream: bool) -> dict[str, list[float]]:
    """Concurrency 1: each conversation's turns in order, direct and gateway alternating per turn, with the
    single-turn request interleaved too (its added latency measured under the same load)."""
    lat: dict[str, list[float]] = {k: [] for k in ("direct", "gateway", "direct1", "gateway1")}
    s = session(2)
    for k in range(n_conv + 1):
        for t, body in enumerate(conversation(10_000 * int(stream) + k, stream)):
            for name, url, data in (
                ("gateway", gateway, body),
                ("direct", direct, body),
                ("direct1", direct, REQUEST),
                ("gateway1", gateway, REQUEST),
            )[:: 1 if t % 2 else -1]:
                t0 = time.perf_counter()
                status, _ = await s.post(url, data)
                assert status == 200, status
                if k:  # the first conversation warms up
                    lat[name].append((time.perf_counter() - t0) * 1000)
    await s.close()
    return lat


async def conv_burst(url: str, n_conv: int, concurrency: int, stream: bool, offset: int) -> tuple[int, float, int]:
    """``n_conv`` conversations, ``concurrency`` in flight, each turn after the previous answer: (requests,
    wall seconds, errors)."""
    bodies = [conversation(offset + k, stream) for k in range(n_conv)]
    errors = done = 0
    s = session(concurrency)
    todo = iter(bodies)

    async def worker() -> None:
        nonlocal errors, done
        for conv in todo:
            for body in conv:
                status, _ = await s.post(url, body)
                errors += status != 200
                done += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    await s.close()
    return done, wall, errors


def measure_conversations(
    direct: str, gateway: str, n1: int, n64: int, log_dir: Path, pid: int
) -> list[tuple[str, dict]]:
    rows = []
    for stream in (False, True):
        seq = run(conv_sequential(direct, gateway, max(n1 // TURNS, 2), stream))
        res, steal0, cal = {}, stolen(), calibrate()
        for name, url in (("direct", direct), ("gateway", gateway)):
            before = cpu_seconds(pid)
            n, wall, err = run(conv_burst(url, max(n64 // TURNS, 64), 64, stream, 100_000 * (1 + stream)))
            res[name] = (n / wall, err, (cpu_seconds(pid) - before) / n * 1e6, (cpu_seconds(pid) - before) / wall)
        rows.append(
            (
                "streamed" if stream else "not streamed",
                {
                    "added_p50": pct(seq["gateway"], 0.5) - pct(seq["direct"], 0.5),
                    "added_p50_single": pct(seq["gateway1"], 0.5) - pct(seq["direct1"], 0.5),
                    "direct_rps": res["direct"][0],
                    "rps": res["gateway"][0],
                    "cpu_us": res["gateway"][2],
                    "gw_cores": res["gateway"][3],
                    "steal": steal_share(steal0),
                    "cal": (cal + calibrate()) / 2,
                    "errors": res["direct"][1] + res["gateway"][1],
                },
            )
        )
    recs = [json.loads(x) for x in (log_dir / "requests.jsonl").read_bytes().splitlines()]
    turns = [r for r in recs if r.get("tools_hash")]
    linked = sum(1 for r in turns if r["history"] == (2 * r["turn"] + 1 if r["turn"] else 0))
    calls = sum(1 for r in turns if r.get("tool_calls") == [CALL])
    rows.append(
        (
            "log",
            {"turns": len(turns), "linked": linked, "calls": calls, "bytes": sum(len(json.dumps(r)) for r in turns)},
        )
    )
    return rows


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
GOALS = "c=64 single-turn >= 50% of direct, p99 <= 40 ms; 20-turn conversations >= 2,500 req/s, streamed and not"


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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer requests (200 / 1,000): a smoke run")
    ap.add_argument("--variants", default="httptools:write", help="client:durability[@DIR] list (first: the goals')")
    ap.add_argument("--before", default="", metavar="DIR", help="also measure the checkout in DIR (aiohttp:write@DIR)")
    ap.add_argument("--no-conversations", action="store_true", help="skip the agent-conversation lines")
    ap.add_argument(
        "--conversations-all", action="store_true", help="conversation lines for every variant (default: the first)"
    )
    ap.add_argument(
        "--generator",
        default="raw,aiohttp",
        help="load generators, each measuring every variant (raw: pre-encoded requests on uvloop; aiohttp: its client)",
    )
    ap.add_argument("--profile", action="store_true", help="then profile the first variant's gateway (cProfile)")
    ap.add_argument("--processes", type=int, default=0, metavar="N", help="then 1 and N gateways behind one port")
    ap.add_argument(
        "--interleave", default="", metavar="DIR", help="then this checkout and DIR's gateways, bursts alternating"
    )
    ap.add_argument("--rounds", type=int, default=12, help="--interleave's rounds per kind")
    ap.add_argument("--stub", type=int, default=0, help=argparse.SUPPRESS)  # internal: run the stub on this port
    args = ap.parse_args()
    if args.stub:
        run_stub(args.stub)
        return 0
    n1, n64 = (200, 1000) if args.quick else (1000, 5000)
    variants = args.variants.split(",") + ([f"aiohttp:write@{args.before}"] if args.before else [])
    sport = free_port()
    stub = subprocess.Popen([sys.executable, __file__, "--stub", str(sport)], stdout=subprocess.DEVNULL)
    stub_url = f"http://127.0.0.1:{sport}"
    try:
        wait_up(stub_url + "/v1/chat/completions", stub)
        load = "load {:.1f} {:.1f} {:.1f}".format(*os.getloadavg())
        print(f"gateway benchmark: {n1} requests at concurrency 1, {n64} at 64; cores: {os.cpu_count()}, {load}")
        print("direct and gateway requests alternate (c=1) or alternate in blocks (c=64): same machine load")
        rows = []
        for gen in args.generator.split(","):
            CLIENT["kind"] = gen
            # the stub, the load generator and a throwaway gateway warmed before the first variant: with the
            # stub and the generator alone warmed, the first variant still measured ~10% more gateway CPU a
            # request than the same code measured later in the run
            run(burst(stub_url + "/v1/chat/completions", n64, 64))
            with tempfile.TemporaryDirectory() as tmp:
                gw, url = start_gateway(stub_url, variants[0].partition("@")[0].split(":")[0], "write", tmp)
                try:
                    run(burst(url, n64, 64))
                finally:
                    gw.terminate()
                    gw.wait(30)
            for variant in variants:
                spec, _, other = variant.partition("@")
                client, durability = spec.split(":")
                with tempfile.TemporaryDirectory() as tmp:
                    gw, url = start_gateway(stub_url, client, durability, tmp, Path(other) if other else REPO)
                    try:
                        pids = {"gateway": gw.pid, "stub": stub.pid}
                        m = measure(stub_url + "/v1/chat/completions", url, n1, n64, pids)
                        m["first"] = variant == variants[0]
                        with_conv = m["first"] or args.conversations_all or (args.before and variant == variants[-1])
                        if with_conv and not args.no_conversations:  # agent conversations
                            m["conv"] = measure_conversations(
                                stub_url + "/v1/chat/completions", url, n1, n64, Path(tmp), gw.pid
                            )
                    finally:
                        gw.terminate()
                        gw.wait(30)
                    m["logged"] = len((Path(tmp) / "requests.jsonl").read_bytes().splitlines())
                rows.append((f"{variant} [{gen}]", m))
        report(rows)
        if args.processes > 1:
            processes(stub_url, args.processes, n64)
        if args.interleave:
            interleave(stub_url, Path(args.interleave), args.rounds)
        if args.profile:
            profile(stub_url, variants[0].partition("@")[0].split(":")[0], n64)
    finally:
        stub.terminate()
        stub.wait(10)
    return 0


def report(rows: list[tuple[str, dict]]) -> None:
    w = max(14, *(len(v) for v, _ in rows))
    print(
        f"\n{'variant':{w}s} {'direct p50':>10s} {'+p50 c1':>8s} {'+p99 c1':>8s} {'direct/s':>9s} {'gw req/s':>9s}"
        f" {'of direct':>9s} {'p99 c64':>8s} {'direct':>7s} {'gw CPU':>7s} {'stub CPU':>8s} {'steal':>5s}"
        f" {'cal':>6s} logged"
    )
    for variant, m in rows:
        d, g, c = m["direct"], m["gateway"], m["cpu_us"]
        print(
            f"{variant:{w}s} {d['p50_c1']:8.3f}ms {g['p50_c1'] - d['p50_c1']:6.3f}ms"
            f" {g['p99_c1'] - d['p99_c1']:6.2f}ms"
            f" {d['rps']:9,.0f} {g['rps']:9,.0f} {g['rps'] / d['rps']:9.0%} {g['p99_c64']:6.1f}ms {d['p99_c64']:5.1f}ms"
            f" {c['gateway']:5.0f}us {c['stub']:6.0f}us {m['steal']:5.0%} {m['cal']:4.0f}ms {m['logged']}"
            f" (errors {d['errors'] + g['errors']})"
        )
    for variant, m in rows:
        if "conv" not in m:
            continue
        conv = m["conv"]
        print(f"\nagent conversations ({variant}): {TURNS} turns, 31-52 KB requests, one tool call per answer")
        head = f"{'+p50 c1':>8s} {'single':>8s} {'diff':>7s} {'direct/s':>9s} {'gw req/s':>9s} {'of direct':>9s}"
        print(f"{'':14s} {head} {'gw CPU':>7s} {'steal':>5s} {'cal':>6s}")
        for name, c in conv[:2]:
            diff = c["added_p50"] - c["added_p50_single"]
            print(
                f"{name:14s} {c['added_p50']:6.3f}ms {c['added_p50_single']:6.3f}ms {diff:5.2f}ms"
                f" {c['direct_rps']:9,.0f} {c['rps']:9,.0f} {c['rps'] / c['direct_rps']:9.0%}"
                f" {c['cpu_us']:5.0f}us {c['steal']:5.0%} {c['cal']:4.0f}ms (errors {c['errors']})"
            )
        lg = conv[2][1]
        print(
            f"log: {lg['turns']} conversation turns, {lg['linked']} linked to their conversation at the right turn,"
            f" {lg['calls']} with the tool call assembled; {lg['bytes'] / max(lg['turns'], 1) / 1024:.1f} KB a"
            " record (only the new messages)"
        )
    for variant, m in rows:
        if m["first"]:
            verdicts(variant, m)
    print("on a shared machine the ratios are the figures to compare; gw CPU: the gateway process' CPU per request;")
    print("steal: the share of the machine's CPU time its host took while the c=64 lines ran (a VM); cal: ms of a")
    print("fixed piece of Python work around them (a VM's cores also slow without steal when the host's other guests")
    print("share them): figures taken at about the same cal compare")
    print("machine load at the end: {:.1f} {:.1f} {:.1f} (1, 5, 15 min)".format(*os.getloadavg()))


def verdicts(variant: str, m: dict) -> None:
    """Issue 45's done-when lines (and the earlier issues' goals) for one variant under one load generator."""
    d, g = m["direct"], m["gateway"]
    print(f"\ndone when (issue 45), {variant}: {GOALS}")
    print(
        f"  {'met   ' if g['rps'] >= 0.5 * d['rps'] and g['p99_c64'] <= 40 else 'missed'} single-turn at c=64:"
        f" {g['rps'] / d['rps']:.0%} of direct ({g['rps']:,.0f} / {d['rps']:,.0f} req/s), p99 {g['p99_c64']:.1f} ms;"
        f" gateway {m['cpu_us']['gateway']:.0f} us CPU a request, {m['gw_cores']:.2f} of a core busy"
    )
    for name, c in m.get("conv", [])[:2]:
        print(
            f"  {'met   ' if c['rps'] >= 2500 else 'missed'} 20-turn conversations, {name}: {c['rps']:,.0f} req/s"
            f" ({c['rps'] / c['direct_rps']:.0%} of direct); gateway {c['cpu_us']:.0f} us CPU a request,"
            f" {c['gw_cores']:.2f} of a core busy"
        )
    goals = [
        ("added p50 at c=1 <= 0.5 ms (issue 12)", g["p50_c1"] - d["p50_c1"] <= 0.5),
        *(
            (
                f"{name}: added p50 at c=1 within 1 ms of a single-turn request's (issue 28)",
                c["added_p50"] - c["added_p50_single"] <= 1.0,
            )
            for name, c in m.get("conv", [])[:2]
        ),
    ]
    print("other goals:")
    for name, ok in goals:
        print(f"  {'met   ' if ok else 'missed'} {name}")


if __name__ == "__main__":
    sys.exit(main())
