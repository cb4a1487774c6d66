"""Validate stage, part 2: the regression (safety) gate, run before any A/B traffic.

The candidate (base + this round's LoRA adapter) and the baseline (``resolve_baseline``: the champion
adapter, else model.adapter, else the bare base; the A/B stage uses the same resolver) answer the same
held-out regression set with the same sampling settings, prompt order, seed and batch layout, so every
(task, sample) is a *pair*. Per family and overall, the gate is a paired non-inferiority test: the
candidate passes only if the one-sided (1 - validate.alpha) upper confidence bound of its drop in pass
rate (Tango's score bound for paired proportions) lies below ``validate.tolerance``. A drop that is merely
not shown to be significant no longer passes: a small set now stops a candidate rather than waving it
through, and the report says how small is too small (the chance to stop a true ``validate.power_drop``
drop and to pass an equally good candidate, with a warning under ``validate.min_power``).

Reads:
- ``<round_dir>/prep/heldout_dataset`` (HF datasets dir, "prompt" column) when prep wrote it: its
  prompts are embedded tasks, scored by the task verifiers. Families with fewer than
  ``validate.eval_tasks_per_family`` prompts are topped up with generated held-out tasks (held out by
  prompt hash, so never in training data): a family of 5 prompts would turn one unlucky sample into a
  20-point "regression". Without prep's set, every task is generated.
- the candidate adapter (``<round_dir>/train/adapter``, base from ``train/run.json``) and the baseline
  adapter (explicit, else the champion in ``runs/state.json``, else ``model.adapter``, else none).
- when the round trains an embedded agent family (``grpo.environment`` is ``hermes_lab.tasks.hermes:WorkspaceEnv``,
  the default, or ``hermes_lab.tasks.agent:TimeEnv``), ``validate.eval_tasks_per_family`` generated held-out tasks
  of it, each played as a whole episode (tool calls, their results, the answer; a hermes task verified on its
  workspace) ``validate.samples_per_task`` times per arm with the same seeds: the family ``hermes`` (or ``agent``)
  of the gate, paired like the others. A user's own environment has no held-out tasks the
  gate knows of: it is not evaluated here (train's episode metrics and the live A/B judge it).
  With ``agent.runner: hermes`` (the default) the real Hermes Agent also plays ``agent.heldout_tasks`` of those
  tasks once each against each arm served on 127.0.0.1 (``evaluate.played``; ``validate/hermes/<arm>/``), paired by
  task: the report's ``agent_played`` holds each arm's success, the paired gain and the harm test, which stops a
  candidate significantly worse for the real agent (the one-sided upper bound of its gain below 0). The family's
  non-inferiority stays the built-in loop's: ~100 tasks played once cannot show a drop is under 5 points.

Writes ``<round_dir>/validate/regression.json`` {passed, baseline, candidate (per-item scores), per_family
and overall (pass rates, lost/gained pairs, drop_ucb, stop_if_drop, pass_if_equal), reasons, warnings,
sampling} and, in the active MLflow run, ``validate/regression_*`` metrics plus the tag
``regression_gate`` = passed | stopped.

    hermes-lab validate --base embedded:tiny --candidate-adapter runs/round-01/train/adapter \\
        --output runs/round-01/validate            # exit 0: passed, 4: stopped
    python -m hermes_lab.evaluate.validate ...               # the same

Also ``verdict.json`` (the gate in the round runner's format, ``hermes_lab.round.stages``). The notebook raises
``RegressionGateStop`` when the gate stops a candidate, so papermill stops; the verdict tells the round
runner it was the gate.
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from hermes_lab.core.inputs import VALIDATE
from hermes_lab.core.jsonl import safe_name, write_json_atomic
from hermes_lab.core.layout import RoundLayout, ValidateLayout
from hermes_lab.core.verdict import STOP_REGRESSION, gate, write_verdict
from hermes_lab.policy.arms import ADAPTER_KINDS, ArmError, resolve_adapter, resolve_baseline
from hermes_lab.tasks import suite as T

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

EXIT_STOPPED = 4


class RegressionGateStop(RuntimeError):
    """The candidate regressed beyond the tolerance: stop before any A/B traffic."""

    def __init__(self, report: dict[str, Any], path: str | Path | None = None):
        self.report, self.path = report, path
        where = f" (details: {path})" if path else ""
        super().__init__("regression gate stopped the candidate: " + "; ".join(report.get("reasons") or ["?"]) + where)


# ------------------------------------------------------------------------------------------- inputs
def _prompt_text(value: Any) -> str | None:
    """A dataset prompt as text: a plain string, or the last user turn of a chat-format prompt."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        for msg in reversed(value):
            if isinstance(msg, dict) and msg.get("role", "user") == "user" and isinstance(msg.get("content"), str):
                return msg["content"]
    return None


