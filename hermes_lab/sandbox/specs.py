"""Scoring: a completion's code run against its task's tests, what each run scored, the cache of outcomes.

Stage: train (the tests reward), every stage that scores the embedded code family. Reads and writes nothing;
programs run through an ``Executor``. What the tests look like, how they parse and what the judge runs:
``hermes_lab.sandbox.shapes`` (``TestSpec``, ``parse_tests`` and ``SpecError`` are importable from here too).

Scoring (``TestRunner.score``): a completion's code is checked for syntax here (a compile error costs no run),
then runs once (``assert``, ``check``: every test in one process, each test's pass or failure reported on a
line that carries a per-run random marker the program cannot know in advance, so printing a fake report
earns nothing) or once a case (``io``: stdout compared line by line, trailing whitespace ignored). Its kind
is the worst that happened: ``compile_error``, ``timeout``, ``memory``, ``output_limit``, ``crash`` (killed,
or it exited before its tests reported: ``os._exit`` passes nothing) and ``no_code`` score 0;
``runtime_error`` (the code raised before any test ran) passes nothing; ``failed`` is some tests passed;
``passed`` all; ``sandbox_error`` (the executor failed, not the completion) scores None. Results are cached
by (code, spec): a group's duplicate completions run once.
"""

from __future__ import annotations

import hashlib
import secrets
import warnings
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Any

from hermes_lab.sandbox.executor import Executor, Limits, RunRequest, RunResult
from hermes_lab.sandbox.shapes import SpecError, TestSpec, job_of, parse_tests, plan_of, solution_source

# SpecError, TestSpec and parse_tests are shapes' (here too: prep's logs.lines and tasks.code import them from here)
__all__ = [
    "KINDS",
    "ZERO_KINDS",
    "Outcome",
    "RunnerStats",
    "SpecError",
    "TestRunner",
    "TestSpec",
    "harness_outcome",
    "io_outcome",
    "parse_tests",
]

KINDS = (
    "passed",
    "failed",
    "runtime_error",
    "compile_error",
    "timeout",
    "memory",
    "output_limit",
    "crash",
    "no_code",
    "sandbox_error",
)
ZERO_KINDS = frozenset({"compile_error", "timeout", "memory", "output_limit", "crash", "no_code", "runtime_error"})


# ------------------------------------------------------------------------------------------ outcome
@dataclass
class Outcome:
    kind: str  # one of KINDS
    passed: int = 0
    total: int = 0  # tests counted: those that called the candidate, or would have
    detail: str = ""
    marks: str = ""  # per test: 1 pass, n pass without calling the candidate (not counted), 0 assertion failed,
    # e error, m MemoryError, t timeout, - not run
    partial: bool = True  # whether a share of the tests earns its share (not for check: see docs/rewards.md)

    @property
    def share(self) -> float:
        """In [0, 1] by construction: passed <= total, both counted here from the verdict's marks."""
        if self.kind in ZERO_KINDS or not self.total:
            return 0.0
        if not self.partial:
            return 1.0 if self.kind == "passed" else 0.0
        return min(1.0, max(0.0, self.passed / self.total))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _compile_error(source: str) -> str | None:
    try:
        with warnings.catch_warnings():  # a policy's code is not ours to warn about ("'int' object is not callable")
            warnings.simplefilter("ignore")
            compile(source, "solution.py", "exec", dont_inherit=True)
    except (SyntaxError, ValueError) as e:
        return f"{type(e).__name__}: {getattr(e, 'msg', e)} (line {getattr(e, 'lineno', '?')})"
    except (RecursionError, MemoryError) as e:
        return f"{type(e).__name__} while compiling"
    return None


def _run_kind(r: RunResult) -> str | None:
    """The kind a run's status says by itself (None: look at what the program reported)."""
    if r.status == "timeout":
        return "timeout"
    if r.status == "output_limit":
        return "output_limit"
    if r.status == "sandbox_error":
        return "sandbox_error"
    if r.status == "killed":
        return "crash"
    if r.status == "error" and "MemoryError" in r.stderr[-300:]:
        return "memory"
    return None


_VERDICT_KINDS = frozenset({"runtime_error", "memory", "timeout", "crash", "output_limit"})
_MARKS = frozenset("1n0em-")


def harness_outcome(r: RunResult, nonce: str, spec: TestSpec) -> tuple[Outcome, bool | None]:
    """The outcome of a harness run, and whether its judge was out of the candidate's reach ('P'; None when no
    verdict says). Only the judge writes to the run's stdout; still, only a line with this run's nonce counts,
    and its marks must match the plan's tests one for one."""
    n, partial = plan_of(spec).n_tests, spec.kind != "check"
    kind = _run_kind(r)
    if kind is not None:
        return Outcome(kind, 0, n, r.detail or _tail(r.stderr), "-" * n, partial), None
    line = next((s for s in reversed(r.stdout.split("\n")) if s.startswith(nonce + " ")), None)
    parts = line.split(" ", 5) if line else []
    if len(parts) != 6:
        why = _tail(r.stderr) or f"exit {r.exit_code}"
        return Outcome("crash", 0, n, "exited before its tests reported: " + why, "-" * n, partial), None
    _, what, marks, ok, protected, detail = parts
    detail = detail[1:-1][:300]
    if what in _VERDICT_KINDS:
        return Outcome(what, 0, n, detail, "-" * n, partial), protected == "P"
    if what != "done" or len(marks) != n or not set(marks) <= _MARKS:
        return Outcome("crash", 0, n, "the harness's report does not match its tests", "-" * n, partial), None
    counted, passed = n - marks.count("n"), marks.count("1")
    if "m" in marks:
        return Outcome("memory", passed, counted, "MemoryError in a test", marks, partial), protected == "P"
    if counted == 0:
        detail = detail or "no test called the code under test"
    good = counted > 0 and passed == counted and (partial or ok == "ok")
    return Outcome("passed" if good else "failed", passed, counted, detail, marks, partial), protected == "P"


