"""Validate stage, part 2: the regression (safety) gate, run before any A/B traffic.

The candidate (base + this round's LoRA adapter) and the baseline (base + the champion adapter, or the
bare base when there is no champion) are evaluated on the same held-out regression set with the same
sampling settings (temperature, seed, samples per task), overall and per task family. A candidate whose
pass rate drops by more than ``validate.tolerance`` below the baseline's -- on any family, or overall --
is stopped here: it never reaches the A/B router.

Reads:
- ``<round_dir>/prep/heldout_dataset`` (HF datasets dir, "prompt" column) when prep wrote it: its
  prompts are embedded tasks, scored by the task verifiers. Families with fewer than
  ``validate.eval_tasks_per_family`` prompts are topped up with generated held-out tasks (held out by
  prompt hash, so never in training data): a family of 5 prompts would turn one unlucky sample into a
  20-point "regression". Without prep's set, every task is generated.
- the candidate adapter (``<round_dir>/train/adapter``, base from ``train/run.json``) and the baseline
  adapter (explicit, else the champion in ``runs/state.json``, else ``model.adapter``, else none).

Writes ``<round_dir>/validate/regression.json`` {passed, baseline, candidate, per_family (deltas and a
one-sided two-proportion test), overall, reasons, sampling} and, in the active MLflow run, the same
numbers as ``validate/regression_*`` metrics plus the tag ``regression_gate`` = passed | stopped.

    hermes-lab validate --base embedded:tiny --candidate-adapter runs/round-01/train/adapter \\
        --output runs/round-01/validate            # exit 0: passed, 4: stopped
    python -m hermes_lab.validate ...               # the same

Also ``verdict.json`` (the gate in the round runner's format, ``hermes_lab.stages``). The notebook raises
``RegressionGateStop`` when the gate stops a candidate, so papermill stops; the verdict tells the round
runner it was the gate.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hermes_lab import tasks as T
from hermes_lab.stages import STOP_REGRESSION, gate, write_verdict

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
        heldout_dir = Path(round_dir) / "prep" / "heldout_dataset"
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


def candidate_from_train_dir(train_dir: str | Path, cfg: Any) -> tuple[str, str]:
    """(base model, adapter dir) of a training output: run.json's, else model.base_model and train/adapter."""
    td = Path(train_dir)
    info: dict[str, Any] = {}
    rj = td / "run.json"
    if rj.is_file():
        try:
            info = json.loads(rj.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ValueError(f"{rj}: not valid JSON ({e.msg})") from None
    base = info.get("base_model") or cfg.model.base_model
    adapter = info.get("adapter") or str(td / "adapter")
    if not Path(adapter, "adapter_config.json").is_file():
        raise FileNotFoundError(f"candidate adapter not found: {adapter} (no adapter_config.json; did train run?)")
    return str(base), str(adapter)


def resolve_baseline_adapter(cfg: Any, explicit: str | None = None) -> str | None:
    """The baseline the candidate must not fall below: an explicit adapter, else the live champion
    (runs/state.json), else model.adapter, else None (the bare base policy)."""
    from hermes_lab.state import FlywheelState, state_path

    if explicit:
        return explicit
    champ = FlywheelState.load(state_path(cfg.round.runs_dir)).champion_adapter
    return champ or cfg.model.adapter or None


# ------------------------------------------------------------------------------------------- the comparison
def two_proportion_test(x_base: int, n_base: int, x_cand: int, n_cand: int) -> tuple[float, float]:
    """Pooled two-proportion z-test; returns (z, one-sided p for 'candidate below baseline')."""
    from scipy.stats import norm

    if n_base == 0 or n_cand == 0:
        return math.nan, math.nan
    pooled = (x_base + x_cand) / (n_base + n_cand)
    se = math.sqrt(pooled * (1 - pooled) * (1 / n_base + 1 / n_cand))
    if se == 0:  # both arms all-pass or all-fail: no evidence of a difference
        return 0.0, 1.0
    z = (x_cand / n_cand - x_base / n_base) / se
    return z, float(norm.cdf(z))


def _row(
    base: dict[str, Any], cand: dict[str, Any], tolerance: float, alpha: float, require_significance: bool
) -> dict[str, Any]:
    nb, nc = int(base.get("n", 0)), int(cand.get("n", 0))
    pb, pc = float(base.get("pass_rate", 0.0)), float(cand.get("pass_rate", 0.0))
    z, p = two_proportion_test(round(pb * nb), nb, round(pc * nc), nc)
    beyond = pc < pb - tolerance - 1e-12  # the gate: a drop of more than `tolerance` (equal is allowed)
    significant = bool(p < alpha) if not math.isnan(p) else False
    return {
        "baseline_pass_rate": pb,
        "candidate_pass_rate": pc,
        "delta": round(pc - pb, 6),
        "baseline_mean_reward": base.get("mean_reward"),
        "candidate_mean_reward": cand.get("mean_reward"),
        "mean_reward_delta": None
        if base.get("mean_reward") is None or cand.get("mean_reward") is None
        else round(float(cand["mean_reward"]) - float(base["mean_reward"]), 6),
        "baseline_n": nb,
        "candidate_n": nc,
        "z": None if math.isnan(z) else round(z, 4),
        "p_value": None if math.isnan(p) else round(p, 6),
        "beyond_tolerance": beyond,
        "significant_drop": significant and pc < pb,
        "regressed": beyond and (significant or not require_significance),
    }


def compare(
    baseline: dict[str, Any],
    candidate: dict[str, Any],
    tolerance: float = 0.05,
    alpha: float = 0.05,
    require_significance: bool = False,
) -> dict[str, Any]:
    """Gate decision from two ``policy.evaluate`` results. Stopped when any family (or the overall pass
    rate) has candidate < baseline - tolerance (and, with require_significance, p < alpha)."""
    overall = _row(baseline, candidate, tolerance, alpha, require_significance)
    per_family: dict[str, Any] = {}
    reasons: list[str] = []
    fams = sorted(set(baseline.get("per_family", {})) | set(candidate.get("per_family", {})))
    for f in fams:
        b, c = baseline.get("per_family", {}).get(f), candidate.get("per_family", {}).get(f)
        if not b or not c:
            reasons.append(f"family '{f}' evaluated in only one arm: the arms did not see the same tasks")
            continue
        row = per_family[f] = _row(b, c, tolerance, alpha, require_significance)
        if row["regressed"]:
            reasons.append(_reason(f"family '{f}'", row, tolerance))
    if overall["regressed"]:
        reasons.append(_reason("overall", overall, tolerance))
    return {
        "passed": not reasons,
        "tolerance": tolerance,
        "alpha": alpha,
        "require_significance": require_significance,
        "overall": overall,
        "per_family": per_family,
        "reasons": reasons,
    }


def _reason(what: str, row: dict[str, Any], tolerance: float) -> str:
    p = "n/a" if row["p_value"] is None else f"{row['p_value']:.3g}"
    return (
        f"{what}: candidate pass rate {row['candidate_pass_rate']:.3f} < baseline "
        f"{row['baseline_pass_rate']:.3f} - tolerance {tolerance:g} (delta {row['delta']:+.3f}, "
        f"n={row['candidate_n']}, one-sided p={p})"
    )


# ------------------------------------------------------------------------------------------- evaluation
def evaluate_arm(base_model: str, adapter: str | None, tasks: list[T.Task], cfg: Any) -> dict[str, Any]:
    """One arm's pass rate with the gate's sampling settings; the model is freed afterwards so the two
    arms never sit in memory together."""
    from hermes_lab import policy as P

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
    v = cfg.validate
    res = P.evaluate(
        pol,
        tasks,
        temperature=v.temperature,
        samples_per_task=v.samples_per_task,
        seed=v.seed,
        threshold=cfg.reward.success_threshold,
    )
    del pol
    gc.collect()
    res.update(model=str(base_model), adapter=adapter)
    return res


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
    Never raises on a stop: call ``raise_if_stopped(report)`` for that."""
    if tasks is None:
        tasks, task_note = regression_tasks(cfg, round_dir)
    v = cfg.validate
    candidate = evaluate_arm(base_model, candidate_adapter, tasks, cfg)
    baseline = evaluate_arm(base_model, baseline_adapter, tasks, cfg)
    report = compare(baseline, candidate, v.tolerance, v.alpha, v.require_significance)
    report = {
        "passed": report.pop("passed"),
        "baseline": baseline,
        "candidate": candidate,
        **report,
        "sampling": {
            "temperature": v.temperature,
            "samples_per_task": v.samples_per_task,
            "seed": v.seed,
            "success_threshold": cfg.reward.success_threshold,
            "tasks": task_note or {"n_tasks": len(tasks)},
        },
    }
    if output_dir is None and round_dir is not None:
        output_dir = Path(round_dir) / "validate"
    if output_dir is not None:
        out = Path(output_dir)
        out.mkdir(parents=True, exist_ok=True)
        report["path"] = str(out / "regression.json")
        (out / "regression.json").write_text(json.dumps(report, indent=2), encoding="utf-8")
        detail = "; ".join(report["reasons"]) or "no family regressed"
        write_verdict(
            out,
            "validate",
            [gate("regression", report["passed"], detail)],
            None if report["passed"] else STOP_REGRESSION,
        )
    log_report(report)
    return report


def log_report(report: dict[str, Any]) -> None:
    """validate/regression_* metrics + tags of the gate in the active MLflow run (no-op without one)."""
    from hermes_lab import tracking

    m: dict[str, float] = {"regression_passed": float(report["passed"])}
    for arm in ("baseline", "candidate"):
        m[f"regression_{arm}_pass_rate"] = float(report[arm]["pass_rate"])
        m[f"regression_{arm}_mean_reward"] = float(report[arm]["mean_reward"])
    m["regression_delta"] = float(report["overall"]["delta"])
    for f, row in report["per_family"].items():
        m[f"regression_{f}_delta"] = float(row["delta"])
        m[f"regression_{f}_candidate_pass_rate"] = row["candidate_pass_rate"]
        m[f"regression_{f}_baseline_pass_rate"] = row["baseline_pass_rate"]
    tracking.log_metrics("validate", m)
    tracking.set_tags(
        {
            "regression_gate": "passed" if report["passed"] else "stopped",
            "regression_reasons": ("; ".join(report["reasons"]) or "none")[:5000],
        }
    )
    if report.get("path"):
        tracking.log_artifact(report["path"])


def raise_if_stopped(report: dict[str, Any]) -> None:
    if not report["passed"]:
        raise RegressionGateStop(report, report.get("path"))


def report_table(report: dict[str, Any]) -> pd.DataFrame:
    """Per family (and overall): baseline, candidate, delta, p, verdict -- the notebook's table."""
    import pandas as pd

    rows = {**report["per_family"], "overall": report["overall"]}
    cols = [
        "baseline_pass_rate",
        "candidate_pass_rate",
        "delta",
        "baseline_mean_reward",
        "candidate_mean_reward",
        "candidate_n",
        "p_value",
        "beyond_tolerance",
        "regressed",
    ]
    df = pd.DataFrame.from_dict(rows, orient="index")[cols]
    df.index.name = "family"
    return df


# ------------------------------------------------------------------------------------------- CLI
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base", required=True, help="Base model: hub id, local path or embedded:tiny.")
    p.add_argument("--candidate-adapter", required=True, help="LoRA adapter dir of the candidate.")
    p.add_argument(
        "--baseline-adapter",
        default=None,
        help="LoRA adapter dir of the baseline (default: the champion in runs/state.json, else "
        "model.adapter, else the bare base).",
    )
    p.add_argument("--params", default=None, help="YAML config (validate section: tolerance, sampling).")
    p.add_argument("--heldout", default=None, help="Held-out datasets dir (default: generated held-out tasks).")
    p.add_argument("--output", required=True, help="Where regression.json goes.")
    p.add_argument("--parent-run-id", default="", help="MLflow run to nest the validate run under.")
    p.add_argument("--no-mlflow", action="store_true", help="Do not log to MLflow.")


def run_cli(args: argparse.Namespace) -> int:
    import contextlib

    from hermes_lab import tracking
    from hermes_lab.config import load_config

    cfg = load_config(args.params)
    tasks, note = regression_tasks(cfg, heldout_dir=args.heldout)
    baseline = resolve_baseline_adapter(cfg, args.baseline_adapter)
    ctx = (
        contextlib.nullcontext()
        if args.no_mlflow
        else tracking.stage_run("validate", args.parent_run_id or None, cfg.round.runs_dir, cfg.round.experiment)
    )
    with ctx:
        report = regression_gate(
            cfg, args.base, args.candidate_adapter, baseline, tasks=tasks, task_note=note, output_dir=args.output
        )
    print(report_table(report).to_string(float_format=lambda x: f"{x:.3f}"))
    if report["passed"]:
        print(f"regression gate: passed ({report['path']})")
        return 0
    print("regression gate: STOPPED -- " + "; ".join(report["reasons"]), file=sys.stderr)
    return EXIT_STOPPED


def main(argv: list[str] | None = None) -> int:
    from hermes_lab.cli import run_module

    return run_module("hermes_lab.validate", add_arguments, run_cli, argv, description=__doc__.split("\n")[0])


if __name__ == "__main__":
    sys.exit(main())