def load_heldout_tasks(path: str | Path) -> tuple[list[T.Task], int]:
    """Distinct embedded tasks behind a held-out dataset's prompts, and how many prompts were not ours."""
    from datasets import DatasetDict, load_from_disk

    p = Path(path)
    try:
        ds = load_from_disk(str(p))
    except Exception as e:
        raise ValueError(f"{p}: not a datasets directory ({type(e).__name__}: {e})") from None
    if isinstance(ds, DatasetDict):
        ds = ds["test"] if "test" in ds else ds[next(iter(ds))]
    if "prompt" not in ds.column_names:
        raise ValueError(f"{p}: no 'prompt' column (columns: {', '.join(ds.column_names)})")
    seen: dict[str, T.Task] = {}
    unknown = 0
    for value in ds["prompt"]:
        text = _prompt_text(value)
        task = T.parse_prompt(text) if text is not None else None
        if task is None:
            unknown += 1
        else:
            seen.setdefault(task.prompt, task)  # several trajectories share a task: evaluate it once
    return list(seen.values()), unknown


def regression_tasks(
    cfg: Any, round_dir: str | Path | None = None, heldout_dir: str | Path | None = None
) -> tuple[list[T.Task], dict[str, Any]]:
    """The regression set and a note on where it came from (written into regression.json)."""
    per_family = cfg.validate.eval_tasks_per_family
    fams = T.check_families(cfg.execute.families or None)
    if heldout_dir is None and round_dir is not None:
        heldout_dir = RoundLayout(round_dir).prep.heldout_dataset
    tasks: list[T.Task] = []
    note: dict[str, Any] = {"heldout_dataset": None, "from_dataset": 0, "unknown_prompts": 0}
    if heldout_dir is not None and Path(heldout_dir).exists():
        tasks, unknown = load_heldout_tasks(heldout_dir)
        tasks = [t for t in tasks if t.family in fams]
        note.update(heldout_dataset=str(heldout_dir), from_dataset=len(tasks), unknown_prompts=unknown)
    have = {f: sum(t.family == f for t in tasks) for f in fams}
    known = {t.prompt for t in tasks}
    generated = repeated = 0
    for f in fams:
        need = per_family - have[f]
        if need <= 0:
            continue
        # draw extra held-out tasks of this family, skipping prompts already in the set
        for t in T.generate_tasks(per_family * 3, split="heldout", seed=cfg.validate.seed, families=[f]):
            if need <= 0:
                break
            if t.prompt not in known:
                known.add(t.prompt)
                tasks.append(t)
                generated += 1
                need -= 1
        # a small prompt space (tool: ~7 held-out prompts) runs dry: sample its prompts again rather
        # than judge the family on a handful of samples, where one miss is a 15-point "regression"
        fam_tasks = [t for t in tasks if t.family == f]
        for i in range(need if fam_tasks else 0):
            tasks.append(fam_tasks[i % len(fam_tasks)])
            repeated += 1
    note["generated"] = generated
    note["repeated"] = repeated
    note["n_tasks"] = len(tasks)
    note["per_family"] = {f: sum(t.family == f for t in tasks) for f in fams}
    if not tasks:
        raise ValueError("regression set is empty: set validate.eval_tasks_per_family >= 1")
    return tasks, note


