"""The gateway's HTTP/1.1 server (hermes_lab.live.server) as clients use it: a real `hermes-lab serve` subprocess
on 127.0.0.1 with both arms on the fake OpenAI upstream, driven by raw sockets, http.client and curl.

Keep-alive, pipelining in order, Expect: 100-continue, chunked request bodies, 413 before a large body is read
(the connection still usable after it), malformed requests, HTTP/1.0, SSE as chunks, and a SIGTERM that lets a
request in flight finish.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from gateway_process import wait_healthy

from fake_openai import PROXY_ENV_VARS, FakeOpenAI, free_port
from repo_paths import REPO

MAX_BODY = 4096
CHAT = {"model": "hermes", "messages": [{"role": "user", "content": "hello"}]}


class Served:
    def __init__(self, tmp: Path, upstream: str, extra: tuple[str, ...] = ()):
        self.port, self.log_dir = free_port(), tmp / "log"
        env = {k: v for k, v in os.environ.items() if k not in PROXY_ENV_VARS}
        env.update(PYTHONPATH=str(REPO), MLFLOW_DISABLE_TELEMETRY="true")
        cmd = [sys.executable, "-m", "hermes_lab.live.serve", "--port", str(self.port), "--log-dir", str(self.log_dir)]
        cmd += ["--baseline", upstream, "--baseline-model", "m", "--candidate", upstream, "--candidate-model", "m"]
        cmd += ["--ratio", "0.5", "--set", f"serve.max_body_bytes={MAX_BODY}", "--set", "serve.rollout=false"]
        cmd += ["--set", f"round.runs_dir={tmp / 'runs'}", *extra]
        self.out = tmp / "gateway.out"
        self.proc = subprocess.Popen(cmd, stdout=self.out.open("w"), stderr=subprocess.STDOUT, env=env, cwd=tmp)
        wait_healthy(self.url, self.proc, self.out.read_text)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def sock(self) -> socket.socket:
        s = socket.create_connection(("127.0.0.1", self.port), timeout=30)
        return s

    def records(self) -> list[dict]:
        p = self.log_dir / "requests.jsonl"
        return [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []


@pytest.fixture(scope="module")
def upstream():
    s = FakeOpenAI(models=("m",)).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def served(upstream, tmp_path_factory):
    srv = Served(tmp_path_factory.mktemp("served"), upstream.url)
    yield srv
    srv.proc.terminate()
    srv.proc.wait(60)


def post(path: str, body: bytes, extra: str = "", version: str = "1.1") -> bytes:
    return (
        f"POST {path} HTTP/{version}\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n{extra}\r\n"
    ).encode() + body


def read_response(f) -> tuple[int, dict[str, str], bytes]:
    """One response from a socket file: status, headers, body (content-length or chunked)."""
    status = int(f.readline().split()[1])
    hdrs = {}
    while (line := f.readline()) not in (b"\r\n", b""):
        k, _, v = line.decode().partition(":")
        hdrs[k.strip().lower()] = v.strip()
    if "content-length" in hdrs:
        return status, hdrs, f.read(int(hdrs["content-length"]))
    body = b""
    while size := int(f.readline().strip(), 16):
        body += f.read(size)
        f.readline()
    f.readline()
    return status, hdrs, body


def test_keep_alive_and_pipelined_requests_answered_in_order(served):
    assert httpx.get(served.url + "/healthz", trust_env=False).json()["event_loop"] == "uvloop"  # the default
    t0 = time.time()  # /healthz says warm once the decision's imports (a thread after start) are done
    with httpx.Client(trust_env=False) as poll:
        while not poll.get(served.url + "/healthz").json()["warm"]:
            assert time.time() - t0 < 120, "the gateway never said warm"
            time.sleep(0.2)
    c = http.client.HTTPConnection("127.0.0.1", served.port, timeout=30)
    first = None
    for i in range(3):  # one connection, three requests
        c.request("POST", "/v1/chat/completions", json.dumps(CHAT), {"X-Request-ID": f"ka-{i}"})
        r = c.getresponse()
        assert r.status == 200 and r.getheader("x-request-id") == f"ka-{i}" and r.getheader("x-hermes-arm")
        assert json.loads(r.read())["choices"][0]["message"]["content"]
        first = first or c.sock
        assert c.sock is first  # the same socket: kept alive
    c.close()
    # pipelined: three requests in one write (the middle one a GET of another route), answers in their order
    body = json.dumps(CHAT).encode()
    s = served.sock()
    s.sendall(
        post("/v1/chat/completions", body, "X-Request-ID: p-1\r\n")
        + b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
        + post("/v1/chat/completions", body, "X-Request-ID: p-2\r\n")
    )
    f = s.makefile("rb")
    got = [read_response(f) for _ in range(3)]
    assert [g[0] for g in got] == [200, 200, 200]
    assert got[0][1]["x-request-id"] == "p-1" and got[2][1]["x-request-id"] == "p-2"
    assert json.loads(got[1][2])["status"] == "ok"
    s.close()


def test_expect_continue_chunked_bodies_and_413(served):
    body = json.dumps({**CHAT, "messages": [{"role": "user", "content": "x" * 2000}]}).encode()
    # curl waits for the 100 before it sends the body (it asks by itself for large bodies: over 1 MB in curl 8)
    out = subprocess.run(
        [
            "curl",
            "-sS",
            "-v",
            "--noproxy",
            "*",
            "-H",
            "Content-Type: application/json",
            "-H",
            "Expect: 100-continue",
            "--data-binary",
            "@-",
            served.url + "/v1/chat/completions",
        ],
        input=body,
        capture_output=True,
        timeout=60,
        check=True,
    )
    assert b"< HTTP/1.1 100 Continue" in out.stderr and b"< HTTP/1.1 200 OK" in out.stderr, out.stderr[-600:]
    assert json.loads(out.stdout)["choices"][0]["message"]["content"]
    s = served.sock()
    f = s.makefile("rb")
    # a too-large body announced with Expect: refused at once, the body never sent
    s.sendall(
        post("/v1/chat/completions", b"", "Expect: 100-continue\r\n").replace(
            b"Content-Length: 0", f"Content-Length: {MAX_BODY + 1}".encode()
        )
    )
    status, _, err = read_response(f)
    assert status == 413 and json.loads(err)["error"]["code"] == "body_too_large"
    s.close()
    # a chunked body is read whole; a chunked body over the limit is read, dropped and refused; the connection
    # goes on serving
    s = served.sock()
    f = s.makefile("rb")
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    small = json.dumps(CHAT).encode()
    s.sendall(head + b"%x\r\n%s\r\n%x\r\n%s\r\n0\r\n\r\n" % (10, small[:10], len(small) - 10, small[10:]))
    assert read_response(f)[0] == 200
    big = b"x" * 3000
    s.sendall(head + (b"%x\r\n%s\r\n" % (len(big), big)) * 2 + b"0\r\n\r\n")
    status, _, err = read_response(f)
    assert status == 413 and b"serve.max_body_bytes" in err
    s.sendall(post("/v1/chat/completions", small))
    assert read_response(f)[0] == 200
    s.close()
    # a Content-Length over the limit without Expect: the body is read and dropped, 413, and the next request works
    s = served.sock()
    f = s.makefile("rb")
    s.sendall(post("/v1/chat/completions", b"y" * (MAX_BODY + 10)) + post("/v1/chat/completions", small))
    assert [read_response(f)[0] for _ in range(2)] == [413, 200]
    s.close()


def test_malformed_http_1_0_and_streams(served):
    s = served.sock()
    s.sendall(b"THIS IS NOT HTTP\r\n\r\n")
    f = s.makefile("rb")
    status, hdrs, _ = read_response(f)
    assert status == 400 and hdrs["connection"] == "close" and f.read() == b""  # then closed
    s.close()
    # a malformed request after a good one on the same connection: the good one answered first, then the 400
    s = served.sock()
    s.sendall(post("/v1/chat/completions", json.dumps(CHAT).encode()) + b"GARBAGE / HTTP/9\r\n\r\n")
    f = s.makefile("rb")
    assert [read_response(f)[0] for _ in range(2)] == [200, 400] and f.read() == b""
    s.close()
    # HTTP/1.0 without keep-alive: answered, then closed
    s = served.sock()
    s.sendall(post("/v1/chat/completions", json.dumps(CHAT).encode(), version="1.0"))
    f = s.makefile("rb")
    assert read_response(f)[0] == 200 and f.read() == b""
    s.close()
    # a streamed answer: SSE events as HTTP chunks, ending with [DONE], its record complete
    with (
        httpx.Client(trust_env=False, timeout=30) as h,
        h.stream(
            "POST",
            served.url + "/v1/chat/completions",
            json={**CHAT, "stream": True},
            headers={"X-Request-ID": "sse-1"},
        ) as r,
    ):
        assert r.headers["transfer-encoding"] == "chunked" and r.headers["content-type"] == "text/event-stream"
        text = b"".join(r.iter_bytes()).decode()
    events = [e for e in text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]" and len(events) >= 3
    rec = next(r for r in served.records() if r["request_id"] == "sse-1")
    assert rec["stream"] and rec["status"] == "ok" and rec["response"]


def test_sigterm_lets_a_request_in_flight_finish(upstream, tmp_path):
    """On Python's own event loop (serve.event_loop: asyncio; the other tests run on uvloop, the default)."""
    srv = Served(tmp_path, upstream.url, ("--set", "serve.event_loop=asyncio"))
    assert httpx.get(srv.url + "/healthz", trust_env=False).json()["event_loop"] == "asyncio"
    upstream.configure(delay_s=2.0)
    try:
        got: dict = {}

        def call() -> None:
            got["r"] = httpx.post(
                srv.url + "/v1/chat/completions",
                json=CHAT,
                trust_env=False,
                timeout=60,
                headers={"X-Request-ID": "in-flight"},
            )

        t = threading.Thread(target=call)
        t.start()
        time.sleep(1.0)  # the request is waiting on its upstream
        srv.proc.send_signal(signal.SIGTERM)
        t.join(60)
        assert got["r"].status_code == 200
        assert srv.proc.wait(60) == 0
        assert [r["request_id"] for r in srv.records()] == ["in-flight"]
        with pytest.raises(httpx.ConnectError):  # no longer accepting
            httpx.get(srv.url + "/healthz", trust_env=False, timeout=2)
    finally:
        upstream.reset()
        if srv.proc.poll() is None:
            srv.proc.kill()


