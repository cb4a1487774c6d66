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

The user's keys map onto TRL's GRPOConfig and PEFT's LoraConfig in ``hermes_lab.config.trl`` (a table there). The
prompt set comes from ``hermes_lab.train.prompts``; TRL's log lines and the health guards are
``hermes_lab.train.callback``'s.

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
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hermes_lab.config.schema import HermesConfig, dump_config, load_config, set_overrides
from hermes_lab.config.trl import grpo_kwargs, lora_config
from hermes_lab.core.inputs import TRAIN
from hermes_lab.core.jsonl import write_json_atomic
from hermes_lab.core.layout import TrainLayout
from hermes_lab.core.redaction import redact
from hermes_lab.core.reports import EvalReport
from hermes_lab.core.verdict import STOP_HEALTH, gate, write_verdict
from hermes_lab.policy import formats
from hermes_lab.policy.arms import resolve_adapter
from hermes_lab.policy.episodes import family_of_environment
from hermes_lab.train import episodes as EP
from hermes_lab.train.callback import TrainingHealthError, make_callback
from hermes_lab.train.prompts import (
    filter_long_prompts,
    load_prompt_set,
    no_data_error,
    prep_data_file,
    prompt_set_beside,
    turn_config,
)
from hermes_lab.train.state import health_report, mlflow_run, prepare_output, resume_marker

log = logging.getLogger("hermes_lab.train")


# the train stage's metrics that are not TRL's per-step curves (all are logged as train/<name>)
SUMMARY_METRICS = ("seconds", "eval_pass_rate_before", "eval_pass_rate_after", "judge_requests")


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


def _turn_phase(
    cfg: HermesConfig, data: str | os.PathLike[str], out: Path, start_adapter: str, parent_run_id: str | None
) -> TrainResult | None:
    """grpo.turns after a prompt set: ``grpo.turn_steps`` more steps on the conversations' turns, continuing the
    prompt set's adapter, under ``<output>/turns/``; None (said in the log) when no conversation has a turn to
    train on (a round whose traffic held none)."""
    src = Path(data) if Path(data).is_dir() else TrainLayout(out).prep.root
    try:
        return train(
            cfg, src, TrainLayout(out).turns.root, parent_run_id, start_adapter, evaluate_heldout=False, turns_only=True
        )
    except ValueError as e:
        if "no assistant turn to train on" not in str(e):
            raise
        log.info("the turn phase is skipped: %s", e)
        return None


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


