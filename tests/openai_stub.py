"""A real OpenAI-compatible upstream for the gateway tests: aiohttp.web on 127.0.0.1, in a thread.

Answers GET /v1/models and POST /v1/chat/completions, non-streaming and streaming (SSE; each event is
written in two pieces, so a reader must reassemble events split across reads; a usage chunk when
``stream_options.include_usage``). The reply to an embedded task prompt is its correct answer (a
"perfect" policy), anything else gets "OK"; ``reply`` fixes the reply (a bad policy). ``api_key``:
require that Bearer key (401 otherwise); ``fail``: answer 500. Every request is recorded (path,
lower-cased headers, JSON body).

``agent=True`` makes it a scripted tool-using model for agents that send ``tools`` (the Hermes Agent
fixtures, tests/fixtures/hermes/make_fixtures.py): to a user turn it answers with the tool calls of the
first ``plans`` entry whose key occurs in the conversation's first user message (default: one call of
``terminal``, else of the first offered tool), to tool results with a text that quotes them; a first
message holding ``loop_key`` gets tool calls after every result too (an agent that never finishes). Each
answer carries ``reasoning_content``. Tool calls stream as OpenAI's do: ``delta.tool_calls`` with an index,
the arguments in two pieces.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path
from typing import Any

from aiohttp import web

from hermes_lab.tasks import suite as T


class OpenAIStub:
    def __init__(self, models: tuple[str, ...] = ("up-model",), api_key: str | None = None):
        self.models, self.api_key, self.fail = list(models), api_key, False
        self.reply: str | None = None  # a fixed reply instead of the right answer (a bad arm)
        self.agent = False  # scripted tool calls for an agent (see the module docstring)
        self.plans: dict[str, list[tuple[str, dict[str, Any]]]] = {}  # first-user-message key -> tool calls
        self.loop_key = "never finish"  # a first user message holding this: tools after every result
        self.requests: list[dict[str, Any]] = []
        # vLLM's runtime LoRA API (POST /v1/load_lora_adapter): None = not enabled (404, as vLLM without
        # VLLM_ALLOW_RUNTIME_LORA_UPDATING); a dict = lora name -> path of the adapters loaded so far
        self.loras: dict[str, str] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self.port = 0

    # ------------------------------------------------------------------------------------ lifecycle
    def start(self) -> OpenAIStub:
        ready = threading.Event()

        def run() -> None:
            self._loop = asyncio.new_event_loop()
            app = web.Application()
            app.router.add_get("/v1/models", self._models)
            app.router.add_post("/v1/chat/completions", self._chat)
            app.router.add_post("/v1/load_lora_adapter", self._load_lora)
            self._runner = web.AppRunner(app, access_log=None)
            self._loop.run_until_complete(self._runner.setup())
            site = web.TCPSite(self._runner, "127.0.0.1", 0)
            self._loop.run_until_complete(site.start())
            self.port = site._server.sockets[0].getsockname()[1]
            ready.set()
            self._loop.run_forever()

        threading.Thread(target=run, daemon=True, name="openai-stub").start()
        ready.wait(10)
        return self

    def stop(self) -> None:
        if self._loop and self._runner:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # ------------------------------------------------------------------------------------ handlers
    def _refuse(self, request: web.Request) -> web.Response | None:
        if self.api_key is not None and request.headers.get("Authorization") != f"Bearer {self.api_key}":
            return web.json_response({"error": {"message": "bad key", "code": "invalid_api_key"}}, status=401)
        if self.fail:
            return web.json_response({"error": {"message": "upstream down"}}, status=500)
        return None

    async def _models(self, request: web.Request) -> web.Response:
        self.requests.append({"path": request.path, "headers": {k.lower(): v for k, v in request.headers.items()}})
        return self._refuse(request) or web.json_response(
            {"object": "list", "data": [{"id": m, "object": "model"} for m in self.models]}
        )

    async def _load_lora(self, request: web.Request) -> web.Response:
        """vLLM's answers: 404 when runtime updating is off; 400 for a missing field, a path without an
        adapter_config.json, or a name already loaded; 200 with a plain-text line otherwise."""
        body = await request.json()
        self.requests.append({"path": request.path, "body": body})
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
        body = await request.json()
        self.requests.append(
            {"path": request.path, "headers": {k.lower(): v for k, v in request.headers.items()}, "body": body}
        )
        refused = self._refuse(request)
        if refused:
            return refused
        if body.get("model") not in self.models:
            return web.json_response({"error": {"message": f"no model {body.get('model')}"}}, status=404)
        user = next((m.get("content", "") for m in reversed(body["messages"]) if m.get("role") == "user"), "")
        task = T.parse_prompt(user) if isinstance(user, str) else None
        reply = self.reply if self.reply is not None else (task.answer if task else "OK")
        if self.loras is not None and body["model"] in self.loras:  # which adapter answered, in the text
            reply = f"{body['model']}: {reply}"
        calls: list[dict[str, Any]] = []
        reasoning = ""
        if self.agent and body.get("tools"):
            reply, calls, reasoning = self._agent_turn(body)
        n_in = len(str(user))
        usage = {"prompt_tokens": n_in, "completion_tokens": len(reply), "total_tokens": n_in + len(reply)}
        base = {"id": "cmpl-stub", "created": int(time.time()), "model": body["model"]}
        finish = "tool_calls" if calls else "stop"
        if not body.get("stream"):
            msg: dict[str, Any] = {"role": "assistant", "content": (reply or None) if calls else reply}
            if calls:
                msg["tool_calls"] = calls
            if reasoning:
                msg["reasoning_content"] = reasoning
            return web.json_response(
                {
                    **base,
                    "object": "chat.completion",
                    "choices": [{"index": 0, "message": msg, "finish_reason": finish}],
                    "usage": usage,
                }
            )
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
        events = [
            {**base, "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": d, "finish_reason": None}]}
            for d in pieces
        ]
        events.append(
            {**base, "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]}
        )
        if (body.get("stream_options") or {}).get("include_usage"):
            events.append({**base, "object": "chat.completion.chunk", "choices": [], "usage": usage})
        for ev in events:
            data = f"data: {json.dumps(ev)}\n\n".encode()
            await resp.write(data[:7])  # split an event across writes
            await asyncio.sleep(0.002)
            await resp.write(data[7:])
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

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
