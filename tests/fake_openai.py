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

A vLLM stand-in: ``FakeOpenAI(models=("base",), vllm_flags=formats.vllm_flags(tok), env={...}, tokenizer=tok)`` is a
``vllm serve base <flags>`` (``VllmServe``): it parses the flags as vLLM's CLI does (unknown ones and an
``--enable-auto-tool-choice`` without ``--tool-call-parser`` fail at start), answers 400 to ``tools`` with
tool_choice auto unless both tool flags are set, mounts /v1/load_lora_adapter only with
VLLM_ALLOW_RUNTIME_LORA_UPDATING true in ``env`` (else 404) and loads an adapter only with ``--enable-lora`` (else
400), renders each prompt with its ``--chat-template`` (else the tokenizer's), writes a tool call as the model's
template writes it and reads it back into ``tool_calls`` with the project's reader of the ``--tool-call-parser``
name (``policy.formats.parser_template``), as vLLM's parser does: structured calls only when the flags are right.

Every request is recorded (``requests``: method, path, lower-cased headers, JSON body); ``max_inflight`` is the
most requests seen in flight at once. Reads and writes nothing on disk but an adapter dir's config, looked up.
"""

from __future__ import annotations

import argparse
import asyncio
import codecs
import copy
import json
import re
import socket
import threading
import time
import uuid
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
    def __init__(
        self,
        models: tuple[str, ...] | list[str] = ("judge-1", "policy-1"),
        *,
        vllm_flags: list[str] | None = None,
        env: dict[str, str] | None = None,
        tokenizer: Any = None,
        **settings: Any,
    ):
        self.models = list(models)
        # a `vllm serve` started with these flags, in this environment, serving this tokenizer's model (None: not vLLM)
        self.vllm = None if vllm_flags is None else VllmServe.start(vllm_flags, tokenizer, env or {})
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
        if self.vllm is not None and self.vllm.runtime_lora:  # the LoRA API is mounted: none loaded yet
            self.loras = {}

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
        if self.vllm is not None:
            refused = self.vllm.refuse_lora(name, path)
            if refused is not None:
                return refused
        elif not (Path(path) / "adapter_config.json").is_file():
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
        if self.vllm is not None:
            turn = self.vllm.chat(body, lambda: self._reply(msgs, user), self._agent_turn, self.loras or {})
            if isinstance(turn, web.Response):
                return turn
            reply, calls, usage = turn
            reasoning = ""
        else:
            reply = self._reply(msgs, user)
            if self.loras is not None and model in self.loras:  # which adapter answered, in the text
                reply = f"{model}: {reply}"
            calls = []
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


# ------------------------------------------------------------------------------ vLLM: `vllm serve <model> <flags>`
# What each check mirrors is vLLM 0.x's own code (github.com/vllm-project/vllm), named at each place.
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vllm/config/lora.py MaxLoRARanks
# the tokens a tool parser looks up in the vocabulary when it is made, per request (hermes_tool_parser.py
# Hermes2ProToolParser.__init__: "could not locate tool call start/end tokens in the tokenizer!"; mistral's and
# qwen3_coder's parsers look theirs up the same way; llama3_json only encodes <|python_tag|>, which never fails)
VLLM_PARSER_TOKENS = {
    "hermes": ("<tool_call>", "</tool_call>"),
    "qwen3_coder": ("<tool_call>", "</tool_call>"),
    "mistral": ("[TOOL_CALLS]",),
    "llama3_json": (),
}


def vllm_error(message: str, status: int = 400, kind: str = "BadRequestError") -> web.Response:
    """vLLM's ErrorResponse (serving_engine.create_error_response: BAD_REQUEST unless told)."""
    return web.json_response(
        {"error": {"message": message, "type": kind, "param": None, "code": status}}, status=status
    )


def _vllm_cli(flags: list[str]) -> argparse.Namespace:
    """The serve flags this stand-in knows, parsed as vLLM's FlexibleArgumentParser does (argparse: an unknown flag
    or a bad value fails the start). Defaults as vLLM's EngineArgs/LoRAConfig: LoRA off, max_loras 1, max_lora_rank
    16 (one of MaxLoRARanks)."""
    p = argparse.ArgumentParser(prog="vllm serve", add_help=False, exit_on_error=False)
    p.add_argument("--enable-auto-tool-choice", action="store_true")
    p.add_argument("--tool-call-parser")
    p.add_argument("--chat-template")
    p.add_argument("--enable-lora", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--max-loras", type=int, default=1)
    p.add_argument("--max-lora-rank", type=int, default=16, choices=VLLM_MAX_LORA_RANKS)
    try:
        args, unknown = p.parse_known_args(list(flags))
    except (argparse.ArgumentError, SystemExit) as e:
        raise ValueError(f"vllm serve: error: {e}") from None
    if unknown:
        raise ValueError(f"vllm serve: error: unrecognized arguments: {' '.join(unknown)}")
    return args


def _load_chat_template(value: str) -> str:
    """vllm/entrypoints/chat_utils.load_chat_template: a file's text; a value that cannot be opened is the template
    itself only when it holds one of "{}\\n", else the start fails ("looks like a file path, but it failed to be
    opened")."""
    try:
        return Path(value).read_text(encoding="utf-8")
    except OSError as e:
        if not any(c in value for c in "{}\n"):
            raise ValueError(
                f"The supplied chat template ({value}) looks like a file path, but it failed to be opened. Reason: {e}"
            ) from None
        return codecs.decode(value, "unicode_escape")


@dataclass
class VllmServe:
    """``vllm serve <model> <flags>`` as far as the gateway meets it: the chat route's tool handling and the runtime
    LoRA route. The model is scripted (FakeOpenAI's replies and agent plans); what it writes for a tool call is its
    chat template's own rendering of that call, as a model trained on the template writes it."""

    args: argparse.Namespace
    tokenizer: Any
    template: str  # the chat template prompts are rendered with: --chat-template, else the tokenizer's
    runtime_lora: bool  # VLLM_ALLOW_RUNTIME_LORA_UPDATING: /v1/load_lora_adapter is mounted

    @classmethod
    def start(cls, flags: list[str], tokenizer: Any, env: dict[str, str]) -> VllmServe:
        args = _vllm_cli(flags)
        # cli_args.validate_parsed_serve_args: "Error: --enable-auto-tool-choice requires --tool-call-parser"
        if args.enable_auto_tool_choice and not args.tool_call_parser:
            raise TypeError("Error: --enable-auto-tool-choice requires --tool-call-parser")
        if args.tool_call_parser and args.tool_call_parser not in VLLM_PARSER_TOKENS:
            # vLLM knows more parsers (openai, glm45, ...); this stand-in reads only those the project implements
            raise ValueError(
                f"--tool-call-parser {args.tool_call_parser}: this stand-in implements {', '.join(VLLM_PARSER_TOKENS)}"
            )
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise ValueError("a vLLM stand-in serves a model: pass tokenizer= (one with a chat template)")
        template = _load_chat_template(args.chat_template) if args.chat_template else tokenizer.chat_template
        # vllm/envs.py: VLLM_ALLOW_RUNTIME_LORA_UPDATING is true for "1" or "true", any case
        runtime = env.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "0").strip().lower() in ("1", "true")
        return cls(args, tokenizer, template, runtime)

    # ------------------------------------------------------------------------------------------ LoRA
    def refuse_lora(self, name: str, path: str) -> web.Response | None:
        """The engine's add_lora, after the route's own checks (serving_models.load_lora_adapter wraps what it raises:
        400, 404 for "No adapter found"). Mounted at all only with VLLM_ALLOW_RUNTIME_LORA_UPDATING
        (entrypoints/serve/lora/api_router.attach_router): FakeOpenAI answers 404 before this otherwise."""
        if not self.args.enable_lora:  # LoRAModelRunnerMixin.add_lora: no lora_manager without --enable-lora
            return vllm_error("LoRA is not enabled.")
        cfg = Path(path) / "adapter_config.json"
        if not cfg.is_file():  # lora/worker_manager._load_adapter
            return vllm_error(f"Loading lora {name} failed: No adapter found for {path}", 404, "NotFoundError")
        rank = json.loads(cfg.read_text()).get("r", 0)
        if rank > self.args.max_lora_rank:  # lora/worker_manager._load_adapter
            return vllm_error(f"LoRA rank {rank} is greater than max_lora_rank {self.args.max_lora_rank}.")
        return None

    # ------------------------------------------------------------------------------------------ chat
    def chat(
        self, body: dict[str, Any], reply: Any, agent_turn: Any, loras: dict[str, str]
    ) -> web.Response | tuple[str, list[dict[str, Any]], dict[str, int]]:
        """(content, tool_calls, usage) of serving_chat.create_chat_completion + chat_completion_full_generator for
        this request, or its error response. ``reply()``: the scripted text answer; ``agent_turn(body)``: the
        scripted tool-using turn (FakeOpenAI._agent_turn)."""
        a, tok = self.args, self.tokenizer
        tools = body.get("tools") or None
        # protocol.ChatCompletionRequest.check_tool_usage: tools without a tool_choice mean "auto"
        choice = body.get("tool_choice", "auto" if tools else "none")
        auto_tools = bool(a.enable_auto_tool_choice and a.tool_call_parser)
        if choice == "auto" and not auto_tools:  # serving_chat.create_chat_completion, for HF tokenizers
            return vllm_error('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set')
        if tools and choice not in ("auto", "none"):  # "required" / a named tool: vLLM's structured outputs
            return vllm_error(f"this vLLM stand-in does not emulate tool_choice={choice!r}", 501, "NotImplementedError")
        try:  # _preprocess_chat: the served template renders the conversation (a template error is a 400)
            prompt = tok.apply_chat_template(
                body.get("messages", []),
                tools=tools,
                chat_template=self.template,
                add_generation_prompt=True,
                tokenize=False,
            )
        except Exception as e:
            return vllm_error(f"{e} {e.__cause__}")
        model = body.get("model")
        if tools and choice == "auto":
            text, calls, _ = agent_turn(body)  # no --reasoning-parser: no reasoning_content
            text = self.write(calls, tools) if calls else text
            for t in VLLM_PARSER_TOKENS[a.tool_call_parser]:  # the parser is made for this request
                if t not in tok.get_vocab():
                    return vllm_error(f"{a.tool_call_parser} tool parser could not locate {t} in the tokenizer!")
            content, out = self.read(text, prompt)
        else:  # tool_choice none, or no tools: content as the model wrote it
            content = reply()
            if model in loras:  # which adapter answered, in the text
                content = f"{model}: {content}"
            text, out = content, []
        n_in = len(tok(prompt, add_special_tokens=False)["input_ids"])
        n_out = len(tok(text, add_special_tokens=False)["input_ids"]) + 1  # and its stop token
        return content or "", out, {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}

    def write(self, calls: list[dict[str, Any]], tools: list[Any] | None) -> str:
        """The model's text for these calls: the served template's rendering of them after its generation prompt, up
        to its stop token (vLLM's output text leaves the stop token out)."""
        tok = self.tokenizer
        user = [{"role": "user", "content": "x"}]
        fns = [{"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])} for c in calls]
        msg = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": f} for f in fns]}
        kw: dict[str, Any] = dict(tools=tools, chat_template=self.template, tokenize=False)
        head = tok.apply_chat_template(user, add_generation_prompt=True, **kw)
        full = tok.apply_chat_template([*user, msg], **kw)
        assert full.startswith(head), "the template's answer does not extend its generation prompt"
        text = full[len(head) :]
        stops = [tok.eos_token] if tok.eos_token else []
        return text[: min([text.index(s) for s in stops if s in text] or [len(text)])]

    def read(self, text: str, prompt: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, tool_calls) as vLLM's tool parser returns them (ExtractedToolCallInformation), read with the
        project's reader of that parser name (policy.formats.parser_template): each call an OpenAI tool call with a
        ``chatcmpl-tool-`` id and its arguments as a JSON string (json.dumps, ensure_ascii=False); the content
        before the calls, or None. A text the reader cannot parse, or one without calls, is the content as it was
        written (the parsers' ``except``: tools_called=False, content=model_output)."""
        from hermes_lab.policy import formats

        tok = self.tokenizer
        try:
            parsed = tok.parse_response(
                text, schema=formats.parser_template(tok, self.args.tool_call_parser), prefix=prompt
            )
        except Exception:
            return text, []
        calls = [c.get("function", c) for c in parsed.get("tool_calls") or []]
        if not calls:
            return text, []
        out = [
            {
                "id": f"chatcmpl-tool-{uuid.uuid4().hex}",
                "type": "function",
                "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)},
            }
            for c in calls
        ]
        return parsed.get("content") or None, out
