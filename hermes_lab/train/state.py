"""What a training run leaves to be resumed and judged: checkpoints, ``--resume``, health.json (train.grpo).

Reads and writes under ``<output>/trl/`` (``runs/round-NN/train/trl/``): TRL's ``checkpoint-N/`` folders
(LoRA adapter, optimizer, scheduler and RNG state, ``trainer_state.json``; saved every
``hermes_lab.config.trl.save_steps(cfg)`` steps, at most ``grpo.save_total_limit`` kept) and ``hermes_resume.json``:
the settings, base, start adapter and prompt-set digest the checkpoints were trained with, and the MLflow run
they log to. ``--resume`` continues from the newest complete checkpoint only when those still match (a
checkpoint cut short by a kill is skipped), trims ``train_log.jsonl`` to the checkpoint's step and keeps
logging to the same MLflow run, so the curves continue. ``health_report`` is the content of
``<output>/health.json``: guard warnings, flagged prompts, steps, the checkpoint resumed from, and the API
judge's requests and failures (``hermes_lab.rewards.registry.JudgeFaults``), also when training stopped.

    hermes-lab train --config params/embedded.yaml --data runs/round-01/prep --output runs/round-01/train --resume
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

from hermes_lab.config.schema import HermesConfig
from hermes_lab.core.layout import TRL_RESUME, TrainLayout

log = logging.getLogger("hermes_lab.train")

RESUME_FILE = TRL_RESUME  # in <output>/trl/: what the checkpoints there were trained with
# keys that may change between a run and its --resume (how long, how often, how the judge is reached)
RESUME_MAY_CHANGE = {"grpo.max_steps", "grpo.save_steps", "grpo.save_total_limit", "grpo.logging_steps"}


def last_checkpoint(trl_dir: Path) -> Path | None:
    """The newest complete checkpoint under ``trl_dir``: the highest checkpoint-N whose trainer_state.json
    (written last by transformers) reads back; a checkpoint cut short by a kill is skipped."""
    if not trl_dir.is_dir():
        return None
    found = []
    for d in trl_dir.glob("checkpoint-*"):
        suffix = d.name.rsplit("-", 1)[-1]
        if d.is_dir() and suffix.isdigit():
            found.append((int(suffix), d))
    for _, d in sorted(found, reverse=True):
        try:
            json.loads((d / "trainer_state.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        return d
    return None


def resume_marker(cfg: HermesConfig, base: str, start_adapter: str | None, ds: Any) -> dict[str, Any]:
    import hashlib

    settings = {
        k: v
        for k, v in cfg.flat_params().items()
        if k.split(".")[0] in ("model", "lora", "grpo", "reward")
        and k not in RESUME_MAY_CHANGE
        and not k.startswith("reward.judge_")
        and k != "reward.max_judge_failure_rate"
    }
    digest = hashlib.sha256("\x00".join(map(str, ds["prompt"])).encode("utf-8", "surrogatepass")).hexdigest()
    return {
        "settings": {k: str(v) for k, v in settings.items()},
        "base": base,
        "start_adapter": start_adapter,
        "prompts": len(ds),
        "prompts_sha256": digest[:16],
    }


def check_resume(trl_dir: Path, marker: dict[str, Any]) -> dict[str, Any]:
    """The saved marker of the checkpoints in ``trl_dir``; ValueError naming what changed since they were made."""
    p = trl_dir / RESUME_FILE
    try:
        saved = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        raise ValueError(
            f"--resume: {trl_dir} holds checkpoints but no readable {RESUME_FILE}: they were not made by "
            f"hermes-lab train; remove {trl_dir} or run without --resume"
        ) from None
    changed = sorted(
        k
        for k in set(marker["settings"]) | set(saved.get("settings", {}))
        if marker["settings"].get(k) != saved.get("settings", {}).get(k)
    )
    changed += [k for k in ("base", "start_adapter", "prompts", "prompts_sha256") if marker[k] != saved.get(k)]
    if changed:
        raise ValueError(
            f"--resume: the checkpoints in {trl_dir} were trained with other settings or data "
            f"(changed: {', '.join(changed[:8])}{' ...' if len(changed) > 8 else ''}); remove {trl_dir} "
            "to start over, or resume with the settings they were made with"
        )
    return saved


def prepare_output(
    trl_dir: Path, log_path: Path, marker: dict[str, Any], resume: bool, is_main: bool, max_steps: int
) -> tuple[Path | None, dict[str, Any]]:
    """(checkpoint to resume from or None, its saved marker). A fresh run removes an earlier run's checkpoints
    and train_log.jsonl; a resumed one keeps the log up to the checkpoint's step."""
    ckpt = last_checkpoint(trl_dir) if resume else None
    saved = check_resume(trl_dir, marker) if ckpt is not None else {}
    if not is_main:
        return ckpt, saved
    if ckpt is None:
        log_path.unlink(missing_ok=True)
        stale = sorted(trl_dir.glob("checkpoint-*"))
        for old in stale:  # an earlier run's checkpoints: not ours to continue
            shutil.rmtree(old, ignore_errors=True)
        if resume:
            # a round always asks to resume: a first try with nothing saved is no problem worth a warning
            say = log.warning if stale else log.info
            say("--resume: no complete checkpoint in %s; training starts at step 0", trl_dir)
    else:
        step = int(ckpt.name.rsplit("-", 1)[1])
        keep_log_until(log_path, step)
        log.info("resuming from %s (step %d of %d)", ckpt, step, max_steps)
    return ckpt, saved


