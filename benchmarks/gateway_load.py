"""The gateway benchmark's load (benchmarks/bench_gateway.py): what it sends, what answers, and how it sends.

The requests: one single-turn chat completion (``REQUEST``) and 20-turn tool-calling conversations whose requests
carry the whole history (``conversation``). The instant upstream (``run_stub``: aiohttp.web, one fixed pre-encoded
answer of each kind: text, a tool call, a streamed tool call), which bench_gateway.py runs in its own process
(``--stub PORT``). The two load generators (``RawSession``: pre-encoded requests on kept-alive connections on uvloop;
``AiohttpSession``: aiohttp's client; ``CLIENT["kind"]`` picks) and what they measure: requests one after another
(``sequential``, ``conv_sequential``) and many in flight (``burst``, ``conv_burst``). Reads and writes no files.
Not a script: bench_gateway.py and gateway_processes.py import it.

    python benchmarks/bench_gateway.py --quick --no-conversations --generator raw
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

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
