"""A live gateway's log dir as round data: the log's files, reading them back, and joining requests with
their feedback into trajectories that prep ingests like any other execution log.

Stages: execute (``execute.source: live``) and prep (``hermes-lab prep --input LOGDIR``). ``hermes-lab serve``
writes the log dir (``runs/live/<experiment>/``: ``requests.jsonl``, ``feedback.jsonl``, ``experiment.json``;
``tools.jsonl``; ``hermes_lab.live.log`` writes them); this module reads it. ``gateway_trajectories`` splits the
log by conversation (``conversation_id``; a log from before conversations: one per request):

- a single-turn chat in the completion form (one request of one user message, no tools, no tool call: the
  embedded string tasks' traffic) is joined with its
  feedback (the latest of ``serve.feedback_source``) into ``<name>.trajectories.jsonl`` as before; answered
  ones without feedback are kept aside (``<name>.unrewarded.jsonl``) and counted, and reach GRPO data only
  with ``serve.score_unrewarded: judge``. requests = errors + answered; answered = rewarded + judged +
  unrewarded.
- every other conversation (several turns, tools offered or called) is reassembled whole into
  ``<name>.conversations.jsonl``, one OpenAI-shaped line per conversation that prep's conversation reader
  turns into the canonical record (``hermes_lab.logs.record``): the turns' new messages and answers in
  order (a failed turn's are left out: its retry re-sends them; a turn that re-sends an earlier point of the
  conversation replaces what followed it), the tools from ``tools.jsonl``, the feedback on the conversation
  (by its id or any of its request ids) as the reward (``feedback:<source>``), else none (prep's outcome
  rules decide), and per turn its request id, arm, latency, usage, finish reason, status, ``message`` (the
  index of its answer in ``messages``) and, answered in-process, ``tokens`` (the prompt and completion token ids
  and logprobs the policy saw and sampled: what turn-level training trains on, ``hermes_lab.train.turns``) in
  ``meta.turns``. turns = failed turns + answered turns.
- the gateway's own failures never become training data: a request it answered with an error (a 5xx of the
  upstream, a timeout: any status but ok) and a conversation it failed (no turn answered, or its last turn an
  error: the gateway cut it, the policy did not end it) are left out and kept with their reason in
  ``<name>.gateway_failures.jsonl``, counted apart (``errors``, ``gateway_failed``), never rejected lines or
  "failed" conversations of the policy's. A failed turn that a retry answered is the retry's (its messages come
  again). requests = errors + answered + conversation turns; conversations seen = conversations + gateway_failed.

A live round's data (``execute.source: live``): ``runs/round-NN/trajectories.jsonl`` is the gateway log
``execute.live_dir`` (empty: the live experiment of the previous round, ``runs/live/round-<NN-1>``) joined with
its feedback, the join's files kept in ``runs/round-NN/live/``. Round 1 has no previous round and no traffic
yet: with ``live_dir`` empty it executes the embedded tasks (``hermes_lab.agents.execute`` says so).

    hermes-lab prep --input runs/live/tiny-vs-round-01 --output runs/round-02/prep
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson

from hermes_lab.config.schema import ConfigError, HermesConfig
from hermes_lab.core import layout
from hermes_lab.core.layout import EXPERIMENT, FEEDBACK, REQUESTS, TOOLS, RoundLayout, RunsLayout  # noqa: F401 (live.log's)


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


# ------------------------------------------------------------------------------------------ for prep
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


def _single_turn(rec: dict[str, Any]) -> bool:
    """A request in the completion form (``hermes_lab.policy.turn``): one user message, no tools, no tool call, no
    earlier turn. Its prompt is the message's text, as the policy is served and trained on it; any other chat (a
    system prompt too) is a conversation, trained turn by turn with the chat template."""
    if rec.get("tools_hash") or rec.get("tool_calls") or rec.get("history") or rec.get("turn"):
        return False
    msgs = rec.get("messages")
    if not isinstance(msgs, list):
        return True
    return len(msgs) == 1 and isinstance(msgs[0], dict) and msgs[0].get("role") == "user"


def _answer(rec: dict[str, Any]) -> dict[str, Any]:
    """A turn's logged answer as the assistant message the client got."""
    calls = rec.get("tool_calls") if isinstance(rec.get("tool_calls"), list) else None
    text = rec.get("response") if isinstance(rec.get("response"), str) else ""
    msg: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
    if calls:
        msg["tool_calls"] = calls
    if isinstance(rec.get("reasoning"), str) and rec["reasoning"]:
        msg["reasoning"] = rec["reasoning"]
    return msg


