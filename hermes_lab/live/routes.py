"""The gateway's routes: the ASGI app ``hermes-lab serve`` runs, and every endpoint but the chat one.

Stage: validate (live A/B). The app sends ``POST /v1/chat/completions`` straight to the request handling
(``hermes_lab.live.handling``: no router on the hot path) and the rest through Starlette's router to the
``Routes`` methods of ``hermes_lab.live.gateway.Gateway``: ``GET /healthz``, ``GET /v1/models`` and ``GET
/v1/models/{name}`` (each model's ``max_model_len``, as vLLM states it), ``GET /version``, ``POST /v1/feedback``
(appended to feedback.jsonl), ``GET /v1/conversations/{id}``, ``GET /v1/experiment``; any other path an
OpenAI-shaped 404. The lifespan starts and stops the gateway.

    hermes-lab serve --params params/embedded.yaml      # then GET http://127.0.0.1:8700/v1/experiment
"""

from __future__ import annotations

import asyncio
import os
import time
from contextlib import asynccontextmanager
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from hermes_lab.live import log as L
from hermes_lab.live.arms import ARMS
from hermes_lab.live.handling import _Raw, _Refused, error_body

try:
    VERSION = version("hermes-lab")
except PackageNotFoundError:  # a checkout run without being installed
    VERSION = "0"