def _tango_z(n10: Any, n01: Any, n: Any, drop: Any) -> Any:
    """Tango's (1998) score statistic for H0: P(lost) - P(gained) = drop, on paired binary outcomes
    (n10: pairs the baseline passed and the candidate failed, n01: the reverse). Vectorised."""
    n10, n01, n, drop = (np.asarray(x, np.float64) for x in (n10, n01, n, drop))
    b = -n10 - n01 + (2 * n - n10 + n01) * drop
    c = -n01 * drop * (1 - drop)
    p01 = (-b + np.sqrt(np.maximum(b * b - 8 * n * c, 0))) / (4 * n)  # restricted MLE of P(gained)
    with np.errstate(divide="ignore", invalid="ignore"):
        z = (n10 - n01 - n * drop) / np.sqrt(n * (2 * p01 + drop * (1 - drop)))
    return np.where(np.isfinite(z), z, np.where(n10 - n01 - n * drop < 0, -np.inf, 0.0))


def drop_upper_bound(n10: int, n01: int, n: int, alpha: float) -> float:
    """One-sided (1 - alpha) upper confidence bound of the paired drop in pass rate (Tango's score bound)."""
    from scipy.optimize import brentq
    from scipy.stats import norm

    if n == 0:
        return 1.0
    est, zc = (n10 - n01) / n, norm.ppf(1 - alpha)
    f = lambda d: float(_tango_z(n10, n01, n, d)) + zc  # noqa: E731  decreasing in d
    if est >= 1 or f(1 - 1e-12) >= 0:
        return 1.0
    return float(brentq(f, est, 1 - 1e-12, xtol=1e-10))


def gate_power(
    n: int,
    discordance: float,
    tolerance: float,
    alpha: float,
    drop: float,
    churn: float | None = None,
    sims: int = 4000,
) -> dict:
    """Operating characteristics of the paired non-inferiority test at n pairs, by simulation (fixed seed):
    the chance it stops a candidate with a true ``drop`` (at ``discordance`` discordant pairs, at least
    ``drop``), and the chance an equally good candidate passes (at ``churn`` discordant pairs, split evenly;
    default: ``discordance``)."""
    from scipy.stats import norm

    rng = np.random.default_rng(0)
    zc = norm.ppf(1 - alpha)

    def pass_rate(p10: float, p01: float) -> float:
        cnt = rng.multinomial(n, [p10, p01, max(1 - p10 - p01, 0.0)], sims)
        return float(np.mean(_tango_z(cnt[:, 0], cnt[:, 1], n, tolerance) < -zc))

    psi = min(max(discordance, drop), 1.0)
    churn = discordance if churn is None else churn
    return {
        "stop_if_drop": 1 - pass_rate((psi + drop) / 2, (psi - drop) / 2),
        "pass_if_equal": pass_rate(churn / 2, churn / 2),
        "discordance": discordance,
        "drop": drop,
    }