def _statuses(recs: list[dict[str, Any]]) -> str:
    """'HTTP 500 x3, timeout x1': the failed requests' statuses."""
    got: dict[str, int] = {}
    for r in recs:
        k = f"HTTP {r['http_status']}" if isinstance(r.get("http_status"), int) else str(r.get("status") or "error")
        got[k] = got.get(k, 0) + 1
    return ", ".join(f"{k} x{n}" for k, n in got.items())


def gateway_failure(turns: list[tuple[int, dict[str, Any]]]) -> str | None:
    """Why a conversation of the log is the gateway's failure, not the policy's (None: it is the policy's): no
    turn answered, or its last turn (after any retry) failed."""
    ordered = sorted(turns, key=lambda x: (int(x[1].get("turn") or 0), x[0]))
    bad = [r for _, r in ordered if r.get("status") != "ok"]
    if not bad:
        return None
    if len(bad) == len(ordered):
        return f"gateway error: no turn answered ({_statuses(bad)})"
    last = ordered[-1][1]
    if last.get("status") != "ok":  # every attempt at it failed (a retry that was answered comes after them)
        tries = [r for r in bad if r.get("turn") == last.get("turn")]
        return (
            f"gateway error on its last turn (turn {last.get('turn')}, {_statuses(tries)}): the gateway cut the "
            "conversation, the policy did not end it"
        )
    return None


def _failure_line(reason: str, recs: list[tuple[int, dict[str, Any]]], cid: Any, where: str) -> bytes:
    return (
        orjson.dumps(
            {
                "conversation_id": cid,
                "reason": reason,
                "gateway_log": where,
                "lines": [n for n, _ in recs],
                "request_ids": [r.get("request_id") for _, r in recs],
                "errors": [str(r.get("error"))[:200] for _, r in recs if r.get("status") != "ok"][:5],
            }
        )
        + b"\n"
    )


def conversation_line(
    cid: str, turns: list[tuple[int, dict[str, Any]]], tools: dict[str, Any], fb: dict[str, Any] | None, where: str
) -> dict[str, Any]:
    """One conversation of the log, reassembled from its turns ((line, record), in log order) as an OpenAI-shaped
    line for prep's reader."""
    turns = sorted(turns, key=lambda x: (int(x[1].get("turn") or 0), x[0]))
    msgs: list[Any] = []
    owner: list[int | None] = []  # per message: the meta turn whose answer it is
    meta_turns, th, failed = [], None, 0
    for lineno, rec in turns:
        ok = rec.get("status") == "ok"
        meta_turns.append(
            {
                "turn": rec.get("turn"),
                "request_id": rec.get("request_id"),
                "line": lineno,
                **{
                    k: rec.get(k)
                    for k in ("arm", "model", "status", "latency_ms", "ttft_ms", "usage", "finish_reason", "stream")
                },
                "switched": bool(rec.get("switched")),
                "tool_calls": len(rec["tool_calls"]) if isinstance(rec.get("tool_calls"), list) else 0,
            }
        )
        if not ok:  # its new messages come again with the retry
            failed += 1
            continue
        new = rec.get("messages") if isinstance(rec.get("messages"), list) else []
        h = int(rec.get("history") or 0)
        keep = h if h <= len(msgs) else len(msgs)
        msgs = msgs[:keep] + new + [_answer(rec)]
        owner = owner[:keep] + [None] * len(new) + [len(meta_turns) - 1]
        if isinstance(rec.get("tokens"), dict):  # an in-process arm's answer: its exact tokens
            meta_turns[-1]["tokens"] = rec["tokens"]
        th = rec.get("tools_hash") or th
    for k, t in enumerate(owner):  # where each answer ended up (a re-sent turn replaces what followed it)
        if t is not None:
            meta_turns[t]["message"] = k
    first, last = turns[0][1], turns[-1][1]
    end = "error" if last.get("status") != "ok" else None
    line: dict[str, Any] = {
        "conversation_id": cid,
        "messages": msgs,
        "tools": tools.get(th, []) if th else [],
        "model": first.get("model"),
        "started_at": first.get("timestamp"),
        "task_id": next((r.get("task_id") for _, r in turns if r.get("task_id")), None),
        "api_calls": len(turns),
        "meta": {
            "gateway_log": where,
            "arm": first.get("arm"),
            "switched": any(t["switched"] for t in meta_turns),
            "failed_turns": failed,
            "turns": meta_turns,
        },
    }
    if end:
        line["end_reason"] = end
    if fb is not None:
        line.update(reward=fb.get("reward"), reward_source=f"feedback:{fb.get('source', 'system')}")
    return line


