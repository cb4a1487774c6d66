"""The live A/B gateway: an OpenAI-compatible server that routes each request to baseline or candidate.

Stage: validate (live A/B on real traffic). Reads the two arms (``hermes_lab.live.arms``: an upstream
OpenAI-compatible server, or ``hermes_lab.live.local``: a policy served in-process). Writes its log dir (default
``runs/live/<experiment>/``; ``hermes_lab.live.log``): requests.jsonl, tools.jsonl, feedback.jsonl, experiment.json.

    hermes-lab serve --params params/embedded.yaml --baseline embedded:tiny --candidate latest
    make serve                                  # the same on the embedded default
    hermes-lab agent --url http://127.0.0.1:8700 --requests 500     # drive it like a real agent

Endpoints: ``GET /healthz``, ``GET /v1/models``, ``POST /v1/chat/completions`` (non-streaming and ``stream:
true``: SSE chunks passed through as they arrive; any model name is served unless ``serve.models`` lists the
accepted ones), ``POST /v1/feedback`` (``{"conversation_id" | "request_id", "reward", "source"?, "detail"?,
"close"?}``: it scores the whole conversation; 202; 404 unknown id; 422 bad body or reward outside
0..reward.scale), ``GET /v1/conversations/{id}`` (a conversation's turns, arm, state, reward; a request id
finds its conversation), ``GET /v1/experiment`` (stage, ratio, counts, per-arm conversation statistics, the
decision of ``hermes_lab.ab.stats``, the latest look's delta and interval).

Routing is the user's ABRouter bucket (``hermes_lab.ab.stats.bucket``, md5 of the unit id, ``ab.salt``) on the
unit. ``ab.unit: conversation``: a conversation's first turn is routed on its id (``hermes_lab.live.conversations``
links every later turn to it: an explicit id, else the message prefix), and every later turn goes to the same
arm; after a roll back (share 0) a candidate conversation's next turns go to the baseline, ``switched`` in the
log. ``ab.unit: request``: the ``X-Request-ID`` header (generated when absent); ``ab.unit: user``: the OpenAI
``user`` field or an ``X-Hermes-User`` header (a request with neither is its own unit). Every answer carries
``X-Request-ID``, ``X-Hermes-Conversation`` and ``X-Hermes-Arm``. A request's record (the turn's new messages,
the answer whole: text, tool calls assembled from the stream, reasoning, usage) is durable
(``serve.durability``) before the last byte of its answer goes out, so a kill -9 loses no answered request; a
restart on the same dir continues the experiment.

Security: binds 127.0.0.1 unless told otherwise; ``serve.api_key_env`` names the env var holding an
optional gateway key (Bearer); bodies over ``serve.max_body_bytes`` get 413; the client's Authorization
header is never logged nor forwarded, and an upstream's key goes only to that upstream.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
import os
import re
import time
from contextlib import asynccontextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from hermes_lab.ab import stats as ab
from hermes_lab.config.schema import ConfigError, HermesConfig
from hermes_lab.live import experiment as X
from hermes_lab.live import log as L
from hermes_lab.live.arms import ARMS, Answer, ArmSpec, CallAssembler, UpstreamError, flatten_messages
from hermes_lab.live.conversations import Link, Tracker, tool_errors
from hermes_lab.live.local import ArmPool, build_arms

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
                await send({"type": "http.response.body", "body": piece, "more_body": True})
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


def error_body(message: str, kind: str = "invalid_request_error", code: str | None = None) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": kind, "code": code}})


def default_experiment(specs: dict[str, ArmSpec]) -> str:
    return f"{specs['baseline'].slug}-vs-{specs['candidate'].slug}"


# --------------------------------------------------------------------------------------------- gateway
class Gateway:
    """The experiment behind the server: arms, router, durable logs, in-memory tally."""

    def __init__(
        self,
        cfg: HermesConfig,
        specs: dict[str, ArmSpec],
        *,
        ratio: float | None = None,
        log_dir: str | os.PathLike[str] | None = None,
        experiment: str | None = None,
        say: Any = print,
        pool: ArmPool | None = None,
    ):
        self.cfg, s = cfg, cfg.serve
        self.specs, self.say = specs, say
        self.name = experiment or s.experiment or default_experiment(specs)
        self.log_dir = Path(log_dir or s.log_dir or Path(cfg.round.runs_dir) / "live" / self.name)
        self.stages, ratio = X.live_stages(cfg, self.log_dir, ratio)  # errors name the ab.* key
        self.public = s.public_model
        self.accepted = {self.public, *s.models} if s.models else None  # None: any model name is served
        self.unit, self.salt = cfg.ab.unit, cfg.ab.salt
        self.from_user = s.conversation_from_user
        self.convs = Tracker(s.conversation_idle_s, s.conversation_tool_wait_s, s.max_conversations)
        self.max_body = s.max_body_bytes
        self.scale = float(cfg.reward.scale)
        # first: a missing key fails before any state is written. A shared pool (the live flywheel's one
        # gateway, hermes_lab.live.switch) keeps its policies and worker; else they are this gateway's
        self.arms, self.worker = build_arms(cfg, specs, pool)
        ident = X.experiment_ident(cfg, {n: specs[n].describe() for n in ARMS}, self.name)
        self.state = X.open_experiment(self.log_dir, ident, self.stages, ratio, arm_specs=X.arm_specs(specs))
        self.stage, self.ratio = int(self.state["stage"]), float(self.state["ratio"])
        self.t0 = float(self.state["start_unix"])
        self.fallback = s.fallback == "baseline"
        self._auth: bytes | None = None
        if s.api_key_env:
            key = os.environ.get(s.api_key_env, "")
            if not key:
                raise ConfigError(f"serve.api_key_env names {s.api_key_env}, which is not set: export the gateway key")
            self._auth = f"Bearer {key}".encode()
        # the adjusted rule needs one reward row per unit: a request, or a conversation (its first turn's row)
        covs = cfg.ab.covariates if cfg.ab.unit != "user" else ()
        self.tally = L.Tally.from_dir(self.log_dir, s.feedback_source, covariates=covs)
        for cid, arm, turns, msgs, age in L.open_conversations(self.log_dir, s.conversation_tool_wait_s):
            if cid not in self.tally.conv_reward:  # a scored conversation was closed by its feedback
                self.convs.restore(cid, arm, turns, msgs, age)
        # the staged rollout on the (scaled) wall clock: it owns stage and ratio, the gateway routes with them
        self.rollout = X.LiveRollout(cfg, self.state, self.log_dir, self.tally, say)
        self.clock = self.rollout.clock
        self._looks: asyncio.Task | None = None
        self.rejected = 0
        self.req_log = self.fb_log = self.tools_log = None
        self.traces: Any = None
        self._decision: tuple[Any, dict[str, Any]] = (None, {})
        self.flywheel: Any = None  # the live flywheel's status (a callable), shown by /v1/experiment
        self._debug = log.isEnabledFor(logging.DEBUG)
        # generated request ids: a random per-process prefix and a counter (unique across restarts, and
        # cheaper than uuid4, whose urandom call showed up in the profile)
        self._rid_prefix, self._rid_seq = f"hl-{os.urandom(6).hex()}-", itertools.count(1)

    async def startup(self) -> None:
        s = self.cfg.serve
        self.req_log = L.LogWriter(self.log_dir / L.REQUESTS, s.durability, s.fsync_ms)
        self.fb_log = L.LogWriter(self.log_dir / L.FEEDBACK, s.durability, s.fsync_ms)
        self.tools_log = L.ToolsLog(self.log_dir, s.durability, s.fsync_ms)
        for a in self.arms.values():
            await a.start()
        # the decision's scipy/statsmodels imports take seconds: done now, off the loop, not at the first look
        self._warm = asyncio.get_running_loop().run_in_executor(None, X.warm_up)
        if s.mlflow_traces:
            from hermes_lab.live.traces import TraceSink

            self.traces = TraceSink(self.cfg, self.name)
        self.rollout.start_clock()
        self.t0 = self.rollout.t0
        if self.rollout.next_look() is not None:
            self._looks = asyncio.create_task(self.rollout.run(self._moved))

    def _moved(self) -> None:
        """The rollout took a step: route with its stage and ratio from the next request on."""
        self.stage, self.ratio = int(self.state["stage"]), float(self.state["ratio"])

    async def shutdown(self) -> None:
        if self._looks is not None:
            if not self.rollout.reporting:  # the final report is being written: let it finish
                self._looks.cancel()
            await asyncio.gather(self._looks, return_exceptions=True)
        for a in self.arms.values():
            await a.close()
        for w in (self.req_log, self.fb_log, self.tools_log):
            if w is not None:
                w.close()
        if self.worker is not None:
            self.worker.close()
        if self.traces is not None:
            self.traces.close()

    # --------------------------------------------------------------------------------- helpers
    async def _body(self, request: Request) -> bytes:
        return await self._read(dict(request.scope["headers"]), request.receive)

    async def _read(self, hdr: dict[bytes, bytes], receive: Any) -> bytes:
        """The body, once the gateway key (if any) checks out and within serve.max_body_bytes."""
        if self._auth is not None and not hmac.compare_digest(hdr.get(b"authorization", b""), self._auth):
            raise _Refused(401, "missing or wrong gateway key (Authorization: Bearer ...)", "invalid_api_key")
        cl = hdr.get(b"content-length", b"")
        too_big = f"request body over {self.max_body} bytes (serve.max_body_bytes)"
        if cl.isdigit() and int(cl) > self.max_body:
            raise _Refused(413, too_big, "body_too_large")
        chunks, n = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                raise _Refused(400, "the client disconnected before its body was read", "client_disconnected")
            chunk = msg.get("body", b"")
            n += len(chunk)
            if n > self.max_body:
                raise _Refused(413, too_big, "body_too_large")
            chunks.append(chunk)
            if not msg.get("more_body"):
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def _refuse(self, e: _Refused, rid: str | None = None) -> Response:
        self.rejected += 1
        extra = [(b"x-request-id", rid.encode())] if rid else []
        return _Raw(error_body(str(e), e.kind, e.code), e.status, extra)

    def _record(
        self, rid: str, unit: str, arm: int, payload: dict[str, Any], task_id: Any, t_start: float, turn: dict[str, Any]
    ) -> dict[str, Any]:
        now = time.time()
        return {
            "request_id": rid,
            "unit": unit,
            "arm": ARMS[arm],
            "model": self.arms[ARMS[arm]].served_model,
            "stage": self.stage,
            "ratio": self.ratio,
            "t": round(self.clock(now), 3),
            "t_done": None,
            "timestamp": datetime.fromtimestamp(now, timezone.utc).isoformat(),
            "status": "ok",
            "http_status": 200,
            "error": None,
            "fallback": None,
            "latency_ms": round((time.perf_counter() - t_start) * 1000, 3),
            "ttft_ms": None,
            "usage": None,
            "stream": False,
            "finish_reason": None,
            "prompt": None,
            "response": "",
            "tool_calls": None,
            "reasoning": None,
            "task_id": task_id if isinstance(task_id, str) and task_id else None,
            "requested_model": payload.get("model"),
            **turn,
        }

    async def _commit(self, rec: dict[str, Any], wait: bool = True, link: tuple[Any, Link, int] | None = None) -> None:
        if link is not None and rec["status"] == "ok":  # a continuation can link from now on
            conv, lk, n = link
            answer = {"role": "assistant", "content": rec["response"], "tool_calls": rec["tool_calls"]}
            self.convs.answered(conv, lk.hasher, n, answer)
        line = orjson.dumps(rec) + b"\n"
        if wait:
            await self.req_log.append(line)
        else:
            self.req_log.append_nowait(line)
        self.tally.add_request(rec)
        if self.traces is not None:
            self.traces.request(rec)
        if self._debug:
            log.debug(
                "request_id=%s conversation=%s turn=%s arm=%s status=%s",
                rec["request_id"],
                rec["conversation_id"],
                rec["turn"],
                rec["arm"],
                rec["http_status"],
            )

    # --------------------------------------------------------------------------------- endpoints
    async def healthz(self, request: Request) -> Response:
        return _Raw(orjson.dumps({"status": "ok", "experiment": self.name, "pid": os.getpid()}), 200, [])

    async def models(self, request: Request) -> Response:
        try:
            await self._body(request)
        except _Refused as e:
            return self._refuse(e)
        names = [self.public, *sorted((self.accepted or set()) - {self.public})]
        data = [{"id": n, "object": "model", "created": int(self.t0), "owned_by": "hermes-lab"} for n in names]
        return _Raw(orjson.dumps({"object": "list", "data": data}), 200, [])

    async def chat_asgi(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """POST /v1/chat/completions as a plain ASGI app: the hot path skips Starlette's Request and
        middleware layers (measured: benchmarks/bench_gateway.py); its responses are Starlette's."""
        response = await self.chat(dict(scope["headers"]), receive)
        await response(scope, receive, send)

    def _explicit(self, hdr: dict[bytes, bytes], payload: dict[str, Any]) -> str | None:
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

    def _route(self, rid: str, cid: str, payload: dict[str, Any], hdr: dict[bytes, bytes]) -> str:
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
            payload = orjson.loads(await self._read(hdr, receive))
            if not isinstance(payload, dict):
                raise _Refused(400, "the body must be a JSON object", "invalid_body")
            messages = payload.get("messages")
            if not isinstance(messages, list) or not messages:
                raise _Refused(400, "'messages' must be a non-empty list", "invalid_messages")
            if self.accepted is not None and payload.get("model") not in self.accepted:
                raise _Refused(
                    404,
                    f"The model {payload.get('model')!r} does not exist; ask for one of {sorted(self.accepted)}",
                    "model_not_found",
                )
            explicit = self._explicit(hdr, payload)
        except orjson.JSONDecodeError as e:
            return self._refuse(_Refused(400, f"the body is not valid JSON: {e}", "invalid_json"), rid)
        except _Refused as e:
            return self._refuse(e, rid)
        # the conversation: one digest pass over the parsed messages, one dict lookup
        link = self.convs.link(messages, explicit)
        conv, switched = link.conv, False
        if conv is None:
            cid = explicit or rid
            unit = self._route(rid, cid, payload, hdr)
            arm = 1 if ab.bucket(unit, self.salt) < self.ratio else 0
            conv = self.convs.open_new(cid, arm, explicit is not None)
        elif self.unit == "conversation":
            unit, arm = conv.id, conv.arm
            if arm == 1 and self.ratio <= 0:  # rolled back: the candidate's running conversations go to the baseline
                arm, switched, conv.switched = 0, True, True
        else:  # request / user units: every turn routed on its own unit
            unit = self._route(rid, conv.id, payload, hdr)
            arm = 1 if ab.bucket(unit, self.salt) < self.ratio else 0
        turn = conv.turns
        self.convs.started(conv)
        new = messages[link.history :] if link.history <= len(messages) else messages
        md = payload.get("metadata")
        task_id = (md.get("task_id") if isinstance(md, dict) else None) or hdr.get(b"x-hermes-task-id", b"").decode()
        arm_obj = self.arms[ARMS[arm]]
        prompt = flatten_messages(messages) if (arm_obj.needs_prompt or not link.history) else ""
        info = {
            "conversation_id": conv.id,
            "turn": turn,
            "history": link.history,
            "messages": new,
            "tools_hash": self.tools_log.add(payload.get("tools")),
            "tool_errors": tool_errors(new),
            "switched": switched,
        }
        headers = [(b"x-request-id", rid.encode()), (b"x-hermes-arm", ARM_HEADER[arm])]
        headers.append((b"x-hermes-conversation", conv.id.encode()))
        rec = self._record(rid, unit, arm, payload, task_id, t_start, info)
        if not link.history:
            rec["prompt"] = prompt  # a conversation's opening (a single-turn request: its whole prompt)
        ctx = (conv, link, len(messages))
        if payload.get("stream") is True:
            return await self._stream(payload, prompt, rid, arm, rec, headers, t_start, ctx)
        ans = await self._call(arm_obj.complete, payload, prompt, rid)
        self._finish(rec, ans, t_start)
        if arm == 1 and self.fallback and rec["status"] != "ok":
            ans = await self._call(self.arms["baseline"].complete, payload, prompt, rid)
            self._fell_back(rec, ans.status, ans.error, t_start, headers)
        await self._commit(rec, link=ctx)
        return _Raw(ans.body, ans.status, headers)

    def _fell_back(
        self, rec: dict[str, Any], status: int, error: str | None, t_start: float, headers: list[tuple[bytes, bytes]]
    ) -> None:
        """serve.fallback: the baseline answered a failed candidate call. The record stays the candidate's
        error (its arm's error rate sees it; feedback on it is ignored); the client waited for both."""
        rec["fallback"] = {"arm": "baseline", "http_status": status, "error": error}
        rec["latency_ms"] = round((time.perf_counter() - t_start) * 1000, 3)
        rec["t_done"] = round(self.clock(), 3)
        headers.append((b"x-hermes-fallback", b"baseline"))

    async def _call(self, fn: Any, payload: dict[str, Any], prompt: str, rid: str) -> Any:
        try:
            return await fn(payload, prompt, rid)
        except UpstreamError as e:
            code = "gateway_timeout" if e.status == 504 else "bad_gateway"
            return Answer(e.status, error_body(str(e), "upstream_error", code), error=str(e))
        except Exception as e:  # an in-process generation failure: a 500 naming it
            log.exception("arm failed")
            msg = f"{type(e).__name__}: {e}"
            return Answer(500, error_body(msg, "server_error", "generation_failed"), error=msg)

    def _finish(self, rec: dict[str, Any], ans: Answer, t_start: float) -> None:
        ok = ans.status == 200 and not ans.error
        rec.update(
            status="ok" if ok else "error",
            http_status=ans.status,
            error=ans.error,
            usage=ans.usage,
            finish_reason=ans.finish_reason,
            response=ans.text,
            tool_calls=ans.tool_calls,
            reasoning=ans.reasoning,
            latency_ms=round((time.perf_counter() - t_start) * 1000, 3),
            t_done=round(self.clock(), 3),
        )
        if ans.tokens is not None:  # an in-process arm's answer: its exact tokens, for turn-level training
            rec["tokens"] = ans.tokens

    async def _stream(
        self,
        payload: dict[str, Any],
        prompt: str,
        rid: str,
        arm: int,
        rec: dict[str, Any],
        headers: list[tuple[bytes, bytes]],
        t_start: float,
        ctx: tuple[Any, Link, int],
    ) -> Response | _Events:
        rec["stream"] = True
        opened = await self._call(self.arms[ARMS[arm]].stream, payload, prompt, rid)
        err, events = opened if isinstance(opened, tuple) else (opened, None)
        fell = False
        if err is not None:  # refused before the first byte: a plain JSON error, as OpenAI answers
            self._finish(rec, err, t_start)
            if arm == 1 and self.fallback:  # (a break mid-stream cannot fall back: bytes went out)
                opened = await self._call(self.arms["baseline"].stream, payload, prompt, rid)
                err, events = opened if isinstance(opened, tuple) else (opened, None)
                self._fell_back(rec, 200 if err is None else err.status, err and err.error, t_start, headers)
                fell = err is None
            if not fell:
                await self._commit(rec)
                return _Raw(err.body, err.status, headers)

        async def body() -> Any:
            text, thought, usage, finish, ttft, error, done = [], [], None, None, None, None, False
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
                    if ch.raw:
                        yield ch.raw
            except UpstreamError as e:
                error = str(e)
            except BaseException:  # the client went away (cancelled): record what it got, without waiting
                self._finish(rec, answer(499, "client disconnected"), t_start)
                rec["ttft_ms"] = ttft
                await self._commit(rec, wait=False)
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
                yield b"data: [DONE]\n\n"
            else:
                yield b"data: " + error_body(error, "upstream_error", "bad_gateway") + b"\n\n"

        return _Events(body(), headers)

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


def build_app(gw: Gateway) -> Any:
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
        Route("/v1/feedback", gw.feedback, methods=["POST"]),
        Route("/v1/experiment", gw.experiment, methods=["GET"]),
        Route("/v1/conversations/{cid:path}", gw.conversation, methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)

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
