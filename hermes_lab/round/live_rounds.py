"""The live flywheel's rounds as its supervisor (``hermes_lab.round.supervisor``) hands them out and reads them back.

What a round gets: its params file (``live_params``: ``runs/live/flywheel/round-NN.yaml``, the base params with the
live keys) and the worker process that runs it (``worker``: ``python -m hermes_lab.round.supervisor --worker
PARAMS``, which dies with the supervisor). What makes one due: the conversations with feedback in the served
experiment's log (``FeedbackCounter`` on ``runs/live/<experiment>/feedback.jsonl``, read incrementally). What is
said of one: the next stage of its progress, its summary's figures as a line (``describe``, ``describe_agent``,
also the live demo's). Writes only the params file.

    hermes-lab flywheel --live --params params/live.yaml
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import yaml

from hermes_lab.live import log as L


def live_params(base: str | os.PathLike[str] | None, out: Path, time_scale: float, **extra: Any) -> Path:
    """``base`` with the keys a live flywheel round needs, written to ``out`` (the file the round runs with):
    traffic as data (``execute.source: live`` on ``execute.live_dir``; its conversations trained turn by turn,
    ``grpo.turns: all`` unless ``base`` sets it), the A/B on the gateway (``ab.mode: live``), the clock
    (``serve.time_scale``; K != 1: the round's simulated clock, kept in step)."""
    cfg = (yaml.safe_load(Path(base).read_text(encoding="utf-8")) or {}) if base else {}
    cfg.setdefault("execute", {})["source"] = "live"
    cfg.setdefault("grpo", {}).setdefault("turns", "all")  # the traffic's conversations, trained turn by turn
    cfg.setdefault("ab", {})["mode"] = "live"
    cfg.setdefault("serve", {})["time_scale"] = float(time_scale)
    cfg.setdefault("round", {})["simulated_clock"] = float(time_scale) != 1.0
    for dotted, value in extra.items():
        sec, key = dotted.split(".", 1)
        cfg.setdefault(sec, {})[key] = value
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(f"# written by hermes-lab flywheel --live from {base or 'the defaults'}\n" + yaml.safe_dump(cfg))
    os.replace(tmp, out)
    return out


class FeedbackCounter:
    """Conversations with feedback in a gateway log dir, read incrementally (the file only grows)."""

    def __init__(self, log_dir: Path):
        self.path, self.offset, self.ids = log_dir / L.FEEDBACK, 0, set()

    def count(self) -> int:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return len(self.ids)
        end = data.rfind(b"\n") + 1  # a line being written is read next time, whole
        for line in data[:end].splitlines():
            try:
                self.ids.add(json.loads(line)["conversation_id"])
            except (ValueError, KeyError, TypeError):
                continue
        self.offset += end
        return len(self.ids)


def die_with_parent() -> None:
    """In the worker, before exec: SIGKILL when the supervisor dies (Linux prctl PR_SET_PDEATHSIG)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)


def describe(row: dict[str, Any]) -> str:
    b, a, g = row.get("base_pass_rate"), row.get("pass_rate"), row.get("gain")
    if b is None or a is None:
        return f"{g * 100:+.1f} points"
    return f"{b:.1%} -> {a:.1%} ({g * 100:+.1f} points)"


def describe_agent(a: dict[str, Any]) -> str:
    """'live success baseline 41.2% (n=85) vs candidate 63.0% (n=27); held-out episodes 44.0% -> 61.5%; real Hermes
    on 96 held-out tasks 57.3% -> 64.6%'."""
    live = a.get("live") or {}
    arms = " vs ".join(f"{arm} {v['success']:.1%} (n={v['n']})" for arm, v in live.items() if v["n"])
    parts = [f"live success {arms}"] if arms else []
    if a.get("heldout_before") is not None and a.get("heldout_after") is not None:
        parts.append(f"held-out episodes {a['heldout_before']:.1%} -> {a['heldout_after']:.1%}")
    if a.get("played"):  # validate's held-out tasks, played by the real Hermes Agent against each arm
        b, c = a["played"]["before"], a["played"]["after"]
        parts.append(f"real Hermes on {c['tasks']} held-out tasks {b['pass_rate']:.1%} -> {c['pass_rate']:.1%}")
    return "; ".join(parts) or "no agent conversation"


def next_stage(prog: dict[str, Any]) -> str | None:
    from hermes_lab.round.stages import STAGES

    done = set(prog.get("completed", []))
    return next((s.name for s in STAGES if s.name not in done), None)


def read_json_or_empty(p: Path) -> dict[str, Any]:
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except (FileNotFoundError, ValueError):
        return {}


def worker(params: str) -> int:
    """The round a supervisor runs: a new one, or the unfinished one continued."""
    from hermes_lab.round.runner import OK_STATUSES, RoundError, RoundLocked, run_round

    try:
        r = run_round(params, resume=None)
    except (RoundError, RoundLocked) as e:
        print(f"hermes-lab flywheel --live worker: {e}", file=sys.stderr, flush=True)
        return 1
    return 0 if r.status.startswith(OK_STATUSES) else 4
