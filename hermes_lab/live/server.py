"""The gateway's HTTP/1.1 server: ``hermes-lab serve`` and the live flywheel's switchboard on a bound socket.

Stage: validate (live A/B). Reads and writes nothing itself: it parses requests (httptools: llhttp, the parser
uvicorn uses) and hands ``POST /v1/chat/completions`` straight to the gateway's ``chat`` (``hermes_lab.live.handling``),
its answer written as one buffer (``_Raw``) or as chunked SSE pieces (``_Events``); every other request goes to the
gateway's ASGI app (``hermes_lab.live.routes.build_app``: Starlette's router) through a minimal ASGI bridge. The
gateway's start and stop are called around serving (what the ASGI lifespan did under uvicorn).

    hermes-lab serve --params params/embedded.yaml      # python -m hermes_lab.live.serve (Server.serve)
    hermes-lab flywheel --live                           # its supervisor: Server.start / Server.stop

Why not uvicorn: on the hot path it cost a scope dict, a request-response cycle object, header checks by regular
expression and one ``send`` message per response part (benchmarks/bench_gateway.py --profile); here a request is
a dict of lower-cased headers and its body, an answer one ``transport.write``. HTTP/1.1 as clients use it:
keep-alive (closed after ``KEEP_ALIVE_S`` idle), pipelined requests answered in order, ``Expect: 100-continue``,
chunked request bodies, a body over ``max_body`` refused with 413 (read and dropped, the connection kept; not
sent at all after ``Expect: 100-continue``), a malformed request a 400 in its turn, then the connection closed.
SIGTERM / SIGINT: stop accepting, close idle connections, let requests in flight finish (``GRACE_S`` at most),
then stop the gateway.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import logging
import signal
import socket
import sys
import time
from collections import deque
from typing import Any
from urllib.parse import unquote

import httptools

from hermes_lab.live.handling import _Events, _Last, _Raw, error_body, too_big

log = logging.getLogger("hermes_lab.serve")
access = logging.getLogger("hermes_lab.serve.access")
KEEP_ALIVE_S = 75.0  # an idle kept-alive connection is closed after this (uvicorn's setting before)
GRACE_S = 30.0  # requests still in flight this long after SIGTERM are cut
HIGH_WATER = 64 * 1024  # a stream waits for a slow client once this much is unsent
BACKLOG = 2048  # the listening socket's queue, and the most connections taken from it at one readiness
_OUT_OF = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)  # accept() failing for want of resources
CHAT = b"/v1/chat/completions"
_REASONS = {
    200: b"OK",
    202: b"Accepted",
    400: b"Bad Request",
    401: b"Unauthorized",
    404: b"Not Found",
    405: b"Method Not Allowed",
    413: b"Payload Too Large",
    422: b"Unprocessable Entity",
    429: b"Too Many Requests",
    500: b"Internal Server Error",
    502: b"Bad Gateway",
    503: b"Service Unavailable",
    504: b"Gateway Timeout",
}


def status_line(status: int) -> bytes:
    return b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b"Status"))


_STATUS = {k: status_line(k) for k in _REASONS}


def head(status: int, headers: list[tuple[bytes, bytes]], close: bool) -> bytes:
    """A response's status line and headers (names and values are the gateway's own: no checks needed), joined
    from their parts (``b"%s: %s" %`` per header cost ~0.8 us more of a request)."""
    parts = [_STATUS.get(status) or status_line(status)]
    for k, v in headers:
        parts += (k, b": ", v, b"\r\n")
    parts.append(b"connection: close\r\n\r\n" if close else b"\r\n")
    return b"".join(parts)


class Request:
    """One parsed request: method, URL, headers (a dict, last one wins, and the raw list for ASGI) and body."""

    __slots__ = ("body", "fail", "hdr", "headers", "keep_alive", "method", "url")

    def __init__(self) -> None:
        self.method, self.url, self.keep_alive = b"", b"", True
        # answered with this error (status, message, code) instead: a body over the limit (read and dropped), or a
        # request that cannot be read on (then keep_alive is False: the connection closes after it)
        self.fail: tuple[int, str, str] | None = None
        self.hdr: dict[bytes, bytes] = {}
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []


class Connection(asyncio.Protocol):
    """One client connection: httptools parses, complete requests are answered one at a time, in order."""

    def __init__(self, server: Server):
        self.server = server
        self.parser = httptools.HttpRequestParser(self)
        self.transport: Any = None
        self.req: Request | None = None
        self.size = 0
        self.queue: deque[Request] = deque()
        self.task: asyncio.Task | None = None
        self.loop: Any = None
        self.gone: asyncio.Future | None = None  # set when the client goes away
        self.paused = False  # our writes: the transport's buffer is over its high water mark
        self.drained: asyncio.Future | None = None
        self.idle_since = time.monotonic()
        self.streaming = self.failed = False

    # the transport's side
    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        transport.set_write_buffer_limits(HIGH_WATER)
        sock = transport.get_extra_info("socket")
        if sock is not None:  # an answer goes out at once, not after the client's delayed ACK
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.loop = asyncio.get_running_loop()
        self.gone = self.loop.create_future()
        self.server.conns.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.conns.discard(self)
        if self.gone is not None and not self.gone.done():
            self.gone.set_result(None)
        if self.drained is not None and not self.drained.done():
            self.drained.set_result(None)
        if self.task is not None and self.streaming:  # a stream's client left: stop it (its record says 499)
            self.task.cancel()

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        if self.drained is not None and not self.drained.done():
            self.drained.set_result(None)

    def data_received(self, data: bytes) -> None:
        if self.failed:  # the rest of a connection whose request could not be read: dropped
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(400, "protocol upgrades are not served", "bad_request")
        except httptools.HttpParserError as e:
            self._fail(400, f"malformed HTTP request: {e}", "bad_request")

    # the parser's callbacks
    def on_message_begin(self) -> None:
        self.req, self.size = (None if self.failed else Request()), 0

    def on_url(self, url: bytes) -> None:
        if self.req is not None:
            self.req.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.req is not None:
            name = name.lower()
            self.req.hdr[name] = value
            self.req.headers.append((name, value))

    def on_headers_complete(self) -> None:
        req = self.req
        if req is None:
            return
        req.method = self.parser.get_method()
        req.keep_alive = self.parser.should_keep_alive()
        cl = req.hdr.get(b"content-length", b"")
        if cl.isdigit() and int(cl) > self.server.max_body:
            req.fail = self.server.too_big
        if req.hdr.get(b"expect", b"").lower() == b"100-continue":
            if req.fail is not None:  # the client waits for this answer before it sends the body
                self._fail(*req.fail)
            elif not self.queue and self.task is None:
                self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        req = self.req
        if req is None or req.fail is not None:  # an oversized body is read and dropped; its answer is a 413
            return
        self.size += len(body)
        if self.size > self.server.max_body:
            req.fail, req.body = self.server.too_big, []
            return
        req.body.append(body)

    def on_message_complete(self) -> None:
        req, self.req = self.req, None
        if req is None or self.transport.is_closing():
            return
        self.queue.append(req)
        if self.task is None:
            self.task = self.loop.create_task(self._answer_all())
        elif len(self.queue) > 1:  # pipelined beyond one: read no more until they are answered
            self.transport.pause_reading()

    def _fail(self, status: int, message: str, code: str) -> None:
        """A request that cannot be read on: answered with its error after the requests before it, then the
        connection is closed (what follows it is not read)."""
        req = Request()
        req.fail, req.keep_alive = (status, message, code), False
        self.req, self.failed = None, True
        self.queue.append(req)
        if self.task is None:
            self.task = self.loop.create_task(self._answer_all())
        self.transport.pause_reading()

    # answering
    async def _answer_all(self) -> None:
        try:
            while self.queue:
                req = self.queue.popleft()
                keep = await self._answer(req) and req.keep_alive and not self.server.stopping
                if not keep:
                    self.transport.close()
                    return
                if self.transport.is_closing():
                    return
                self.transport.resume_reading()
        finally:
            self.task = None
            self.idle_since = time.monotonic()

    async def _answer(self, req: Request) -> bool:
        """Answer one request; False: the connection cannot carry another (an answer cut short)."""
        srv, out = self.server, None
        srv.inflight += 1
        t, status = time.perf_counter(), 500
        try:
            if req.fail is not None:  # a 413 is the gateway's refusal (counted); a malformed request the server's
                status, message, code = req.fail
                resp = (
                    srv.refuse(status, message, code)
                    if status == 413
                    else _Raw(error_body(message, code=code), status, [])
                )
            elif req.method == b"POST" and req.url == CHAT:
                body = req.body[0] if len(req.body) == 1 else b"".join(req.body)
                resp = await srv.chat(req.hdr, _Receive(body, self.gone))
            else:
                resp = srv.app
            if type(resp) is _Raw:
                status = resp.status_code
                self._write(resp, not req.keep_alive)
                return True
            if type(resp) is _Events:
                status = 200
                return await self._stream(resp, req.keep_alive)
            out = _Send(self, req.keep_alive)  # any other answer, or another route: ASGI
            await resp(self._scope(req), _Receive(b"".join(req.body), self.gone), out)
            status = out.status
            return out.done
        except asyncio.CancelledError:
            if self.transport.is_closing():  # the client left mid-answer: nothing more to do
                status = 499
                return False
            raise
        except Exception:
            log.exception("request failed: %s %s", req.method.decode(), req.url.decode("latin-1"))
            if out is None or not out.status:
                failed = error_body("the gateway failed on this request (see its log)", "server_error", "internal")
                self._write(_Raw(failed, 500, []), True)
            return False
        finally:
            srv.inflight -= 1
            if srv.access:
                ms = (time.perf_counter() - t) * 1000
                access.info('"%s %s" %d %.1f ms', req.method.decode(), req.url.decode("latin-1"), status, ms)

    def _write(self, resp: _Raw, close: bool) -> None:
        if not self.transport.is_closing():
            self.transport.write(head(resp.status_code, resp.raw_headers, close) + resp.body)

    async def _drain(self) -> None:
        if self.paused and not self.transport.is_closing():
            self.drained = self.loop.create_future()
            await self.drained

    async def _stream(self, resp: _Events, keep_alive: bool) -> bool:
        """An SSE answer as HTTP chunks: each upstream piece one chunk. The head goes out with the first piece and
        the end with the last (one send each instead of three: a send is a system call)."""
        write = self.transport.writelines  # one writev of the parts: a piece is framed without being copied
        pending = head(200, [*resp.raw_headers, (b"transfer-encoding", b"chunked")], not keep_alive)
        self.streaming = True
        try:
            async for piece in resp.body:
                if self.transport.is_closing():
                    raise asyncio.CancelledError
                parts = (pending, b"%x\r\n" % len(piece), piece, b"\r\n") if piece else (pending,)
                pending = b""
                if type(piece) is _Last:
                    write((*parts, b"0\r\n\r\n"))
                    return True
                write(parts)
                await self._drain()
            write((pending, b"0\r\n\r\n"))
            return True
        finally:
            self.streaming = False
            await resp.body.aclose()  # a generator left mid-way records what its client got

    def _scope(self, req: Request) -> dict[str, Any]:
        path, _, query = req.url.partition(b"?")
        return {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": req.method.decode(),
            "scheme": "http",
            "path": unquote(path.decode("latin-1")),
            "raw_path": path,
            "query_string": query,
            "root_path": "",
            "headers": req.headers,
            "server": self.server.address,
            "client": self.transport.get_extra_info("peername"),
        }


class _Receive:
    """ASGI receive: the body whole, then ``http.disconnect`` once the client goes away."""

    __slots__ = ("body", "gone")

    def __init__(self, body: bytes, gone: asyncio.Future | None):
        self.body, self.gone = body, gone

    async def __call__(self) -> dict[str, Any]:
        if self.body is not None:
            body, self.body = self.body, None
            return {"type": "http.request", "body": body, "more_body": False}
        if self.gone is not None:
            await asyncio.shield(self.gone)
        return {"type": "http.disconnect"}


class _Send:
    """ASGI send onto the connection: a response with a content-length as is, else chunked."""

    def __init__(self, conn: Connection, keep_alive: bool):
        self.conn, self.keep_alive = conn, keep_alive
        self.chunked = self.done = False
        self.status = 0

    async def __call__(self, msg: dict[str, Any]) -> None:
        t = self.conn.transport
        if t.is_closing():
            return
        if msg["type"] == "http.response.start":
            self.status = msg["status"]
            hdrs = [(bytes(k).lower(), bytes(v)) for k, v in msg.get("headers", [])]
            self.chunked = not any(k == b"content-length" for k, _ in hdrs)
            if self.chunked:
                hdrs.append((b"transfer-encoding", b"chunked"))
            t.write(head(msg["status"], hdrs, not self.keep_alive))
        elif msg["type"] == "http.response.body" and not self.done:
            body, more = msg.get("body", b""), msg.get("more_body", False)
            if self.chunked:
                t.write((b"%x\r\n%s\r\n" % (len(body), body) if body else b"") + (b"" if more else b"0\r\n\r\n"))
            elif body:
                t.write(body)
            self.done = not more
            await self.conn._drain()


class Server:
    """The listening socket's connections, the gateway's chat handler and ASGI app, and an orderly stop."""

    def __init__(self, app: Any, chat: Any, refuse: Any, max_body: int, access_log: bool = False):
        """``chat(headers, receive)``: the chat endpoint's answer; ``refuse(status, message)``: an error answer
        (the gateway's, which counts it)."""
        self.app, self.chat, self.refuse, self.max_body, self.access = app, chat, refuse, max_body, access_log
        self.too_big = (413, too_big(max_body), "body_too_large")
        self.conns: set[Connection] = set()
        self.inflight = 0
        self.stopping = False
        self.address: tuple[str, int] | None = None
        self._loop: Any = None
        self._sock: Any = None
        self._sweeper: Any = None

    async def start(self, sock: socket.socket) -> None:
        """Accept connections on ``sock`` (bound) from now on, on the running event loop.

        The server takes every pending connection at each readiness of the listening socket itself, as
        Python's asyncio does, instead of ``loop.create_server``: under uvloop, libuv accepts one connection
        per loop iteration (since libuv 1.45, libuv#3696), so on a busy loop a burst of 64 new connections
        waited up to 64 iterations, 100-400 ms (docs/performance.md, the single-turn p99)."""
        self.address = sock.getsockname()[:2]
        self._loop, self._sock = asyncio.get_running_loop(), sock
        sock.setblocking(False)
        sock.listen(BACKLOG)
        self._loop.add_reader(sock.fileno(), self._accept)
        self._sweeper = asyncio.ensure_future(self._sweep())

    def _accept(self) -> None:
        for _ in range(BACKLOG):
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno not in _OUT_OF:  # ECONNABORTED and the like: that client is gone, the next may wait
                    continue
                # out of descriptors or memory: stop accepting for a second (the kernel queues) instead of
                # spinning on a socket that stays readable
                log.warning("serve: cannot accept connections (%s); retrying in 1 s", e)
                self._loop.remove_reader(self._sock.fileno())
                self._loop.call_later(1.0, self._resume_accepting)
                return
            conn.setblocking(False)
            task = self._loop.create_task(self._loop.connect_accepted_socket(lambda: Connection(self), conn))
            task.add_done_callback(functools.partial(_accepted, conn))

    def _resume_accepting(self) -> None:
        if not self.stopping:
            self._loop.add_reader(self._sock.fileno(), self._accept)

    async def stop(self) -> None:
        """Stop accepting, close idle connections, let the requests in flight finish (GRACE_S at most)."""
        self.stopping = True
        self._loop.remove_reader(self._sock.fileno())
        self._sock.close()
        self._sweeper.cancel()
        t0 = time.monotonic()
        while time.monotonic() - t0 < GRACE_S:
            for c in list(self.conns):
                if c.task is None:
                    c.transport.close()
            if not self.inflight:
                break
            await asyncio.sleep(0.05)
        for c in list(self.conns):
            c.transport.close()

    async def serve(self, sock: socket.socket, startup: Any, shutdown: Any) -> None:
        """``startup()``, serve until SIGTERM / SIGINT, ``stop()``, ``shutdown()``."""
        loop = asyncio.get_running_loop()
        await startup()
        stop = loop.create_future()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda: stop.done() or stop.set_result(None))
        await self.start(sock)
        try:
            await stop
        finally:
            await self.stop()
            await shutdown()

    async def _sweep(self) -> None:
        """Close kept-alive connections idle longer than KEEP_ALIVE_S (one pass every few seconds, not a timer
        per request)."""
        while True:
            await asyncio.sleep(min(5.0, KEEP_ALIVE_S / 2))
            limit = time.monotonic() - KEEP_ALIVE_S
            for c in list(self.conns):
                if c.task is None and not c.queue and c.idle_since < limit:
                    c.transport.close()


