"""The tests reward: every sampled completion's code runs against its task's tests, in the sandbox.

Stage: train (``reward.types: [..., tests]``). Reads the GRPO dataset's ``tests`` column (a JSON spec per
prompt, written by prep from the trajectories' ``tests`` / ``entry_point`` / stdin-stdout fields; see
``hermes_lab.sandbox.specs`` for the shapes) through TRL, which hands dataset columns to reward functions as
keyword arguments. Writes nothing itself: train puts ``SandboxTally.to_dict()`` into ``health.json`` and the
counts by kind into MLflow (``train/tests_<kind>``).

    reward:
      types: [system, tests]    # tests: a row without tests scores None (TRL: not applicable)
      tests_score: share        # or all: scale only when every test passes
      code_from: auto           # the last ```python block, else the whole completion
    sandbox:
      executor: local           # or fusion + url: a SandboxFusion run_code service

Per completion: its code (``reward.code_from``), compiled here (a syntax error costs no run), run once with the
grading harness (assert / check shapes: ``hermes_lab.sandbox.harness``) or once per stdin/stdout case, under
``sandbox.*`` limits; runs go in parallel up to ``sandbox.workers`` and a group's duplicate completions run once
(``TestRunner``'s cache by (code, tests) hash). The verdict never lives where the completion runs: the harness's
judge runs the tests in a process of its own, the completion's functions answer its calls as plain data from
another, and an io case's output is compared here (``hermes_lab.sandbox.specs``).

Reward: ``reward.scale`` x the share of tests passed (MBPP's assert lines, io cases: independent tests), or
all-or-nothing (``tests_score: all``, and always for HumanEval's ``check``, which passes as a whole); in
[0, scale] by construction: the share is counted here from one mark per planned test. A compile error, a
timeout, a crash, a memory or output limit scores 0; a sandbox error (the executor failed, not the completion)
scores None and counts towards ``sandbox.max_error_rate``, past which training stops with the executor's error.
"""

from __future__ import annotations

import json
import sys
from collections import deque
from typing import Any

from hermes_lab.config.schema import HermesConfig
from hermes_lab.sandbox.executor import Executor, Limits
from hermes_lab.sandbox.fusion import FusionExecutor
from hermes_lab.sandbox.local import LocalExecutor
from hermes_lab.sandbox.shapes import SpecError, TestSpec, extract_code, parse_tests
from hermes_lab.sandbox.specs import KINDS, Outcome, TestRunner

