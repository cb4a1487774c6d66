"""The gateway's request handling: ``POST /v1/chat/completions`` from the request's bytes to its answer.

Stage: validate (live A/B, ``hermes-lab serve``). Part of ``hermes_lab.live.gateway.Gateway`` (its ``ChatHandling``
methods): the body read within ``serve.max_body_bytes`` and the gateway key, split into raw slices
(``hermes_lab.live.wire``: a history seen at earlier turns is not parsed again), the request's conversation linked
(``hermes_lab.live.conversations``), its arm chosen (the unit's ABRouter bucket; a conversation stays on its
arm), the arm called (``hermes_lab.live.arms``: an upstream, or ``hermes_lab.live.local``: in-process), streamed or
not, the fallback to the baseline (``serve.fallback``); the answers as plain ASGI responses. The record of each
request is ``hermes_lab.live.records``'; the other routes are ``hermes_lab.live.routes``'.

    hermes-lab serve --params params/embedded.yaml      # then POST http://127.0.0.1:8700/v1/chat/completions
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
import time
from typing import Any

import orjson
from starlette.responses import Response

from hermes_lab.ab import stats as ab
from hermes_lab.live.arms import ARMS, Answer, UpstreamError, flatten_messages
from hermes_lab.live.conversations import Link, tool_errors
from hermes_lab.live.sse import CallAssembler
from hermes_lab.live.wire import BadBody, ChatBody

log = logging.getLogger("hermes_lab.serve")
ARM_HEADER = {0: b"baseline", 1: b"candidate"}
_RID = re.compile(r"^[A-Za-z0-9._:@/+=-]{1,128}$")
_JSON = (b"content-type", b"application/json")


class _Raw(Response):
    """A response from ready bytes and raw headers (no header parsing on the hot path)."""

    def __init__(self, body: bytes, status: int, headers: list[tuple[bytes, bytes]]):
        self.body, self.status_code, self.background = body, status, None
        self.raw_headers = [_JSON, (b"content-length", str(len(body)).encode()), *headers]

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        await send({"type": "http.response.body", "body": self.body})


class _Last(bytes):
    """A stream's last piece: sent with the end of the response."""


class _Events:
    """A streamed answer (SSE) as a plain ASGI app. The client going away cancels the task that streams, as
    Starlette's StreamingResponse does, with one watcher task instead of a task group per request."""

    def __init__(self, body: Any, headers: list[tuple[bytes, bytes]]):
        self.body = body
        self.raw_headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"), *headers]

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        task, state = asyncio.current_task(), {"over": False, "gone": False}

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            if not state["over"]:
                state["gone"] = True
                task.cancel()  # type: ignore[union-attr]

        watcher = asyncio.ensure_future(watch())
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for piece in self.body:
                if type(piece) is _Last:  # the answer's end and the stream's in one write
                    state["over"] = True
                    await send({"type": "http.response.body", "body": piece, "more_body": False})
                    break
                await send({"type": "http.response.body", "body": piece, "more_body": True})
            else:
                state["over"] = True
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not state["gone"]:
                raise
            if hasattr(task, "uncancel"):  # the client left: nothing more to send (3.11+: the task goes on)
                task.uncancel()
        finally:
            state["over"] = True
            watcher.cancel()
            await self.body.aclose()  # a generator left mid-way records what its client got


