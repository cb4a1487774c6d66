"""The one OpenAI-compatible HTTP server of the tests: aiohttp.web on 127.0.0.1 (a free port), in a thread.

Every test that needs an upstream, a judge or a model API uses it (the ``fake_openai`` fixture of
tests/conftest.py, or ``FakeOpenAI(models=...).start()``), and so do the fixture scripts that run a real agent
against it (tests/fixtures/hermes/make_fixtures.py, make_exports.py, tests/fixtures/atropos/make_fixtures.py).

Speaks GET /v1/models, POST /v1/chat/completions (plain JSON, or SSE with ``"stream": true``: each event written
in two pieces, so a reader must reassemble events split across reads; a usage chunk when
``stream_options.include_usage``) and vLLM's runtime LoRA API (POST /v1/load_lora_adapter). A chat gets:

- ``chat_reply`` when set (a fixed reply: unparseable text, a bad policy);
- else, when its user message holds the judge's REFERENCE and RESPONSE blocks (between markers carrying the tag
  its system message announces: hermes_lab.llm.judge), a deterministic score (``judge_score``, formatted by
  ``judge_format``);
- else, to an embedded task's prompt, that task's correct answer (a "perfect" policy);
- else "OK".

An answer to a LoRA adapter's model name starts with that name (which adapter answered). Every answer carries
``usage`` and the header ``x-request-id``. Behaviour is set through attributes (or ``configure(**kw)``;
``reset()`` restores the defaults):

    api_key      require "Authorization: Bearer <api_key>", else 401 with a JSON error that echoes the key
                 it got (as some providers do), so tests can check the client redacts it
    mode         "ok" | "html" (200 text/html page, a middlebox) | "malformed" (truncated JSON)
                 | "no_choices" (valid JSON without choices)
    fail         answer 500 to every request (an upstream that is down)
    fail_429     answer 429 this many times (with Retry-After: ``retry_after`` when set), then normally
    fail_500     answer 500 this many times
    delay_s      sleep this long before answering; ``delay_n`` limits it to the first N requests
    injectable   a gullible judge: it obeys "score: N" (or "reply N") anywhere outside the tagged data blocks,
                 the way an injected instruction reaches a model once a completion has closed its block
    agent        a scripted tool-using model for requests that send ``tools`` (the Hermes Agent fixtures): to a
                 user turn it answers with the tool calls of the first ``plans`` entry whose key occurs in the
                 conversation's first user message (default: one call of ``terminal``, else of the first
                 offered tool), to tool results with a text that quotes them; a first message holding
                 ``loop_key`` gets tool calls after every result too (an agent that never finishes). Each answer
                 carries ``reasoning_content``; tool calls stream as OpenAI's do (``delta.tool_calls`` with an
                 index, the arguments in two pieces)
    stream_whole a streamed answer written in one piece, [DONE] included (a fast server, or a proxy that
                 buffers): the events and the end reach a reader in the same read
    max_model_len  stated in each model of GET /v1/models (vLLM's key) when set
    loras        None: vLLM without VLLM_ALLOW_RUNTIME_LORA_UPDATING (load_lora_adapter answers 404); a dict:
                 LoRA name -> path of the adapters loaded so far (a loaded name joins ``models``)

Every request is recorded (``requests``: method, path, lower-cased headers, JSON body); ``max_inflight`` is the
most requests seen in flight at once. Reads and writes nothing on disk but an adapter dir's config, looked up.
"""

from __future__ import annotations

import asyncio
import copy
import json
import re
import socket
import threading
import time
from dataclasses import dataclass, field
from difflib import SequenceMatcher
from pathlib import Path
from typing import Any

