"""Stage 20, train: GRPO + LoRA from the user's YAML with TRL's GRPOTrainer, tracked in MLflow.

Reads the GRPO prompt set (a prep output dir ``runs/round-NN/prep/``, a saved ``datasets`` dir, or a
trajectories JSONL, which is run through prep first) and writes under ``--output`` (``runs/round-NN/train/``):
``adapter/`` (LoRA adapter + tokenizer), ``train_log.jsonl`` (every TRL log line), ``samples.jsonl``
(completions with their rewards), ``config.yaml`` (resolved, no secrets), ``health.json`` (guard
verdicts, the API judge's requests and failures, the tests reward's completions by kind: compile_error,
timeout, crash... and what the sandbox isolates, also ``train/tests_<kind>`` in MLflow), ``eval.json``
(held-out pass rate before/after), ``run.json`` (MLflow run id, base, adapter) and ``trl/`` (checkpoints
every ``grpo.save_steps`` steps: ``--resume`` continues from the last one, see ``hermes_lab.train.state``). JSON
files are written atomically.
``verdict.json`` (the training_health gate for the round runner; written on a NaN stop too).

    python -m hermes_lab.train --config params/hermes_grpo_lora.yaml --data runs/round-01/prep \
        --output runs/round-01/train
    hermes-lab train --config params/embedded.yaml --data trajectories.jsonl --output checkpoints/round-01
    hermes-lab train ... --resume          # a killed training continues from its last checkpoint

The user's keys map onto TRL's GRPOConfig and PEFT's LoraConfig in ``hermes_lab.config.trl`` (a table there).

Round N+1 continues from the champion: with ``model.adapter`` (or ``start_adapter``) set, that adapter
is loaded trainable and TRL keeps a frozen copy of it as the KL reference ("ref" adapter), so KL
measures drift from the promoted policy, not from the bare base.

Multi-process: the entry point is a plain script, so ``accelerate launch -m hermes_lab.train ...`` or
``torchrun --nproc_per_node 2 -m hermes_lab.train ...`` run it data-parallel (gloo on CPU, NCCL on GPU);
only the main process writes files and MLflow.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hermes_lab.config.schema import HermesConfig, dump_config, load_config, set_overrides
from hermes_lab.config.trl import grpo_kwargs, lora_config
from hermes_lab.core.jsonl import write_json_atomic
from hermes_lab.core.redaction import redact
from hermes_lab.core.verdict import STOP_HEALTH, gate, write_verdict
from hermes_lab.policy.arms import ADAPTER_KINDS, resolve_adapter
from hermes_lab.tasks import agent as A
from hermes_lab.train import episodes as EP
from hermes_lab.train.state import RESUME_FILE, health_report, mlflow_run, prepare_output, resume_marker

log = logging.getLogger("hermes_lab.train")


# the train stage's metrics that are not TRL's per-step curves (all are logged as train/<name>)
SUMMARY_METRICS = ("seconds", "eval_pass_rate_before", "eval_pass_rate_after", "judge_requests")


class TrainingHealthError(RuntimeError):
    """Training was stopped by a health guard (NaN loss)."""


@dataclass
class TrainResult:
    output_dir: Path
    adapter_dir: Path
    mlflow_run_id: str | None
    steps: int
    seconds: float
    warnings: list[str] = field(default_factory=list)
    eval: dict[str, Any] = field(default_factory=dict)
    flagged_prompts: int = 0
    resumed_from: int | None = None  # the checkpoint step training continued from
    judge: dict[str, Any] | None = (
        None  # the API judge's request/failure counts (hermes_lab.rewards.registry.JudgeFaults)
    )
    episodes: dict[str, Any] | None = None  # the episode phase's totals (train.episodes.EpisodeReward.to_dict)
    turns: dict[str, Any] | None = None  # turn rows trained (grpo.turns): how many, how many on logged tokens, steps


# ------------------------------------------------------------------------------------------------ data
def _no_data(data: str | os.PathLike[str]) -> FileNotFoundError:
    return FileNotFoundError(f"--data {data}: no such file or directory")


def load_prompt_set(data: str | os.PathLike[str], cfg: HermesConfig, work_dir: Path) -> Any:
    """The GRPO prompt set as a ``datasets.Dataset`` (columns: prompt, reference, ref_reward, ...)."""
    from datasets import Dataset, load_from_disk

    p = Path(data)
    table = "conversations" if cfg.grpo.turns else "grpo_dataset"  # grpo.turns: turn-level, from conversations
    if p.is_dir() and (p / table).is_dir():
        p = p / table
    elif cfg.grpo.turns and p.is_dir() and (p / "grpo_dataset").is_dir():  # a prep dir without conversations
        return Dataset.from_dict({"messages": []})  # no conversation: no turn to train on
    if p.is_dir():
        try:
            ds = load_from_disk(str(p))
        except (IndexError, FileNotFoundError, ValueError):
            if not cfg.grpo.turns or p.name != "conversations":
                raise
            ds = Dataset.from_dict({"messages": []})  # prep wrote no conversation (an empty dataset dir)
    elif p.is_file():
        out = _run_prep(p, cfg, work_dir)
        if not (out / table).is_dir():
            raise ValueError(f"--data {data}: prep found no {table} in it (grpo.turns={cfg.grpo.turns!r})")
        ds = load_from_disk(str(out / table))
    else:
        raise _no_data(data)
    if cfg.grpo.turns:
        if "messages" not in ds.column_names:
            raise ValueError(f"--data {data}: grpo.turns needs prep's conversations (columns: {ds.column_names})")
        return ds  # train() turns it into turn prompts with the policy's chat template (train.turns)
    if "prompt" not in ds.column_names:
        raise ValueError(f"--data {data}: the dataset has no 'prompt' column (columns: {ds.column_names})")
    if cfg.grpo.environment and "family" in ds.column_names:
        # agent conversations are trained whole, in the episode phase: their first user turn is no string prompt
        ds = ds.filter(lambda fam: fam != "agent", input_columns="family")
    if "weight" in ds.column_names:  # hard (negative) prompts are repeated
        from hermes_lab.data.prep import expand_by_weight

        ds = expand_by_weight(ds)
    if cfg.grpo.max_train_prompts and len(ds) > cfg.grpo.max_train_prompts:
        ds = ds.shuffle(seed=cfg.grpo.seed).select(range(cfg.grpo.max_train_prompts))
    return ds if isinstance(ds, Dataset) else Dataset.from_list(list(ds))


def _run_prep(path: Path, cfg: HermesConfig, work_dir: Path) -> Path:
    """A trajectories file given as --data, through prep into ``work_dir/prep``; its output dir."""
    from hermes_lab.data import prep

    try:
        res = prep.run_prep([path], work_dir / "prep", cfg, make_plots=False)
    except prep.GateRefused as e:  # a direct `train` call is an explicit decision to train
        res = e.result
        log.warning("data gates would refuse this round: %s (training anyway: explicit train call)", e)
    return Path(res.output_dir)


def filter_long_prompts(ds: Any, tokenizer: Any, cfg: HermesConfig) -> tuple[Any, list[dict[str, Any]], int]:
    """Leave out prompts with no room for a full completion (prompt + max_completion_length > max_seq_len);
    return the kept set, the left-out prompts flagged, and the completion length.

    The completion length is never shortened to fit a long prompt: one long prompt would otherwise cut
    every completion of the run short. (config.py refuses a completion length that leaves no room at all.)"""
    budget, completion = cfg.data.max_seq_len, cfg.grpo.max_completion_length
    prompts = list(ds["prompt"])
    if "prompt_ids" in ds.column_names:  # turn rows: the tokens the trainer takes as they are
        given = list(ds["prompt_ids"])
        lens = [
            len(x) if x else len(tokenizer(p, add_special_tokens=False)["input_ids"]) for p, x in zip(prompts, given)
        ]
    else:
        lens = [len(ids) for ids in tokenizer(prompts, add_special_tokens=False)["input_ids"]]
    keep = [i for i, n in enumerate(lens) if n + completion <= budget]
    kept = set(keep)
    flagged = [
        {
            "prompt": prompts[i][:200],
            "prompt_tokens": lens[i],
            "reason": f"prompt + completion ({lens[i]} + {completion}) > data.max_seq_len {budget}",
        }
        for i in range(len(lens))
        if i not in kept
    ]
    if not keep:
        raise ValueError(
            f"every prompt is longer than data.max_seq_len={budget} allows "
            f"(with grpo.max_completion_length={completion}); raise it"
        )
    return ds.select(keep), flagged, completion


def _prompt_set_beside(data: str | os.PathLike[str], cfg: HermesConfig, work_dir: Path) -> Any:
    """A prep dir's prompt set as training would take it (the agent family's rows left to the episode phase), when
    it holds a row: then grpo.turns trains the conversations' turns in a phase of their own, after it. Else None."""
    p = Path(data)
    if not (p.is_dir() and (p / "grpo_dataset").is_dir()):
        return None
    try:
        ds = load_prompt_set(p, replace(cfg, grpo=replace(cfg.grpo, turns="")), work_dir)
    except (IndexError, FileNotFoundError, ValueError):  # an empty dataset dir: no prompt set
        return None
    return ds if len(ds) else None