def _accepted(conn: socket.socket, task: asyncio.Task) -> None:
    """A connection whose transport could not be set up (its client already gone): closed and logged, never
    raised."""
    if not task.cancelled() and task.exception() is not None:
        log.debug("serve: an accepted connection was dropped: %s", task.exception())
        conn.close()


def run(sock: socket.socket, gw: Any, app: Any, access_log: bool = False, event_loop: str = "uvloop") -> None:
    """Serve gateway ``gw`` (its ASGI ``app`` for the routes but chat) on ``sock`` until SIGTERM / SIGINT, on
    ``event_loop`` (serve.event_loop: uvloop where it is installed, or Python's asyncio)."""
    factory: Any = None
    if event_loop == "uvloop":
        try:
            import uvloop

            factory = uvloop.new_event_loop
        except ImportError:  # pragma: no cover - uvloop comes with uvicorn[standard]
            log.warning("serve.event_loop uvloop: uvloop is not installed; Python's asyncio serves")
    if access_log:  # serve.access_log: one line per request on stdout (never headers or bodies)
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        access.addHandler(handler)
        access.setLevel(logging.INFO)
    srv = Server(app, gw.chat, gw.refuse, gw.max_body, access_log)
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(srv.serve(sock, gw.startup, gw.shutdown))
