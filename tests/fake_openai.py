"""A real OpenAI-compatible HTTP server for tests (http.server in a thread, 127.0.0.1, a free port).

Speaks GET /v1/models and POST /v1/chat/completions. A chat whose user message holds the judge's REFERENCE and
RESPONSE blocks (between markers carrying the tag its system message announces: hermes_lab.llm.judge) gets a
deterministic score (``judge_score``); any other chat gets "OK". Misbehaves on request, through attributes (or
``configure(**kw)``):

    api_key      require "Authorization: Bearer <api_key>", else 401 with a JSON error that echoes the key
                 it got (as some providers do), so tests can check the client redacts it
    mode         "ok" | "html" (200 text/html page, a middlebox) | "malformed" (truncated JSON)
                 | "no_choices" (valid JSON without choices)
    fail_429     answer 429 this many times (with Retry-After: ``retry_after`` when set), then normally
    fail_500     answer 500 this many times
    delay_s      sleep this long before answering; ``delay_n`` limits it to the first N requests
    chat_reply   a fixed chat reply (e.g. unparseable text); ``judge_format`` formats the score ("{score}")
    injectable   a gullible judge: it obeys "score: N" (or "reply N") anywhere outside the tagged data blocks,
                 the way an injected instruction reaches a model once a completion has closed its block

Every request is recorded (``requests``: method, path, lower-cased headers, JSON body);
``max_inflight`` is the most requests seen in flight at once. Reads and writes nothing on disk.
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import threading
import time
from dataclasses import dataclass, field
from difflib import SequenceMatcher
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

PROXY_ENV_VARS = (
    "HTTPS_PROXY",
    "https_proxy",
    "HTTP_PROXY",
    "http_proxy",
    "ALL_PROXY",
    "all_proxy",
    "NO_PROXY",
    "no_proxy",
)
HTML_PAGE = (
    "<!DOCTYPE html>\n<html><head><title>Access denied</title></head>"
    "<body><h1>Blocked by gateway</h1><p>Your request was blocked.</p></body></html>\n"
)
_DEFAULTS: dict[str, Any] = {
    "api_key": None,
    "mode": "ok",
    "fail_429": 0,
    "retry_after": None,
    "fail_500": 0,
    "delay_s": 0.0,
    "delay_n": None,
    "chat_reply": None,
    "judge_format": "{score}",
    "injectable": False,
}


def free_port() -> int:
    """A port that nothing listens on (bound, then closed): 'server down' and 'stale proxy' tests."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def judge_score(response: str, reference: str, scale: int = 5) -> int:
    """The fake judge: full marks for an exact match, else similarity rounded down, at most scale - 1."""
    if response.strip() == reference.strip():
        return scale
    return min(scale - 1, int(scale * SequenceMatcher(None, response.strip(), reference.strip()).ratio()))


@dataclass
class Recorded:
    method: str
    path: str
    headers: dict[str, str]
    body: Any = None
    at: float = field(default_factory=time.time)


