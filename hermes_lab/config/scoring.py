"""Config sections of what scores a completion: ``reward`` (the reward functions, the judge, the reward audit)
and ``sandbox`` (where and under which limits the tests reward runs code).

Part of the config layer (``hermes_lab.config.schema`` builds ``HermesConfig`` from the sections and loads it):
each field with its help text and bounds, choices as ``Literal`` types, ``REWARD_TYPES`` (the names
``reward.types`` accepts, checked without importing the rewards), ``callable_spec`` (the form of an import path
a key may hold) and the checks: ``reward_problems``, ``sandbox_problems``, ``sandbox_warnings`` (the tests reward on
a sandbox that may run without isolation). Reads and writes nothing.

    hermes-lab config --explain        # every key, with its choices and bounds
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Literal

from hermes_lab.config.serving import ENV_NAME
from hermes_lab.core.yaml_typed import field_with as _f

# The names reward.types accepts, with their help. hermes_lab.rewards.registry implements exactly these (a test
# pins it); they are named here, below the rewards, so that a config is checked without importing them.
REWARD_TYPES: dict[str, str] = {
    "system": "system feedback, 'the tests pass' (reward.system: the embedded verifiers or 'module:function')",
    "comparison": "comparison feedback: the completion judged against the logged reference (reward.model's judge, "
    "or the local one)",
    "tests": "system feedback from execution: the completion's code runs against its task's tests in the sandbox "
    "(sandbox.*); the share passed on reward.scale (reward.tests_score); rows without tests score None",
    "group_comparison": "the group-relative comparison judge (RULER-like): one judge call scores a group's "
    "samples together on 0..scale; malformed replies are retried (reward.group_judge_retries), then the group "
    "falls back to the pointwise local judge; no reward.model: the local judge",
    "tool_call": "tool-call validity of a sampled assistant turn (turn-level GRPO, grpo.turns): its <tool_call> "
    "blocks parse, name a tool of the conversation's schema, and their arguments satisfy it; no call: None",
}


def callable_spec(value: str) -> bool:
    """An import path to a function or class, 'package.module:name' (reward.types, reward.system,
    grpo.environment): its form only, nothing imported."""
    mod, _, fn = value.partition(":")
    return bool(re.fullmatch(r"[A-Za-z_][\w.]*", mod) and re.fullmatch(r"[A-Za-z_]\w*", fn))


@dataclass
class RewardSection:
    model: str | None = _f(
        None, "Judge model id for the comparison reward (OpenAI-compatible). Empty or 'local': the local judge."
    )
    base_url: str | None = _f(None, "OpenAI-compatible API root of the judge.")
    api_key_env: str = _f("TAOTOKEN_API_KEY", "NAME of the environment variable holding the judge's key.")
    types: list[str] = _f(
        ["system", "comparison"],
        "Reward functions: system (tests pass / verifier), comparison (judge vs the reference response), "
        "tests (the task's tests run on the completion's code), or 'module:function'.",
    )
    weights: list[float] | None = _f(None, "One weight per entry of types (default: all 1).")
    system: str = _f("verifier", "System feedback: 'verifier' (embedded task verifiers) or 'module:function'.")
    scale: float = _f(5, "Reward scale: rewards lie in 0..scale.", gt=0)
    success_threshold: float = _f(3, "A score >= this is a success (docs/SPEC.md: 3 on the 5 scale).", gt=0)
    judge_concurrency: int = _f(8, "Concurrent judge requests.", ge=1)
    judge_timeout_s: float = _f(30.0, "Judge request timeout in seconds.", gt=0)
    judge_retries: int = _f(4, "Retries on 429/5xx/timeouts, with exponential backoff.", ge=0)
    max_judge_failure_rate: float = _f(
        0.2,
        "Training stops when more than this share of the last judge_failure_window judged samples failed "
        "(a 429/5xx after the retries, a timeout, a reply without a score). Below it a failed sample falls "
        "back to its group's mean judge score, or to the system reward alone (see hermes_lab.rewards.registry).",
        ge=0,
        le=1,
    )
    judge_failure_window: int = _f(200, "Judged samples over which max_judge_failure_rate is measured.", ge=1)
    group_judge_retries: int = _f(
        2,
        "group_comparison: times a group is asked again when the judge's reply has the wrong number of scores "
        "(or none it can read); then the group falls back to the pointwise local judge (counted, never fatal).",
        ge=0,
    )
    tests_score: Literal["share", "all"] = _f(
        "share",
        "The tests reward: share (scale x the share of tests passed) or all (scale when every test passes, else "
        "0). Compile errors, timeouts, crashes, memory and output limits score 0 either way.",
    )
    code_from: Literal["auto", "fenced", "whole"] = _f(
        "auto",
        "The tests reward: the code of a completion. fenced: its last ```python block (none: scores 0, no_code); "
        "whole: the completion as it is; auto: the fenced block if there is one, else the whole completion.",
    )
    audit: Literal["block", "warn"] = _f(
        "block",
        "The reward audit before every training (hermes_lab.rewards.audit): each reward scores built-in adversarial "
        "completions (attacks on the tests' grader, requests for a high score, useless tool calls, an empty answer, "
        "the prompt echoed...). block: a completion paid above audit_threshold stops the round before training, "
        "named with its reward; warn: they are named and the round goes on.",
    )
    audit_threshold: float = _f(
        0.4,
        "The reward audit: an adversarial completion paid more than this share of scale is a finding (2 on the 5 "
        "scale). The verifier's partial credit and the local judge pay an echoed embedded prompt up to 0.32 of it.",
        ge=0,
        le=1,
    )


@dataclass
class SandboxSection:
    executor: Literal["local", "fusion"] = _f(
        "local",
        "Where the tests reward runs completions' code. local: this machine, no extra service (runs forked from a "
        "warm launcher, each in bubblewrap's root of its own with namespaces, a seccomp filter, a cgroup; Landlock "
        "where there are no namespaces: hermes_lab.sandbox.isolation). fusion: a sandbox service speaking "
        "SandboxFusion's POST /run_code API at sandbox.url.",
    )
    url: str = _f("", "executor fusion: the service's http(s) root (e.g. http://sandbox:8080; /run_code is appended).")
    api_key_env: str = _f(
        "", "executor fusion: NAME of an env var holding a key sent as 'Authorization: Bearer' (empty: none)."
    )
    workers: int = _f(0, "Programs run at once (0: one per CPU core; fusion: concurrent requests, 0 means 8).", ge=0)
    timeout_s: float = _f(
        4.0, "Wall-clock limit of one run (all of a completion's tests; one stdin/stdout case).", gt=0, le=600
    )
    cpu_s: float = _f(4.0, "CPU-seconds limit of each process of a run (RLIMIT_CPU; local executor).", gt=0, le=600)
    memory_mb: int = _f(
        512,
        "Memory of one run, MiB: its cgroup's limit for all its processes, tmpfs files and shared memory together, "
        "and each process's address space (RLIMIT_AS; fusion: memory_limit_MB).",
        ge=32,
    )
    file_mb: int = _f(
        16,
        "Largest file a run may write, MiB (RLIMIT_FSIZE; also the size of each of its tmpfs: work dir, /tmp).",
        ge=1,
    )
    max_processes: int = _f(
        16, "Processes and threads a run may have at once (its cgroup's pids limit).", ge=1, le=4096
    )
    max_output_kb: int = _f(
        1024, "Output a run may print, KiB (stdout and stderr each); past it the run is stopped.", ge=1
    )
    cache_size: int = _f(
        100_000, "Completions whose results are kept by (code, tests) hash; duplicates run once.", ge=0
    )
    python: str = _f(
        "",
        "local executor: the interpreter programs run with, a virtualenv's bin/python whose packages they may "
        "import (numpy, pandas); read-only in the sandbox. Empty: this interpreter, the standard library only.",
    )
    require_isolation: bool = _f(
        True,
        "local executor: refuse to score completions (training with the tests reward stops before it starts, "
        "naming what is missing) unless every layer is kernel-enforced here: seccomp, a cgroup per run, and a root "
        "of its own (bubblewrap) or Landlock. false: go on without them, and say in the round's output what is "
        "then not enforced.",
    )
    max_error_rate: float = _f(
        0.2,
        "Training stops when more than this share of the last 200 scored completions met a sandbox error (the "
        "executor failed, not the completion: scored None, counted in health.json).",
        ge=0,
        le=1,
    )


def reward_problems(r: RewardSection) -> list[str]:
    """The rewards' checks beyond bounds: registry names or import paths, one weight per type, a threshold on
    the scale, and the judge's API address when the comparison reward calls one."""
    errs: list[str] = []
    if not r.types:
        errs.append("reward.types must name at least one reward")
    for t in r.types:
        if t not in REWARD_TYPES and not callable_spec(t):
            errs.append(
                f"reward.types entry '{t}' is unknown: use {', '.join(REWARD_TYPES)} or 'package.module:function'"
            )
    if r.weights is not None and len(r.weights) != len(r.types):
        errs.append(f"reward.weights needs one weight per reward type ({len(r.types)}), got {len(r.weights)}")
    if r.system != "verifier" and not callable_spec(r.system):
        errs.append(f"reward.system must be 'verifier' or 'package.module:function', got {r.system!r}")
    if r.success_threshold > r.scale:
        errs.append(f"reward.success_threshold {r.success_threshold:g} lies above reward.scale {r.scale:g}")
    if "comparison" in r.types and r.model and r.model.strip().lower() != "local":
        from hermes_lab.llm.base import ApiConfigError, normalize_base_url

        try:
            normalize_base_url(r.base_url, "reward.base_url (the judge API for reward.model)")
        except ApiConfigError as e:
            errs.append(str(e))
    return errs


def sandbox_problems(s: SandboxSection) -> list[str]:
    out = []
    if s.executor == "fusion" and not s.url.startswith(("http://", "https://")):
        out.append(
            f"sandbox.url must be the http(s) root of a run_code server when sandbox.executor is fusion, got {s.url!r}"
        )
    if s.api_key_env and not ENV_NAME.match(s.api_key_env):  # never echo it: it may be the key
        out.append("sandbox.api_key_env must be the NAME of an environment variable, not the key itself")
    if s.python and not (os.path.isfile(s.python) and os.access(s.python, os.X_OK)):
        out.append(f"sandbox.python must be a Python interpreter (a virtualenv's bin/python), got {s.python!r}")
    return out


def sandbox_warnings(s: SandboxSection, r: RewardSection) -> list[str]:
    """The tests reward on a local sandbox that may run without isolation: allowed, said."""
    if "tests" in r.types and s.executor == "local" and not s.require_isolation:
        return [
            "sandbox.require_isolation is false: completions run even where this machine lacks a sandbox layer "
            "(the train stage and inspect's sandbox diagnostic name what is then not enforced; so does "
            "hermes-lab doctor --params FILE)"
        ]
    return []
