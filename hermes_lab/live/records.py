"""The gateway's durable log of requests: each request's record, built as it arrives, completed by its answer,
and appended to requests.jsonl before the answer's last byte goes out.

Stage: validate (live A/B, ``hermes-lab serve``). Part of ``hermes_lab.live.gateway.Gateway`` (its
``RequestRecords`` methods). Writes ``requests.jsonl`` in the gateway's log dir through ``hermes_lab.live.log``'s
``LogWriter`` (``serve.durability``: written, or fsynced, before ``_commit`` returns), and keeps the tally the looks
analyse current. The record's fields are listed in ``hermes_lab.live.log``.

    hermes-lab serve --params params/embedded.yaml --log-dir runs/live/tiny-vs-round-01
"""

from __future__ import annotations

import logging
import time
from typing import Any

import orjson

from hermes_lab.live import log as L
from hermes_lab.live.arms import ARMS, Answer
from hermes_lab.live.conversations import Link, empty

log = logging.getLogger("hermes_lab.serve")


class RequestRecords:
    """The request log's methods of ``Gateway`` (its writers, tally, clock and tracker are the gateway's)."""

    def _record(
        self, rid: str, unit: str, arm: int, payload: Any, task_id: Any, t_start: float, turn: dict[str, Any]
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
            "timestamp": L.now_iso(now),
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

    def _fell_back(
        self, rec: dict[str, Any], status: int, error: str | None, t_start: float, headers: list[tuple[bytes, bytes]]
    ) -> None:
        """serve.fallback: the baseline answered a failed candidate call. The record stays the candidate's
        error (its arm's error rate sees it; feedback on it is ignored); the client waited for both."""
        rec["fallback"] = {"arm": "baseline", "http_status": status, "error": error}
        rec["latency_ms"] = round((time.perf_counter() - t_start) * 1000, 3)
        rec["t_done"] = round(self.clock(), 3)
        headers.append((b"x-hermes-fallback", b"baseline"))

    async def _commit(self, rec: dict[str, Any], wait: bool = True, link: tuple[Any, Link, int] | None = None) -> None:
        if link is not None:
            conv, lk, n = link
            answer = {"role": "assistant", "content": rec["response"], "tool_calls": rec["tool_calls"]}
            if rec["status"] != "ok" or empty(answer):  # the same messages again are this turn's retry
                arm = 1 if rec["arm"] == "candidate" else 0
                self.convs.failed(conv, lk, rec["turn"], arm, rec["unit"])
            if rec["status"] == "ok":  # a continuation can link from now on
                self.convs.answered(conv, lk.hasher, n, answer, lk.full)
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