def test_a_client_leaving_mid_stream_is_recorded_with_what_it_got(served, upstream):
    """The stream is stopped when its client goes away, and its record says 499 with the part it was sent."""
    upstream.configure(chat_reply="word " * 400)  # ~400 pieces, 2 ms apart: about a second of streaming
    try:
        s = served.sock()
        body = json.dumps({**CHAT, "stream": True}).encode()
        s.sendall(post("/v1/chat/completions", body, "X-Request-ID: gone-1\r\n"))
        got = b""
        while got.count(b"data:") < 5:  # some of the answer has arrived
            got += s.recv(65536)
        s.close()
        t0 = time.time()
        while time.time() - t0 < 30 and not any(r["request_id"] == "gone-1" for r in served.records()):
            time.sleep(0.1)
        rec = next(r for r in served.records() if r["request_id"] == "gone-1")
        assert (rec["http_status"], rec["error"], rec["stream"]) == (499, "client disconnected", True)
        assert 0 < len(rec["response"]) < len("word " * 400)
    finally:
        upstream.reset()


def test_a_stream_that_ends_in_its_last_piece_goes_out_with_its_end(served, upstream):
    """An upstream piece that holds the answer's last events and [DONE] reaches the client whole and in one chunk
    with the end, after its record is written; earlier pieces still go out as they come (the test above)."""
    upstream.configure(stream_whole=True, chat_reply="all in one piece")
    try:
        s = served.sock()
        body = json.dumps({**CHAT, "stream": True, "stream_options": {"include_usage": True}}).encode()
        s.sendall(post("/v1/chat/completions", body, "X-Request-ID: whole-1\r\n"))
        f = s.makefile("rb")
        assert int(f.readline().split()[1]) == 200
        while f.readline() != b"\r\n":
            pass
        chunks = []
        while size := int(f.readline().strip(), 16):
            chunks.append(f.read(size))
            f.readline()
        s.close()
        assert len(chunks) == 1, chunks  # the events, the usage and [DONE]: one chunk, then the end
        events = [json.loads(e[6:]) for e in chunks[0].decode().split("\n\n") if e and e != "data: [DONE]"]
        assert chunks[0].endswith(b"data: [DONE]\n\n")
        text = "".join((e["choices"][0]["delta"].get("content") or "") for e in events if e["choices"])
        assert text == "all in one piece" and events[-1]["usage"]["completion_tokens"] > 0
        rec = next(r for r in served.records() if r["request_id"] == "whole-1")
        assert (rec["status"], rec["response"], rec["stream"]) == ("ok", "all in one piece", True)
    finally:
        upstream.reset()