def turn_config(cfg: HermesConfig, inner: bool) -> HermesConfig:
    """The turn rows' phase: completions of grpo.turn_completion_length (a tool call is longer than a string
    answer); ``inner`` (the phase after a prompt set's): grpo.turn_steps steps and no episode phase of its own (the
    outer training runs it after)."""
    g = cfg.grpo
    kw: dict[str, Any] = {"max_completion_length": g.turn_completion_length or g.max_completion_length}
    if inner:
        kw.update(max_steps=g.turn_steps or g.max_steps, environment="")
    return replace(cfg, grpo=replace(g, turn_completion_length=0, **kw))


def _turn_phase(
    cfg: HermesConfig, data: str | os.PathLike[str], out: Path, start_adapter: str, parent_run_id: str | None
) -> TrainResult | None:
    """grpo.turns after a prompt set: ``grpo.turn_steps`` more steps on the conversations' turns, continuing the
    prompt set's adapter, under ``<output>/turns/``; None (said in the log) when no conversation has a turn to
    train on (a round whose traffic held none)."""
    src = Path(data) if Path(data).is_dir() else out / "prep"
    try:
        return train(cfg, src, out / "turns", parent_run_id, start_adapter, evaluate_heldout=False, turns_only=True)
    except ValueError as e:
        if "no assistant turn to train on" not in str(e):
            raise
        log.info("the turn phase is skipped: %s", e)
        return None


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
            if kl > cfg.grpo.kl_warn:
                self._warn(
                    "kl_high",
                    f"KL {kl:.3f} at step {step} exceeds {cfg.grpo.kl_warn}: the policy is "
                    f"running off; raise kl_coefficient (now {cfg.grpo.kl_coefficient}) and rerun.",
                )
            elif med is not None and len(hist) >= 3 and kl > 0.2 and kl > 4 * max(med, 1e-3):
                self._warn(
                    "kl_rising",
                    f"KL jumped to {kl:.3f} at step {step} (recent median {med:.3f}): "
                    f"raise kl_coefficient (now {cfg.grpo.kl_coefficient}).",
                )
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


