"""Stage 20, train: what a GRPO run does with each of TRL's log lines, and its health guards.

Writes ``train_log.jsonl`` (every TRL log line, under ``--output``: ``runs/round-NN/train/``) and the
``train/<TRL name>`` MLflow metrics of the running training, and stops it on a NaN loss
(``TrainingHealthError``); warns once per kind when KL runs off (above ``grpo.kl_warn``, or two logs in a row
far above its recent median: one spike is the estimator's noise) or groups stop differing. Built by
``hermes_lab.train.grpo`` (``hermes-lab train``) for each phase.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

from hermes_lab.config.schema import HermesConfig

log = logging.getLogger("hermes_lab.train")


class TrainingHealthError(RuntimeError):
    """Training was stopped by a health guard (NaN loss)."""


# ------------------------------------------------------------------------------------------ callback
def make_callback(
    cfg: HermesConfig, log_path: Path, samples: Any, is_main: bool, judge: Any = None, sandbox: Any = None
) -> Any:
    """TRL log line -> train_log.jsonl + ``train/<TRL name>`` MLflow metrics + health guards (+ the judge's
    failure counts).

    The JSONL gets every line at once; MLflow gets them in batches (``tracking.MetricBuffer``: a write to
    the SQL store costs more than a tiny-policy step can spare) and at the end, also after a guard stop."""
    from transformers import TrainerCallback

    from hermes_lab.core import tracking

    class HermesCallback(TrainerCallback):
        def __init__(self) -> None:
            self.warnings: list[str] = []
            self.kl_hist: list[float] = []
            self._spike: tuple[int, float] | None = None  # (step, median before it) of a KL spike not yet a trend
            self.zero_hist: list[float] = []
            self._warned: set[str] = set()
            self._file: Any = None  # train_log.jsonl, opened on the first line
            self.metrics = tracking.MetricBuffer("train")

        def _warn(self, key: str, msg: str) -> None:
            if key not in self._warned:  # once per kind, or a long run prints a wall of warnings
                self._warned.add(key)
                self.warnings.append(msg)
                log.warning(msg)

        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            # completions are generated and scored inside the step: label them with the step they belong
            # to, the number train_log.jsonl and MLflow give that step once it ends
            samples.step = state.global_step + 1

        def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kw: Any) -> None:
            logs = dict(logs or {})
            step = state.global_step
            if judge is not None and "loss" in logs:  # cumulative, so a curve shows when the judge faltered
                logs["judge_failures"] = judge.failures  # -> train/judge_failures in MLflow
                logs["judge_failure_rate"] = round(judge.rate, 4)
            if sandbox is not None and "loss" in logs:  # cumulative completions by kind: train/tests_timeout...
                logs.update(sandbox.metrics())
            loss = logs.get("loss")
            if loss is not None and not math.isfinite(float(loss)):
                raise TrainingHealthError(
                    f"NaN/inf loss at step {step}: look for reward outliers (prep's outlier report), normalise or "
                    f"clip rewards, and lower the learning rate ({cfg.grpo.learning_rate}) before rerunning."
                )
            self._guard_kl(logs.get("kl"), step)
            self._guard_zero_std(logs.get("frac_reward_zero_std"), step)
            if not is_main:
                return
            if self._file is None:
                self._file = open(log_path, "a", encoding="utf-8")  # noqa: SIM115 (closed in close())
            self._file.write(json.dumps({"step": step, "epoch": state.epoch, **logs}) + "\n")
            self._file.flush()  # inspect may read it live; a crash keeps every finished step
            self.metrics.log(logs, step)

        def _guard_kl(self, kl: Any, step: int) -> None:
            if kl is None or not math.isfinite(kl):
                return
            hist = self.kl_hist[-5:]
            med = sorted(hist)[len(hist) // 2] if hist else None
            jump = med is not None and len(hist) >= 3 and kl > 0.2 and kl > 4 * max(med, 1e-3)
            spike, self._spike = self._spike, None
            if kl > cfg.grpo.kl_warn:
                self._warn(
                    "kl_high",
                    f"KL {kl:.3f} at step {step} exceeds {cfg.grpo.kl_warn}: the policy is "
                    f"running off; raise kl_coefficient (now {cfg.grpo.kl_coefficient}) and rerun.",
                )
            elif spike is not None and kl > 0.2 and kl > 4 * max(spike[1], 1e-3):
                self._warn(
                    "kl_rising",
                    f"KL rose to {kl:.3f} by step {step} and stayed (median {spike[1]:.3f} before step {spike[0]}): "
                    f"raise kl_coefficient (now {cfg.grpo.kl_coefficient}).",
                )
            elif jump:
                # one log this far above the median is not yet a trend: TRL's per-token k3 estimate spikes when the
                # sharpened policy samples a token the reference found unlikely (0.74 against a median of 0.09 in
                # the embedded round, back to the median the next step). The next log tells.
                self._spike = (step, med)
                log.debug("KL spiked to %.3f at step %d (recent median %.3f)", kl, step, med)
            self.kl_hist.append(kl)

        def _guard_zero_std(self, zero: Any, step: int) -> None:
            if zero is None:
                return
            # averaged over the last 5 logs: with a few prompts per step one batch can be all-solved by chance
            self.zero_hist.append(zero)
            avg = sum(self.zero_hist[-5:]) / len(self.zero_hist[-5:])
            if len(self.zero_hist) >= 5 and avg > cfg.grpo.zero_std_warn:
                self._warn(
                    "zero_std",
                    f"{avg:.0%} of groups had identical rewards over the 5 logs to step {step}: "
                    f"their advantage is zero; raise temperature (now {cfg.grpo.temperature}) or group_size.",
                )

        def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.close()

        def close(self) -> None:
            """Close train_log.jsonl and write the buffered MLflow metrics (also when a guard stopped training)."""
            if self._file is not None:
                self._file.close()
                self._file = None
            self.metrics.flush(wait=True)

    return HermesCallback()
