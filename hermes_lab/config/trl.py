"""How the user's keys map onto TRL's ``GRPOConfig`` and PEFT's ``LoraConfig`` (TRL's own defaults are never
relied on). Used by the train stage (``hermes_lab.train``) and by ``hermes-lab config --check``, which builds
TRL's config from ours to ask TRL itself what it refuses. Reads and writes nothing; imports TRL and torch
only inside ``grpo_kwargs``, PEFT only inside ``lora_config``.

| user YAML                    | TRL GRPOConfig / PEFT LoraConfig                                       |
|------------------------------|------------------------------------------------------------------------|
| grpo.group_size              | num_generations                                                        |
| grpo.kl_coefficient          | beta (always passed: TRL's default 0.0 drops KL and the reference)     |
| grpo.clip_range              | epsilon                                                                |
| grpo.learning_rate           | learning_rate (TRL's default 1e-6 is far too low for LoRA)             |
| grpo.max_steps               | max_steps                                                              |
| grpo.per_device_batch_size   | per_device_train_batch_size = per_device_batch_size * group_size       |
|                              | (the user counts prompts, TRL counts completions)                      |
| grpo.gradient_accumulation   | gradient_accumulation_steps                                            |
| grpo.temperature             | temperature                                                            |
| data.max_seq_len             | prompt + max_completion_length <= max_seq_len; TRL no longer truncates |
|                              | prompts, so longer prompts are flagged and left out (health.json)      |
| reward.types / weights       | reward_funcs / reward_weights (hermes_lab.rewards.registry)            |
| grpo.use_vllm / vllm_mode    | use_vllm / vllm_mode (GPU only)                                        |
| lora.*                       | peft.LoraConfig(**lora)                                                |
| lora.modules_to_save_        | the optimizer's own param group for the modules_to_save (train.grpo's  |
|   learning_rate              | with_module_lr); not a LoraConfig key                                  |
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from hermes_lab.config.schema import HermesConfig
from hermes_lab.core.layout import TrainLayout


def lora_config(cfg: HermesConfig) -> Any:
    """PEFT's LoraConfig for a HermesConfig's ``lora`` section: the adapter a training starts (the train stage's
    prompt set and episode phase, and bench_train's bare TRL arms, build the same one)."""
    from peft import LoraConfig

    lc = cfg.lora
    return LoraConfig(
        r=lc.r,
        lora_alpha=lc.lora_alpha,
        lora_dropout=lc.lora_dropout,
        target_modules=list(lc.target_modules),
        modules_to_save=list(lc.modules_to_save) or None,
        bias=lc.bias,
        task_type=lc.task_type,
    )


def grpo_kwargs(
    cfg: HermesConfig, output_dir: Path, max_completion_length: int, weights: list[float]
) -> dict[str, Any]:
    """The GRPOConfig keyword arguments for a HermesConfig (the table in the module docstring)."""
    import dataclasses

    import torch
    from trl import GRPOConfig

    g = cfg.grpo
    on_gpu = torch.cuda.is_available()
    # transformers 5 renamed gradient_checkpointing to activation_checkpointing and warns (FutureWarning) on
    # the old name: pass the new one where it exists (older 5.x releases only know the old one)
    ckpt = (
        "activation_checkpointing"
        if "activation_checkpointing" in {f.name for f in dataclasses.fields(GRPOConfig)}
        else "gradient_checkpointing"
    )
    kw = dict(
        output_dir=str(TrainLayout(output_dir).trl),
        num_generations=g.group_size,
        beta=g.kl_coefficient,
        epsilon=g.clip_range,
        learning_rate=g.learning_rate,
        max_steps=g.max_steps,
        per_device_train_batch_size=g.per_device_batch_size * g.group_size,
        gradient_accumulation_steps=g.gradient_accumulation,
        temperature=g.temperature,
        max_completion_length=max_completion_length,
        num_iterations=g.num_iterations,
        loss_type=g.loss_type,
        scale_rewards=g.scale_rewards,
        reward_weights=weights,
        logging_steps=g.logging_steps,
        seed=g.seed,
        use_vllm=g.use_vllm,
        report_to="none",  # our callback logs to MLflow itself: nesting and names stay ours
        # checkpoints (adapter + optimizer state) for --resume; the final adapter is saved where the round expects it
        save_strategy="steps",
        save_steps=save_steps(cfg),
        save_total_limit=g.save_total_limit,
        bf16=on_gpu and torch.cuda.is_bf16_supported(),
        use_cpu=not on_gpu,
        dataloader_num_workers=0,
        disable_tqdm=False,
        remove_unused_columns=False,  # reward functions read reference / ref_reward columns
    )
    kw[ckpt] = g.gradient_checkpointing
    if g.use_vllm:
        kw["vllm_mode"] = g.vllm_mode
    return kw


def save_steps(cfg: HermesConfig) -> int:
    """Checkpoint interval: grpo.save_steps, or about four checkpoints a run (at most every 50 steps)."""
    g = cfg.grpo
    return g.save_steps or max(1, min(50, math.ceil(g.max_steps / 4)))