def keep_log_until(log_path: Path, step: int) -> None:
    """train_log.jsonl without the rows after ``step``: the resumed run logs those steps again."""
    from hermes_lab.core.jsonl import write_text_atomic

    if not log_path.exists():
        return
    kept = []
    for line in log_path.read_text(encoding="utf-8").splitlines():
        try:
            if int(json.loads(line).get("step", 0)) <= step:
                kept.append(line + "\n")
        except (ValueError, TypeError, AttributeError):
            continue  # a torn last line from the kill
    write_text_atomic(log_path, "".join(kept))


def mlflow_run(run_id: str | None, parent_run_id: str | None, runs_dir: str, cfg: HermesConfig) -> Any:
    """The train stage's MLflow run: the interrupted run again when resuming (its curve continues), else a new one."""
    from hermes_lab.core import tracking

    if run_id:
        import mlflow

        tracking.setup(runs_dir, cfg.round.experiment)
        try:
            mlflow.MlflowClient().get_run(run_id)
        except Exception:  # another store, or the run was deleted: start a new one
            log.warning("--resume: MLflow run %s not found; logging to a new run", run_id)
        else:
            return mlflow.start_run(run_id=run_id)
    return tracking.stage_run("train", parent_run_id, runs_dir, cfg.round.experiment)


def health_report(
    status: str,
    warnings: list[str],
    flagged: list[dict[str, Any]],
    steps: int,
    resumed_from: int | None,
    judge: Any,
    sandbox: Any = None,
) -> dict[str, Any]:
    """health.json: ``status`` completed or stopped; the judge's counts (None without an API judge); the tests
    reward's completions by kind, runs and isolation (``sandbox``, None without a tests reward)."""
    j = judge.to_dict() if judge is not None else None
    h: dict[str, Any] = {
        "status": status,
        "warnings": warnings,
        "flagged_prompts": flagged,
        "steps": steps,
        "resumed_from_step": resumed_from,
        "judge_requests": j["judge_requests"] if j else 0,
        "judge_failures": j["judge_failures"] if j else 0,
        "judge_failure_rate": j["judge_failure_rate"] if j else 0.0,
        "judge": j,
        "sandbox": sandbox.to_dict() if sandbox is not None else None,
    }
    return h


def sandbox_diagnostic(train_dir: str | Path) -> dict[str, Any] | None:
    """The inspect stage's entry for the tests reward (rule ``sandbox``), from health.json; None without one.
    warn: the sandbox failed on some completions, or a layer of the local sandbox is not enforced here
    (``sandbox.require_isolation: false`` on a machine that lacks it: the layers are named)."""
    try:
        health = json.loads(TrainLayout(train_dir).health.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    s = health.get("sandbox") if isinstance(health, dict) else None
    if not isinstance(s, dict):
        return None
    n, errors = int(s.get("completions", 0)), int(s.get("sandbox_errors", 0))
    iso = s.get("isolation") or {}
    gaps = list(iso.get("missing") or []) if iso.get("executor") == "local" else []  # layers not enforced
    kinds = ", ".join(f"{k} {v}" for k, v in (s.get("by_kind") or {}).items())
    msg = f"{n} completions ran against their tests ({kinds or 'none'}); {s.get('executions', 0)} runs"
    advice = ""
    if errors:
        advice = f"{errors} sandbox errors (scored None): check sandbox.executor / sandbox.url (hermes-lab doctor)"
    if gaps:
        advice += ("; " if advice else "") + "NOT enforced by the local sandbox here: " + "; ".join(gaps)
    return {
        "rule": "sandbox",
        "severity": "warn" if errors or gaps else "ok",
        "step": None,
        "value": errors / n if n else 0.0,
        "message": msg,
        "advice": advice,
    }


def judge_diagnostic(train_dir: str | Path, max_rate: float) -> dict[str, Any] | None:
    """The inspect stage's diagnostics entry for the API judge (rule ``judge_failures``), from health.json;
    None when the run used no API judge. warn: some judgements failed; fail: more than ``max_rate``."""
    try:
        health = json.loads(TrainLayout(train_dir).health.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    j = health.get("judge") if isinstance(health, dict) else None
    if not isinstance(j, dict):
        return None
    n, bad = int(j.get("judge_samples", 0)), int(j.get("judge_failures", 0))
    rate = bad / n if n else 0.0
    severity = "ok" if bad == 0 else "fail" if rate > max_rate else "warn"
    msg = (
        f"{bad} of {n} judged samples failed ({rate:.1%}): {j.get('imputed_from_group', 0)} took their group's mean "
        f"judge score, {j.get('system_reward_only', 0)} the system reward alone"
        + (f"; kinds: {j.get('by_kind')}" if bad else "")
    )
    advice = "check the judge (hermes-lab doctor); past reward.max_judge_failure_rate, training stops" if bad else ""
    return {
        "rule": "judge_failures",
        "severity": severity,
        "step": None,
        "value": rate,
        "message": msg,
        "advice": advice,
    }
