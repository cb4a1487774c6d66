"""Every problem of a config at once: the config's own checks (``hermes_lab.config.schema``, also run by
``load_config``) and, with ``deep``, what TRL and PEFT themselves refuse: their config classes built from ours
(``hermes_lab.config.trl``; imports torch). Reads and writes nothing.

    hermes-lab config --check --params params/hermes_grpo_lora.yaml   # every problem, exit 0 / 2
"""

from __future__ import annotations

from pathlib import Path

from hermes_lab.config.schema import HermesConfig, config_problems, problems_error
from hermes_lab.config.trl import grpo_kwargs


def deep_problems(cfg: HermesConfig) -> list[str]:
    """What TRL and PEFT themselves refuse: their config classes built from ours (imports torch)."""
    import importlib.util
    import tempfile
    import warnings

    out = []
    if importlib.util.find_spec("trl") is None:  # no TRL, nothing to ask
        return out
    if cfg.grpo.use_vllm and importlib.util.find_spec("vllm") is None:
        out.append("grpo.use_vllm is true but vllm is not installed (pip install vllm, GPU only)")
    from peft import LoraConfig, TaskType
    from trl import GRPOConfig

    if cfg.lora.task_type not in {t.value for t in TaskType}:
        out.append(f"lora.task_type must be one of PEFT's: {', '.join(t.value for t in TaskType)}")
    try:
        lc = cfg.lora
        LoraConfig(r=lc.r, lora_alpha=lc.lora_alpha, lora_dropout=lc.lora_dropout, bias=lc.bias)
    except (ValueError, TypeError) as e:
        out.append(f"lora: PEFT's LoraConfig refuses these settings: {e}")
    weights = list(cfg.reward.weights) if cfg.reward.weights else [1.0] * len(cfg.reward.types)
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecation notes about TRL's own defaults are not the user's problem
        try:
            GRPOConfig(**grpo_kwargs(cfg, Path(tmp), cfg.grpo.max_completion_length, weights))
        except (ValueError, TypeError) as e:
            out.append(f"grpo: TRL's GRPOConfig refuses these settings: {e}")
    return out


def check_config(cfg: HermesConfig, deep: bool = False) -> list[str]:
    """Every problem of a config at once (ConfigError), else its warnings. ``deep``: also ask TRL and PEFT."""
    errs, warns = config_problems(cfg)
    if deep and not errs:
        errs += deep_problems(cfg)
    if errs:
        raise problems_error(cfg.source or "<defaults>", errs)
    return warns