def _row(fam: str, idx: np.ndarray, base: dict, cand: dict, v: Any, threshold: float) -> dict[str, Any]:
    b = np.asarray(base["scores"], np.float64)[idx]
    c = np.asarray(cand["scores"], np.float64)[idx]
    bp, cp = b >= threshold, c >= threshold
    n, n10, n01 = len(idx), int((bp & ~cp).sum()), int((~bp & cp).sum())
    ucb = drop_upper_bound(n10, n01, n, v.alpha)
    # nuisance: the share of discordant pairs. A true drop needs at least power_drop of them; an equally good
    # candidate is given this one's symmetric churn (2 min(lost, gained)), not the disagreement its gains cause
    power = gate_power(
        n, (n10 + n01) / n if n else 0.0, v.tolerance, v.alpha, v.power_drop, 2 * min(n10, n01) / max(n, 1)
    )
    return {
        "baseline_pass_rate": round(float(bp.mean()), 6) if n else None,
        "candidate_pass_rate": round(float(cp.mean()), 6) if n else None,
        "delta": round(float(cp.mean() - bp.mean()), 6) if n else None,
        "baseline_mean_reward": round(float(b.mean()), 6) if n else None,
        "candidate_mean_reward": round(float(c.mean()), 6) if n else None,
        "mean_reward_delta": round(float(c.mean() - b.mean()), 6) if n else None,
        "n_pairs": n,
        "lost": n10,  # pairs (task, sample) the baseline passed and the candidate failed
        "gained": n01,
        "drop_ucb": round(ucb, 6),
        "passed": bool(ucb < v.tolerance),
        "regressed": not ucb < v.tolerance,
        "stop_if_drop": round(power["stop_if_drop"], 4),  # P(stop | a true validate.power_drop drop)
        "pass_if_equal": round(power["pass_if_equal"], 4),
        "family": fam,
    }


def compare(baseline: dict[str, Any], candidate: dict[str, Any], cfg: Any) -> dict[str, Any]:
    """The gate from two ``evaluate_arm`` results (per-item ``scores`` on the same task/sample order).

    Paired non-inferiority per family and overall: the candidate passes a family only if the one-sided
    (1 - validate.alpha) upper bound of its drop in pass rate, paired on (task, sample seed), lies below
    validate.tolerance. The gate passes only if every family and the overall set pass, so a regressed
    family gets through with probability <= alpha (an intersection-union test: no multiplicity correction).
    Warns when the set is too small for validate.min_power (stopping a ``power_drop`` drop, or passing an
    equally good candidate)."""
    v, thr = cfg.validate, float(cfg.reward.success_threshold)
    if list(baseline.get("task_ids", [])) != list(candidate.get("task_ids", [])) or len(baseline["scores"]) != len(
        candidate["scores"]
    ):
        return {
            "passed": False,
            "overall": {},
            "per_family": {},
            "reasons": ["the arms did not see the same tasks in the same order: no paired comparison possible"],
            "warnings": [],
        }
    fams = np.asarray(baseline["families"])
    per_family = {f: _row(f, np.flatnonzero(fams == f), baseline, candidate, v, thr) for f in sorted(set(fams))}
    overall = _row("overall", np.arange(len(fams)), baseline, candidate, v, thr)
    reasons, warns = [], []
    for what, row in [*((f"family '{f}'", r) for f, r in per_family.items()), ("overall", overall)]:
        if row["regressed"]:
            reasons.append(
                f"{what}: the {1 - v.alpha:.0%} upper bound of the drop in pass rate, {row['drop_ucb']:.3f}, is not "
                f"below the tolerance {v.tolerance:g} (pass rate {row['baseline_pass_rate']:.3f} -> "
                f"{row['candidate_pass_rate']:.3f}; {row['n_pairs']} pairs, {row['lost']} lost, {row['gained']} gained)"
            )
        if row["stop_if_drop"] < v.min_power or row["pass_if_equal"] < v.min_power:
            churn = 2 * min(row["lost"], row["gained"]) / max(row["n_pairs"], 1)
            warns.append(
                f"{what}: {row['n_pairs']} pairs are too few for {v.min_power:.0%} power: a true "
                f"{v.power_drop:.0%} drop is stopped {row['stop_if_drop']:.0%} of the time and an equally good "
                f"candidate (with this one's {churn:.0%} churn) passes {row['pass_if_equal']:.0%}; raise "
                "validate.eval_tasks_per_family or validate.samples_per_task"
            )
    return {"passed": not reasons, "overall": overall, "per_family": per_family, "reasons": reasons, "warnings": warns}