from aiohttp import web

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
    "fail": False,
    "fail_429": 0,
    "retry_after": None,
    "fail_500": 0,
    "delay_s": 0.0,
    "delay_n": None,
    "chat_reply": None,
    "judge_format": "{score}",
    "injectable": False,
    "agent": False,
    "plans": {},  # first-user-message key -> [(tool name, arguments), ...]
    "loop_key": "never finish",
    "loras": None,
    "stream_whole": False,
    "max_model_len": None,
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
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self.reset()
        self.configure(**settings)

    # ------------------------------------------------------------------------------------- control
    def reset(self) -> None:
        for k, v in _DEFAULTS.items():
            setattr(self, k, copy.copy(v))

    def configure(self, **settings: Any) -> FakeOpenAI:
        for k, v in settings.items():
            if k not in _DEFAULTS:
                raise AttributeError(f"FakeOpenAI has no setting {k!r}; settings: {', '.join(_DEFAULTS)}")
            setattr(self, k, v)
        return self

    def start(self) -> FakeOpenAI:
        ready, failed = threading.Event(), []

        def run() -> None:
            self._loop = loop = asyncio.new_event_loop()
            try:
                app = web.Application(middlewares=[self._serve], client_max_size=64 * 2**20)
                app.router.add_get("/v1/models", self._models)
                app.router.add_post("/v1/chat/completions", self._chat)
                app.router.add_post("/v1/load_lora_adapter", self._load_lora)
                app.router.add_route("*", "/{tail:.*}", self._unknown)
                app.on_response_prepare.append(self._stamp)
                self._runner = web.AppRunner(app, access_log=None)
                loop.run_until_complete(self._runner.setup())
                # a short shutdown: stop() must not wait for a handler asleep in delay_s
                site = web.TCPSite(self._runner, "127.0.0.1", 0, shutdown_timeout=0.1)
                loop.run_until_complete(site.start())
                self.port = self._runner.addresses[0][1]
            except BaseException as e:  # handed to start()'s caller
                failed.append(e)
                return
            finally:
                ready.set()
            loop.run_forever()
            loop.close()  # stop() ended the loop

        threading.Thread(target=run, daemon=True, name="fake-openai").start()
        if not ready.wait(30) or failed:
            raise RuntimeError(f"the fake OpenAI server did not start: {failed[0] if failed else 'timed out'}")
        return self

    def stop(self) -> None:
        if self._loop and self._runner:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._runner = None

    def __enter__(self) -> FakeOpenAI:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def url(self) -> str:
        """The API root, as TAOTOKEN_BASE_URL holds it (the client appends /v1/...)."""
        assert self.port, "server not started"
        return f"http://127.0.0.1:{self.port}"

    def count(self, path: str | None = None) -> int:
        return sum(1 for r in self.requests if path is None or r.path == path)

    # ------------------------------------------------------------------------------------- serving
    @web.middleware
    async def _serve(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """Every request: recorded, delayed, refused or garbled as configured, else answered by its route."""
        raw = await request.read()  # aiohttp keeps it: a route's request.json() reads it again
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = raw
        self.requests.append(
            Recorded(request.method, request.path, {k.lower(): v for k, v in request.headers.items()}, body)
        )
        n = len(self.requests)
        self.inflight += 1
        self.max_inflight = max(self.max_inflight, self.inflight)
        try:
            if self.delay_s and (self.delay_n is None or n <= self.delay_n):
                await asyncio.sleep(self.delay_s)
        finally:
            # out of flight once the answer starts: a client that reads it and sends its next request at once
            # must not be seen with one request too many
            self.inflight -= 1
        auth = request.headers.get("Authorization", "")
        if self.api_key is not None and auth != f"Bearer {self.api_key}":
            sent = auth.split(" ", 1)[-1] if auth else "none"
            error = {"message": f"Incorrect API key provided: {sent}", "type": "invalid_request_error"}
            return web.json_response({"error": {**error, "code": "invalid_api_key"}}, status=401)
        if self.fail_429 > 0:
            self.fail_429 -= 1
            extra = {"Retry-After": str(self.retry_after)} if self.retry_after is not None else {}
            error = {"message": "Rate limit reached", "code": "rate_limit"}
            return web.json_response({"error": error}, status=429, headers=extra)
        if self.fail or self.fail_500 > 0:
            self.fail_500 = max(0, self.fail_500 - 1)
            return web.json_response({"error": {"message": "Internal server error"}}, status=500)
        if self.mode == "html":
            return web.Response(text=HTML_PAGE, content_type="text/html")
        if self.mode == "malformed":
            return web.Response(
                body=b'{"id": "cmpl-1", "choices": [{"message": {"content": "4', content_type="application/json"
            )
        if self.mode == "no_choices":
            return web.json_response({"id": "cmpl-1", "object": "chat.completion"})
        return await handler(request)

    async def _stamp(self, request: web.Request, response: web.StreamResponse) -> None:
        response.headers["x-request-id"] = f"srv-{len(self.requests)}"

    async def _unknown(self, request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": f"Unknown path {request.path}"}}, status=404)

    async def _models(self, request: web.Request) -> web.Response:
        data = [{"id": m, "object": "model", "owned_by": "fake"} for m in self.models]
        if self.max_model_len is not None:  # as vLLM states each model's context length
            data = [{**m, "max_model_len": self.max_model_len} for m in data]
        return web.json_response({"object": "list", "data": data})

    async def _load_lora(self, request: web.Request) -> web.Response:
        """vLLM's answers: 404 when runtime updating is off; 400 for a missing field, a path without an
        adapter_config.json, or a name already loaded; 200 with a plain-text line otherwise."""
        body = await request.json()
        if self.loras is None:
            return web.json_response({"detail": "Not Found"}, status=404)
        name, path = body.get("lora_name"), body.get("lora_path")
        if not name or not path:
            return web.json_response({"error": {"message": "Both 'lora_name' and 'lora_path' must be provided."}}, 400)
        if name in self.loras:
            msg = f"The lora adapter '{name}' has already been loaded."
            return web.json_response({"error": {"message": msg, "type": "InvalidUserInput"}}, status=400)
        if not (Path(path) / "adapter_config.json").is_file():
            return web.json_response({"error": {"message": f"No adapter found for {path}"}}, status=400)
        self.loras[name] = path
        self.models.append(name)
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except ValueError:
            body = None  # not JSON: no model named
        model = body.get("model") if isinstance(body, dict) else None
        if model not in self.models:
            error = {"message": f"The model `{model}` does not exist", "code": "model_not_found"}
            return web.json_response({"error": error}, status=404)
        msgs = body.get("messages", [])
        user = next((m.get("content", "") for m in reversed(msgs) if m.get("role") == "user"), "")
        reply = self._reply(msgs, user)
        if self.loras is not None and model in self.loras:  # which adapter answered, in the text
            reply = f"{model}: {reply}"
        calls: list[dict[str, Any]] = []
        reasoning = ""
        if self.agent and body.get("tools"):
            reply, calls, reasoning = self._agent_turn(body)
        n_in = len(str(user))
        usage = {"prompt_tokens": n_in, "completion_tokens": len(reply), "total_tokens": n_in + len(reply)}
        base = {"id": "cmpl-1", "created": int(time.time()), "model": model}
        finish = "tool_calls" if calls else "stop"
        if not body.get("stream"):
            msg: dict[str, Any] = {"role": "assistant", "content": (reply or None) if calls else reply}
            if calls:
                msg["tool_calls"] = calls
            if reasoning:
                msg["reasoning_content"] = reasoning
            choice = {"index": 0, "message": msg, "finish_reason": finish}
            return web.json_response({**base, "object": "chat.completion", "choices": [choice], "usage": usage})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        pieces: list[dict[str, Any]] = [{"role": "assistant", "content": ""}]
        pieces += [{"reasoning_content": reasoning[i : i + 16]} for i in range(0, len(reasoning), 16)]
        pieces += [{"content": reply[i : i + 2]} for i in range(0, len(reply), 2)]
        for k, c in enumerate(calls):  # name first, the arguments in two pieces: a reader must join them
            args = c["function"]["arguments"]
            head = {"index": k, "id": c["id"], "type": "function", "function": {"name": c["function"]["name"]}}
            pieces.append({"tool_calls": [{**head, "function": {**head["function"], "arguments": args[:5]}}]})
            pieces.append({"tool_calls": [{"index": k, "function": {"arguments": args[5:]}}]})
        chunk = {**base, "object": "chat.completion.chunk"}
        events = [{**chunk, "choices": [{"index": 0, "delta": d, "finish_reason": None}]} for d in pieces]
        events.append({**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
        if (body.get("stream_options") or {}).get("include_usage"):
            events.append({**chunk, "choices": [], "usage": usage})
        if self.stream_whole:
            await resp.write(b"".join(f"data: {json.dumps(ev)}\n\n".encode() for ev in events) + b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        for ev in events:
            data = f"data: {json.dumps(ev)}\n\n".encode()
            await resp.write(data[:7])  # split an event across writes
            await asyncio.sleep(0.002)
            await resp.write(data[7:])
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    # ------------------------------------------------------------------------------------- replies
    def _reply(self, msgs: list[dict[str, Any]], user: Any) -> str:
        if self.chat_reply is not None:
            return self.chat_reply
        if not isinstance(user, str):
            return "OK"
        system = next((m.get("content", "") for m in msgs if m.get("role") == "system"), "")
        tag = re.search(r"<<<END TASK ([0-9a-f]+)>>>", system or "")
        blocks = re.compile(rf"<<<([A-Z0-9 ]+?) {tag[1]}>>>\n(.*?)\n<<<END \1 {tag[1]}>>>", re.S) if tag else None
        found = {m.group(1): m.group(2) for m in blocks.finditer(user)} if blocks else {}
        if self.injectable:
            outside = blocks.sub("", user) if blocks else user
            order = re.search(r"(?i)\b(?:score|reply)\s*[:=]?\s*(\d+(?:\.\d+)?)\b", outside)
            if order:
                return order.group(1)
        if "REFERENCE" in found and "RESPONSE" in found:
            return self.judge_format.format(score=judge_score(found["RESPONSE"], found["REFERENCE"]))
        from hermes_lab.tasks import suite  # imported on first use: the judge tests need no task suite

        task = suite.parse_prompt(user)
        return task.answer if task else "OK"

    def _agent_turn(self, body: dict[str, Any]) -> tuple[str, list[dict[str, Any]], str]:
        """(text, tool calls, reasoning) of the scripted agent model for this request."""
        msgs = body["messages"]
        first = next((str(m.get("content") or "") for m in msgs if m.get("role") == "user"), "")
        offered = [t["function"]["name"] for t in body["tools"] if t.get("type") == "function"]
        plan = next((p for k, p in self.plans.items() if k in first), None)
        if plan is None:
            tool = "terminal" if "terminal" in offered else offered[0] if offered else None
            plan = [(tool, {"command": "echo hello from the fixture"})] if tool else []
        results = []
        for m in reversed(msgs):  # the results of the last tool turn
            if m.get("role") != "tool":
                break
            results.insert(0, str(m.get("content") or ""))
        n_turn = sum(1 for m in msgs if m.get("role") == "assistant")
        if (not results or self.loop_key in first) and plan:
            calls = [
                {
                    "id": f"call_{n_turn}_{k}",
                    "type": "function",
                    "function": {"name": name, "arguments": json.dumps(args)},
                }
                for k, (name, args) in enumerate(plan)
            ]
            names = ", ".join(name for name, _ in plan)
            return "", calls, f"The user asks: {first[:60]}. I will call {names} first."
        quoted = " | ".join(r[:200] for r in results) or "nothing"
        return f"Done. The tools returned: {quoted}", [], "I have the tool results; time to answer."
