"""One gateway address for a sequence of experiments: the live flywheel's hot swap.

Stage: validate (live A/B), in the process of ``hermes-lab flywheel --live`` (``hermes_lab.round.supervisor``).
Reads and writes what each experiment's ``hermes_lab.live.gateway.Gateway`` does (its log dir under
``runs/live/``); serves the status page (``hermes_lab.live.page``) at ``GET /`` and the flywheel's status as
JSON at ``GET /v1/flywheel``.

The switchboard is what the gateway's server (``hermes_lab.live.server``) answers with: its ``chat`` the chat
endpoint, itself an ASGI app for the other routes (uvicorn can serve it too). It holds the *current* gateway (one
experiment: its arms, log dir, rollout) and hands every request to it. ``swap`` puts the next experiment in
without a restart:

1. the new gateway is built off the event loop (its in-process policies come from one shared
   ``hermes_lab.live.local.ArmPool``: the new adapter is loaded beside the running ones, the champion is
   not loaded twice; a vLLM arm loads its adapter through the runtime LoRA API at start) and started;
2. one assignment makes it current: the next new conversation is routed by the new experiment;
3. the old gateway drains: a request that continues one of its open conversations still goes to it (a
   running conversation finishes on the arm it started with, logged in the experiment it belongs to),
   requests already in flight finish there, and once it has neither (or its conversations idled out,
   ``serve.conversation_idle_s``) it is shut down (its logs closed, its rollout task stopped).

Nothing is dropped at the switch: no request is refused or held back, and each is logged by the gateway
that answered it. Left out on purpose: moving an open conversation to the new experiment (it would be
answered by two arms) and draining across a restart (after a restart its continuations open new
conversations in the current experiment, as any gateway restart does).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from collections.abc import Callable
from typing import Any

import orjson
from starlette.responses import HTMLResponse

from hermes_lab.live.gateway import Gateway
from hermes_lab.live.handling import _Events, _Raw, _Refused
from hermes_lab.live.local import ArmPool
from hermes_lab.live.page import render
from hermes_lab.live.routes import build_app

log = logging.getLogger("hermes_lab.serve")
DRAIN_POLL_S = 0.5


class Switchboard:
    """The current experiment's gateway, the ones still draining, and the flywheel's status."""

    def __init__(self, gateway: Gateway, pool: ArmPool, status: Callable[[], dict[str, Any]] | None = None):
        self.pool = pool
        self.status = status or (lambda: {})
        self.current = gateway
        self._app = build_app(gateway)  # its routes (healthz, models, feedback, ...) bound to the current gateway
        self.draining: list[Gateway] = []
        self._inflight: dict[int, int] = {}
        self._drains: set[asyncio.Task] = set()
        self.swaps = 0
        self.loop: asyncio.AbstractEventLoop | None = None
        gateway.flywheel = self.status

    # ----------------------------------------------------------------------------------- lifecycle
    async def startup(self) -> None:
        self.loop = asyncio.get_running_loop()  # a swap from another thread goes through it
        await self.current.startup()

    async def shutdown(self) -> None:
        for t in list(self._drains):
            t.cancel()
        await asyncio.gather(*self._drains, return_exceptions=True)
        for gw in [*self.draining, self.current]:
            await gw.shutdown()
        self.draining.clear()
        self.pool.close()

    async def swap(self, build: Callable[[], Gateway]) -> Gateway:
        """Build the next experiment's gateway (in a thread: loading a policy takes seconds), start it, make
        it current; the old one drains in the background. Raises what building or starting raised, the old
        gateway still current."""
        new = await asyncio.to_thread(build)
        try:
            await new.startup()
        except BaseException:
            await new.shutdown()
            raise
        new.flywheel = self.status
        old, self.current = self.current, new  # the switch: one assignment on the event loop
        self._app = build_app(new)
        self.swaps += 1
        self.draining.append(old)
        task = asyncio.create_task(self._drain(old))
        self._drains.add(task)
        task.add_done_callback(self._drains.discard)
        return new

    async def _drain(self, gw: Gateway) -> None:
        """Wait until the old gateway has no request in flight and no open conversation, then shut it down."""
        deadline = asyncio.get_running_loop().time() + gw.cfg.serve.conversation_idle_s + 5
        while asyncio.get_running_loop().time() < deadline:
            gw.convs.sweep()
            if not self._inflight.get(id(gw)) and not gw.convs.open:
                break
            await asyncio.sleep(DRAIN_POLL_S)
        while self._inflight.get(id(gw)):  # an answer being written is never cut
            await asyncio.sleep(DRAIN_POLL_S)
        self.draining.remove(gw)
        await gw.shutdown()
        self.pool.keep([*self.current.specs.values(), *(s for g in self.draining for s in g.specs.values())])
        log.info("experiment %s drained and closed", gw.name)

    # ----------------------------------------------------------------------------------- routing
    def _owner(self, body: bytes, hdr: dict[bytes, bytes]) -> Gateway | None:
        """The draining gateway whose open conversation this request continues, if any."""
        try:
            payload = orjson.loads(body)
            messages = payload.get("messages") if isinstance(payload, dict) else None
            if not isinstance(messages, list) or not messages:
                return None
            for gw in self.draining:
                link = gw.convs.link(messages, gw._explicit(hdr, payload))
                if link.conv is not None:
                    return gw
        except (orjson.JSONDecodeError, _Refused):  # the current gateway answers it with the error
            return None
        return None

    async def chat(self, hdr: dict[bytes, bytes], receive: Any) -> Any:
        """``POST /v1/chat/completions`` to the gateway that owns it: the current one, or a draining one whose open
        conversation it continues. It counts as in flight there until its answer is over (a stream: until it
        is closed), so a draining gateway is never shut down under an answer."""
        gw = self.current
        if self.draining:  # read the body once to find its conversation, then replay it to the owner
            try:
                body = await gw._read(hdr, receive)
            except _Refused as e:
                return gw._refuse(e)
            gw = self._owner(body, hdr) or gw
            receive = _replay(body, receive)
        key = id(gw)
        self._inflight[key] = self._inflight.get(key, 0) + 1
        try:
            resp = await gw.chat(hdr, receive)
        except BaseException:
            self._answered(key)
            raise
        if isinstance(resp, _Events):
            resp.body = _Counted(resp.body, functools.partial(self._answered, key))
        else:
            self._answered(key)
        return resp

    def _answered(self, key: int) -> None:
        self._inflight[key] -= 1

    def refuse(self, status: int, message: str, code: str = "body_too_large") -> Any:
        return self.current.refuse(status, message, code)

    async def _chat(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        resp = await self.chat(dict(scope["headers"]), receive)
        await resp(scope, receive, send)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        path = scope.get("path", "")
        if scope["type"] == "http" and path == "/v1/chat/completions" and scope["method"] == "POST":
            await self._chat(scope, receive, send)
        elif scope["type"] == "http" and path in ("/", "/index.html") and scope["method"] == "GET":
            await HTMLResponse(render(self.snapshot()), headers={"cache-control": "no-store"})(scope, receive, send)
        elif scope["type"] == "http" and path == "/v1/flywheel" and scope["method"] == "GET":
            await _Raw(orjson.dumps(self.snapshot(), default=str), 200, [])(scope, receive, send)
        else:
            await self._app(scope, receive, send)

    def snapshot(self) -> dict[str, Any]:
        """The flywheel's status with what only the gateway knows: its pid, the experiments draining."""
        out = dict(self.status())
        out.setdefault("pid", os.getpid())
        out["draining"] = [g.name for g in self.draining]
        out["swaps_in_process"] = self.swaps
        return out

    async def _lifespan(self, receive: Any, send: Any) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                try:
                    await self.startup()
                except BaseException as e:
                    await send({"type": "lifespan.startup.failed", "message": str(e)})
                    raise
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return


class _Counted:
    """A stream's pieces, and ``done()`` once when it is closed (both servers close a stream they answered)."""

    def __init__(self, body: Any, done: Callable[[], None]):
        self.body, self.done = body, done

    def __aiter__(self) -> _Counted:
        return self

    async def __anext__(self) -> Any:
        return await self.body.__anext__()

    async def aclose(self) -> None:
        try:
            await self.body.aclose()
        finally:
            if self.done is not None:
                self.done, done = None, self.done
                done()


def _replay(body: bytes, receive: Any) -> Any:
    """An ASGI receive that gives the already-read body first, then whatever the client sends (disconnect)."""
    sent = False

    async def again() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return again