# ------------------------------------------------------------------------------------------- evaluation
EVAL_BATCH = 64  # one batch layout for both arms: the k-th (task, sample) gets the same torch seed in each


def agent_tasks(cfg: Any) -> list[Any]:
    """The agent family's held-out tasks for the gate, played as whole episodes in process (the built-in loop, on
    the same tools): none unless the round trains an embedded agent family."""
    from hermes_lab.policy.episodes import family_of_environment

    fam = family_of_environment(cfg.grpo.environment)
    if fam is None:
        return []
    return fam.generate_tasks(cfg.validate.eval_tasks_per_family, split="heldout", seed=cfg.validate.seed)


def arm_rates(items: list[Any], scores: list[float], thr: float) -> dict[str, Any]:
    """Pass rates and mean rewards of an arm's scored items, overall and per family, with the per-item lists the
    gate pairs (scores, task_ids, families)."""

    def stats(vs: list[float]) -> dict[str, Any]:
        return {
            "pass_rate": round(sum(x >= thr for x in vs) / len(vs), 4),
            "mean_reward": round(sum(vs) / len(vs), 4),
            "n": len(vs),
        }

    fams = sorted({t.family for t in items})
    return {
        **stats(scores),
        "per_family": {f: stats([x for x, t in zip(scores, items) if t.family == f]) for f in fams},
        "scores": scores,
        "task_ids": [t.task_id for t in items],
        "families": [t.family for t in items],
    }


def evaluate_arm(
    base_model: str, adapter: str | None, tasks: list[T.Task], cfg: Any, agent: list[Any] | None = None
) -> dict[str, Any]:
    """One arm's per-item scores on the regression set, with the gate's sampling settings, and their pass
    rates overall and per family. Both arms get the same prompts in the same order, the same seed and the
    same batch layout, so each (task, sample) pair is sampled with the same random numbers in both: the
    pairs the gate compares. ``agent`` tasks are played as whole episodes (``policy.episodes``), each
    ``validate.samples_per_task`` times, also with the same seeds and tool results in both arms. The model is
    freed afterwards so the two arms never sit in memory together."""
    from hermes_lab.policy import episodes as E
    from hermes_lab.policy import formats
    from hermes_lab.policy import model as P

    if adapter and not Path(adapter, "adapter_config.json").is_file():
        raise FileNotFoundError(f"adapter not found: {adapter} (no adapter_config.json)")
    pol = P.load_policy(
        base_model,
        adapter=adapter,
        runs_dir=cfg.round.runs_dir,
        seed=cfg.model.seed,
        dtype=cfg.model.dtype,
        trust_remote_code=cfg.model.trust_remote_code,
    )
    formats.prepare(pol.tokenizer, cfg.model.tool_parser)  # the policy's reader, as every stage reads it
    v, thr = cfg.validate, cfg.reward.success_threshold
    items = [t for t in tasks for _ in range(v.samples_per_task)]
    responses = pol.generate(
        [t.prompt for t in items],
        temperature=v.temperature,
        max_new_tokens=cfg.execute.max_new_tokens,
        seed=v.seed,
        batch_size=EVAL_BATCH,
    )
    plays = [t for t in agent or [] for _ in range(v.samples_per_task)]
    episodes = E.run_episodes(pol, plays, temperature=v.temperature, seed=v.seed, max_turns=cfg.grpo.max_turns)
    del pol
    gc.collect()
    scores = T.score_tasks(items, responses)  # the code family's hidden tests run in the sandbox, in parallel
    scores += [e.reward for e in episodes]
    items = [*items, *plays]
    return {
        **arm_rates(items, scores, thr),
        "temperature": v.temperature,
        "samples_per_task": v.samples_per_task,
        "model": str(base_model),
        "adapter": adapter,
        "items": items,  # for played_by_hermes; regression_gate drops it before the report is written
    }