WINDOW = 200  # scored completions over which sandbox.max_error_rate is measured
MIN_DECIDE = 16


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot score completions: no isolation where it is required, or the service keeps failing."""


def limits_of(cfg: HermesConfig) -> Limits:
    s = cfg.sandbox
    return Limits(
        timeout_s=s.timeout_s,
        cpu_s=s.cpu_s,
        memory_mb=s.memory_mb,
        file_mb=s.file_mb,
        max_processes=s.max_processes,
        max_output_kb=s.max_output_kb,
    )


def executor_of(cfg: HermesConfig) -> Executor:
    """The configured executor. A local one must have every kernel layer here (``sandbox.require_isolation``,
    ``hermes_lab.sandbox.isolation.missing``); opted out, it says on stderr what is then not enforced."""
    s = cfg.sandbox
    if s.executor == "fusion":
        return FusionExecutor(s.url, workers=s.workers or None, api_key_env=s.api_key_env)
    ex = LocalExecutor(workers=s.workers or None, python=s.python or None)
    gaps = ex.describe().get("missing") or []
    if gaps and s.require_isolation:
        ex.close()
        raise SandboxUnavailable(
            "the sandbox cannot give its barriers on this machine: " + "; ".join(gaps) + ". Install what is "
            "missing (README, set-up: make sandbox-deps), see `hermes-lab doctor --params FILE`, or set "
            "sandbox.require_isolation: false to score completions without them"
        )
    if gaps:
        print(f"sandbox: NOT enforced (sandbox.require_isolation is false): {'; '.join(gaps)}", file=sys.stderr)
    return ex


def spec_of(value: Any, cache: dict[str, TestSpec | None]) -> TestSpec | None:
    """A ``tests`` column value: prep's JSON text (cached: a prompt's spec repeats in every group), a dict or a
    list (a dataset built by hand), None or '' for a row without tests."""
    if value is None or value == "":
        return None
    if isinstance(value, str):
        if value not in cache:
            cache[value] = parse_tests({"tests": json.loads(value)})
        return cache[value]
    return parse_tests({"tests": value})


class SandboxTally:
    """Completions by kind, the executor's runs, sandbox errors in a window (the stop), for health.json."""

    def __init__(self, runner: TestRunner, max_error_rate: float, isolation: dict[str, Any]):
        self.runner, self.max_rate, self.isolation = runner, float(max_error_rate), isolation
        self.by_kind: dict[str, int] = {}
        self.recent: deque[bool] = deque(maxlen=WINDOW)
        self.first_errors: list[str] = []
        self.scored = 0

    def add(self, outcomes: list[Outcome | None]) -> None:
        for o in outcomes:
            if o is None:
                continue
            self.scored += 1
            self.by_kind[o.kind] = self.by_kind.get(o.kind, 0) + 1
            bad = o.kind == "sandbox_error"
            self.recent.append(bad)
            if bad and len(self.first_errors) < 5:
                self.first_errors.append(o.detail[:300])

    def check(self) -> None:
        n, bad = len(self.recent), sum(self.recent)
        if n >= min(MIN_DECIDE, WINDOW) and bad / n > self.max_rate:
            raise SandboxUnavailable(
                f"the sandbox failed on {bad} of the last {n} completions (> sandbox.max_error_rate "
                f"{self.max_rate:.0%}); first error: {self.first_errors[0] if self.first_errors else '?'}. "
                "Check the executor (sandbox.url, hermes-lab doctor), then continue with --resume."
            )

    def metrics(self) -> dict[str, int]:
        """Cumulative counts by kind: train/tests_<kind> in MLflow (every kind, zeros too: one curve each)."""
        return {f"tests_{k}": self.by_kind.get(k, 0) for k in KINDS}

    def to_dict(self) -> dict[str, Any]:
        ex = self.runner.executor.stats
        return {
            "completions": self.scored,
            "by_kind": {k: self.by_kind[k] for k in KINDS if k in self.by_kind},
            "executions": self.runner.stats.executions,
            "cache_hits": self.runner.stats.cache_hits,
            "run_seconds": round(ex.seconds, 2),
            "runs_by_status": dict(ex.by_status),
            "sandbox_errors": self.by_kind.get("sandbox_error", 0),
            "judge_exposed": self.runner.stats.exposed,  # harness runs whose judge's memory was not out of reach
            "first_errors": list(self.first_errors),
            "isolation": self.isolation,
            "limits": self.runner.limits.to_dict(),
        }


def _text(c: Any) -> str:
    if isinstance(c, list):  # TRL's conversational completions: [{"role", "content"}]
        return "".join(m.get("content", "") for m in c if isinstance(m, dict))
    return str(c)


def make_tests_reward(cfg: HermesConfig, executor: Executor | None = None) -> Any:
    """The ``tests`` entry of the reward registry: fn(prompts, completions, tests=[...], **kw) -> rewards."""
    ex = executor or executor_of(cfg)
    runner = TestRunner(ex, limits_of(cfg), cache_size=cfg.sandbox.cache_size)
    tally = SandboxTally(runner, cfg.sandbox.max_error_rate, ex.describe())
    scale, all_or_nothing, code_from = float(cfg.reward.scale), cfg.reward.tests_score == "all", cfg.reward.code_from
    specs: dict[str, TestSpec | None] = {}

    def reward(prompts: list[Any], completions: list[Any], tests: list[Any] | None = None, **kw: Any) -> list[Any]:
        if tests is None:  # a dataset without a tests column: not applicable to any row
            return [None] * len(completions)
        try:
            row_specs = [spec_of(t, specs) for t in tests]
        except (SpecError, ValueError) as e:
            raise SpecError(f"the dataset's tests column holds a spec that does not parse: {e}") from None
        codes = [extract_code(_text(c), code_from) for c in completions]
        outcomes = runner.score(codes, row_specs)
        tally.add(outcomes)
        tally.check()
        out: list[float | None] = []
        for o in outcomes:
            if o is None or o.kind == "sandbox_error":
                out.append(None)
            elif all_or_nothing:
                out.append(scale if o.kind == "passed" else 0.0)
            else:
                out.append(round(min(scale, max(0.0, scale * o.share)), 4))  # share is in [0, 1]: belt and braces
        return out

    reward.__name__ = "tests"
    reward.sandbox = tally  # type: ignore[attr-defined]  (train writes it into health.json)
    return reward
