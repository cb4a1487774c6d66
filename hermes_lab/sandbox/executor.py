"""The executor interface: run untrusted programs under limits, many at once, and say what happened.

Stage: train (the tests reward) and every stage that scores the embedded code family. Reads and writes
nothing itself; an implementation may use temp dirs (``local``) or a sandbox service (``fusion``).

Two implementations, the same contract (``run_many(requests, limits) -> results``, in order):

- ``hermes_lab.sandbox.local.LocalExecutor``: this machine, no extra service; runs forked from a warm launcher
  (``hermes_lab.sandbox.launcher``), each confined by the kernel: a root of its own (bubblewrap), seccomp, a
  cgroup, or Landlock where there are no namespaces (``hermes_lab.sandbox.isolation``).
- ``hermes_lab.sandbox.fusion.FusionExecutor``: a SandboxFusion server's ``POST /run_code`` (or anything that
  speaks that API), for a user who already runs a sandbox service for many machines.

``hermes_lab.rewards.tests.executor_of(cfg)`` builds the one the config names (``sandbox.executor``). What goes
into a program (the completion's code, a test harness) is ``hermes_lab.sandbox.specs``' business, not the
executor's.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

# what a run ended as; an executor never raises for a program's behaviour, only for its own misuse
Status = Literal["ok", "error", "timeout", "output_limit", "killed", "sandbox_error"]
STATUSES: tuple[str, ...] = ("ok", "error", "timeout", "output_limit", "killed", "sandbox_error")


@dataclass(frozen=True)
class Limits:
    """Per-run limits. Wall time is the parent's (it kills the whole run); memory and processes hold for the
    whole run (its cgroup) and each process (RLIMIT_AS); CPU, file size and open files are each process's."""

    timeout_s: float = 4.0
    cpu_s: float = 4.0
    memory_mb: int = 512
    file_mb: int = 16
    max_processes: int = 16
    max_files: int = 64
    max_output_kb: int = 1024

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class RunRequest:
    """One program (Python source run as ``__main__``, or a bash script) and what its stdin holds; ``files``
    written into its work dir first (relative paths), ``fetch`` read back from it after (SandboxFusion's
    ``files`` and ``fetch_files``)."""

    program: str
    stdin: str = ""
    language: Literal["python", "bash"] = "python"
    files: dict[str, bytes] = field(default_factory=dict)
    fetch: tuple[str, ...] = ()


@dataclass
class RunResult:
    status: str  # one of STATUSES
    exit_code: int | None = None
    stdout: str = ""
    stderr: str = ""
    seconds: float = 0.0
    signal: int | None = None  # the signal that ended the program, when one did
    detail: str = ""  # why, in words, for a status other than ok / error
    files: dict[str, bytes] = field(default_factory=dict)  # what ``fetch`` asked for and the run left

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class ExecutorStats:
    """What an executor did, for health.json: runs by status and the time they took."""

    runs: int = 0
    seconds: float = 0.0
    by_status: dict[str, int] = field(default_factory=dict)

    def add(self, r: RunResult) -> None:
        self.runs += 1
        self.seconds += r.seconds
        self.by_status[r.status] = self.by_status.get(r.status, 0) + 1


class Executor:
    """Runs programs in parallel up to ``workers`` (default: the machine's cores). Subclasses implement
    ``run_one``; ``run_many`` keeps the order of the requests."""

    name = "executor"

    def __init__(self, workers: int | None = None):
        self.workers = max(1, workers or os.cpu_count() or 1)
        self.stats = ExecutorStats()
        self._pool: ThreadPoolExecutor | None = None

    def run_one(self, req: RunRequest, limits: Limits) -> RunResult:
        raise NotImplementedError

    def run_many(self, requests: list[RunRequest], limits: Limits) -> list[RunResult]:
        if not requests:
            return []
        if len(requests) == 1 or self.workers == 1:
            out = [self.run_one(r, limits) for r in requests]
        else:
            if self._pool is None:  # threads: each waits on its child process or HTTP call, the GIL is free
                self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix=f"sandbox-{self.name}")
            out = list(self._pool.map(lambda r: self.run_one(r, limits), requests))
        for r in out:
            self.stats.add(r)
        return out

    def describe(self) -> dict[str, Any]:
        """What isolation holds, in words (health.json, doctor, the docs)."""
        return {"executor": self.name, "workers": self.workers}

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
