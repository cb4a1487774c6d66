"""The live gateway's log directory: durable appends, the experiment state, and the tally the looks analyse.

Stage: validate (live A/B). ``hermes-lab serve`` writes, in its log dir (``runs/live/<experiment>/``):

  requests.jsonl    one record per request (a turn of a conversation): request_id, unit, arm, model, stage,
                    ratio, t (arrival, s since the experiment start on its clock: wall seconds x
                    serve.time_scale), t_done (answer complete), timestamp, status, http_status, error,
                    fallback, latency_ms, ttft_ms, usage, stream, task_id, requested_model; the conversation:
                    conversation_id, turn (0, 1, ...), history (how many of the request's messages earlier
                    turns logged: the conversation so far, their messages and answers), messages (only the
                    new ones: messages[history:]), tools_hash (its schemas in tools.jsonl), tool_errors (of
                    the new tool results), switched (a candidate conversation's turn the baseline answered
                    after a roll back), retry (0; a resend of a failed or empty turn's very messages: its
                    attempt, 1, 2, ..., logged under that turn's number, arm and unit); the answer, whole
                    whether streamed or not: response (text), tool_calls (assembled from the stream's
                    deltas), reasoning, finish_reason, usage; prompt (the flattened opening of a
                    conversation's first turn, null later); tokens
                    (in-process arms only: prompt_ids and completion_ids as the policy saw and sampled them,
                    logprobs of the sampled tokens, spliced: continued from its earlier turns' tokens,
                    truncated: cut to the policy's context)
  tools.jsonl       one line per distinct tool-schema list the agents sent: tools_hash, tools
  feedback.jsonl    one record per POST /v1/feedback: conversation_id, request_id (when it named one), reward,
                    source, detail, arm, t, timestamp; it scores the whole conversation
  experiment.json   the experiment's mutable state (arms, stages, current stage and ratio, stage starts,
                    every look's decision, restarts), written atomically (``hermes_lab.core.jsonl.write_json_atomic``)
  ab_report.json    the live rollout's report (``hermes_lab.live.report``), with plots/*.png

Both JSONL files are append-only: never rewritten in place. A line torn by a crash is skipped by every
reader (and counted); the next writer starts on a fresh line. Reading a log dir back as round data (prep,
``execute.source: live``) is ``hermes_lab.logs.gateway``'s, which owns the file names and the reader.

    hermes-lab serve --params params/embedded.yaml --log-dir runs/live/tiny-vs-round-01
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import threading
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import orjson
import xxhash

from hermes_lab.ab.covariates import Encoder, early_keys
from hermes_lab.core.jsonl import write_json_atomic
from hermes_lab.live.wire import raw_digest
from hermes_lab.logs.gateway import EXPERIMENT, FEEDBACK, REQUESTS, TOOLS, read_jsonl  # the log's format is data's

log = logging.getLogger("hermes_lab.serve")


# ------------------------------------------------------------------------------------------ writing
class LogWriter:
    """Appends lines to one JSONL file; ``await append(line)`` returns once the line is durable.

    durability 'write' (default): the line is written (the kernel holds it: a kill -9 of the gateway
    cannot lose it) before ``append`` returns, with the other lines of the same pass of the event loop in one
    ``os.write``; the thread fdatasyncs within ``fsync_ms``.
    durability 'fsync': group commit. Lines queue up while the writer thread is in write+fdatasync; each
    waiter is released by the fdatasync that covers its line, so at any load a record costs at most about
    two fsyncs of latency and one fsync serves every line that arrived meanwhile.
    """

    def __init__(self, path: str | os.PathLike[str], durability: str = "write", fsync_ms: float = 100.0):
        self.path, self.durability, self.interval = Path(path), durability, fsync_ms / 1000
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        size = os.fstat(self.fd).st_size
        if size:  # a torn last line (crash mid-write) must not swallow the next record
            with open(self.path, "rb") as f:
                f.seek(size - 1)
                if f.read(1) != b"\n":
                    os.write(self.fd, b"\n")
        self._cond = threading.Condition()
        self._lines: list[bytes] = []
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        self._dirty = self._closed = False
        # durability 'write': the lines of this pass of the event loop, who waits for them, and the loop
        self._batch_lines: list[bytes] = []
        self._batch_waiters: list[asyncio.Future] = []
        self._batch_loop: asyncio.AbstractEventLoop | None = None
        self.stats = {"lines": 0, "writes": 0, "fsyncs": 0}
        self._thread = threading.Thread(target=self._run, name=f"log-{self.path.name}", daemon=True)
        self._thread.start()

    async def append(self, line: bytes) -> None:
        if self.durability == "write":
            fut = self._batch(line).create_future()  # type: ignore[union-attr]
            self._batch_waiters.append(fut)
            await fut  # (cancelled meanwhile: the line is written all the same)
            return
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._cond:
            self._lines.append(line)
            self._waiters.append((loop, fut))
            self._cond.notify()
        await asyncio.shield(fut)  # a cancelled request still gets its record written

    def append_nowait(self, line: bytes) -> None:
        """Queue a line without waiting (a request whose client is gone, cleanup paths)."""
        if self.durability == "write":
            self._batch(line)
            return
        with self._cond:
            self._lines.append(line)
            self._cond.notify()

    def _batch(self, line: bytes) -> asyncio.AbstractEventLoop | None:
        """durability 'write': the line joins the lines of this pass of the event loop, written by one ``os.write``
        once the pass's callbacks are done (at 64 requests in flight a pass holds ~26 records, and a write each was
        ~7% of a single-turn request's CPU in the gateway). Without a running loop (a plain call): written at once."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._write_batch()
            self._write_lines([line])  # (an error is the caller's, as it was)
            return None
        if self._batch_lines and self._batch_loop is not loop:  # a batch a former loop left (it stopped first)
            self._write_batch()
        if not self._batch_lines:
            self._batch_loop = loop
            loop.call_soon(self._write_batch)
        self._batch_lines.append(line)
        return loop

    def _write_batch(self) -> None:
        lines, waiters = self._batch_lines, self._batch_waiters
        self._batch_lines, self._batch_waiters = [], []
        if lines:  # (none: close wrote them)
            self._write(lines, waiters)

    def _write(self, lines: list[bytes], waiters: list[asyncio.Future]) -> None:
        try:
            self._write_lines(lines)
        except OSError as e:
            log.error("%s: %d lines not written: %s", self.path, len(lines), e)
            for fut in waiters:  # their requests fail with it (a 500 each, as when each line was written alone)
                if not fut.done():
                    fut.set_exception(e)
            return
        for fut in waiters:
            _release(fut)

    def _write_lines(self, lines: list[bytes]) -> None:
        """The lines in one write (either durability), counted; the thread fdatasyncs them."""
        data = lines[0] if len(lines) == 1 else b"".join(lines)
        while data:  # a regular file takes it whole; loop for the rule's sake
            data = data[os.write(self.fd, data) :]
        self.stats["lines"] += len(lines)
        self.stats["writes"] += 1
        self._dirty = True

    def _run(self) -> None:
        while True:
            with self._cond:
                if self.durability == "write":
                    self._cond.wait(self.interval)
                else:
                    while not self._lines and not self._closed:
                        self._cond.wait()
                lines, waiters = self._lines, self._waiters
                self._lines, self._waiters = [], []
                closed = self._closed
            if lines:
                self._write_lines(lines)
            if self._dirty:
                self._dirty = False
                os.fdatasync(self.fd)
                self.stats["fsyncs"] += 1
            for loop, fut in waiters:
                loop.call_soon_threadsafe(_release, fut)
            if closed:
                return

    def close(self) -> None:
        self._write_batch()  # this pass's lines (a stopping gateway's last records)
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=10)
        if self._dirty:
            os.fdatasync(self.fd)
        os.close(self.fd)