def io_outcome(results: list[RunResult], spec: TestSpec) -> Outcome:
    marks, worst = "", None
    for r, (_, expected) in zip(results, spec.cases):
        kind = _run_kind(r)
        if kind is not None:
            worst = worst or kind
            marks += "t" if kind == "timeout" else "-"
        elif r.status == "ok" and _lines(r.stdout) == _lines(expected):
            marks += "1"
        else:
            marks += "e" if r.status == "error" else "0"
    total = len(spec.cases)
    if worst is not None:
        return Outcome(worst, 0, total, next(r.detail for r in results if _run_kind(r) == worst), marks)
    passed = marks.count("1")
    return Outcome("passed" if passed == total else "failed", passed, total, "", marks)


def _lines(text: str) -> list[str]:
    out = [s.rstrip() for s in text.replace("\r\n", "\n").split("\n")]
    while out and not out[-1]:
        out.pop()
    return out


def _tail(text: str) -> str:
    lines = [s for s in (text or "").strip().splitlines() if s.strip()]
    return lines[-1][:300] if lines else ""


# ------------------------------------------------------------------------------------------- runner
@dataclass
class RunnerStats:
    completions: int = 0
    cache_hits: int = 0
    executions: int = 0  # programs the executor ran
    by_kind: dict[str, int] = field(default_factory=dict)
    exposed: int = 0  # harness runs whose judge could not make its memory unreachable (see harness._protect)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class TestRunner:
    """Scores completions' code against specs through an executor, with an LRU cache by (code, spec)."""

    __test__ = False  # not a pytest class, whatever its name

    def __init__(self, executor: Executor, limits: Limits | None = None, cache_size: int = 100_000):
        self.executor, self.limits = executor, limits or Limits()
        self.cache: OrderedDict[str, Outcome] = OrderedDict()
        self.cache_size = cache_size
        self.stats = RunnerStats()

    @staticmethod
    def key(code: str, spec: TestSpec) -> str:
        return hashlib.sha256(f"{len(code)}:{code}\0{spec.to_json()}".encode("utf-8", "surrogatepass")).hexdigest()

    def score(self, codes: list[str | None], specs: list[TestSpec | None]) -> list[Outcome | None]:
        """One Outcome per completion (None where the spec is None: no tests, not applicable)."""
        out: list[Outcome | None] = [None] * len(codes)
        todo: dict[str, tuple[str, TestSpec, list[int]]] = {}
        for i, (code, spec) in enumerate(zip(codes, specs)):
            if spec is None:
                continue
            self.stats.completions += 1
            if code is None or not code.strip():
                out[i] = Outcome("no_code", 0, spec.n_tests, "no code in the completion", partial=spec.kind != "check")
                continue
            k = self.key(code, spec)
            hit = self.cache.get(k)
            if hit is not None:
                self.cache.move_to_end(k)
                self.stats.cache_hits += 1
                out[i] = hit
            elif k in todo:
                self.stats.cache_hits += 1  # a duplicate within the batch: runs once
                todo[k][2].append(i)
            else:
                todo[k] = (code, spec, [i])
        for k, outcome in self._run(todo).items():
            for i in todo[k][2]:
                out[i] = outcome
            if outcome.kind != "sandbox_error":  # an executor fault is retried next time, not remembered
                self.cache[k] = outcome
                if len(self.cache) > self.cache_size:
                    self.cache.popitem(last=False)
        for o in out:
            if o is not None:
                self.stats.by_kind[o.kind] = self.stats.by_kind.get(o.kind, 0) + 1
        return out

    def _run(self, todo: dict[str, tuple[str, TestSpec, list[int]]]) -> dict[str, Outcome]:
        done: dict[str, Outcome] = {}
        requests: list[RunRequest] = []
        plan: list[tuple[str, TestSpec, str, int]] = []  # key, spec, nonce, how many requests
        for k, (code, spec, _) in todo.items():
            source = solution_source(code, spec)
            err = _compile_error(source)
            if err is not None:
                done[k] = Outcome("compile_error", 0, spec.n_tests, err, partial=spec.kind != "check")
                continue
            if spec.kind == "io":
                program = f"{spec.setup}\n{source}" if spec.setup else source
                requests += [RunRequest(program, stdin) for stdin, _ in spec.cases]
                plan.append((k, spec, "", len(spec.cases)))
            else:
                nonce = "HERMES-" + secrets.token_hex(16)  # per run, in the judge's job only
                requests.append(job_of(code, spec, nonce, self.limits))
                plan.append((k, spec, nonce, 1))
        results = self.executor.run_many(requests, self.limits)
        self.stats.executions += len(requests)
        at = 0
        for k, spec, nonce, n in plan:
            rs = results[at : at + n]
            at += n
            if spec.kind == "io":
                done[k] = io_outcome(rs, spec)
                continue
            done[k], protected = harness_outcome(rs[0], nonce, spec)
            self.stats.exposed += protected is False
        return done