class Routes:
    """The endpoints' methods of ``Gateway`` but the chat one (``hermes_lab.live.handling``)."""

    async def _body(self, request: Request) -> bytes:
        return await self._read(dict(request.scope["headers"]), request.receive)

    async def healthz(self, request: Request) -> Response:
        # warm: the decision's scipy / statsmodels imports done (a thread after start; until then it shares the GIL)
        warm = self._warm is not None and self._warm.done()
        loop = "uvloop" if type(asyncio.get_running_loop()).__module__.startswith("uvloop") else "asyncio"
        out = {"status": "ok", "experiment": self.name, "pid": os.getpid(), "warm": warm, "event_loop": loop}
        return _Raw(orjson.dumps(out), 200, [])

    def context_length(self) -> int:
        """The context length the gateway states: the least of its arms' (``serve.context_length`` for an
        in-process arm, an upstream's own ``max_model_len`` where its /v1/models states one), so that whichever
        arm answers, a conversation within it is served."""
        lengths = [getattr(a, "context_length", None) for a in self.arms.values()]
        return min([n for n in lengths if n] or [self.cfg.serve.context_length])

    def _model(self, name: str) -> dict[str, Any]:
        """One model object as vLLM lists it: ``max_model_len`` is what Hermes Agent (and vLLM's clients) read."""
        return {
            "id": name,
            "object": "model",
            "created": int(self.t0),
            "owned_by": "hermes-lab",
            "root": name,
            "parent": None,
            "max_model_len": self.context_length(),
        }

    async def models(self, request: Request) -> Response:
        try:
            await self._body(request)
        except _Refused as e:
            return self._refuse(e)
        names = [self.public, *sorted((self.accepted or set()) - {self.public})]
        data = [self._model(n) for n in names]
        return _Raw(orjson.dumps({"object": "list", "data": data}), 200, [])

    async def model(self, request: Request) -> Response:
        """GET /v1/models/{name}: the model's object, for a name the chat endpoint serves (any name while
        serve.models is empty); else 404 as OpenAI answers an unknown model."""
        try:
            await self._body(request)
        except _Refused as e:
            return self._refuse(e)
        name = request.path_params["name"]
        if self.accepted is not None and name not in self.accepted:
            msg = f"The model {name[:128]!r} does not exist; ask for one of {sorted(self.accepted)}"
            return _Raw(error_body(msg, code="model_not_found"), 404, [])
        return _Raw(orjson.dumps(self._model(name)), 200, [])

    async def version(self, request: Request) -> Response:
        """GET /version, as vLLM answers it (Hermes Agent probes it to tell a vLLM server; nothing rides on it)."""
        return _Raw(orjson.dumps({"version": VERSION, "server": "hermes-lab"}), 200, [])

    async def feedback(self, request: Request) -> Response:
        try:
            body = await self._body(request)
            try:
                fb = orjson.loads(body)
            except orjson.JSONDecodeError as e:
                raise _Refused(422, f"the body is not valid JSON: {e}", "invalid_json") from None
            ids = ("conversation_id", "request_id")
            if not isinstance(fb, dict) or not any(isinstance(fb.get(k), str) for k in ids):
                raise _Refused(
                    422, "the body must be an object with a string 'conversation_id' or 'request_id'", "invalid_body"
                )
            r = fb.get("reward")
            if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 <= r <= self.scale:
                raise _Refused(422, f"'reward' must be a number in 0..{self.scale:g} (reward.scale)", "invalid_reward")
            src = fb.get("source", "system")
            if not isinstance(src, str) or not src:
                raise _Refused(422, "'source' must be a non-empty string", "invalid_source")
            close = fb.get("close", True)
            if not isinstance(close, bool):
                raise _Refused(422, "'close' must be true or false", "invalid_close")
            rid = fb.get("request_id") if isinstance(fb.get("request_id"), str) else None
            cid = fb.get("conversation_id") if isinstance(fb.get("conversation_id"), str) else None
            if cid is not None and cid not in self.tally.conv_rows:
                raise _Refused(404, f"unknown conversation_id {cid[:128]!r}", "unknown_conversation_id")
            if rid is not None:
                of = self.tally.conversation_of(rid)
                if of is None:
                    raise _Refused(404, f"unknown request_id {rid[:128]!r}", "unknown_request_id")
                if cid is not None and of != cid:
                    msg = f"request {rid[:128]!r} is not a turn of conversation {cid[:128]!r}"
                    raise _Refused(422, msg, "conversation_mismatch")
                cid = of
        except _Refused as e:
            return self._refuse(e)
        now = time.time()
        first = self.tally.conv_rows[cid][0]
        rec = {
            "conversation_id": cid,
            "request_id": rid if rid is not None else self.tally.turn["rid"][first],
            "reward": float(r),
            "source": src,
            "detail": fb.get("detail"),
            "arm": ARMS[self.tally.cols["arm"][first]],
            "t": round(self.clock(now), 3),
            "timestamp": L.now_iso(now),
        }
        await self.fb_log.append(orjson.dumps(rec) + b"\n")
        self.tally.add_feedback(rec)
        if close:  # the conversation is scored: a later turn continuing it opens a new one
            self.convs.close(cid)
        if self.traces is not None:
            self.traces.feedback(rec)
        out = {"status": "accepted", "conversation_id": cid, "request_id": rec["request_id"]}
        return _Raw(orjson.dumps(out), 202, [])

    async def conversation(self, request: Request) -> Response:
        """GET /v1/conversations/{id}: its turns (request ids, arm, status, tool calls, ...), state and reward;
        a request id finds its conversation too."""
        try:
            await self._body(request)
        except _Refused as e:
            return self._refuse(e)
        key = request.path_params["cid"]
        cid = key if key in self.tally.conv_rows else self.tally.conversation_of(key)
        got = self.tally.conversation(cid) if cid is not None else None
        if got is None:
            return _Raw(error_body(f"unknown conversation {key[:128]!r}", code="unknown_conversation_id"), 404, [])
        got["state"] = "scored" if got["reward"] is not None else self.convs.state(cid)
        return _Raw(orjson.dumps(got), 200, [])

    async def experiment(self, request: Request) -> Response:
        try:
            await self._body(request)
        except _Refused as e:
            return self._refuse(e)
        key, dec = self._decision
        now_key = (sum(self.tally.feedback), sum(self.tally.errors), self.stage, int(time.monotonic() // 5))
        if key != now_key:  # new rewards (or 5 s on): analyse again, in a thread, off the event loop
            dec = await asyncio.to_thread(self.rollout.current)
            self._decision = (now_key, dec)
        t, st, ro = self.tally, self.state, self.rollout
        nxt = ro.next_look()
        out = {
            "experiment": self.name,
            "log_dir": str(self.log_dir),
            "status": self.state["status"],
            "stage": self.stage,
            "ratio": self.ratio,
            "stages": self.stages,
            "unit": self.cfg.ab.unit,
            "public_model": self.public,
            "arms": {n: self.specs[n].describe() for n in ARMS},
            "started": st["created"],
            "t": round(self.clock(), 3),
            "time_scale": ro.K,
            "rollout": ro.enabled,
            "stage_starts": st["stage_starts"],
            "looks": len(st["looks"]),
            "last_look": st["looks"][-1] if st["looks"] else None,
            "next_look": None if nxt is None else {"t": nxt, "in_s": round(max(ro.wall_at(nxt) - time.time(), 0), 3)},
            "waiting_for": ro.waiting_for(),
            "rollout_decision": st.get("decision"),
            "report": st.get("report"),
            "restarts": st["restarts"],
            "n_baseline": t.n[0],
            "n_candidate": t.n[1],
            "errors": {"baseline": t.errors[0], "candidate": t.errors[1]},
            "feedback": {"baseline": t.feedback[0], "candidate": t.feedback[1]},
            "conversations": t.conversation_stats(),
            "open_conversations": len(self.convs.open),
            "rejected": self.rejected,
            **dec,
        }
        if self.flywheel is not None:
            out["flywheel"] = self.flywheel()
        return _Raw(orjson.dumps(out), 200, [])


async def _not_found(request: Request, exc: Exception) -> Response:
    return _Raw(error_body(f"no route {request.url.path[:128]!r} (see GET /v1/models)", code="not_found"), 404, [])


async def _not_allowed(request: Request, exc: Exception) -> Response:
    msg = f"{request.method} is not allowed on {request.url.path[:128]!r}"
    return _Raw(error_body(msg, code="method_not_allowed"), 405, [])


def build_app(gw: Any) -> Any:
    @asynccontextmanager
    async def lifespan(app: Starlette) -> Any:
        await gw.startup()
        try:
            yield
        finally:
            await gw.shutdown()

    routes = [
        Route("/healthz", gw.healthz, methods=["GET"]),
        Route("/v1/models", gw.models, methods=["GET"]),
        Route("/v1/models/{name:path}", gw.model, methods=["GET"]),
        Route("/version", gw.version, methods=["GET"]),
        Route("/v1/feedback", gw.feedback, methods=["POST"]),
        Route("/v1/experiment", gw.experiment, methods=["GET"]),
        Route("/v1/conversations/{cid:path}", gw.conversation, methods=["GET"]),
    ]
    # any other path (llama.cpp's /props, Ollama's /api/tags and /api/show, LM Studio's /api/v1/models, which Hermes
    # Agent probes before a session): an OpenAI-shaped 404 at once, so a client's probe reads "not this server"
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={404: _not_found, 405: _not_allowed})

    async def asgi(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] == "/v1/chat/completions":  # the hot path, no router
            if scope["method"] == "POST":
                await gw.chat_asgi(scope, receive, send)
            else:
                await _Raw(error_body("use POST", code="method_not_allowed"), 405, [(b"allow", b"POST")])(
                    scope, receive, send
                )
        else:
            await app(scope, receive, send)

    return asgi