def _release(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


# ------------------------------------------------------------------------------------------ reading
def load_experiment(log_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    p = Path(log_dir) / EXPERIMENT
    if not p.is_file():
        return None
    try:
        return orjson.loads(p.read_bytes())
    except orjson.JSONDecodeError as e:
        raise ValueError(f"{p}: not valid JSON ({e})") from None


_NEW = object()


class ToolsLog:
    """tools.jsonl: each distinct tool-schema list the agents sent, once, under its hash (a request's record
    names the hash; an agent sends the same ~7 KB of schemas with every turn). A restart knows the hashes."""

    def __init__(self, log_dir: str | os.PathLike[str], durability: str = "write", fsync_ms: float = 100.0):
        self.seen = {str(r.get("tools_hash")) for _, r in read_jsonl(Path(log_dir) / TOOLS)}
        self.writer = LogWriter(Path(log_dir) / TOOLS, durability, fsync_ms)
        self._raw: dict[bytes, str | None] = {}  # a tool list's bytes' digest -> its hash

    def add_raw(self, raw: Any) -> str | None:
        """``add`` of a tool list as the client's bytes (``hermes_lab.live.wire``): parsed (and checked: orjson
        raises ``JSONDecodeError``) only the first time these bytes come."""
        if raw is None:
            return None
        d = raw_digest(raw)
        th = self._raw.get(d, _NEW)
        if th is _NEW:
            th = self.add(orjson.loads(memoryview(raw)))
            if len(self._raw) >= 4096:
                self._raw.clear()
            self._raw[d] = th
        return th  # type: ignore[return-value]

    def add(self, tools: Any) -> str | None:
        if not tools:
            return None
        raw = orjson.dumps(tools)  # (cheaper than comparing the parsed list with a known one: measured)
        th = xxhash.xxh3_64_hexdigest(raw)
        if th not in self.seen:
            self.seen.add(th)
            self.writer.append_nowait(b'{"tools_hash":"' + th.encode() + b'","tools":' + raw + b"}\n")
        return th

    def close(self) -> None:
        self.writer.close()


def open_conversations(log_dir: str | os.PathLike[str], within_s: float) -> list[tuple[str, int, int, list, float]]:
    """Conversations of the log whose last turn is less than ``within_s`` old, reassembled (the log keeps
    only each turn's new messages): (id, arm of the first turn, turns, messages with the last answer, age s)."""
    from hermes_lab.logs.gateway import conversation_line

    now = time.time()
    turns: dict[str, list[tuple[int, dict[str, Any]]]] = {}
    for lineno, rec in read_jsonl(Path(log_dir) / REQUESTS):
        cid = rec.get("conversation_id")
        if isinstance(cid, str):
            turns.setdefault(cid, []).append((lineno, rec))
    out = []
    for cid, ts in turns.items():
        try:
            age = now - datetime.fromisoformat(str(ts[-1][1].get("timestamp"))).timestamp()
        except ValueError:
            continue
        if age < within_s and ts[-1][1].get("status") == "ok":
            line = conversation_line(cid, ts, {}, None, "")
            arm = 1 if ts[0][1].get("arm") == "candidate" else 0
            n_turns = max(int(r.get("turn") or 0) for _, r in ts) + 1  # a turn's retries share its number
            out.append((cid, arm, n_turns, line["messages"], age))
    return out


def save_experiment(log_dir: str | os.PathLike[str], state: dict[str, Any]) -> Path:
    state["updated"] = datetime.now(timezone.utc).isoformat()
    return write_json_atomic(Path(log_dir) / EXPERIMENT, state)


class Tally:
    """The experiment's requests in memory: counts per arm, and the columns ``hermes_lab.ab.stats`` analyses.

    Built from requests.jsonl + feedback.jsonl at start (a restarted gateway continues the same counts),
    then kept current by the gateway. A request's reward is its latest feedback of ``source`` ('any': of
    any source). Rewards are per conversation: feedback (by the conversation's id or any of its request ids)
    is carried by the conversation's first turn, its later turns have none (NaN: they count in the error and
    latency guardrails, not in the reward's numbers), so the reward's statistics count conversations; a
    single-turn request is a conversation of one turn, as before. A failed first turn counts as reward 0 (as
    ab-run scores an empty answer) unless a retry of it (the same turn, ``hermes_lab.live.conversations``) was
    answered: then the conversation's feedback is its reward. Times are the
    experiment clock's (seconds since the start, ``serve.time_scale`` included): ``t`` when the request
    arrived, ``t_done`` when its answer was complete, ``t_fb`` when its first counted feedback arrived (a
    failed request: its ``t_done``), so that ``columns(known_by=T)`` is what a look at T could know.
    """

    def __init__(self, source: str = "system", covariates: Sequence[str] = ()):
        self.source = source
        # the requests' covariate codes (ab.covariates, request and conversation units): ab-run's adjusted rule
        self.covariates = Encoder(covariates) if covariates else None
        self._cov_on = bool(self.covariates)  # asked once: Encoder.__bool__ was 1% of a request's time
        self.cov: list[tuple[int, int]] = []
        # the requests whose covariate codes are still to be worked out: at the next look (columns), in its thread,
        # not on the event loop (parsing each prompt for its task was 7% of the gateway's time per request). Not in
        # a thread of its own every few thousand requests either: its GIL slices held the loop's requests ~100 ms.
        # A conversation turn's keys are taken at once (``early_keys``: two digests at its opening, none after),
        # so the tally does not hold every turn's messages until the look (ab.look_every: 15 minutes by default)
        self._cov_todo: list[Any] = []  # a request's (cell key, task key), its prompt, or its messages
        self._conv_cov: dict[str, tuple[Any, Any]] = {}  # a conversation's keys, its opening turn's: its later turns'
        self._cov_lock = threading.Lock()
        self.index: dict[str, int] = {}
        self.cols: dict[str, list[Any]] = {
            k: [] for k in ("t", "t_done", "t_fb", "stage", "arm", "error", "latency_ms", "unit", "conv")
        }
        # per turn, for the conversation statistics and GET /v1/conversations/{id}
        self.turn: dict[str, list[Any]] = {k: [] for k in ("rid", "turn", "calls", "tool_errors", "tokens", "finish")}
        self.conv_rows: dict[str, list[int]] = {}  # conversation id -> its rows, in arrival order
        self.conv_ids: list[str] = []  # conversation code -> id
        self.conv_reward: dict[str, tuple[float, str]] = {}
        self._failed_open: set[str] = set()  # conversations whose opening failed and no retry answered it: reward 0
        self.reward: list[float] = []
        self.family: list[int] = []  # filled by from_dir(families=True) only (the report's per-family rows)
        self.units: dict[str, int] = {}
        self.n = [0, 0]
        self.errors = [0, 0]
        self.feedback = [0, 0]
        self.torn = {"requests": 0, "feedback": 0}

    def add_request(self, rec: dict[str, Any]) -> None:
        arm = 1 if rec.get("arm") == "candidate" else 0
        err = rec.get("status") != "ok"
        self.index[str(rec.get("request_id"))] = len(self.reward)
        c = self.cols
        t = float(rec.get("t") or 0.0)
        done = float(rec.get("t_done") or t)  # logs from before t_done: the arrival
        c["t"].append(t)
        c["t_done"].append(done)
        c["t_fb"].append(done if err else math.inf)
        c["stage"].append(int(rec.get("stage") or 0))
        c["arm"].append(arm)
        c["error"].append(err)
        c["latency_ms"].append(float(rec.get("latency_ms") or 0.0))
        c["unit"].append(self.units.setdefault(str(rec.get("unit")), len(self.units)))
        cid = str(rec.get("conversation_id") or rec.get("request_id"))  # logs from before conversations: one each
        rows = self.conv_rows.get(cid)
        if rows is None:
            rows = self.conv_rows[cid] = []
            self.conv_ids.append(cid)
        c["conv"].append(cid)
        rows.append(len(self.reward))
        u, tc = rec.get("usage"), rec.get("tool_calls")
        tr = self.turn
        tr["rid"].append(str(rec.get("request_id")))
        tr["turn"].append(int(rec.get("turn") or 0))
        tr["calls"].append(len(tc) if isinstance(tc, list) else 0)
        tr["tool_errors"].append(int(rec.get("tool_errors") or 0))
        tr["tokens"].append(int(u.get("total_tokens") or 0) if isinstance(u, dict) else 0)
        tr["finish"].append(rec.get("finish_reason"))
        if self._cov_on:  # one row per request, kept aligned with the reward's rows (at the next look)
            entry = self._conv_cov.get(cid) if len(rows) > 1 else None  # a later turn: its conversation's keys
            if entry is None:
                prompt, todo = rec.get("prompt"), {"messages": rec.get("messages")}
                keys = early_keys(todo, self.covariates.kinds)  # type: ignore[union-attr]
                # a lone prompt's keys are its text's alone: the tally holds the text (its messages and their dicts,
                # ~0.5 KB a request, were held until the look: at 3,000 req/s and a 15-minute look, over 1 GB)
                entry = keys if keys is not None else prompt if type(prompt) is str else todo
                if keys is not None and len(rows) == 1:
                    self._conv_cov[cid] = keys
            self._cov_todo.append(entry)
        if len(rows) > 1:  # a later turn: its conversation's reward is on the first turn
            c["t_fb"][-1] = math.inf
            self.reward.append(math.nan)
            if not err and cid in self._failed_open and not rec.get("turn"):
                # a retry answered the opening that failed: the conversation goes on, its reward is its feedback's
                self._failed_open.discard(cid)
                first = rows[0]
                self.reward[first], c["t_fb"][first] = math.nan, math.inf
        else:
            self.reward.append(0.0 if err else math.nan)
            if err:
                self._failed_open.add(cid)
        self.n[arm] += 1
        self.errors[arm] += err

    def _cov_rows(self) -> None:
        """The covariate codes of the requests added since the last look, in arrival order: (cell, task), no
        history on live traffic. Any thread; one at a time (codes are numbered in order of first sight)."""
        with self._cov_lock:
            todo = self._cov_todo[:]  # the event loop may append meanwhile: those wait for the next look
            enc = self.covariates
            for x in todo:
                row = enc.row_of(*x) if type(x) is tuple else enc.row({"prompt": x} if type(x) is str else x)  # type: ignore[union-attr]
                self.cov.append(row[:2])
            del self._cov_todo[: len(todo)]

    def conversation_of(self, request_id: str) -> str | None:
        i = self.index.get(request_id)
        return None if i is None else self.cols["conv"][i]

    def add_feedback(self, rec: dict[str, Any]) -> bool:
        """Apply one feedback record to its conversation (every turn), or to its request (a log from before
        conversations); False when neither is known."""
        cid = rec.get("conversation_id")
        if not (isinstance(cid, str) and cid in self.conv_rows):
            j = self.index.get(str(rec.get("request_id")))
            if j is None:
                return False
            cid = self.cols["conv"][j]
        if self.source not in ("any", rec.get("source", "system")):
            return True
        t = float(rec.get("t") or 0.0)
        self.conv_reward[cid] = (float(rec["reward"]), t)
        i = self.conv_rows[cid][0]
        if cid not in self._failed_open:
            if math.isnan(self.reward[i]):  # the first counted feedback: the reward is known from then on
                self.feedback[self.cols["arm"][i]] += 1
                self.cols["t_fb"][i] = t
            self.reward[i] = float(rec["reward"])  # file order: the latest feedback wins
        return True

    def conversation_stats(self) -> dict[str, Any]:
        """Per arm (the arm of a conversation's first turn): conversations, turns per conversation, tool-call rate
        (turns answered with tool calls), tool calls, tool errors, tokens, latency, conversations with feedback,
        switched after a roll back."""
        import numpy as np

        n = len(self.reward)
        if not n:
            return {}
        codes = {cid: k for k, cid in enumerate(self.conv_ids)}
        conv = np.fromiter((codes[c] for c in self.cols["conv"][:n]), np.int64, n)
        first = np.asarray([self.cols["arm"][rows[0]] for rows in self.conv_rows.values()], np.int64)
        conv_arm = first[conv]
        calls = np.asarray(self.turn["calls"][:n], np.int64)
        lat = np.asarray(self.cols["latency_ms"][:n], np.float64)
        rewarded = np.asarray([not math.isnan(self.reward[rows[0]]) for rows in self.conv_rows.values()])
        out: dict[str, Any] = {}
        for a, name in ((0, "baseline"), (1, "candidate")):
            m = conv_arm == a
            nc = int((first == a).sum())
            out[name] = {
                "conversations": nc,
                "turns": int(m.sum()),
                "turns_per_conversation": round(float(m.sum()) / nc, 3) if nc else None,
                "tool_call_rate": round(float((calls[m] > 0).mean()), 4) if m.any() else None,
                "tool_calls": int(calls[m].sum()),
                "tool_errors": int(np.asarray(self.turn["tool_errors"][:n])[m].sum()),
                "tokens": int(np.asarray(self.turn["tokens"][:n])[m].sum()),
                "latency_ms_p50": round(float(np.median(lat[m])), 3) if m.any() else None,
                "rewarded_conversations": int(rewarded[first == a].sum()),
                "errors": int(np.asarray(self.cols["error"][:n], bool)[m].sum()),
            }
        return out

    def conversation(self, cid: str) -> dict[str, Any] | None:
        """A conversation's turns as the log has them (GET /v1/conversations/{id})."""
        rows = self.conv_rows.get(cid)
        if rows is None:
            return None
        c, tr = self.cols, self.turn
        turns = [
            {
                "turn": tr["turn"][i],
                "request_id": tr["rid"][i],
                "arm": "candidate" if c["arm"][i] else "baseline",
                "status": "error" if c["error"][i] else "ok",
                "finish_reason": tr["finish"][i],
                "tool_calls": tr["calls"][i],
                "tool_errors": tr["tool_errors"][i],
                "tokens": tr["tokens"][i],
                "latency_ms": c["latency_ms"][i],
                "t": c["t"][i],
            }
            for i in rows
        ]
        r = self.conv_reward.get(cid)
        return {
            "conversation_id": cid,
            "arm": turns[0]["arm"],
            "turns": turns,
            "reward": None if r is None else r[0],
        }

    @classmethod
    def from_dir(
        cls,
        log_dir: str | os.PathLike[str],
        source: str = "system",
        families: bool = False,
        covariates: Sequence[str] = (),
    ) -> Tally:
        """The tally of a log dir; ``families``: also each request's task family (its prompt's; slower);
        ``covariates``: ``ab.covariates`` (request and conversation units), each request's cell and task codes."""
        t = cls(source, covariates)
        bad: list[int] = []
        if families:
            from hermes_lab.tasks import suite as T

            fam_index = {f: i for i, f in enumerate(T.FAMILIES)}
        for _, rec in read_jsonl(Path(log_dir) / REQUESTS, bad):
            t.add_request(rec)
            if families:
                f = T.family_of(rec.get("prompt") if isinstance(rec.get("prompt"), str) else "")
                t.family.append(fam_index.get(f or "", len(fam_index)))
        if t.covariates:
            t._cov_rows()
        t.torn["requests"], bad = len(bad), []
        for _, rec in read_jsonl(Path(log_dir) / FEEDBACK, bad):
            if isinstance(rec.get("reward"), (int, float)):
                t.add_feedback(rec)
        t.torn["feedback"] = len(bad)
        return t

    def columns(self, stage: int | None = None, known_by: float | None = None) -> dict[str, Any]:
        """Columns for ``hermes_lab.ab.stats``, in arrival order: every request of ``stage`` (None: all) complete by
        ``known_by`` (None: now); its reward NaN until its feedback (a failed request: 0). NaN rewards are
        left out of the reward's statistics and count in the guardrails and SRM (``ab.look_path``)."""
        import numpy as np

        if self.covariates:
            self._cov_rows()
        n = len(self.reward)  # a snapshot: the event loop may append while a thread analyses
        if self.covariates:
            n = min(n, len(self.cov))
        r = np.asarray(self.reward[:n], np.float64)
        cols = {k: np.asarray(v[:n]) for k, v in self.cols.items() if k != "conv"}
        keep = np.ones(n, bool) if stage is None else cols["stage"] == stage
        if known_by is not None:
            keep &= cols["t_done"] <= known_by
            r = np.where(cols["t_fb"] <= known_by, r, np.nan)
        order = np.flatnonzero(keep)
        order = order[np.argsort(cols["t"][order], kind="stable")]  # time order (answers finish out of order)
        out = {k: v[order] for k, v in cols.items()}
        fam = np.asarray(self.family[:n], np.int64)[order] if len(self.family) >= n else np.zeros(len(order), np.int64)
        if self.covariates:
            cov = np.asarray(self.cov[:n], np.int64).reshape(-1, 2)[order]
            out["cell"], out["task"] = cov[:, 0], cov[:, 1]
        out.update(
            t=out["t"].astype(np.float64),
            stage=out["stage"].astype(np.int64),
            arm=out["arm"].astype(np.int8),
            error=out["error"].astype(bool),
            latency_ms=out["latency_ms"].astype(np.float64),
            unit=out["unit"].astype(np.int64),
            reward=r[order],
            family=fam,
        )
        return out


def agent_success(log_dir: str | os.PathLike[str], threshold: float, source: str = "system") -> dict[str, Any]:
    """Per arm, the agent conversations of a log dir (tools offered on their first turn) that got feedback of
    ``source`` ('any': every source; the latest wins): how many, and the share whose reward reaches ``threshold``."""
    arm_of: dict[str, str] = {}
    for _, rec in read_jsonl(Path(log_dir) / REQUESTS):
        cid = rec.get("conversation_id")
        if rec.get("turn") == 0 and rec.get("tools_hash") and isinstance(cid, str):
            arm_of[cid] = str(rec.get("arm"))
    reward: dict[str, float] = {}
    for _, fb in read_jsonl(Path(log_dir) / FEEDBACK):
        cid = fb.get("conversation_id")
        if cid in arm_of and (source == "any" or fb.get("source", "system") == source):
            reward[cid] = float(fb.get("reward") or 0.0)
    out: dict[str, Any] = {}
    for arm in ("baseline", "candidate"):
        rs = [r for cid, r in reward.items() if arm_of[cid] == arm]
        out[arm] = {"n": len(rs), "success": round(sum(r >= threshold for r in rs) / len(rs), 4) if rs else None}
    return out


_SECOND: tuple[float, str] = (math.nan, "")  # the last whole second formatted (one tuple: any thread may call)


def now_iso(ts: float | None = None) -> str:
    """ISO 8601 UTC with microseconds (datetime's isoformat with a zone cost ~6 us, on every request's record)."""
    global _SECOND
    now = time.time() if ts is None else ts
    sec = math.floor(now)
    last = _SECOND
    if sec != last[0]:
        last = _SECOND = (sec, datetime.fromtimestamp(sec, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S"))
    return f"{last[1]}.{int((now - sec) * 1e6):06d}+00:00"
