"""The gateway's own HTTP client for URL arms (hermes_lab.live.upstream, serve.upstream_client: httptools) against a
real server on 127.0.0.1 that answers byte for byte as told: SSE events split anywhere across chunked pieces, a
kept-alive connection the server closed, an answer that never comes (a timeout: 504). The gateway's tests
(test_serve.py, test_live_rollout.py, test_gateway_conversations.py) drive the same client end to end."""

from __future__ import annotations

import asyncio
import itertools
import json

import pytest

from hermes_lab.config.schema import load_config
from hermes_lab.live.arms import UpstreamArm, UpstreamError, resolve_arm


def sse(obj: dict | str) -> bytes:
    return b"data: " + (obj if isinstance(obj, str) else json.dumps(obj)).encode() + b"\n\n"


def delta(**d: object) -> dict:
    return {"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": d, "finish_reason": None}]}


EVENTS = [
    sse(delta(role="assistant", content="")),
    b": a comment line, not forwarded\n\n",
    sse(delta(content="Hel")).replace(b"\n\n", b"\r\n\r\n"),  # CRLF events
    sse(delta(content="lo")),
    sse(delta(tool_calls=[{"index": 0, "id": "call_1", "function": {"name": "ls", "arguments": '{"pa'}}])),
    sse(delta(tool_calls=[{"index": 0, "function": {"arguments": 'th": "."}'}}])),
    sse({"id": "c", "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}),
    sse({"id": "c", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}),
    sse("[DONE]"),
]
STREAM = b"".join(EVENTS)
BODY = json.dumps({"choices": [{"message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}]}).encode()


class Server:
    """An HTTP/1.1 server from raw bytes: ``mode`` 'sse' (chunked, split into pieces at ``cuts``), 'close' (one
    answer per connection, then it closes though it said keep-alive), 'silent' (reads, never answers), 'slow'
    (answers after 50 ms; ``most``: the most requests it held at once)."""

    def __init__(self, mode: str, cuts: tuple[int, ...] = ()):
        self.mode, self.cuts, self.connections, self.requests = mode, cuts, 0, 0
        self.held = self.most = 0
        self.bodies: list[bytes] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                n = int(next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")).split(b":")[1])
                self.bodies.append(await reader.readexactly(n))
                self.requests += 1
                if self.mode == "silent":
                    await asyncio.sleep(30)
                if self.mode == "slow":
                    self.held += 1
                    self.most = max(self.most, self.held)
                    await asyncio.sleep(0.05)
                    self.held -= 1
                if self.mode == "sse":
                    writer.write(
                        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                    )
                    edges = [0, *self.cuts, len(STREAM)]
                    for a, b in itertools.pairwise(edges):  # each piece its own chunk, its own write
                        writer.write(b"%x\r\n" % (b - a) + STREAM[a:b] + b"\r\n")
                        await writer.drain()
                        await asyncio.sleep(0.001)
                    writer.write(b"0\r\n\r\n")
                else:
                    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                    writer.write(head % len(BODY) + BODY)
                await writer.drain()
                if self.mode == "close":
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()


def arm(url: str, **overrides: object) -> UpstreamArm:
    cfg = load_config(None, overrides=overrides)
    a = UpstreamArm(resolve_arm(cfg, "baseline", url, "m", ""), cfg)
    a.client_kind = "httptools"  # serve.upstream_client's default; said here whatever the config's default is
    return a


@pytest.mark.parametrize("cuts", [(), (7, 8, 60, 61, 150, 151, 152, 300), tuple(range(3, len(STREAM), 3))])
def test_a_stream_split_anywhere_is_forwarded_whole_and_read_for_the_log(cuts):
    """Pieces cut anywhere (inside 'data:', inside '\\r\\n\\r\\n', three bytes each): the client gets every event's
    bytes in order but the usage chunk it did not ask for and [DONE] (the gateway writes its own); the log's text,
    tool call, finish reason and usage are the stream's."""

    async def go() -> None:
        async with Server("sse", cuts) as url:
            a = arm(url)
            await a.start()
            err, events = await a.stream({"model": "x", "messages": [{"role": "user", "content": "hi"}]})
            assert err is None
            chunks = [c async for c in events]
            await a.close()
        forwarded = b"".join(c.raw for c in chunks)
        kept = [e for e in EVENTS if e.startswith(b"data:") and b'"usage"' not in e and b"[DONE]" not in e]
        assert forwarded == b"".join(kept)
        assert "".join(c.text for c in chunks) == "Hello"
        assert [c.finish_reason for c in chunks if c.finish_reason] == ["tool_calls"]
        assert [c.usage for c in chunks if c.usage] == [{"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}]
        calls = [p for c in chunks if c.calls for p in c.calls]
        assert "".join(p["function"]["arguments"] for p in calls) == '{"path": "."}'

    asyncio.run(go())


def test_a_kept_alive_connection_the_server_closed_is_not_reused_and_an_answer_that_never_comes_is_a_504():
    async def go() -> None:
        srv = Server("close")
        async with srv as url:
            a = arm(url)
            await a.start()
            for _ in range(3):  # the server closes each answer's connection: the next request opens a new one
                ans = await a.complete({"model": "x", "messages": [{"role": "user", "content": "hi"}]})
                assert (ans.status, ans.text, ans.finish_reason) == (200, "hi", "stop")
                await asyncio.sleep(0.05)
            await a.close()
        assert srv.requests == 3 and srv.connections == 3
        async with Server("silent") as url:
            a = arm(url, **{"serve.upstream_timeout_s": 0.3})
            await a.start()
            with pytest.raises(UpstreamError) as e:
                await a.complete({"model": "x", "messages": [{"role": "user", "content": "hi"}]})
            assert e.value.status == 504 and "timeout" in str(e.value)
            await a.close()

    asyncio.run(go())


def test_at_most_upstream_connections_requests_are_in_flight_and_a_cancelled_wait_frees_no_slot_twice():
    async def go() -> None:
        srv = Server("slow")
        async with srv as url:
            a = arm(url, **{"serve.upstream_connections": 2})
            await a.start()
            msg = {"model": "x", "messages": [{"role": "user", "content": "hi"}]}
            answers = await asyncio.gather(*(a.complete(msg) for _ in range(6)))
            assert [x.text for x in answers] == ["hi"] * 6
            assert srv.most == 2 and srv.connections == 2  # the other four waited for a slot, then reused them
            # two requests waiting for a slot are cancelled (their clients left); the slots stay two, not fewer
            # (a leaked slot) nor more (a waiter's slot handed on twice)
            tasks = [asyncio.ensure_future(a.complete(msg)) for _ in range(4)]
            await asyncio.sleep(0.02)  # two in flight, two waiting
            for t in tasks[2:]:
                t.cancel()
            done = await asyncio.gather(*tasks, return_exceptions=True)
            assert [x.text for x in done[:2]] == ["hi", "hi"]
            assert all(isinstance(x, asyncio.CancelledError) for x in done[2:])
            srv.most = 0
            # (a leaked slot would leave these waiting for ever: 10 s fails the test instead)
            answers = await asyncio.wait_for(asyncio.gather(*(a.complete(msg) for _ in range(5))), 10)
            assert [x.text for x in answers] == ["hi"] * 5 and srv.most == 2 and srv.requests == 13
            await a.close()

    asyncio.run(go())


@pytest.mark.parametrize("client", ["httptools", "httpx", "aiohttp"])
def test_each_client_sends_the_clients_messages_and_tools_with_the_arms_model(client):
    """serve.upstream_client: the gateway's own client writes a large body's parts as they are (its messages and
    tools the client's bytes), httpx and aiohttp (an arm behind a proxy) get them joined: the same body either way."""
    from hermes_lab.live.wire import ChatBody

    sent = {"model": "asked", "messages": [{"role": "user", "content": "x" * 5000}], "tools": [{"type": "function"}]}
    body = ChatBody(json.dumps(sent).encode())
    assert body.raws is not None  # large: sliced

    async def go() -> None:
        for mode in ("close", "sse"):
            srv = Server(mode)
            async with srv as url:
                a = arm(url)
                a.client_kind = client
                await a.start()
                if mode == "close":
                    ans = await a.complete(body)
                    assert ans.text == "hi"
                else:
                    err, events = await a.stream(body)
                    assert err is None and "".join([c.text async for c in events]) == "Hello"
                await a.close()
            got = json.loads(srv.bodies[0])
            want = {**sent, "model": "m"}
            if mode == "sse":
                want |= {"stream": True, "stream_options": {"include_usage": True}}
            assert got == want, mode

    asyncio.run(go())
