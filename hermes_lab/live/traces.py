"""Gateway traffic in MLflow: each request an MLflow trace, each feedback an assessment on it.

Stage: validate (live A/B), on with ``serve.mlflow_traces: true``. Writes to the MLflow store of the
round (``hermes_lab.core.tracking.setup``: ``runs/mlflow.db`` or ``MLFLOW_TRACKING_URI``), experiment
``round.experiment``, so traffic and its feedback show in the MLflow UI next to the rounds. The JSONL log
(``hermes_lab.live.log``) stays the durable source: this sink runs in its own thread, in batches, off the
request path, and a failure here is a warning, never a failed request.

A trace is one root span (``mlflow.start_span_no_context``, name ``serve/chat``: inputs the messages,
outputs the text, the request's own start time and latency) tagged ``serve/request_id`` / ``serve/arm`` /
``serve/experiment`` / ``serve/stage``; feedback is ``mlflow.log_feedback`` named after its source
(``system`` ...). Feedback on a request logged before a restart finds its trace by its request_id tag.

    hermes-lab serve --set serve.mlflow_traces=true ...;  make mlflow-ui
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from datetime import datetime
from typing import Any

log = logging.getLogger("hermes_lab.serve")
BATCH, EVERY_S = 200, 1.0


class TraceSink:
    """A background thread turning request/feedback records into MLflow traces and assessments."""

    def __init__(self, cfg: Any, experiment: str):
        self.cfg, self.experiment = cfg, experiment
        self._q: queue.Queue[tuple[str, dict[str, Any]] | None] = queue.Queue(maxsize=100_000)
        self.trace_ids: dict[str, str] = {}
        self.stats = {"traces": 0, "assessments": 0, "dropped": 0, "failed": 0}
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="serve-mlflow", daemon=True)
        self._thread.start()

    def request(self, rec: dict[str, Any]) -> None:
        self._put(("request", rec))

    def feedback(self, rec: dict[str, Any]) -> None:
        self._put(("feedback", rec))

    def _put(self, item: tuple[str, dict[str, Any]]) -> None:
        try:
            self._q.put_nowait(item)
        except queue.Full:  # MLflow cannot keep up: the JSONL log has the record anyway
            self.stats["dropped"] += 1

    def close(self, timeout: float = 30.0) -> None:
        self._q.put(None)
        self._thread.join(timeout)

    def wait_ready(self, timeout: float = 60.0) -> bool:
        return self._ready.wait(timeout)

    # ------------------------------------------------------------------------------------- thread
    def _run(self) -> None:
        import mlflow

        from hermes_lab.core import tracking

        tracking.setup(self.cfg.round.runs_dir, self.cfg.round.experiment)
        self._ready.set()
        done = False
        while not done:
            batch: list[tuple[str, dict[str, Any]]] = []
            deadline = time.monotonic() + EVERY_S
            while len(batch) < BATCH:
                try:
                    item = self._q.get(timeout=max(deadline - time.monotonic(), 0.01))
                except queue.Empty:
                    break
                if item is None:
                    done = True
                    break
                batch.append(item)
            if batch:
                self._write(mlflow, batch)

    def _write(self, mlflow: Any, batch: list[tuple[str, dict[str, Any]]]) -> None:
        from mlflow.entities import AssessmentSource

        for kind, rec in (b for b in batch if b[0] == "request"):
            try:
                ts = rec.get("timestamp")  # written when the answer was complete: start = end - latency
                end = datetime.fromisoformat(ts).timestamp() if isinstance(ts, str) else time.time()
                start_ms = int(end * 1000 - float(rec.get("latency_ms") or 0))
                span = mlflow.start_span_no_context(
                    name="serve/chat",
                    span_type="CHAT_MODEL",
                    inputs={"messages": rec.get("messages")},
                    attributes={
                        k: rec.get(k)
                        for k in ("arm", "model", "status", "http_status", "latency_ms", "ttft_ms", "task_id")
                    }
                    | {"usage": rec.get("usage") or {}, "error": rec.get("error") or ""},
                    tags={
                        "serve/request_id": str(rec["request_id"]),
                        "serve/arm": str(rec["arm"]),
                        "serve/experiment": self.experiment,
                        "serve/stage": str(rec.get("stage")),
                        "serve/status": str(rec.get("status")),
                    },
                    start_time_ns=start_ms * 1_000_000,
                )
                span.end(outputs=rec.get("response"), end_time_ns=int(end * 1e9))
                tid = span.trace_id
                self.trace_ids[str(rec["request_id"])] = tid
                self.stats["traces"] += 1
            except Exception as e:  # MLflow trouble must never reach the request path
                self._fail(kind, e)
        if any(k == "feedback" for k, _ in batch):
            mlflow.flush_trace_async_logging()  # the traces must be in the store before their assessments
        for kind, rec in (b for b in batch if b[0] == "feedback"):
            try:
                tid = self.trace_ids.get(str(rec["request_id"])) or self._find(mlflow, str(rec["request_id"]))
                if tid is None:
                    self.stats["failed"] += 1
                    continue
                detail = rec.get("detail")
                mlflow.log_feedback(
                    trace_id=tid,
                    name=str(rec.get("source") or "system"),
                    value=float(rec["reward"]),
                    source=AssessmentSource(source_type="CODE", source_id=str(rec.get("source") or "system")),
                    rationale=detail if isinstance(detail, str) else None,
                    metadata={"request_id": str(rec["request_id"]), "arm": str(rec.get("arm"))},
                )
                self.stats["assessments"] += 1
            except Exception as e:
                self._fail(kind, e)

    def _find(self, mlflow: Any, rid: str) -> str | None:
        """The trace of a request logged before this process started (by its serve/request_id tag)."""
        found = mlflow.search_traces(
            filter_string=f"tags.`serve/request_id` = '{rid.replace(chr(39), '')}'", max_results=1, return_type="list"
        )
        return found[0].info.trace_id if found else None

    def _fail(self, kind: str, e: BaseException) -> None:
        self.stats["failed"] += 1
        if self.stats["failed"] <= 3:
            log.warning("MLflow %s not written (the JSONL log has it): %s: %s", kind, type(e).__name__, e)