def gateway_trajectories(log_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], cfg: Any) -> dict[str, Any]:
    """Join a gateway log dir into ``<out_dir>/<name>.trajectories.jsonl`` (+ ``.unrewarded.jsonl``) and
    ``<name>.conversations.jsonl`` (the module docstring says which request goes where).

    Every request is accounted for: requests = errors + answered (single-turn) + conversation turns;
    answered = rewarded + judged + unrewarded; conversations = with feedback + without (prep's outcome rules).
    """
    src, out = Path(log_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    source = cfg.serve.feedback_source
    fb: dict[str, dict[str, Any]] = {}
    fb_conv: dict[str, dict[str, Any]] = {}
    bad_fb: list[int] = []
    counts = dict.fromkeys(("feedback_lines", "feedback_other_source", "feedback_unknown_request"), 0)
    for _, rec in read_jsonl(src / FEEDBACK, bad_fb):
        counts["feedback_lines"] += 1
        if source != "any" and rec.get("source", "system") != source:
            counts["feedback_other_source"] += 1
            continue
        fb[str(rec.get("request_id"))] = rec  # file order: the latest wins
        if isinstance(rec.get("conversation_id"), str):
            fb_conv[rec["conversation_id"]] = rec
    # pass 1: which conversations are single-turn chats (the trajectories' fast path)
    shape: dict[str, bool] = {}
    for _, rec in read_jsonl(src / REQUESTS):
        cid = rec.get("conversation_id")
        if isinstance(cid, str):
            shape[cid] = cid not in shape and _single_turn(rec)
    tools = {str(r.get("tools_hash")): r.get("tools") for _, r in read_jsonl(src / TOOLS)}
    name = src.name or "gateway"
    traj, unrew = out / f"{name}.trajectories.jsonl", out / f"{name}.unrewarded.jsonl"
    convf, failf = out / f"{name}.conversations.jsonl", out / f"{name}.gateway_failures.jsonl"
    c = dict.fromkeys(("requests", "errors", "answered", "rewarded", "judged", "unrewarded"), 0)
    cc = dict.fromkeys(("conversations", "conversation_turns", "failed_turns", "with_feedback", "gateway_failed"), 0)
    seen: set[str] = set()
    pending: list[dict[str, Any]] = []
    best: dict[str, tuple[float, str]] = {}
    bad_req: list[int] = []
    convs: dict[str, list[tuple[int, dict[str, Any]]]] = {}
    with open(traj, "wb") as ft, open(failf, "wb") as ff:
        for lineno, rec in read_jsonl(src / REQUESTS, bad_req):
            c["requests"] += 1
            rid = str(rec.get("request_id"))
            seen.add(rid)
            cid = rec.get("conversation_id")
            if isinstance(cid, str) and not shape.get(cid, True):
                convs.setdefault(cid, []).append((lineno, rec))
                seen.add(cid)
                continue
            if rec.get("status") != "ok":
                c["errors"] += 1
                why = f"gateway error: the request failed ({_statuses([rec])})"
                ff.write(_failure_line(why, [(lineno, rec)], cid, str(src / REQUESTS)))
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
            f = fb.get(rid) or (fb_conv.get(cid) if isinstance(cid, str) else None)
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
    with open(convf, "wb") as fc, open(failf, "ab") as ff:
        for cid, turns in convs.items():
            why = gateway_failure(turns)
            if why is not None:  # the gateway's failure: kept with its reason, never training data
                cc["gateway_failed"] += 1
                cc["conversation_turns"] += len(turns)
                ff.write(_failure_line(why, turns, cid, str(src / REQUESTS)))
                continue
            f = fb_conv.get(cid) or next(
                (fb[str(r.get("request_id"))] for _, r in turns if str(r.get("request_id")) in fb), None
            )
            line = conversation_line(cid, turns, tools, f, f"{src / REQUESTS}")
            cc["conversations"] += 1
            cc["conversation_turns"] += len(turns)
            cc["failed_turns"] += line["meta"]["failed_turns"]
            cc["with_feedback"] += f is not None
            fc.write(orjson.dumps(line) + b"\n")
    counts["feedback_unknown_request"] = sum(
        1 for rid, r in fb.items() if rid not in seen and r.get("conversation_id") not in seen
    )
    return {
        "log_dir": str(src),
        "trajectories": str(traj),
        "unrewarded_file": str(unrew),
        "conversations_file": str(convf),
        "gateway_failures_file": str(failf),
        **c,
        **cc,
        **counts,
        "torn_lines": {"requests": len(bad_req), "feedback": len(bad_fb)},
        "feedback_source": source,
        "score_unrewarded": cfg.serve.score_unrewarded,
        "identity": "requests = errors + answered + conversation turns; answered = rewarded + judged + unrewarded",
    }


def expand_inputs(inputs: list[Any], out_dir: str | os.PathLike[str], cfg: Any) -> tuple[list[Any], dict[str, Any]]:
    """prep's inputs with each gateway log dir replaced by its joined trajectories file; what was joined."""
    files, joined = [], {}
    for p in inputs:
        if Path(p).is_dir() and (Path(p) / REQUESTS).is_file():
            info = gateway_trajectories(p, Path(out_dir) / "gateway", cfg)
            joined[str(p)] = info
            if info["answered"] or not info["conversations"]:
                files.append(info["trajectories"])
            if info["conversations"]:
                files.append(info["conversations_file"])
        else:
            files.append(p)
    return files, joined


def describe_gateway(info: dict[str, Any]) -> str:
    """One line accounting for every request of a joined gateway log dir."""
    line = (
        f"gateway {info['log_dir']}: {info['requests']} requests = {info['errors']} errors + {info['answered']} "
        f"answered + {info.get('conversation_turns', 0)} conversation turns; answered = {info['rewarded']} rewarded "
        f"+ {info['judged']} judged + {info['unrewarded']} unrewarded (kept in {info['unrewarded_file']})"
    )
    if info.get("conversations"):
        line += (
            f"; {info['conversations']} conversations ({info['conversation_turns']} turns, {info['failed_turns']} "
            f"failed), {info['with_feedback']} with feedback, the rest rewarded by the outcome rules "
            f"({info['conversations_file']})"
        )
    if info.get("gateway_failed") or info.get("errors"):
        line += (
            f"; the gateway's own failures left out of training ({info['errors']} failed requests, "
            f"{info.get('gateway_failed', 0)} conversations it failed; kept with their reason in "
            f"{info.get('gateway_failures_file')})"
        )
    return line


# ------------------------------------------------------------------------------- a live round's data
def round_number(round_dir: str | os.PathLike[str]) -> int:
    return layout.round_number(Path(round_dir).name) or 0


def source_dir(cfg: HermesConfig, round_dir: str | os.PathLike[str]) -> Path | None:
    """The gateway log dir a live round trains on; None for round 1 with no ``execute.live_dir`` (bootstrap)."""
    if cfg.execute.live_dir:
        return Path(cfg.execute.live_dir)
    n = round_number(round_dir)
    if n <= 1:
        return None
    return RunsLayout(cfg.round.runs_dir).experiment(layout.round_name(n - 1)).root


def pending_samples(cfg: HermesConfig, round_dir: str | os.PathLike[str], default: int) -> int:
    """``hermes-lab status``: the new samples a live round would train on (its source's requests with
    feedback); ``default`` for a first round that executes the tasks."""
    src = source_dir(cfg, round_dir)
    if src is None:
        return default
    return sum(1 for _ in read_jsonl(src / FEEDBACK))  # an upper bound: re-scores count twice


def execute_live(cfg: HermesConfig, output: str | os.PathLike[str], log_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The round's trajectories from a gateway log dir: the requests with feedback (the reward), as prep
    reads them; the join's accounting in the result (and its files under ``<round_dir>/live/``)."""
    src, out = Path(log_dir), Path(output)
    if not (src / REQUESTS).is_file():
        raise ConfigError(
            f"execute.source is live, but {src} holds no {REQUESTS} (set execute.live_dir to a gateway log dir, "
            "or run the previous round's live A/B first)"
        )
    info = gateway_trajectories(src, RoundLayout(out.parent).live, cfg)
    tmp = out.with_suffix(out.suffix + ".tmp")
    shutil.copyfile(info["trajectories"], tmp)
    os.replace(tmp, out)  # a half-written file never looks like a finished execution log
    rewards = [r.get("reward") for _, r in read_jsonl(out)]
    passed = sum(isinstance(r, (int, float)) and r >= cfg.reward.success_threshold for r in rewards)
    print(describe_gateway(info), flush=True)
    return {
        "records": len(rewards),
        "pass_rate": round(passed / max(len(rewards), 1), 4),
        "output": str(out),
        "source": "live",
        "live": info,
    }
