"""Flywheel state and the clock: what the gates need to know about earlier rounds.

Reads and writes ``runs/state.json`` (atomically: ``hermes_lab.core.jsonl.write_json_atomic``) holding the last
training time, the champion adapter, the rounds whose data is negative, the last round number, and the
progress of the round in flight (``progress``: its completed stages, for --resume). Progress and the
flywheel's state live in one file so that one rename changes both: a kill can never leave a round marked
"trained" without its cooldown, or its negatives consumed but still listed.

The clock is injectable: the real one is UTC wall time; a ``SimulatedClock`` (embedded flywheel, tests)
lives in the state file and is advanced explicitly, so the 24 h cooldown holds without waiting a day.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Protocol

from hermes_lab.core.jsonl import write_json_atomic
from hermes_lab.core.layout import RunsLayout


class Clock(Protocol):
    def now(self) -> datetime: ...


class WallClock:
    def now(self) -> datetime:
        return datetime.now(timezone.utc)


@dataclass
class SimulatedClock:
    """A clock that only moves when told to. ``now`` is an aware UTC datetime."""

    current: datetime = field(default_factory=lambda: datetime(2026, 1, 1, tzinfo=timezone.utc))

    def now(self) -> datetime:
        return self.current

    def advance(self, hours: float = 0.0, seconds: float = 0.0) -> datetime:
        self.current = self.current + timedelta(hours=hours, seconds=seconds)
        return self.current


def parse_time(s: str | None) -> datetime | None:
    if not s:
        return None
    dt = datetime.fromisoformat(s)
    return dt if dt.tzinfo else dt.replace(tzinfo=timezone.utc)


@dataclass
class FlywheelState:
    last_train_time: str | None = None  # ISO time of the last training (cooldown gate)
    samples_at_last_train: int = 0  # records seen when the last training ran (data trigger)
    champion_adapter: str | None = None  # path of the promoted adapter, None: the base policy
    champion_round: int | None = None
    negative_rounds: list[int] = field(default_factory=list)  # rounds rolled back: their data is negative
    negative_files: list[str] = field(default_factory=list)  # their trajectories, fed to the next prep
    last_round: int = 0
    simulated_now: str | None = None  # the simulated clock, when the flywheel uses one
    history: list[dict[str, Any]] = field(default_factory=list)
    held: dict[str, Any] | None = None  # a candidate held undecided, for the next round to continue (round.on_held)
    progress: dict[str, Any] | None = None  # the unfinished round (round, completed stages, status, ...)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> FlywheelState:
        p = Path(path)
        if not p.exists():
            return cls()
        data = json.loads(p.read_text(encoding="utf-8"))
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**known)

    def save(self, path: str | os.PathLike[str]) -> None:
        write_json_atomic(path, asdict(self))  # unique temp name, fsync, rename, fsync the directory

    def clock(self, simulated: bool) -> Clock:
        if not simulated:
            return WallClock()
        return SimulatedClock(parse_time(self.simulated_now) or SimulatedClock().current)


def state_path(runs_dir: str | os.PathLike[str]) -> Path:
    return RunsLayout(runs_dir).state
