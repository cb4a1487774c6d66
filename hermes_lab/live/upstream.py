"""The gateway's HTTP/1.1 client for URL arms: kept-alive connections, requests written whole, responses parsed by
httptools (llhttp, the parser uvicorn serves with).

Stage: validate (live A/B, ``hermes-lab serve``). Used by ``hermes_lab.live.arms.UpstreamArm`` when
``serve.upstream_client`` is ``httptools`` (the default); reads and writes nothing on disk.

Why not aiohttp's client: on the gateway's hot path (benchmarks/bench_gateway.py, py-spy on the gateway
process) aiohttp's ``ClientSession._request`` was 33-40% of the event loop's time for a request the gateway only
forwards (request and response objects, header multidicts, timers, payload writers, a cookie jar, tracing hooks);
this client's work per request is one ``writelines`` of the ready head and body, the parser's callbacks, and one
timer. What it does not do, the arm hands to aiohttp: a proxy (``HTTPS_PROXY``), redirects, compression
(it asks for none: no ``Accept-Encoding``), HTTP/2.

A connection taken from the pool that the server had closed (its keep-alive ran out) before any byte of the
answer came is retried once on a new connection, as aiohttp does; a response read to its end goes back to the pool.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import httptools


class Closed(ConnectionError):
    """The server closed the connection before the answer was complete."""


class _Conn(asyncio.Protocol):
    """One connection: a request at a time; its answer's body collected whole, or handed on piece by piece."""

    def __init__(self, pool: Pool):
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.used = 0  # requests sent on it (a reused one may have been closed by the server meanwhile)
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.ctype = b""
        self.body: list[bytes] = []
        self.got = 0  # bytes of the answer received
        self.complete = self.headers_done = self.keep_alive = False
        self.error: BaseException | None = None
        self.waiter: asyncio.Future | None = None
        self.streaming = False

    # ----------------------------------------------------------------------------- protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.got += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._fail(ValueError(f"not an HTTP answer: {e}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.complete:
            self._fail(exc or Closed("the upstream closed the connection"))

    # ----------------------------------------------------------------------------- parser callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        if len(name) == 12 and name.lower() == b"content-type":
            self.ctype = value

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.headers_done = True
        if self.streaming:
            self._wake()

    def on_body(self, body: bytes) -> None:
        self.body.append(body)
        if self.streaming:
            self._wake()

    def on_message_complete(self) -> None:
        self.keep_alive = self.parser.should_keep_alive()  # (the parser forgets it once the message is done)
        self.complete = True
        self._wake()

    # ----------------------------------------------------------------------------- helpers
    def _wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _fail(self, e: BaseException) -> None:
        if self.error is None:
            self.error = e
        w = self.waiter
        if w is not None and not w.done():
            w.set_exception(e)

    def timed_out(self) -> None:
        self._fail(TimeoutError(f"no complete answer within {self.pool.timeout:g} s"))
        self.close()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    async def wait(self) -> None:
        if self.error is not None:
            raise self.error
        self.waiter = self.pool.loop.create_future()
        try:
            await self.waiter
        finally:
            self.waiter = None