class _Refused(Exception):
    def __init__(self, status: int, message: str, code: str, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.code, self.kind = status, code, kind


def too_big(limit: int) -> str:
    """The refusal of a body over serve.max_body_bytes (413, body_too_large)."""
    return f"request body over {limit} bytes (serve.max_body_bytes)"


def error_body(message: str, kind: str = "invalid_request_error", code: str | None = None) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": kind, "code": code}})


def _body_for(arm: Any, req: ChatBody) -> ChatBody | dict[str, Any]:
    """What an arm is called with: an upstream, the body (``ChatBody.upstream``: its messages and tools as the
    client's bytes); an in-process arm, the body parsed whole."""
    return req if arm.wire else req.full()


class ChatHandling:
    """The chat endpoint's methods of ``Gateway`` (its arms, tracker, router state and logs are the gateway's)."""

    async def _read(self, hdr: dict[bytes, bytes], receive: Any) -> bytes:
        """The body, once the gateway key (if any) checks out and within serve.max_body_bytes."""
        if self._auth is not None and not hmac.compare_digest(hdr.get(b"authorization", b""), self._auth):
            raise _Refused(401, "missing or wrong gateway key (Authorization: Bearer ...)", "invalid_api_key")
        cl = hdr.get(b"content-length", b"")
        if cl.isdigit() and int(cl) > self.max_body:
            raise _Refused(413, too_big(self.max_body), "body_too_large")
        chunks, n = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                raise _Refused(400, "the client disconnected before its body was read", "client_disconnected")
            chunk = msg.get("body", b"")
            n += len(chunk)
            if n > self.max_body:
                raise _Refused(413, too_big(self.max_body), "body_too_large")
            chunks.append(chunk)
            if not msg.get("more_body"):
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def refuse(self, status: int, message: str, code: str = "body_too_large") -> Response:
        """An error answer the server gives before the handling (a body over serve.max_body_bytes), counted."""
        return self._refuse(_Refused(status, message, code))

    def _refuse(self, e: _Refused, rid: str | None = None) -> Response:
        self.rejected += 1
        extra = [(b"x-request-id", rid.encode())] if rid else []
        return _Raw(error_body(str(e), e.kind, e.code), e.status, extra)

    async def chat_asgi(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """POST /v1/chat/completions as a plain ASGI app: the hot path skips Starlette's Request and
        middleware layers (measured: benchmarks/bench_gateway.py); its responses are Starlette's."""
        response = await self.chat(dict(scope["headers"]), receive)
        await response(scope, receive, send)

    def _explicit(self, hdr: dict[bytes, bytes], payload: dict[str, Any] | ChatBody) -> str | None:
        """The conversation id the client named: X-Hermes-Conversation, metadata.conversation_id, or (with
        serve.conversation_from_user) its user."""
        raw = hdr.get(b"x-hermes-conversation")
        cid: Any = raw.decode("latin-1") if raw else None
        if cid is None:
            md = payload.get("metadata")
            cid = md.get("conversation_id") if isinstance(md, dict) else None
        if cid is None and self.from_user:
            cid = payload.get("user") or hdr.get(b"x-hermes-user", b"").decode("latin-1") or None
        if cid is None:
            return None
        if not isinstance(cid, str) or not _RID.match(cid):
            raise _Refused(400, "conversation id: 1-128 characters of [A-Za-z0-9._:@/+=-]", "bad_conversation_id")
        return cid

    def _route(self, rid: str, cid: str, payload: ChatBody, hdr: dict[bytes, bytes]) -> str:
        """The randomisation unit of a new conversation's first turn (ab.unit)."""
        if self.unit == "conversation":
            return cid
        if self.unit == "request":
            return rid
        user = payload.get("user") or payload.get("safety_identifier") or hdr.get(b"x-hermes-user", b"").decode()
        return str(user or rid)

    async def chat(self, hdr: dict[bytes, bytes], receive: Any) -> Response | _Events:
        t_start = time.perf_counter()
        raw_rid = hdr.get(b"x-request-id")
        rid = raw_rid.decode("latin-1") if raw_rid else f"{self._rid_prefix}{next(self._rid_seq):x}"
        if not _RID.match(rid):
            return self._refuse(
                _Refused(400, "X-Request-ID: 1-128 characters of [A-Za-z0-9._:@/+=-]", "bad_request_id")
            )
        try:
            req = ChatBody(await self._read(hdr, receive))
            req.encode_messages(self.convs)  # of a large body, only the messages never seen are parsed
            if self.accepted is not None and req.get("model") not in self.accepted:
                raise _Refused(
                    404,
                    f"The model {req.get('model')!r} does not exist; ask for one of {sorted(self.accepted)}",
                    "model_not_found",
                )
            explicit = self._explicit(hdr, req)
            tools_hash = req.tools_hash(self.tools_log)
        except BadBody as e:
            return self._refuse(_Refused(400, str(e), e.code), rid)
        except orjson.JSONDecodeError as e:
            return self._refuse(_Refused(400, f"the body is not valid JSON: {e}", "invalid_json"), rid)
        except _Refused as e:
            return self._refuse(e, rid)
        # the conversation: the messages' encodings digested, one dict lookup
        link = req.link(self.convs, explicit)
        conv, switched = link.conv, False
        if conv is None:
            cid = explicit or rid
            unit = self._route(rid, cid, req, hdr)
            arm = 1 if ab.bucket(unit, self.salt) < self.ratio else 0
            conv = self.convs.open_new(cid, arm, explicit is not None)
        elif link.retry:  # the same messages after a failed or empty answer: that turn again, on its arm and unit
            unit, arm = link.unit, link.arm
            if arm == 1 and self.ratio <= 0 and self.unit == "conversation":
                arm, switched, conv.switched = 0, True, True
        elif self.unit == "conversation":
            unit, arm = conv.id, conv.arm
            if arm == 1 and self.ratio <= 0:  # rolled back: the candidate's running conversations go to the baseline
                arm, switched, conv.switched = 0, True, True
        else:  # request / user units: every turn routed on its own unit
            unit = self._route(rid, conv.id, req, hdr)
            arm = 1 if ab.bucket(unit, self.salt) < self.ratio else 0
        turn = link.turn if link.retry else conv.turns
        self.convs.started(conv, link.retry > 0)
        n = req.n
        new = req.messages(link.history if link.history <= n else 0)
        md = req.get("metadata")
        task_id = (md.get("task_id") if isinstance(md, dict) else None) or hdr.get(b"x-hermes-task-id", b"").decode()
        arm_obj = self.arms[ARMS[arm]]
        prompt = ""
        if arm_obj.needs_prompt or not link.history:
            prompt = flatten_messages(new if not link.history else req.messages())
        info = {
            "conversation_id": conv.id,
            "turn": turn,
            "history": link.history,
            "messages": new,
            "tools_hash": tools_hash,
            "tool_errors": tool_errors(new),
            "switched": switched,
            "retry": link.retry,
        }
        # the conversation's id on every answer (plain, streamed, refused by the arm), so a client can post
        # feedback for it (POST /v1/feedback {"conversation_id"}) or name it on its next turn
        headers = [(b"x-request-id", rid.encode()), (b"x-hermes-arm", ARM_HEADER[arm])]
        headers.append((b"x-hermes-conversation", conv.id.encode()))
        rec = self._record(rid, unit, arm, req, task_id, t_start, info)
        if not link.history:
            rec["prompt"] = prompt  # a conversation's opening (a single-turn request: its whole prompt)
        ctx = (conv, link, n)
        if req.get("stream") is True:
            return await self._stream(req, prompt, rid, arm, rec, headers, t_start, ctx)
        ans = await self._call(arm_obj.complete, _body_for(arm_obj, req), prompt, rid)
        self._finish(rec, ans, t_start)
        if arm == 1 and self.fallback and rec["status"] != "ok":
            base = self.arms["baseline"]
            ans = await self._call(base.complete, _body_for(base, req), prompt, rid)
            self._fell_back(rec, ans.status, ans.error, t_start, headers)
        await self._commit(rec, link=ctx)
        return _Raw(ans.body, ans.status, headers)

    async def _call(self, fn: Any, payload: ChatBody | dict[str, Any], prompt: str, rid: str) -> Any:
        try:
            return await fn(payload, prompt, rid)
        except UpstreamError as e:
            code = "gateway_timeout" if e.status == 504 else "bad_gateway"
            return Answer(e.status, error_body(str(e), "upstream_error", code), error=str(e))
        except Exception as e:  # an in-process generation failure: a 500 naming it
            log.exception("arm failed")
            msg = f"{type(e).__name__}: {e}"
            return Answer(500, error_body(msg, "server_error", "generation_failed"), error=msg)

    async def _stream(
        self,
        req: ChatBody,
        prompt: str,
        rid: str,
        arm: int,
        rec: dict[str, Any],
        headers: list[tuple[bytes, bytes]],
        t_start: float,
        ctx: tuple[Any, Link, int],
    ) -> Response | _Events:
        rec["stream"] = True
        arm_obj = self.arms[ARMS[arm]]
        opened = await self._call(arm_obj.stream, _body_for(arm_obj, req), prompt, rid)
        err, events = opened if isinstance(opened, tuple) else (opened, None)
        fell = False
        if err is not None:  # refused before the first byte: a plain JSON error, as OpenAI answers
            self._finish(rec, err, t_start)
            if arm == 1 and self.fallback:  # (a break mid-stream cannot fall back: bytes went out)
                base = self.arms["baseline"]
                opened = await self._call(base.stream, _body_for(base, req), prompt, rid)
                err, events = opened if isinstance(opened, tuple) else (opened, None)
                self._fell_back(rec, 200 if err is None else err.status, err and err.error, t_start, headers)
                fell = err is None
            if not fell:
                await self._commit(rec)
                return _Raw(err.body, err.status, headers)

        async def body() -> Any:
            text, thought, usage, finish, ttft, error, done = [], [], None, None, None, None, False
            tail = b""  # the upstream's last piece, sent with the end: one write where it came with [DONE]
            calls, tokens = CallAssembler(), getattr(events, "tokens", None)  # tokens: an in-process arm's

            def answer(status: int, err: str | None) -> Answer:
                return Answer(
                    status, b"", "".join(text), usage, err, finish, calls.result(), "".join(thought) or None, tokens
                )

            try:
                async for ch in events:
                    if ttft is None and (ch.text or ch.calls or ch.reasoning):
                        ttft = round((time.perf_counter() - t_start) * 1000, 3)
                    text.append(ch.text)
                    if ch.calls:
                        calls.add(ch.calls)
                    if ch.reasoning:
                        thought.append(ch.reasoning)
                    usage, finish = ch.usage or usage, ch.finish_reason or finish
                    if ch.end:
                        tail = ch.raw
                    elif ch.raw:
                        yield ch.raw
            except UpstreamError as e:
                error = str(e)
            except BaseException:  # the client went away (cancelled): record what it got, without waiting
                self._finish(rec, answer(499, "client disconnected"), t_start)
                rec["ttft_ms"] = ttft
                await self._commit(rec, wait=False, link=ctx)  # failed: the client's retry is this turn again
                done = True
                raise
            finally:
                if not done and fell:  # the record stays the candidate's error; the fallback's outcome beside it
                    rec["fallback"].update(http_status=200 if error is None else 502, error=error)
                    rec.update(latency_ms=round((time.perf_counter() - t_start) * 1000, 3), t_done=self.clock())
                elif not done:
                    self._finish(rec, answer(200 if error is None else 502, error), t_start)
                    rec["ttft_ms"] = ttft
            await self._commit(rec, link=ctx)  # durable (and linkable) before the last byte ([DONE]) goes out
            if error is None:
                yield _Last(tail + b"data: [DONE]\n\n")
            else:
                yield _Last(tail + b"data: " + error_body(error, "upstream_error", "bad_gateway") + b"\n\n")

        return _Events(body(), headers)