class FakeOpenAI:
    def __init__(self, models: tuple[str, ...] | list[str] = ("judge-1", "policy-1"), **settings: Any):
        self.models = list(models)
        self.requests: list[Recorded] = []
        self.inflight = self.max_inflight = 0
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self.reset()
        self.configure(**settings)

    # ------------------------------------------------------------------------------------- control
    def reset(self) -> None:
        for k, v in _DEFAULTS.items():
            setattr(self, k, v)

    def configure(self, **settings: Any) -> FakeOpenAI:
        for k, v in settings.items():
            if k not in _DEFAULTS:
                raise AttributeError(f"FakeOpenAI has no setting {k!r}; settings: {', '.join(_DEFAULTS)}")
            setattr(self, k, v)
        return self

    def start(self) -> FakeOpenAI:
        handler = type("Handler", (_Handler,), {"fake": self})
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True  # a handler asleep in delay_s must not block stop()
        # a short poll interval: stop() waits up to one interval for the serving loop
        threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True, name="fake-openai"
        ).start()
        return self

    def stop(self) -> None:
        if self._server:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> FakeOpenAI:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def port(self) -> int:
        assert self._server, "server not started"
        return self._server.server_address[1]

    @property
    def url(self) -> str:
        """The API root, as TAOTOKEN_BASE_URL holds it (the client appends /v1/...)."""
        return f"http://127.0.0.1:{self.port}"

    def count(self, path: str | None = None) -> int:
        return sum(1 for r in self.requests if path is None or r.path == path)

    # ------------------------------------------------------------------------------------- serving
    def _handle(self, h: BaseHTTPRequestHandler) -> None:
        length = int(h.headers.get("Content-Length") or 0)
        raw = h.rfile.read(length) if length else b""
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = raw
        path = h.path.split("?", 1)[0]
        with self._lock:
            self.requests.append(Recorded(h.command, path, {k.lower(): v for k, v in h.headers.items()}, body))
            n = len(self.requests)
            self.inflight += 1
            self.max_inflight = max(self.max_inflight, self.inflight)
        try:
            if self.delay_s and (self.delay_n is None or n <= self.delay_n):
                time.sleep(self.delay_s)
        finally:
            # out of flight once the answer starts: a client that reads it and sends its next request at once
            # must not be seen with one request too many (counted after the write, a loaded machine saw 4 of 3)
            with self._lock:
                self.inflight -= 1
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # the client gave up (timeout test)
            self._answer(h, path, body)

    def _answer(self, h: BaseHTTPRequestHandler, path: str, body: Any) -> None:
        auth = h.headers.get("Authorization", "")
        if self.api_key is not None and auth != f"Bearer {self.api_key}":
            sent = auth.split(" ", 1)[-1] if auth else "none"
            return self._json(
                h,
                401,
                {
                    "error": {
                        "message": f"Incorrect API key provided: {sent}",
                        "type": "invalid_request_error",
                        "code": "invalid_api_key",
                    }
                },
            )
        with self._lock:
            e429, self.fail_429 = self.fail_429 > 0, max(0, self.fail_429 - 1)
            e500 = not e429 and self.fail_500 > 0
            if e500:
                self.fail_500 -= 1
        if e429:
            extra = {"Retry-After": str(self.retry_after)} if self.retry_after is not None else {}
            return self._json(h, 429, {"error": {"message": "Rate limit reached", "code": "rate_limit"}}, extra)
        if e500:
            return self._json(h, 500, {"error": {"message": "Internal server error"}})
        if self.mode == "html":
            return self._send(h, 200, HTML_PAGE.encode(), "text/html; charset=utf-8")
        if self.mode == "malformed":
            return self._send(h, 200, b'{"id": "cmpl-1", "choices": [{"message": {"content": "4', "application/json")
        if self.mode == "no_choices":
            return self._json(h, 200, {"id": "cmpl-1", "object": "chat.completion"})
        if h.command == "GET" and path == "/v1/models":
            return self._json(
                h,
                200,
                {"object": "list", "data": [{"id": m, "object": "model", "owned_by": "fake"} for m in self.models]},
            )
        if h.command == "POST" and path == "/v1/chat/completions":
            model = (body or {}).get("model") if isinstance(body, dict) else None
            if model not in self.models:
                return self._json(
                    h, 404, {"error": {"message": f"The model `{model}` does not exist", "code": "model_not_found"}}
                )
            return self._json(
                h,
                200,
                {
                    "id": "cmpl-1",
                    "object": "chat.completion",
                    "model": model,
                    "choices": [
                        {
                            "index": 0,
                            "finish_reason": "stop",
                            "message": {"role": "assistant", "content": self._reply(body)},
                        }
                    ],
                },
            )
        return self._json(h, 404, {"error": {"message": f"Unknown path {path}"}})

    def _reply(self, body: dict[str, Any]) -> str:
        if self.chat_reply is not None:
            return self.chat_reply
        msgs = body.get("messages", [])
        user = next((m.get("content", "") for m in reversed(msgs) if m.get("role") == "user"), "")
        system = next((m.get("content", "") for m in msgs if m.get("role") == "system"), "")
        tag = re.search(r"<<<END TASK ([0-9a-f]+)>>>", system)
        blocks = re.compile(rf"<<<([A-Z0-9 ]+?) {tag[1]}>>>\n(.*?)\n<<<END \1 {tag[1]}>>>", re.S) if tag else None
        found = {m.group(1): m.group(2) for m in blocks.finditer(user)} if blocks else {}
        if self.injectable:
            outside = blocks.sub("", user) if blocks else user
            order = re.search(r"(?i)\b(?:score|reply)\s*[:=]?\s*(\d+(?:\.\d+)?)\b", outside)
            if order:
                return order.group(1)
        if "REFERENCE" not in found or "RESPONSE" not in found:
            return "OK"
        return self.judge_format.format(score=judge_score(found["RESPONSE"], found["REFERENCE"]))

    def _json(self, h: BaseHTTPRequestHandler, status: int, obj: Any, headers: dict[str, str] | None = None) -> None:
        self._send(h, status, json.dumps(obj).encode(), "application/json", headers)

    def _send(
        self, h: BaseHTTPRequestHandler, status: int, data: bytes, ctype: str, headers: dict[str, str] | None = None
    ) -> None:
        h.send_response(status)
        h.send_header("Content-Type", ctype)
        h.send_header("Content-Length", str(len(data)))
        h.send_header("x-request-id", f"srv-{len(self.requests)}")
        for k, v in (headers or {}).items():
            h.send_header(k, v)
        h.end_headers()
        h.wfile.write(data)


class _Handler(BaseHTTPRequestHandler):
    fake: FakeOpenAI

    def do_GET(self) -> None:
        self.fake._handle(self)

    def do_POST(self) -> None:
        self.fake._handle(self)

    def log_message(self, format: str, *args: Any) -> None:  # keep pytest output clean
        pass