def with_module_lr(trainer_cls: type, lr: float | None) -> type:
    """``trainer_cls`` whose optimizer gives the adapter's modules_to_save (``lora.modules_to_save``: trained in
    full, e.g. the final norm) their own learning rate, ``lora.modules_to_save_learning_rate``; unset: unchanged.
    Why: Adam moves every parameter by about the learning rate a step, which a LoRA's small matrices need and a
    norm's gains (~1.0 each) do not notice in 20 steps; the final norm sets how sharp every sampled token is, the
    sharpening a policy whose greedy answers beat its sampled ones needs most (docs/training.md)."""
    if lr is None:
        return trainer_cls

    class ModuleLrTrainer(trainer_cls):  # type: ignore[misc, valid-type]
        def create_optimizer(self, model: Any = None) -> Any:
            fresh = self.optimizer is None
            opt = super().create_optimizer(model)
            if not fresh:
                return opt
            own = [
                p for n, p in (model or self.model).named_parameters() if p.requires_grad and ".modules_to_save." in n
            ]
            if own:
                ids = {id(p) for p in own}
                for g in opt.param_groups:
                    g["params"] = [p for p in g["params"] if id(p) not in ids]
                opt.add_param_group({"params": own, "lr": lr, "weight_decay": 0.0})
            return opt

    return ModuleLrTrainer


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
        data = prep_data_file(Path(data), cfg, out)  # once: its prompt set and its conversations
    prompts = prompt_set_beside(data, cfg, out) if cfg.grpo.turns and not turns_only else None
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
    formats.prepare(tok, cfg.model.tool_parser)  # the policy's reader, as the gateway and execute read it
    if cfg.grpo.turns and not turn_phase:  # turn-level: one row per chosen assistant turn of the conversations
        from hermes_lab.train.turns import turn_dataset

        ds = turn_dataset(ds, cfg, tok)
        if cfg.grpo.max_train_prompts and len(ds) > cfg.grpo.max_train_prompts:
            ds = ds.shuffle(seed=cfg.grpo.seed).select(range(cfg.grpo.max_train_prompts))
    ds, flagged, completion_len = filter_long_prompts(ds, tok, cfg)
    lay = TrainLayout(out)
    log_path, trl_dir = lay.train_log, lay.trl
    marker = resume_marker(cfg, base, start_adapter, ds)  # a resume with other settings fails here, before the model
    ckpt, saved = prepare_output(trl_dir, log_path, marker, resume, is_main, cfg.grpo.max_steps)
    resumed_from = int(ckpt.name.rsplit("-", 1)[1]) if ckpt is not None else None

    from trl import GRPOConfig  # here: the refusals above come without TRL's ~5 s of imports

    from hermes_lab.train.turns import trainer_class

    model, peft_config = _policy_for_training(cfg, base, start_adapter)

    gkw = grpo_kwargs(cfg, out, completion_len, weights)
    args = GRPOConfig(**gkw)
    if is_main:
        dump_config(cfg, lay.config)
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
            write_json_atomic(lay.resume, {**marker, "mlflow_run_id": run_id})
        # TRL's GRPOTrainer, the prompts' tokens the loop's (train.turns)
        trainer = with_module_lr(trainer_class(ds), cfg.lora.modules_to_save_learning_rate)(
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
                write_json_atomic(lay.health, {**h, "error": redact(f"{type(e).__name__}: {e}")[:2000]})
                if isinstance(e, TrainingHealthError):  # the round runner reads this verdict: a gate stop, not a crash
                    write_verdict(out, "train", [gate("training_health", False, str(e))], STOP_HEALTH)
            raise
        finally:  # a run stopped by a guard keeps its curve up to the stop
            callback.close()
        adapter_dir = lay.adapter
        result = TrainResult(
            out, adapter_dir, run_id, trainer.state.global_step, 0.0, callback.warnings, flagged_prompts=len(flagged)
        )
        result.resumed_from = resumed_from
        result.judge = judge.to_dict() if judge else None
        if is_main:
            trainer.model.save_pretrained(str(adapter_dir), selected_adapters=["default"])
            tok.save_pretrained(str(adapter_dir))
            _write_jsonl(lay.samples, list(samples.rows))
            h = health_report("completed", callback.warnings, flagged, result.steps, resumed_from, judge, sandbox)
            gj = rewards.group_judge_of(funcs)
            h["group_judge"] = gj.to_dict() if gj is not None else None  # malformed replies, retries, fallbacks
            write_json_atomic(lay.health, h)
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
                ep = train_episodes(cfg, lay.episodes.root, str(adapter_dir), parent_run_id, data)
                shutil.rmtree(adapter_dir)
                shutil.copytree(ep.adapter_dir, adapter_dir)
                result.warnings += ep.warnings
                result.episodes = ep.episodes
            if evaluate_heldout:
                per_family = eval_tasks_per_family or cfg.validate.gain_tasks_per_family
                result.eval = _eval_before_after(cfg, base, start_adapter, adapter_dir, per_family)
                # the embedded agent family's held-out episodes, before and after, as many as a family's tasks (a
                # user's environment has no held-out tasks known here: its episode metrics are in train_log.jsonl)
                if family_of_environment(cfg.grpo.environment) is not None:
                    result.eval["agent"] = EP.eval_before_after(cfg, base, start_adapter, adapter_dir, per_family)
                EvalReport.from_json(result.eval).write(lay.eval)
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
            write_json_atomic(lay.run, meta)
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
    formats.prepare(tok, cfg.model.tool_parser)  # the policy's reader, as the gateway and execute read it
    model, peft_config = _policy_for_training(cfg, base, start_adapter)
    reward = EP.EpisodeReward(cfg.reward.success_threshold)
    gkw = grpo_kwargs(cfg, out, cfg.grpo.episode_completion_length, [1.0])
    gkw.update(max_steps=cfg.grpo.episode_steps or cfg.grpo.max_steps, max_tool_calling_iterations=cfg.grpo.max_turns)
    gkw.update(num_iterations=cfg.grpo.episode_iterations or cfg.grpo.num_iterations)
    gkw.update(save_strategy="no")  # the phase is short; a killed round reruns it
    gkw.pop("save_steps", None)
    args = GRPOConfig(**gkw)
    lay = TrainLayout(out)
    callback = make_callback(cfg, lay.train_log, reward, True, None, reward)
    lay.train_log.unlink(missing_ok=True)
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
            trainer = with_module_lr(GRPOTrainer, cfg.lora.modules_to_save_learning_rate)(
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
                write_json_atomic(lay.health, {**h, "error": redact(f"{type(e).__name__}: {e}")[:2000]})
                raise
            finally:
                callback.close()
        adapter_dir = lay.adapter
        trainer.model.save_pretrained(str(adapter_dir), selected_adapters=["default"])
        tok.save_pretrained(str(adapter_dir))
        _write_jsonl(lay.samples, list(reward.rows))
        steps = trainer.state.global_step
        health = {"status": "completed", "warnings": callback.warnings, "steps": steps, "episodes": reward.to_dict()}
        write_json_atomic(lay.health, health)
        result = TrainResult(out, adapter_dir, run.info.run_id if run else None, steps, 0.0, callback.warnings)
        result.seconds = round(time.time() - t0, 1)
        result.episodes = {**reward.to_dict(), "steps": steps, "seconds": result.seconds}
        tracking.log_metrics("train", {"episode_seconds": result.seconds})
        tracking.log_artifact(lay.train_log)
        tracking.log_artifact(lay.samples)
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

    lay = TrainLayout(out)
    for path in (lay.train_log, lay.samples, lay.config, lay.health, lay.eval):
        tracking.log_artifact(path)
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
    TRAIN.add_arguments(p)  # hermes_lab.core.inputs: the notebook's parameters and these, declared once


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
            raise no_data_error(args.data)
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
