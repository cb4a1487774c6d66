"""The live gateway's log directory: durable appends, the experiment state, and reading it back.

Stage: validate (live A/B) and prep. ``hermes-lab serve`` writes, in its log dir (``runs/live/<experiment>/``):

  requests.jsonl    one record per request, in the trajectories format (prompt, response, task_id) plus
                    request_id, unit, arm, model, stage, ratio, t (arrival, s since the experiment start on
                    its clock: wall seconds x serve.time_scale), t_done (answer complete), timestamp,
                    status, http_status, error, fallback, latency_ms, ttft_ms, usage, stream, messages
  feedback.jsonl    one record per POST /v1/feedback: request_id, reward, source, detail, arm, t, timestamp
  experiment.json   the experiment's mutable state (arms, stages, current stage and ratio, stage starts,
                    every look's decision, restarts), written atomically (``hermes_lab.core.jsonl.write_json_atomic``)
  ab_report.json    the live rollout's report (``hermes_lab.live.report``), with plots/*.png

Both JSONL files are append-only: never rewritten in place. A line torn by a crash is skipped by every
reader here (and counted); the next writer starts on a fresh line. ``hermes-lab prep --input DIR`` reads
a log dir through ``expand_inputs``: requests joined with their feedback (the latest of
``serve.feedback_source``), written as a trajectories file that prep ingests like any other; answered
requests without feedback are kept aside (``<name>.unrewarded.jsonl``) and counted, and reach GRPO data
only with ``serve.score_unrewarded: judge``.

    hermes-lab prep --input runs/live/tiny-vs-round-01 --output runs/round-02/prep
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import os
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import orjson

from hermes_lab.core.jsonl import write_json_atomic

REQUESTS, FEEDBACK, EXPERIMENT = "requests.jsonl", "feedback.jsonl", "experiment.json"


# ------------------------------------------------------------------------------------------ writing
class LogWriter:
    """Appends lines to one JSONL file; ``await append(line)`` returns once the line is durable.

    durability 'write' (default): the line is written (the kernel holds it: a kill -9 of the gateway
    cannot lose it) before ``append`` returns; the thread fdatasyncs within ``fsync_ms``.
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
        self.stats = {"lines": 0, "fsyncs": 0}
        self._thread = threading.Thread(target=self._run, name=f"log-{self.path.name}", daemon=True)
        self._thread.start()

    async def append(self, line: bytes) -> None:
        if self.durability == "write":
            os.write(self.fd, line)
            self.stats["lines"] += 1
            self._dirty = True
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
            os.write(self.fd, line)
            self._dirty = True
            return
        with self._cond:
            self._lines.append(line)
            self._cond.notify()

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
                data = b"".join(lines)
                while data:  # a regular file takes it whole; loop for the rule's sake
                    data = data[os.write(self.fd, data) :]
                self.stats["lines"] += len(lines)
            if lines or self._dirty:
                self._dirty = False
                os.fdatasync(self.fd)
                self.stats["fsyncs"] += 1
            for loop, fut in waiters:
                loop.call_soon_threadsafe(_release, fut)
            if closed:
                return

    def close(self) -> None:
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
def read_jsonl(path: str | os.PathLike[str], bad: list[int] | None = None) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) of a gateway log; a torn or invalid line is skipped, its number kept in ``bad``."""
    p = Path(path)
    if not p.is_file():
        return
    with open(p, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = orjson.loads(line)
            except orjson.JSONDecodeError:
                obj = None
            if isinstance(obj, dict):
                yield lineno, obj
            elif bad is not None:
                bad.append(lineno)


def load_experiment(log_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    p = Path(log_dir) / EXPERIMENT
    if not p.is_file():
        return None
    try:
        return orjson.loads(p.read_bytes())
    except orjson.JSONDecodeError as e:
        raise ValueError(f"{p}: not valid JSON ({e})") from None


def save_experiment(log_dir: str | os.PathLike[str], state: dict[str, Any]) -> Path:
    state["updated"] = datetime.now(timezone.utc).isoformat()
    return write_json_atomic(Path(log_dir) / EXPERIMENT, state)


class Tally:
    """The experiment's requests in memory: counts per arm, and the columns ``hermes_lab.ab.stats`` analyses.

    Built from requests.jsonl + feedback.jsonl at start (a restarted gateway continues the same counts),
    then kept current by the gateway. A request's reward is its latest feedback of ``source`` ('any': of
    any source); a failed request counts as reward 0 (as ab-run scores an empty answer). Times are the
    experiment clock's (seconds since the start, ``serve.time_scale`` included): ``t`` when the request
    arrived, ``t_done`` when its answer was complete, ``t_fb`` when its first counted feedback arrived (a
    failed request: its ``t_done``), so that ``columns(known_by=T)`` is what a look at T could know.
    """

    def __init__(self, source: str = "system"):
        self.source = source
        self.index: dict[str, int] = {}
        self.cols: dict[str, list[Any]] = {
            k: [] for k in ("t", "t_done", "t_fb", "stage", "arm", "error", "latency_ms", "unit")
        }
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
        self.reward.append(0.0 if err else math.nan)
        self.n[arm] += 1
        self.errors[arm] += err

    def add_feedback(self, rec: dict[str, Any]) -> bool:
        """Apply one feedback record; False when its request is unknown."""
        i = self.index.get(str(rec.get("request_id")))
        if i is None:
            return False
        if self.source in ("any", rec.get("source", "system")) and not self.cols["error"][i]:
            if math.isnan(self.reward[i]):  # the first counted feedback: the reward is known from then on
                self.feedback[self.cols["arm"][i]] += 1
                self.cols["t_fb"][i] = float(rec.get("t") or 0.0)
            self.reward[i] = float(rec["reward"])  # file order: the latest feedback wins
        return True

    @classmethod
    def from_dir(cls, log_dir: str | os.PathLike[str], source: str = "system", families: bool = False) -> Tally:
        """The tally of a log dir; ``families``: also each request's task family (its prompt's; slower)."""
        t = cls(source)
        bad: list[int] = []
        if families:
            from hermes_lab.tasks import suite as T

            fam_index = {f: i for i, f in enumerate(T.FAMILIES)}
        for _, rec in read_jsonl(Path(log_dir) / REQUESTS, bad):
            t.add_request(rec)
            if families:
                f = T.family_of(rec.get("prompt") if isinstance(rec.get("prompt"), str) else "")
                t.family.append(fam_index.get(f or "", len(fam_index)))
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

        n = len(self.reward)  # a snapshot: the event loop may append while a thread analyses
        r = np.asarray(self.reward[:n], np.float64)
        cols = {k: np.asarray(v[:n]) for k, v in self.cols.items()}
        keep = np.ones(n, bool) if stage is None else cols["stage"] == stage
        if known_by is not None:
            keep &= cols["t_done"] <= known_by
            r = np.where(cols["t_fb"] <= known_by, r, np.nan)
        order = np.flatnonzero(keep)
        order = order[np.argsort(cols["t"][order], kind="stable")]  # time order (answers finish out of order)
        out = {k: v[order] for k, v in cols.items()}
        fam = np.asarray(self.family[:n], np.int64)[order] if len(self.family) >= n else np.zeros(len(order), np.int64)
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


# --------------------------------------------------------------------------------------- for prep
def _task_id(rec: dict[str, Any], prompt: str) -> str:
    """The client's task_id, else the embedded task's, else a stable id of the prompt (prep splits by it)."""
    tid = rec.get("task_id")
    if isinstance(tid, str) and tid.strip():
        return tid
    from hermes_lab.tasks import suite as tasks

    t = tasks.parse_prompt(prompt)
    return t.task_id if t else "live-" + hashlib.sha1(prompt.encode("utf-8", "replace")).hexdigest()[:12]


def _family(prompt: str) -> str | None:
    """The embedded task family of a prompt (prep's per-family numbers), None for any other prompt."""
    from hermes_lab.tasks import suite as tasks

    return tasks.family_of(prompt)


def _judge(cfg: Any, rows: list[dict[str, Any]], best: dict[str, tuple[float, str]]) -> list[float | None]:
    """Comparison-judge scores of unrewarded rows against the best rewarded response to the same prompt."""
    from hermes_lab.rewards.registry import local_judge

    todo = [i for i, r in enumerate(rows) if r["prompt"] in best]
    scores: list[float | None] = [None] * len(rows)
    if not todo:
        return scores
    refs = [best[rows[i]["prompt"]] for i in todo]
    r = cfg.reward
    if r.model and r.model.strip().lower() != "local":
        from hermes_lab.llm.judge import ApiJudge

        got = ApiJudge.from_config(cfg).score(
            [rows[i]["prompt"] for i in todo], [rows[i]["response"] for i in todo], [ref for _, ref in refs]
        )
    else:
        got = [
            local_judge(rows[i]["response"], ref, rr, float(r.scale), float(r.success_threshold))
            for i, (rr, ref) in zip(todo, refs)
        ]
    for i, s in zip(todo, got):
        scores[i] = float(s)
    return scores


def gateway_trajectories(log_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], cfg: Any) -> dict[str, Any]:
    """Join a gateway log dir into ``<out_dir>/<name>.trajectories.jsonl`` (+ ``.unrewarded.jsonl``).

    Every request is accounted for: requests = errors + answered; answered = rewarded + judged + unrewarded.
    """
    src, out = Path(log_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    source = cfg.serve.feedback_source
    fb: dict[str, dict[str, Any]] = {}
    bad_fb: list[int] = []
    counts = dict.fromkeys(("feedback_lines", "feedback_other_source", "feedback_unknown_request"), 0)
    for _, rec in read_jsonl(src / FEEDBACK, bad_fb):
        counts["feedback_lines"] += 1
        if source != "any" and rec.get("source", "system") != source:
            counts["feedback_other_source"] += 1
            continue
        fb[str(rec.get("request_id"))] = rec  # file order: the latest wins
    name = src.name or "gateway"
    traj, unrew = out / f"{name}.trajectories.jsonl", out / f"{name}.unrewarded.jsonl"
    c = dict.fromkeys(("requests", "errors", "answered", "rewarded", "judged", "unrewarded"), 0)
    seen: set[str] = set()
    pending: list[dict[str, Any]] = []
    best: dict[str, tuple[float, str]] = {}
    bad_req: list[int] = []
    with open(traj, "wb") as ft:
        for lineno, rec in read_jsonl(src / REQUESTS, bad_req):
            c["requests"] += 1
            rid = str(rec.get("request_id"))
            seen.add(rid)
            if rec.get("status") != "ok":
                c["errors"] += 1
                continue
            c["answered"] += 1
            prompt = rec.get("prompt") if isinstance(rec.get("prompt"), str) else ""
            row = {
                "prompt": prompt,
                "response": rec.get("response") if isinstance(rec.get("response"), str) else "",
                "reward": None,
                "task_id": _task_id(rec, prompt),
                "family": _family(prompt),
                **{k: rec.get(k) for k in ("request_id", "unit", "arm", "model", "stage", "ratio", "t", "timestamp")},
                "messages": rec.get("messages"),
                "gateway_log": f"{src / REQUESTS}:{lineno}",
            }
            f = fb.get(rid)
            if f is None:
                pending.append(row)
                continue
            row.update(reward=f.get("reward"), reward_source=f.get("source", "system"), feedback_detail=f.get("detail"))
            if isinstance(row["reward"], (int, float)) and row["reward"] > best.get(prompt, (-1.0, ""))[0]:
                best[prompt] = (float(row["reward"]), row["response"])
            c["rewarded"] += 1
            ft.write(orjson.dumps(row) + b"\n")
        scores = _judge(cfg, pending, best) if cfg.serve.score_unrewarded == "judge" else [None] * len(pending)
        with open(unrew, "wb") as fu:
            for row, s in zip(pending, scores):
                if s is None:
                    c["unrewarded"] += 1
                    fu.write(orjson.dumps(row) + b"\n")
                else:
                    c["judged"] += 1
                    row.update(reward=s, reward_source="judge")
                    ft.write(orjson.dumps(row) + b"\n")
    counts["feedback_unknown_request"] = sum(1 for rid in fb if rid not in seen)
    return {
        "log_dir": str(src),
        "trajectories": str(traj),
        "unrewarded_file": str(unrew),
        **c,
        **counts,
        "torn_lines": {"requests": len(bad_req), "feedback": len(bad_fb)},
        "feedback_source": source,
        "score_unrewarded": cfg.serve.score_unrewarded,
        "identity": "requests = errors + answered; answered = rewarded + judged + unrewarded",
    }


def expand_inputs(inputs: list[Any], out_dir: str | os.PathLike[str], cfg: Any) -> tuple[list[Any], dict[str, Any]]:
    """prep's inputs with each gateway log dir replaced by its joined trajectories file; what was joined."""
    files, joined = [], {}
    for p in inputs:
        if Path(p).is_dir() and (Path(p) / REQUESTS).is_file():
            info = gateway_trajectories(p, Path(out_dir) / "gateway", cfg)
            joined[str(p)] = info
            files.append(info["trajectories"])
        else:
            files.append(p)
    return files, joined


def describe_gateway(info: dict[str, Any]) -> str:
    """One line accounting for every request of a joined gateway log dir."""
    return (
        f"gateway {info['log_dir']}: {info['requests']} requests = {info['errors']} errors + {info['answered']} "
        f"answered; answered = {info['rewarded']} rewarded + {info['judged']} judged + {info['unrewarded']} "
        f"unrewarded (kept in {info['unrewarded_file']})"
    )


def now_iso(ts: float | None = None) -> str:
    return datetime.fromtimestamp(time.time() if ts is None else ts, timezone.utc).isoformat()