def regression_gate(
    cfg: Any,
    base_model: str,
    candidate_adapter: str,
    baseline_adapter: str | None = None,
    tasks: list[T.Task] | None = None,
    task_note: dict[str, Any] | None = None,
    output_dir: str | Path | None = None,
    round_dir: str | Path | None = None,
) -> dict[str, Any]:
    """Evaluate both arms, decide, write ``output_dir/regression.json`` and log to the active MLflow run.
    Never raises on a stop: call ``raise_if_stopped(report)`` for that. A set too small for
    validate.min_power is warned about (``warnings`` in the report, and a Python warning)."""
    import warnings

    if tasks is None:
        tasks, task_note = regression_tasks(cfg, round_dir)
    from hermes_lab.evaluate.played import played_by_hermes, played_tasks, real_agent_harm

    v = cfg.validate
    agent, played = agent_tasks(cfg), played_tasks(cfg)
    if agent and task_note is not None:
        task_note = {**task_note, "agent_episodes": len(agent) * v.samples_per_task}
        task_note["agent_runner"] = "hermes" if played else "builtin"
        if played:
            task_note["agent_played"] = len(played)
    candidate = evaluate_arm(base_model, candidate_adapter, tasks, cfg, agent)
    baseline = evaluate_arm(base_model, baseline_adapter, tasks, cfg, agent)
    for arm in (candidate, baseline):
        arm.pop("items", None)
    report = compare(baseline, candidate, cfg)
    if played:  # each arm served in turn, the same tasks played against each by the real agent: pairs by task
        import tempfile

        val = ValidateLayout(output_dir or (RoundLayout(round_dir).validate.root if round_dir else tempfile.mkdtemp()))
        for arm, adapter in ((candidate, candidate_adapter), (baseline, baseline_adapter)):
            who = "candidate" if arm is candidate else "baseline"
            arm["agent_played"] = played_by_hermes(cfg, base_model, adapter, played, val.hermes(who).root)
        b, c = baseline["agent_played"], candidate["agent_played"]
        gain, harm = real_agent_harm(b, c, v.alpha)
        report["agent_played"] = {"runner": "hermes", "before": b, "after": c, "gain": gain, "harm": harm}
        if harm:
            report["reasons"].append(harm)
            report["passed"] = False
    report = {
        "passed": report.pop("passed"),
        "baseline": baseline,
        "candidate": candidate,
        **report,
        "method": "paired non-inferiority: Tango's score upper bound of the drop per family < tolerance",
        "tolerance": v.tolerance,
        "alpha": v.alpha,
        "power_drop": v.power_drop,
        "min_power": v.min_power,
        "sampling": {
            "temperature": v.temperature,
            "samples_per_task": v.samples_per_task,
            "seed": v.seed,
            "batch_size": EVAL_BATCH,
            "success_threshold": cfg.reward.success_threshold,
            "tasks": task_note or {"n_tasks": len(tasks)},
        },
    }
    for w in report["warnings"]:
        warnings.warn(f"regression gate: {w}", UserWarning, stacklevel=2)
    if output_dir is None and round_dir is not None:
        output_dir = RoundLayout(round_dir).validate.root
    if output_dir is not None:
        report["path"] = str(ValidateLayout(output_dir).regression)
        write_json_atomic(report["path"], report)  # the round runner reads it back
        detail = "; ".join(report["reasons"]) or "no family regressed"
        write_verdict(
            output_dir,
            "validate",
            [gate("regression", report["passed"], detail)],
            None if report["passed"] else STOP_REGRESSION,
        )
    log_report(report)
    return report