# --------------------------------------------------------------------------------------------- train
def _policy_for_training(cfg: HermesConfig, base: str, start_adapter: str | None) -> tuple[Any, Any]:
    """The model GRPOTrainer trains and its ``peft_config``: the start adapter made trainable (continuing the
    champion: TRL copies it into a frozen "ref" adapter for the KL), else a new LoRA from ``cfg.lora``."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from hermes_lab.core import quiet

    dtype = "auto" if cfg.model.dtype == "auto" else getattr(torch, cfg.model.dtype)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype, trust_remote_code=cfg.model.trust_remote_code)
    if start_adapter:
        with quiet.third_party_deprecations():
            return PeftModel.from_pretrained(model, start_adapter, is_trainable=True), None
    return model, lora_config(cfg)


def _is_main() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def train(
    cfg: HermesConfig,
    data: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    parent_run_id: str | None = None,
    start_adapter: str | None = None,
    evaluate_heldout: bool = True,
    eval_tasks_per_family: int | None = None,
    resume: bool = False,
    turns_only: bool = False,
) -> TrainResult:
    """Run one GRPO + LoRA training. Returns where the adapter is and what happened.

    Checkpoints (adapter + optimizer + scheduler + RNG state) land in ``<output>/trl/`` every
    ``config.trl.save_steps(cfg)`` steps. ``resume``: continue from the newest complete one (same settings and data,
    else a ValueError says what changed); without one, training starts at step 0. Without ``resume``,
    checkpoints of an earlier run in that folder are removed first."""
    from transformers import AutoTokenizer, set_seed

    from hermes_lab.core import quiet, tracking
    from hermes_lab.policy import model as P
    from hermes_lab.rewards import registry as rewards

    t0 = time.time()
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    is_main = _is_main()
    set_seed(cfg.grpo.seed)
    runs_dir = cfg.round.runs_dir
    # bad data paths and reward names fail here, before minutes of model loading
    # grpo.turns beside a prompt set: this phase trains the prompt set, the turn phase follows (turn_phase); without
    # one (a conversations-only log) or inside the turn phase (turns_only), this phase is the turn rows
    if cfg.grpo.turns and Path(data).is_file():
        data = _run_prep(Path(data), cfg, out)  # once: its prompt set and its conversations
    prompts = _prompt_set_beside(data, cfg, out) if cfg.grpo.turns and not turns_only else None
    turn_phase = prompts is not None
    if turn_phase:
        ds = prompts
    else:
        if cfg.grpo.turns:
            cfg = turn_config(cfg, inner=turns_only)
        ds = load_prompt_set(data, cfg, out)
    samples = rewards.SampleLog()
    funcs, weights = rewards.get_reward_funcs(cfg, samples)
    base = P.resolve_model_name(cfg.model.base_model, runs_dir, cfg.model.seed)
    # an adapter dir, a train output dir (its adapter/) or 'champion' (hermes_lab.policy.arms)
    start_adapter = resolve_adapter(start_adapter or cfg.model.adapter, "start_adapter / model.adapter", cfg)
    tok = AutoTokenizer.from_pretrained(base, trust_remote_code=cfg.model.trust_remote_code)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    if cfg.grpo.turns and not turn_phase:  # turn-level: one row per chosen assistant turn of the conversations
        from hermes_lab.train.turns import turn_dataset

        ds = turn_dataset(ds, cfg, tok)
        if cfg.grpo.max_train_prompts and len(ds) > cfg.grpo.max_train_prompts:
            ds = ds.shuffle(seed=cfg.grpo.seed).select(range(cfg.grpo.max_train_prompts))
    ds, flagged, completion_len = filter_long_prompts(ds, tok, cfg)
    log_path, trl_dir = out / "train_log.jsonl", out / "trl"
    marker = resume_marker(cfg, base, start_adapter, ds)  # a resume with other settings fails here, before the model
    ckpt, saved = prepare_output(trl_dir, log_path, marker, resume, is_main, cfg.grpo.max_steps)
    resumed_from = int(ckpt.name.rsplit("-", 1)[1]) if ckpt is not None else None

    from trl import GRPOConfig  # here: the refusals above come without TRL's ~5 s of imports

    from hermes_lab.train.turns import trainer_class

    model, peft_config = _policy_for_training(cfg, base, start_adapter)

    gkw = grpo_kwargs(cfg, out, completion_len, weights)
    args = GRPOConfig(**gkw)
    if is_main:
        dump_config(cfg, out / "config.yaml")
    judge, sandbox = rewards.judge_faults(funcs), rewards.sandbox_tally(funcs)
    callback = make_callback(cfg, log_path, samples, is_main, judge, sandbox)
    run_id = None
    ctx = mlflow_run(saved.get("mlflow_run_id"), parent_run_id, runs_dir, cfg) if is_main else contextlib.nullcontext()
    # TRL and PEFT read a property transformers 5 deprecated (a FutureWarning per run): hidden, see quiet.py
    with ctx as run, quiet.third_party_deprecations():  # only rank 0 tracks
        if run is not None:
            run_id = run.info.run_id
            if resumed_from is None:
                tracking.log_params(
                    {
                        **cfg.flat_params(),
                        **{f"trl.{k}": v for k, v in gkw.items()},
                        "train.prompts": len(ds),
                        "train.flagged_prompts": len(flagged),
                        "train.start_adapter": start_adapter or "",
                        "train.base": base,
                    }
                )
            else:
                tracking.set_tags({"train.resumed_from_step": str(resumed_from)})
        if is_main:
            write_json_atomic(trl_dir / RESUME_FILE, {**marker, "mlflow_run_id": run_id})
        trainer = trainer_class(ds)(  # TRL's GRPOTrainer, the prompts' tokens the loop's (train.turns)
            model=model,
            reward_funcs=funcs,
            args=args,
            train_dataset=ds,
            processing_class=tok,
            peft_config=peft_config,
            callbacks=[callback],
        )

        try:
            trainer.train(resume_from_checkpoint=str(ckpt) if ckpt is not None else None)
        except Exception as e:
            if is_main:  # a stopped run still says why, and how many judgements failed
                step = trainer.state.global_step
                h = health_report("stopped", callback.warnings, flagged, step, resumed_from, judge, sandbox)
                write_json_atomic(out / "health.json", {**h, "error": redact(f"{type(e).__name__}: {e}")[:2000]})
                if isinstance(e, TrainingHealthError):  # the round runner reads this verdict: a gate stop, not a crash
                    write_verdict(out, "train", [gate("training_health", False, str(e))], STOP_HEALTH)
            raise
        finally:  # a run stopped by a guard keeps its curve up to the stop
            callback.close()
        adapter_dir = out / "adapter"
        result = TrainResult(
            out, adapter_dir, run_id, trainer.state.global_step, 0.0, callback.warnings, flagged_prompts=len(flagged)
        )
        result.resumed_from = resumed_from
        result.judge = judge.to_dict() if judge else None
        if is_main:
            trainer.model.save_pretrained(str(adapter_dir), selected_adapters=["default"])
            tok.save_pretrained(str(adapter_dir))
            _write_jsonl(out / "samples.jsonl", list(samples.rows))
            h = health_report("completed", callback.warnings, flagged, result.steps, resumed_from, judge, sandbox)
            gj = rewards.group_judge_of(funcs)
            h["group_judge"] = gj.to_dict() if gj is not None else None  # malformed replies, retries, fallbacks
            write_json_atomic(out / "health.json", h)
            if turn_phase:  # the conversations' turns continue this adapter; theirs is the next phase's start
                tp = _turn_phase(cfg, data, out, str(adapter_dir), parent_run_id)
                if tp is not None:
                    shutil.rmtree(adapter_dir)
                    shutil.copytree(tp.adapter_dir, adapter_dir)
                    result.warnings += tp.warnings
                    result.turns = tp.turns
            if cfg.grpo.environment and int(os.environ.get("WORLD_SIZE", "1")) > 1:
                callback._warn("episodes_multiprocess", "the episode phase runs single-process: skipped under torchrun")
            elif cfg.grpo.environment:
                # the episode phase continues this adapter; its adapter becomes the round's candidate
                ep = train_episodes(cfg, out / "episodes", str(adapter_dir), parent_run_id, data)
                shutil.rmtree(adapter_dir)
                shutil.copytree(ep.adapter_dir, adapter_dir)
                result.warnings += ep.warnings
                result.episodes = ep.episodes
            if evaluate_heldout:
                per_family = eval_tasks_per_family or cfg.validate.gain_tasks_per_family
                result.eval = _eval_before_after(cfg, base, start_adapter, adapter_dir, per_family)
                # the embedded agent family's held-out episodes, before and after, as many as a family's tasks (a
                # user's environment has no held-out tasks known here: its episode metrics are in train_log.jsonl)
                if cfg.grpo.environment == A.ENVIRONMENT:
                    result.eval["agent"] = EP.eval_before_after(cfg, base, start_adapter, adapter_dir, per_family)
                write_json_atomic(out / "eval.json", result.eval)
            result.seconds = round(time.time() - t0, 1)
            meta = {
                "mlflow_run_id": run_id,
                "base_model": base,
                "adapter": str(adapter_dir),
                "start_adapter": start_adapter,
                "steps": result.steps,
                "seconds": result.seconds,
                "resumed_from_step": resumed_from,
                "prompts": len(ds),
            }
            if "prompt_source" in ds.column_names:  # grpo.turns: the turn rows, and those on logged tokens
                sources = list(ds["prompt_source"])
                result.turns = {"turn_rows": len(sources), "turn_rows_logged": sources.count("logged")}
                result.turns.update(steps=result.steps)
            if result.turns:
                meta["turns"] = result.turns
            write_json_atomic(out / "run.json", meta)
            health_detail = "; ".join(callback.warnings) or "no warnings"
            write_verdict(
                out,
                "train",
                [gate("training_health", True, health_detail)],
                adapter=str(adapter_dir),
                mlflow_run_id=run_id,
                eval=result.eval or None,
            )
            if run is not None:
                _log_artifacts(out, result)
    return result


def train_episodes(
    cfg: HermesConfig,
    output_dir: str | os.PathLike[str],
    start_adapter: str | None = None,
    parent_run_id: str | None = None,
    data: str | os.PathLike[str] | None = None,
) -> TrainResult:
    """Episode-level GRPO: ``grpo.environment``'s episodes with TRL's multi-turn tool calling
    (``environment_factory``), ``grpo.episode_steps`` steps from ``start_adapter`` (or a fresh LoRA).

    Writes ``train_log.jsonl`` (TRL's lines, its ``tools/*`` metrics and ``train.episodes.METRICS``),
    ``samples.jsonl`` (whole episodes), ``health.json`` (with the episodes' totals) and ``adapter/`` under
    ``output_dir``; its own MLflow run (``train-episodes``) nested under ``parent_run_id``."""
    from transformers import AutoTokenizer, set_seed
    from trl import GRPOConfig, GRPOTrainer

    from hermes_lab.core import quiet, tracking
    from hermes_lab.policy import model as P

    t0 = time.time()
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    set_seed(cfg.grpo.seed)
    env_cls = EP.load_environment(cfg.grpo.environment)  # a bad spec fails before the model loads
    ds = EP.episode_dataset(cfg, data, env_cls)
    base = P.resolve_model_name(cfg.model.base_model, cfg.round.runs_dir, cfg.model.seed)
    tok = AutoTokenizer.from_pretrained(base, trust_remote_code=cfg.model.trust_remote_code)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model, peft_config = _policy_for_training(cfg, base, start_adapter)
    reward = EP.EpisodeReward(cfg.reward.success_threshold)
    gkw = grpo_kwargs(cfg, out, cfg.grpo.episode_completion_length, [1.0])
    gkw.update(max_steps=cfg.grpo.episode_steps or cfg.grpo.max_steps, max_tool_calling_iterations=cfg.grpo.max_turns)
    gkw.update(save_strategy="no")  # the phase is short; a killed round reruns it
    gkw.pop("save_steps", None)
    args = GRPOConfig(**gkw)
    callback = make_callback(cfg, out / "train_log.jsonl", reward, True, None, reward)
    (out / "train_log.jsonl").unlink(missing_ok=True)
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # environment_factory is TRL-experimental: said here
    with tracking.stage_run("train-episodes", parent_run_id, cfg.round.runs_dir, cfg.round.experiment) as run:
        with quiet.third_party_deprecations():
            tracking.log_params(
                {
                    "episodes.environment": cfg.grpo.environment,
                    "episodes.max_turns": cfg.grpo.max_turns,
                    "episodes.tasks": len(ds) if ds is not None else 0,
                    "episodes.start_adapter": start_adapter or "",
                }
            )
            trainer = GRPOTrainer(
                model=model,
                reward_funcs=[reward],
                args=args,
                train_dataset=ds,
                processing_class=tok,
                peft_config=peft_config,
                callbacks=[callback],
                environment_factory=env_cls,
            )
            try:
                trainer.train()
            except Exception as e:
                h = {"status": "stopped", "warnings": callback.warnings, "episodes": reward.to_dict()}
                write_json_atomic(out / "health.json", {**h, "error": redact(f"{type(e).__name__}: {e}")[:2000]})
                raise
            finally:
                callback.close()
        adapter_dir = out / "adapter"
        trainer.model.save_pretrained(str(adapter_dir), selected_adapters=["default"])
        tok.save_pretrained(str(adapter_dir))
        _write_jsonl(out / "samples.jsonl", list(reward.rows))
        steps = trainer.state.global_step
        health = {"status": "completed", "warnings": callback.warnings, "steps": steps, "episodes": reward.to_dict()}
        write_json_atomic(out / "health.json", health)
        result = TrainResult(out, adapter_dir, run.info.run_id if run else None, steps, 0.0, callback.warnings)
        result.seconds = round(time.time() - t0, 1)
        result.episodes = {**reward.to_dict(), "steps": steps, "seconds": result.seconds}
        tracking.log_metrics("train", {"episode_seconds": result.seconds})
        tracking.log_artifact(out / "train_log.jsonl")
        tracking.log_artifact(out / "samples.jsonl")
    return result


def _eval_before_after(
    cfg: HermesConfig, base: str, start_adapter: str | None, adapter_dir: Path, per_family: int
) -> dict[str, Any]:
    """Held-out sampled pass rate of the starting policy and of the candidate (embedded tasks only).

    validate.gain_tasks_per_family x 6 families x 2 samples (1200 tasks by default): a later round's gain of 3
    points must have its paired 95% interval above 0, which 300 tasks (+-3.2 points) could not show."""
    from hermes_lab.policy import model as P
    from hermes_lab.tasks import suite as T

    tasks_ = T.generate_tasks(per_family * len(T.FAMILIES), split="heldout", seed=cfg.grpo.seed + 1)
    kw = dict(
        temperature=cfg.grpo.temperature,
        samples_per_task=2,
        seed=cfg.grpo.seed,
        max_new_tokens=cfg.execute.max_new_tokens,
        threshold=cfg.reward.success_threshold,
    )
    before = P.evaluate(P.load_policy(base, adapter=start_adapter), tasks_, **kw)
    after = P.evaluate(P.load_policy(base, adapter=str(adapter_dir)), tasks_, **kw)
    gain = P.paired_gain(before, after)  # paired by task: the interval the promoted gains are judged by
    return {"before": before, "after": after, "gain_points": round(100 * gain["gain"], 1), "gain": gain}


def _log_artifacts(out: Path, result: TrainResult) -> None:
    from hermes_lab.core import tracking

    for name in ("train_log.jsonl", "samples.jsonl", "config.yaml", "health.json", "eval.json"):
        tracking.log_artifact(out / name)
    tracking.log_artifacts(result.adapter_dir, "adapter")
    summary = {"seconds": result.seconds}
    if result.judge:
        summary.update({k: result.judge[k] for k in ("judge_requests", "judge_failures", "judge_failure_rate")})
    if result.eval:
        summary["eval_pass_rate_before"] = result.eval["before"]["pass_rate"]
        summary["eval_pass_rate_after"] = result.eval["after"]["pass_rate"]
    tracking.log_metrics("train", summary)  # SUMMARY_METRICS: inspect keeps them out of the per-step curves
    tracking.set_tags({"health.warnings": len(result.warnings)})


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


# ----------------------------------------------------------------------------------------------- CLI
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", "--params", dest="config", required=True, help="the training YAML (user's format)")
    p.add_argument("--data", required=True, help="prep output dir, saved datasets dir, or trajectories JSONL")
    p.add_argument("--output", required=True, help="output dir (adapter/, train_log.jsonl, ...)")
    p.add_argument(
        "--start-adapter", default=None, help=f"continue training this adapter (e.g. champion): {ADAPTER_KINDS}"
    )
    p.add_argument("--parent-run-id", default="", help="MLflow run to nest under (the round's run)")
    p.add_argument(
        "--max-steps",
        type=int,
        default=None,
        help="override grpo.max_steps; also caps grpo.turn_steps and grpo.episode_steps (a smoke run is short in "
        "every phase)",
    )
    p.add_argument("--no-eval", action="store_true", help="skip the held-out before/after pass-rate check")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the last checkpoint in <output>/trl/ (same settings and data); none there: start at 0",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override, e.g. --set grpo.save_steps=5 or --set 'reward.types=[system,tool_call]' (repeatable)",
    )


def run_cli(args: argparse.Namespace) -> int:
    from hermes_lab.config.schema import ConfigError
    from hermes_lab.rewards.registry import RewardError

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    overrides: dict[str, Any] = {"grpo.max_steps": args.max_steps} if args.max_steps else {}
    overrides |= set_overrides(args.set)
    cfg = load_config(args.config, overrides or None)
    if args.max_steps and cfg.grpo.episode_steps > args.max_steps:  # 0 already means grpo.max_steps
        cfg.grpo.episode_steps = args.max_steps
    if args.max_steps and cfg.grpo.turn_steps > args.max_steps:
        cfg.grpo.turn_steps = args.max_steps
    start_adapter = resolve_adapter(args.start_adapter, "--start-adapter", cfg)  # a train output dir: its adapter/

    try:
        # a mistyped --data fails here, after the config's own errors and before train() imports TRL and PEFT (~10 s)
        if not Path(args.data).exists():
            raise _no_data(args.data)
        res = train(
            cfg,
            args.data,
            args.output,
            parent_run_id=args.parent_run_id or None,
            start_adapter=start_adapter,
            evaluate_heldout=not args.no_eval,
            resume=args.resume,
        )
    except FileNotFoundError as e:  # --data: the message names the path
        print(f"error: {redact(str(e))}", file=sys.stderr)
        return 2
    except ConfigError:
        raise  # the entry point prints it as a config error (exit 2)
    except (RewardError, TrainingHealthError, ValueError) as e:  # the message is the diagnosis
        print(f"error: {redact(str(e))}", file=sys.stderr)
        return 1
    if not _is_main():
        return 0
    if res.resumed_from is not None:
        print(f"resumed from the checkpoint at step {res.resumed_from}")
    print(f"adapter: {res.adapter_dir}  ({res.steps} steps, {res.seconds} s, MLflow run {res.mlflow_run_id})")
    if res.judge and res.judge["judge_failures"]:
        j = res.judge
        print(
            f"judge: {j['judge_failures']} of {j['judge_samples']} judgements failed ({j['judge_failure_rate']:.1%}); "
            f"{j['imputed_from_group']} took their group's mean, {j['system_reward_only']} the system reward alone"
        )
    for w in res.warnings:
        print(f"warning: {w}")
    if res.eval:
        from hermes_lab.policy import model as P

        b, a = res.eval["before"]["pass_rate"], res.eval["after"]["pass_rate"]
        print(f"held-out sampled pass rate: {b:.1%} -> {a:.1%} ({P.describe_gain(res.eval)})")
        if res.eval.get("agent"):
            ag = res.eval["agent"]
            b, a = ag["before"]["episode_success"], ag["after"]["episode_success"]
            print(f"held-out agent episode success: {b:.1%} -> {a:.1%} ({P.describe_gain(ag)})")
    return 0


def main(argv: list[str] | None = None) -> int:
    from hermes_lab.core.command import run_module

    return run_module("hermes_lab.train", add_arguments, run_cli, argv, description=__doc__.split("\n")[0])


if __name__ == "__main__":
    sys.exit(main())
