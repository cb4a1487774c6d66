"""A real OpenAI-compatible upstream for the gateway tests: aiohttp.web on 127.0.0.1, in a thread.

Answers GET /v1/models and POST /v1/chat/completions, non-streaming and streaming (SSE; each event is
written in two pieces, so a reader must reassemble events split across reads; a usage chunk when
``stream_options.include_usage``). The reply to an embedded task prompt is its correct answer (a
"perfect" policy), anything else gets "OK"; ``reply`` fixes the reply (a bad policy). ``api_key``:
require that Bearer key (401 otherwise); ``fail``: answer 500. Every request is recorded (path,
lower-cased headers, JSON body).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

from aiohttp import web

from hermes_lab.tasks import suite as T


class OpenAIStub:
    def __init__(self, models: tuple[str, ...] = ("up-model",), api_key: str | None = None):
        self.models, self.api_key, self.fail = list(models), api_key, False
        self.reply: str | None = None  # a fixed reply instead of the right answer (a bad arm)
        self.requests: list[dict[str, Any]] = []
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
        usage = {"prompt_tokens": len(user), "completion_tokens": len(reply), "total_tokens": len(user) + len(reply)}
        base = {"id": "cmpl-stub", "created": int(time.time()), "model": body["model"]}
        if not body.get("stream"):
            msg = {"role": "assistant", "content": reply}
            return web.json_response(
                {
                    **base,
                    "object": "chat.completion",
                    "choices": [{"index": 0, "message": msg, "finish_reason": "stop"}],
                    "usage": usage,
                }
            )
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        pieces = [{"role": "assistant", "content": ""}] + [
            {"content": reply[i : i + 2]} for i in range(0, len(reply), 2)
        ]
        events = [
            {**base, "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": d, "finish_reason": None}]}
            for d in pieces
        ]
        events.append(
            {**base, "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
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