def log_report(report: dict[str, Any]) -> None:
    """validate/regression_* metrics + tags of the gate in the active MLflow run (no-op without one)."""
    from hermes_lab.core import tracking

    m: dict[str, float] = {"regression_passed": float(report["passed"]), "regression_warnings": len(report["warnings"])}
    for arm in ("baseline", "candidate"):
        m[f"regression_{arm}_pass_rate"] = float(report[arm]["pass_rate"])
        m[f"regression_{arm}_mean_reward"] = float(report[arm]["mean_reward"])
    for f, row in [*report["per_family"].items(), ("overall", report["overall"])]:
        pre = "regression" if f == "overall" else f"regression_{safe_name(f)}"
        for k in ("delta", "drop_ucb", "stop_if_drop", "pass_if_equal", "candidate_pass_rate", "baseline_pass_rate"):
            if row.get(k) is not None:
                m[f"{pre}_{k}"] = float(row[k])
    tracking.log_metrics("validate", m)
    tracking.set_tags(
        {
            "regression_gate": "passed" if report["passed"] else "stopped",
            "regression_reasons": ("; ".join(report["reasons"]) or "none")[:5000],
            "regression_warnings": ("; ".join(report["warnings"]) or "none")[:5000],
        }
    )
    if report.get("path"):
        tracking.log_artifact(report["path"])


def raise_if_stopped(report: dict[str, Any]) -> None:
    if not report["passed"]:
        raise RegressionGateStop(report, report.get("path"))


def report_table(report: dict[str, Any]) -> pd.DataFrame:
    """Per family (and overall): pass rates, the paired counts, the drop's upper bound, the test's power,
    verdict -- the notebook's table."""
    import pandas as pd

    rows = {**report["per_family"], "overall": report["overall"]}
    cols = [
        "baseline_pass_rate",
        "candidate_pass_rate",
        "delta",
        "n_pairs",
        "lost",
        "gained",
        "drop_ucb",
        "stop_if_drop",
        "pass_if_equal",
        "passed",
    ]
    df = pd.DataFrame.from_dict(rows, orient="index")[cols]
    df.index.name = "family"
    return df


# ------------------------------------------------------------------------------------------- CLI
def add_arguments(p: argparse.ArgumentParser) -> None:
    VALIDATE.add_arguments(p)  # hermes_lab.core.inputs: the notebook's parameters and these, declared once


def run_cli(args: argparse.Namespace) -> int:
    import contextlib

    from hermes_lab.config.schema import load_config
    from hermes_lab.core import tracking

    cfg = load_config(args.params)
    # typed in a shell: relative to the cwd; a train output dir means its adapter/
    candidate = resolve_adapter(args.candidate_adapter, "--candidate-adapter", cfg)
    if candidate is None:
        raise ArmError("--candidate-adapter", args.candidate_adapter, "no champion promoted yet", ADAPTER_KINDS)
    explicit = resolve_adapter(args.baseline_adapter, "--baseline-adapter", cfg)
    tasks, note = regression_tasks(cfg, heldout_dir=args.heldout)
    baseline = explicit or resolve_baseline(cfg)[1]
    ctx = (
        contextlib.nullcontext()
        if args.no_mlflow
        else tracking.stage_run("validate", args.parent_run_id or None, cfg.round.runs_dir, cfg.round.experiment)
    )
    with ctx:
        report = regression_gate(
            cfg, args.base, candidate, baseline, tasks=tasks, task_note=note, output_dir=args.output
        )
    print(report_table(report).to_string(float_format=lambda x: f"{x:.3f}"))
    for w in report["warnings"]:
        print(f"warning: {w}", file=sys.stderr)
    if report["passed"]:
        print(f"regression gate: passed ({report['path']})")
        return 0
    print("regression gate: STOPPED -- " + "; ".join(report["reasons"]), file=sys.stderr)
    return EXIT_STOPPED


def main(argv: list[str] | None = None) -> int:
    from hermes_lab.core.command import run_module

    return run_module("hermes_lab.evaluate.validate", add_arguments, run_cli, argv, description=__doc__.split("\n")[0])


if __name__ == "__main__":
    sys.exit(main())