class Pool:
    """Kept-alive connections to one upstream origin, at most ``limit`` open at once."""

    def __init__(self, url: str, headers: dict[str, str], limit: int, timeout: float):
        u = urlsplit(url)
        self.host = u.hostname or "127.0.0.1"
        self.port = u.port or (443 if u.scheme == "https" else 80)
        self.ssl: ssl.SSLContext | None = ssl.create_default_context() if u.scheme == "https" else None
        self.path = (u.path or "/") + (f"?{u.query}" if u.query else "")
        host = u.hostname if u.port is None else f"{u.hostname}:{u.port}"
        lines = [f"Host: {host}", *(f"{k}: {v}" for k, v in headers.items()), "Connection: keep-alive"]
        self._head = "\r\n".join(lines).encode("latin-1") + b"\r\nContent-Length: "
        self._heads: dict[str, bytes] = {}  # path -> its request head up to the length
        self.limit, self.timeout = limit, timeout
        self.idle: list[_Conn] = []
        self.open = 0
        # connections that may still open (at most ``limit`` in use), and the requests waiting for one: a
        # counter, not asyncio.Semaphore, whose acquire and release cost ~1.5 us of every request
        self._free = limit
        self._queue: deque[asyncio.Future] = deque()
        self.loop = asyncio.get_running_loop()  # made by the arm's start, on the gateway's loop

    def head(self, path: str, n: int) -> bytes:
        start = self._heads.get(path)
        if start is None:
            start = self._heads[path] = b"POST " + path.encode("latin-1") + b" HTTP/1.1\r\n" + self._head
        return b"%s%d\r\n\r\n" % (start, n)

    async def _acquire(self) -> None:
        """A slot: at once while fewer than ``limit`` requests are in flight, else handed over by ``_release``."""
        if self._free > 0 and not self._queue:
            self._free -= 1
            return
        fut = self.loop.create_future()
        self._queue.append(fut)
        try:
            await fut
        except BaseException:
            if fut.done() and not fut.cancelled():  # handed a slot, then cancelled before it ran: pass it on
                self._release()
            raise

    def _release(self) -> None:
        while self._queue:
            fut = self._queue.popleft()
            if not fut.done():  # (a cancelled waiter's future is done)
                fut.set_result(None)
                return
        self._free += 1

    async def _connect(self) -> _Conn:
        _, conn = await self.loop.create_connection(
            lambda: _Conn(self), self.host, self.port, ssl=self.ssl, server_hostname=self.host if self.ssl else None
        )
        self.open += 1
        return conn

    async def _send(self, path: str, body: list[Any], streaming: bool) -> tuple[_Conn, asyncio.TimerHandle]:
        """A connection with the request written (``body``: its parts, one writev), and the timer that fails it after
        ``timeout`` s."""
        await self._acquire()
        try:
            head = self.head(path, sum(map(len, body)))
            for attempt in (0, 1):
                conn = None
                while self.idle:
                    c = self.idle.pop()
                    if not c.closed:
                        conn = c
                        break
                    self.open -= 1
                fresh = conn is None
                if conn is None:
                    conn = await self._connect()
                conn._reset()
                conn.streaming = streaming
                conn.used += 1
                timer = self.loop.call_later(self.timeout, conn.timed_out)
                conn.transport.writelines((head, *body))  # type: ignore[union-attr]
                try:
                    while not conn.headers_done and not conn.complete:
                        await conn.wait()
                    return conn, timer
                except (Closed, ConnectionResetError, BrokenPipeError):
                    timer.cancel()
                    self._drop(conn)
                    if fresh or conn.got or attempt:  # only a stale kept-alive connection is retried
                        raise
                except BaseException:
                    timer.cancel()
                    self._drop(conn)
                    raise
            raise AssertionError("unreachable")
        except BaseException:
            self._release()
            raise

    def _drop(self, conn: _Conn) -> None:
        conn.close()
        self.open -= 1

    def _done(self, conn: _Conn, timer: asyncio.TimerHandle) -> None:
        """The request is over: the connection back to the pool when its answer was read whole."""
        timer.cancel()
        if conn.complete and not conn.closed and conn.error is None and conn.keep_alive:
            conn.waiter = None
            self.idle.append(conn)
        else:
            self._drop(conn)
        self._release()

    async def post(self, body: bytes | list[Any], path: str | None = None) -> tuple[int, bytes, str]:
        """(status, body, content type) of a POST (its body: bytes, or parts written as one), its answer read whole."""
        conn, timer = await self._send(path or self.path, body if isinstance(body, list) else [body], False)
        try:
            while not conn.complete:
                await conn.wait()
            chunks = conn.body
            return conn.status, chunks[0] if len(chunks) == 1 else b"".join(chunks), conn.ctype.decode("latin-1")
        finally:
            self._done(conn, timer)

    async def post_stream(self, body: list[Any]) -> tuple[int, AsyncIterator[bytes], Any]:
        """(status, the answer's body pieces as they arrive, a close function) of a POST of ``body``'s parts."""
        conn, timer = await self._send(self.path, body, True)
        finished = False

        def close() -> None:
            nonlocal finished
            if not finished:
                finished = True
                if not conn.complete:
                    conn.close()
                self._done(conn, timer)

        async def pieces() -> AsyncIterator[bytes]:
            try:
                while True:
                    if conn.body:
                        got, conn.body = conn.body, []
                        for piece in got:
                            yield piece
                    elif conn.complete:
                        return
                    else:
                        await conn.wait()
            finally:
                close()

        return conn.status, pieces(), close

    async def close(self) -> None:
        for c in self.idle:
            c.close()
        self.idle.clear()