@pytest.mark.parametrize("event_loop", ["uvloop", "asyncio"])
def test_a_burst_of_new_connections_is_accepted_at_once_on_a_busy_loop(event_loop):
    """Every connection waiting in the listening socket's queue is taken at the socket's next readiness, however
    busy the loop: libuv (uvloop) accepts one per loop iteration, which held the last of 64 agents' new
    connections 100-400 ms behind the requests of the first (the single-turn p99, docs/performance.md)."""
    import asyncio

    import uvloop

    from hermes_lab.live.handling import _Raw
    from hermes_lab.live.server import Server

    n, seen, ready = 24, [], threading.Event()

    async def chat(hdr, receive):
        seen.append(len(srv.conns))  # connections accepted when this request is handled
        if len(seen) == 1:  # the first request holds the loop while the others connect and send theirs
            ready.wait(30)
        time.sleep(0.02)  # each request's CPU: a busy loop, one iteration after another
        return _Raw(b"{}", 200, [])

    srv = Server(app=None, chat=chat, refuse=None, max_body=MAX_BODY)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    answers: list[bytes] = []

    def clients():
        socks = [socket.create_connection(("127.0.0.1", port), timeout=30)]
        socks[0].sendall(post("/v1/chat/completions", b"{}"))
        while not seen:
            time.sleep(0.01)
        for _ in range(n):  # completed by the kernel while the loop is held: they wait in the accept queue
            s = socket.create_connection(("127.0.0.1", port), timeout=30)
            s.sendall(post("/v1/chat/completions", b"{}"))
            socks.append(s)
        time.sleep(0.1)
        ready.set()
        answers.extend(read_response(s.makefile("rb"))[0] for s in socks)
        for s in socks:  # after every answer: the server's count of connections is what it accepted
            s.close()

    async def main():
        await srv.start(sock)
        t = threading.Thread(target=clients)
        t.start()
        while t.is_alive():
            await asyncio.sleep(0.01)
        await srv.stop()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop if event_loop == "uvloop" else None) as runner:
        runner.run(main())
    assert answers == [200] * (n + 1)
    assert seen[0] == 1 and seen[1] == n + 1, seen  # all taken before the second request was handled
