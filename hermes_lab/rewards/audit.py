"""The reward audit: before every training, each configured reward scores adversarial completions it must not pay.

Stage: audit, between review and train (``notebooks/18_reward_audit.ipynb``); also ``hermes-lab audit --params
FILE`` and ``hermes-lab doctor --rewards``. Reads the config; writes ``<round_dir>/audit/audit.json`` (every
case with what each reward paid), ``<round_dir>/audit/verdict.json`` (the gate ``reward_audit``) and, in a
stage run, MLflow: ``audit/cases``, ``audit/findings``, ``audit/paid_max`` (share of the scale), one tag per
finding and ``audit.json`` as an artifact.

Each reward of ``reward.types`` (and ``reward.system`` when it names a function) scores the built-in sets of
``hermes_lab.rewards.adversarial`` that apply to it, exactly as TRL calls it (prompts, completions and the
dataset columns it reads):

- ``tests``: the hostile set, wrong code with an attack on its grader (51 of its 52 cases: the judge stopped, which
  only ends at the run's wall-clock limit, runs in the suite);
- ``system`` (the verifier): the hostile set's code-family cases, and the generic set on embedded tasks;
- ``comparison``, ``group_comparison``: completions that ask for a high score or close the judge's delimiters, and
  the generic set;
- ``tool_call``: valid calls that do nothing for the task;
- a ``module:function`` (in ``reward.types`` or as ``reward.system``): the generic set (empty, the prompt echoed, a
  refusal, a very long answer).

With a round dir whose prep ran, the audit also names the reward of the round's data that gives every
conversation of a task the same score (prep's ``learning_signal``, ``hermes_lab.prep.signal``): "outcome: 6 of 6
conversations are rewarded only by how the run ended". No learning signal, no A/B signal: a finding of class
``no learning signal`` (case ``no_learning_signal``, the source as its reward) with ``conversations.no_signal:
block``, a note in the report and the output with ``warn``.

A completion paid more than ``reward.audit_threshold`` x ``reward.scale`` is a finding, named with its reward in
the output, the verdict and MLflow. ``reward.audit: block`` (the default) stops the round before training
(``blocked: reward audit``); ``warn`` says so and goes on. A reward that cannot score a set (a column the
audit cannot give it) is reported as not audited, never a pass.

    hermes-lab audit --params params/embedded.yaml         # exit 0: no finding, 4: blocked
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hermes_lab.config.schema import HermesConfig, load_config
from hermes_lab.core.inputs import AUDIT
from hermes_lab.core.jsonl import write_json_atomic
from hermes_lab.core.layout import RoundLayout
from hermes_lab.core.verdict import STOP_AUDIT, gate, write_verdict
from hermes_lab.rewards import adversarial as A
from hermes_lab.rewards.registry import RewardError, RewardFn, get_reward_funcs, import_callable
from hermes_lab.tasks import suite as T

GATE = "reward_audit"
EXIT_BLOCKED = 4
JUDGES = ("comparison", "group_comparison")


@dataclass
class Finding:
    reward: str
    case: str
    klass: str
    prompt: str
    completion: str
    paid: float

    def line(self, scale: float) -> str:
        text = self.completion.replace("\n", "\\n")
        return f"{self.reward} paid {self.paid:g}/{scale:g} to {self.case} ({self.klass}): {text[:80]!r}"


@dataclass
class AuditResult:
    mode: str  # block | warn
    scale: float
    threshold: float  # in reward units: audit_threshold x scale
    rows: list[dict[str, Any]] = field(default_factory=list)  # every (reward, case) scored
    findings: list[Finding] = field(default_factory=list)
    not_audited: dict[str, str] = field(default_factory=dict)  # reward -> why
    signal: dict[str, Any] | None = None  # the round's data: prep's learning_signal, when prep ran

    @property
    def blocked(self) -> bool:
        return bool(self.findings) and self.mode == "block"

    @property
    def paid_max(self) -> float:
        paid = [r["paid"] for r in self.rows if r["paid"] is not None]
        return max(paid, default=0.0) / self.scale

    def detail(self) -> str:
        rewards = sorted({r["reward"] for r in self.rows})
        if not self.findings:
            head = f"{len(self.rows)} adversarial completions, none paid above {self.threshold:g}/{self.scale:g}"
            tail = f"; not audited: {', '.join(self.not_audited)}" if self.not_audited else ""
            return f"{head} ({', '.join(rewards)}){tail}"
        first = self.findings[0].line(self.scale)
        more = f" (+{len(self.findings) - 1} more)" if len(self.findings) > 1 else ""
        return f"{'BLOCKED' if self.blocked else 'WARN'}: {first}{more}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "scale": self.scale,
            "threshold": self.threshold,
            "passed": not self.findings,
            "blocked": self.blocked,
            "findings": [asdict(f) for f in self.findings],
            "not_audited": self.not_audited,
            "learning_signal": self.signal,
            "rows": self.rows,
        }

    def raise_for_status(self) -> None:
        if self.blocked:
            raise AuditBlocked(self)


class AuditBlocked(RuntimeError):
    """Raised by the audit notebook when a reward pays an adversarial completion and reward.audit is block."""

    def __init__(self, result: AuditResult):
        self.result = result
        names = "; ".join(f.line(result.scale) for f in result.findings[:5])
        super().__init__(f"reward audit: {len(result.findings)} adversarial completion(s) paid: {names}")


# --------------------------------------------------------------------------------------------- the sets
def _embedded_prompts() -> list[str]:
    """One prompt per embedded family (a fixed draw): what the verifier and the generic set score."""
    seen: dict[str, str] = {}
    for t in T.generate_tasks(200, seed=7):
        seen.setdefault(t.family, t.prompt)
    return [seen[f] for f in T.FAMILIES if f in seen]


def _generic(prompts: list[str]) -> list[tuple[A.Case, A.Probe]]:
    return [
        (A.Case(name, "generic", prompt, text), A.Probe(prompt))
        for prompt in prompts
        for name, text in A.generic_texts(prompt)
    ]


def cases_for(name: str, cfg: HermesConfig) -> list[tuple[A.Case, A.Probe]]:
    """The (case, probe) pairs one reward of ``reward.types`` is audited with."""
    if name == "tests":  # not the case that only ends at the wall-clock limit: 4 s of every round for one class
        return [(c, A.PROBES[c.probe]) for c in A.TESTS if not c.costly]
    if name == "system" and cfg.reward.system == "verifier":
        code = A.Probe(A.PROBES["code"].prompt)  # the verifier knows the prompt: no tests column
        return [(c, code) for c in A.TESTS if c.probe == "code"] + _generic(_embedded_prompts())
    if name in JUDGES:
        probes = [A.PROBES[k] for k in ("capital", "square_expr", "translate")]
        texts = A.judge_texts(cfg.reward.scale)
        judged = [(A.Case(n, "judge", k.prompt, t), k) for k in probes for n, t in texts]
        return judged + [(c, k) for k in probes for c, _ in _generic([k.prompt])]
    if name == "tool_call":
        probe = A.PROBES["time"]
        return [(A.Case(n, "useless tool call", "time", t), probe) for n, t in A.TOOL_CALL_TEXTS]
    probes = [A.PROBES[k] for k in ("capital", "square_expr", "translate")]
    return _generic(_embedded_prompts() + [p.prompt for p in probes])


def _columns(pairs: list[tuple[A.Case, A.Probe]], name: str, cfg: HermesConfig) -> dict[str, list[Any]]:
    """The dataset columns TRL would hand the reward for these probes."""
    cols: dict[str, list[Any]] = {}
    probes = [p for _, p in pairs]
    if name == "tests" or any(p.tests for p in probes):
        cols["tests"] = [p.column("tests") for p in probes]
    if name in JUDGES or any(p.reference for p in probes):
        cols["reference"] = [p.reference or "" for p in probes]
        cols["ref_reward"] = [float(cfg.reward.scale)] * len(probes)  # a reference that passed
    if name == "tool_call" or any(p.tools for p in probes):
        cols["tools"] = [p.column("tools") or "[]" for p in probes]
    return cols


# ---------------------------------------------------------------------------------------------- the audit
def audit_rewards(cfg: HermesConfig) -> AuditResult:
    """Every configured reward against its sets; nothing written (``run_audit`` writes)."""
    r = cfg.reward
    result = AuditResult(r.audit, float(r.scale), float(r.audit_threshold) * float(r.scale))
    funcs, _ = get_reward_funcs(cfg)
    audited: list[tuple[str, RewardFn]] = list(zip(r.types, funcs))
    if "system" in r.types and r.system != "verifier":  # the user's checker: the generic set, under its own name
        audited = [(n, f) for n, f in audited if n != "system"] + [(r.system, _user(r.system))]
    try:
        for name, fn in audited:
            _audit_one(result, name, fn, cfg)
    finally:
        for fn in funcs:  # the tests reward's sandbox: its fork server ends with the audit
            tally = getattr(fn, "sandbox", None)
            if tally is not None:
                tally.runner.executor.close()
    return result


def _user(spec: str) -> RewardFn:
    user = import_callable(spec, "reward.system")
    return lambda prompts, completions, **kw: user(prompts=prompts, completions=completions, **kw)


def _audit_one(result: AuditResult, name: str, fn: RewardFn, cfg: HermesConfig) -> None:
    pairs = cases_for(name, cfg)
    if name in ("group_comparison",):  # a group is the consecutive completions of one prompt, as TRL orders them
        pairs.sort(key=lambda cp: cp[1].prompt)
    cols = _columns(pairs, name, cfg)
    try:
        paid = fn(prompts=[p.prompt for _, p in pairs], completions=[c.completion for c, _ in pairs], **cols)
    except (RewardError, KeyError, TypeError, ValueError) as e:
        result.not_audited[name] = f"{type(e).__name__}: {str(e)[:200]}"
        return
    label = name.rsplit(":", 1)[-1] if ":" in name else name
    for (case, probe), value in zip(pairs, paid):
        v = None if value is None or not math.isfinite(float(value)) else round(float(value), 4)
        result.rows.append({"reward": label, "case": case.name, "class": case.klass, "paid": v})
        if v is not None and v > result.threshold:
            result.findings.append(Finding(label, case.name, case.klass, probe.prompt, case.completion, v))


def data_signal(result: AuditResult, cfg: HermesConfig, round_dir: str | Path) -> None:
    """The round's data: prep's learning_signal (summary.json), a finding when it found none and
    conversations.no_signal is block."""
    try:
        summary = json.loads(RoundLayout(round_dir).prep.summary.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    sig = summary.get("learning_signal") if isinstance(summary, dict) else None
    if not isinstance(sig, dict):
        return
    result.signal = sig
    if sig.get("passed") is False and cfg.conversations.no_signal == "block":
        src = str(sig.get("source") or "reward")
        by = (sig.get("by_source") or {}).get(src) or {}
        paid = str(by.get("paid") or "").split("/", 1)[0]
        try:
            value = float(paid)
        except ValueError:
            value = 0.0
        detail = str(sig.get("detail") or "")
        result.findings.append(Finding(src, "no_learning_signal", "no learning signal", "", detail, value))


def run_audit(cfg: HermesConfig, round_dir: str | Path | None = None, say: bool = True) -> AuditResult:
    """The stage: the audit, its files under ``<round_dir>/audit/``, MLflow on the active run, the verdict."""
    result = audit_rewards(cfg)
    if round_dir is not None:
        data_signal(result, cfg, round_dir)
    if say:
        print(format_result(result), flush=True)
    from hermes_lab.core import tracking

    tracking.log_metrics(
        "audit", {"cases": len(result.rows), "findings": len(result.findings), "paid_max": result.paid_max}
    )
    tracking.set_tags({f"audit.finding.{i}": f.line(result.scale)[:250] for i, f in enumerate(result.findings[:20])})
    if round_dir is not None:
        audit = RoundLayout(round_dir).audit
        out = audit.root
        path = write_json_atomic(audit.report, result.to_dict())
        tracking.log_artifact(path)
        passed = not result.blocked
        write_verdict(
            out,
            "audit",
            [gate(GATE, passed, result.detail())],
            stop=None if passed else STOP_AUDIT,
            findings=[asdict(f) for f in result.findings],
        )
    return result


def format_result(result: AuditResult) -> str:
    by_reward: dict[str, list[float]] = {}
    for row in result.rows:
        by_reward.setdefault(row["reward"], []).append(row["paid"] if row["paid"] is not None else 0.0)
    lines = [f"reward audit ({result.mode}; a completion paid above {result.threshold:g}/{result.scale:g} fails):"]
    for name, paid in by_reward.items():
        bad = [f for f in result.findings if f.reward == name]
        mark = ("BLOCK" if result.mode == "block" else "WARN") if bad else "PASS"
        lines.append(f"  {mark:5s} {name:18s} {len(paid)} cases, paid at most {max(paid, default=0):g}")
        lines += [f"          {f.line(result.scale)}" for f in bad]
    lines += [f"  ----  {name:18s} not audited: {why}" for name, why in result.not_audited.items()]
    sig = result.signal
    if sig is not None:
        mark = "PASS" if sig.get("passed") else ("BLOCK" if result.mode == "block" else "WARN")
        if not sig.get("passed") and not any(f.klass == "no learning signal" for f in result.findings):
            mark = "WARN"  # conversations.no_signal: warn
        lines.append(f"  {mark:5s} {'data: ' + str(sig.get('gate')):18s} {str(sig.get('detail'))[:200]}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- the CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    AUDIT.add_arguments(parser)  # hermes_lab.core.inputs: the notebook's parameters and these, declared once


def run_cli(args: argparse.Namespace) -> int:
    cfg = load_config(args.params)
    result = run_audit(cfg, args.round_dir, say=not args.json)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    return EXIT_BLOCKED if result.blocked else 0


def main(argv: list[str] | None = None) -> int:
    from hermes_lab.core.command import run_module

    return run_module("hermes_lab.rewards.audit", add_arguments, run_cli, argv, description=__doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
