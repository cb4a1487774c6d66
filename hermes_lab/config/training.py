"""Config sections of the policy and how it trains: ``model`` (the policy), ``lora`` (PEFT's LoraConfig), ``grpo``
(TRL's GRPOConfig, the episode and turn phases).

Part of the config layer (``hermes_lab.config.schema`` builds ``HermesConfig`` from the sections and loads it):
each field with its help text and the bounds its value must meet (``_f(..., ge=...)``), choices as ``Literal``
types the loader enforces; ``trl_choices`` reads the values the installed TRL accepts (``grpo.loss_type``).
``training_problems``: the checks beyond bounds (room within data.max_seq_len, passed in). The user's keys as
docs/SPEC.md shows them; their mapping onto TRL and PEFT is ``hermes_lab.config.trl``'s. Reads and writes nothing.

    hermes-lab config --explain        # every key, with its choices and bounds
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Literal

from hermes_lab.config.scoring import callable_spec
from hermes_lab.core.yaml_typed import field_with as _f

TOOL_PARSERS = ("hermes", "llama3_json", "mistral", "qwen3_coder")  # vLLM --tool-call-parser names policy reads
EMBEDDED_MODEL = "embedded:tiny"  # builds the tiny local policy under runs/policies/ (no hub download)


@dataclass
class ModelSection:
    base_model: str = _f(
        EMBEDDED_MODEL,
        "Policy to train: a Hugging Face id, a local path, or 'embedded:tiny' "
        "(the tiny local policy the embedded default builds itself).",
    )
    base_url: str | None = _f(None, "OpenAI-compatible API root for a remotely served policy (optional).")
    api_key_env: str = _f(
        "TAOTOKEN_API_KEY",
        "NAME of the environment variable holding the API key (the key itself is never written in a config).",
    )
    adapter: str | None = _f(
        None,
        "LoRA adapter to start from (a path). Empty: the round uses the champion "
        "adapter if there is one, else the bare base model.",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = _f("auto", "Torch dtype to load the policy in.")
    trust_remote_code: bool = _f(False, "Pass trust_remote_code to from_pretrained (off: never run hub code).")
    seed: int = _f(0, "Seed of the embedded tiny policy (its build is deterministic by seed).")
    tool_parser: Literal[TOOL_PARSERS] | None = _f(
        None,
        "How the policy's answers are read into tool calls when TRL does not know its chat template (TRL knows "
        "Qwen2.5, Qwen3, Llama 3.1/3.2, GPT-OSS, ...: then TRL's reader is used and this is ignored). Named as "
        "vLLM's --tool-call-parser: hermes (Hermes 3 / ChatML <tool_call> JSON), llama3_json, mistral, "
        "qwen3_coder. Unset with a template TRL does not know: a named error at doctor and round start.",
    )


@dataclass
class LoraSection:
    r: int = _f(16, "LoRA rank.", ge=1)
    lora_alpha: int = _f(32, "LoRA scaling alpha (effective scale alpha/r).", gt=0)
    lora_dropout: float = _f(0.05, "Dropout on the LoRA path.", ge=0, lt=1)
    target_modules: list[str] = _f(["q_proj", "v_proj", "k_proj", "o_proj"], "Module names LoRA wraps.")
    modules_to_save: list[str] = _f(
        [],
        "Modules trained in full and saved in the adapter (PEFT's modules_to_save), matched by the end of their "
        "name: e.g. 'model.norm', the final norm, whose scale a LoRA cannot change (it sets how sharp every "
        "sampled token is).",
    )
    modules_to_save_learning_rate: float | None = _f(
        None,
        "AdamW learning rate of the modules_to_save' parameters (a few hundred dimensions of a norm need a far "
        "larger step than LoRA's matrices to move in a short round). Unset: grpo.learning_rate.",
        gt=0,
        lt=10,
    )
    bias: Literal["none", "all", "lora_only"] = _f("none", "Which biases train.")
    task_type: str = _f("CAUSAL_LM", "PEFT task type (peft.TaskType; checked by config --check).")


@dataclass
class GrpoSection:
    group_size: int = _f(
        8, "Completions sampled per prompt (TRL num_generations).", ge=2, why="GRPO needs a group for advantages"
    )
    kl_coefficient: float = _f(
        0.04,
        "KL penalty (TRL beta). TRL's default 0.0 disables KL and the reference model; we always pass this value.",
        ge=0,
    )
    clip_range: float = _f(0.2, "Policy-ratio clipping (TRL epsilon).", gt=0, lt=1)
    learning_rate: float = _f(1.0e-5, "AdamW learning rate (TRL's default 1e-6 is too low for LoRA).", gt=0, lt=1)
    max_steps: int = _f(300, "Optimizer steps.", ge=1)
    per_device_batch_size: int = _f(
        2,
        "Prompts per device per micro-batch (TRL counts completions: we multiply by group_size when mapping).",
        ge=1,
    )
    gradient_accumulation: int = _f(8, "Micro-batches per optimizer step.", ge=1)
    temperature: float = _f(0.9, "Sampling temperature; 0.8-1.0 keeps groups diverse.", gt=0, le=2)
    max_completion_length: int = _f(256, "Max new tokens per completion (prompt + this <= data.max_seq_len).", ge=1)
    num_iterations: int = _f(1, "PPO-style updates per generation batch (TRL num_iterations).", ge=1)
    loss_type: str = _f("dapo", "TRL loss_type (the values the installed TRL accepts).")
    scale_rewards: Literal["group", "batch", "none"] = _f("group", "TRL scale_rewards.")
    logging_steps: int = _f(1, "Log every N steps (every TRL metric goes to MLflow).", ge=1)
    seed: int = _f(0, "Training seed.")
    gradient_checkpointing: bool = _f(True, "Trade compute for memory (TRL's default). Off for tiny models on CPU.")
    use_vllm: bool = _f(False, "GPU only: generate with vLLM (TRL use_vllm).")
    vllm_mode: Literal["colocate", "server"] = _f("colocate", "vLLM mode when use_vllm.")
    kl_warn: float = _f(0.5, "Health guard: warn 'raise kl_coefficient' when KL exceeds this.", gt=0)
    zero_std_warn: float = _f(
        0.8, "Health guard: warn 'raise temperature' when frac_reward_zero_std exceeds this.", ge=0, le=1
    )
    max_train_prompts: int = _f(0, "Cap on GRPO prompts per round (0: all).", ge=0)
    save_steps: int = _f(
        0,
        "Save a checkpoint (LoRA adapter + optimizer state) under <output>/trl/ every N steps, so `train "
        "--resume` continues from the last one. 0: about four times a run (ceil(max_steps / 4), at most 50).",
        ge=0,
    )
    save_total_limit: int = _f(
        2, "Checkpoints kept under <output>/trl/ (the oldest are deleted).", ge=1, why="--resume needs the last one"
    )
    environment: str = _f(
        "",
        "Episode-level GRPO: 'package.module:Class', an environment in TRL's contract (reset(**row) returns None or "
        "text for the user turn; its public, typed and documented methods are the tools; get_reward() or "
        "_hermes_score(final_answer) scores the episode). After the prompt set, train runs episode_steps more steps on "
        "whole episodes (TRL's multi-turn tool calling), continuing the same adapter. Empty: no episode phase. "
        "The embedded agent families: hermes_lab.tasks.hermes:WorkspaceEnv (workspace tasks on the Hermes Agent's "
        "own tools, the default), hermes_lab.tasks.agent:TimeEnv (one made-up time tool).",
    )
    max_turns: int = _f(
        2, "Episode mode: tool-calling turns per episode at most (TRL max_tool_calling_iterations).", ge=1, le=16
    )
    episode_steps: int = _f(0, "Episode mode: optimizer steps of the episode phase (0: grpo.max_steps).", ge=0)
    episode_iterations: int = _f(
        0,
        "Episode mode: optimizer steps per generated batch of episodes (TRL num_iterations; 0: grpo.num_iterations). "
        "Episodes cost far more to generate than to learn from: 2 learns about as much per step at half the cost.",
        ge=0,
    )
    episode_completion_length: int = _f(
        144,
        "Episode mode: tokens an episode may add after its prompt, tool results included (TRL max_completion_length; "
        "a tool result that would pass it is dropped by TRL and the episode ends there).",
        ge=8,
    )
    episode_tasks: int = _f(256, "Episode mode: training episodes' tasks (each sampled group_size times).", ge=1)
    turns: Literal["", "all", "last", "failed", "first_tool"] = _f(
        "",
        "Turn-level GRPO on logged conversations (prep's conversations/): which assistant turns become prompts "
        "(the conversation before the turn, with the real tool results, rendered with the policy's chat template "
        "and the conversation's tools; the group samples that turn, the loss covers only it). all: every "
        "assistant turn; last: each conversation's last; failed: every turn of conversations whose reward is "
        "below reward.success_threshold; first_tool: each conversation's first turn that calls a tool. Rewards: "
        "tool_call (validity), comparison (the judge against the logged turn, the conversation's reward as its "
        "ref_reward: the outcome credited to the turn). A turn answered by the gateway's in-process arm is trained "
        "on the tokens it logged (no re-tokenization). Data with a prompt set too (a live round's traffic): the "
        "turns are a phase of their own after the prompt set's (turn_steps). Empty: the prompt sets only, as "
        "before. The live flywheel sets all unless the params say otherwise.",
    )
    turn_completion_length: int = _f(
        0,
        "grpo.turns: max new tokens of a sampled turn (a tool call with its arguments is longer than a string "
        "task's answer). 0: max_completion_length.",
        ge=0,
    )
    turn_steps: int = _f(
        0,
        "grpo.turns beside a prompt set: optimizer steps of the turn phase, which continues the prompt set's "
        "adapter before the episode phase (0: grpo.max_steps).",
        ge=0,
    )


@cache
def trl_choices(name: str) -> tuple[str, ...] | None:
    """The values the installed TRL's GRPOConfig accepts for ``name``: its ``Literal`` type, else the
    "Supported values are ..." sentence of the field's help. Read from TRL's source (no import: TRL pulls
    torch in); None when TRL is absent or says nothing we can read, and the check is skipped."""
    import ast
    import importlib.util

    spec = importlib.util.find_spec("trl")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "trainer" / "grpo_config.py"
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError):
        return None
    for node in ast.walk(tree):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name):
            continue
        ann = node.annotation
        if isinstance(ann, ast.Subscript) and "Literal" in ast.unparse(ann.value):
            vals = [e.value for e in ast.walk(ann.slice) if isinstance(e, ast.Constant) and isinstance(e.value, str)]
            return tuple(vals) or None
        text = ""
        for kw in ast.walk(node.value) if node.value is not None else []:
            if isinstance(kw, ast.keyword) and kw.arg == "metadata" and isinstance(kw.value, ast.Dict):
                for k, v in zip(kw.value.keys, kw.value.values):
                    if isinstance(k, ast.Constant) and k.value == "help" and isinstance(v, ast.Constant):
                        text = str(v.value)
        m = re.search(r"Supported values are:?\s*(.*?)\.(?:\s|$)", text)
        vals = re.findall(r"[`'\"]([a-z][a-z0-9_]*)['\"`]", m.group(1)) if m else []
        return tuple(vals) or None
    return None


def training_problems(m: ModelSection, lora: LoraSection, g: GrpoSection, max_seq_len: int) -> list[str]:
    """The policy's and its training's checks beyond bounds: names that must be there, the installed TRL's loss
    types, an environment's import path, and room within ``data.max_seq_len`` (``max_seq_len``) for a prompt
    and for a turn's context."""
    errs: list[str] = []
    if not m.base_model.strip():
        errs.append("model.base_model must not be empty")
    if not lora.target_modules:
        errs.append("lora.target_modules must name at least one module")
    if lora.modules_to_save_learning_rate is not None and not lora.modules_to_save:
        errs.append(
            "lora.modules_to_save_learning_rate is set but lora.modules_to_save names no module: nothing would "
            "train at that rate (e.g. modules_to_save: [model.norm], the final norm)"
        )
    choices = trl_choices("loss_type")
    if choices and g.loss_type not in choices:
        errs.append(f"grpo.loss_type must be one of the installed TRL's: {', '.join(choices)}; got {g.loss_type!r}")
    if g.turns and g.turn_completion_length >= max_seq_len:
        errs.append(
            f"grpo.turn_completion_length={g.turn_completion_length} leaves no room for a turn's context within "
            f"data.max_seq_len={max_seq_len}: raise data.max_seq_len or lower grpo.turn_completion_length"
        )
    if g.max_completion_length >= max_seq_len:
        errs.append(
            f"grpo.max_completion_length={g.max_completion_length} leaves no room for a prompt within "
            f"data.max_seq_len={max_seq_len}: raise data.max_seq_len or lower grpo.max_completion_length"
        )
    if g.environment and not callable_spec(g.environment):
        errs.append(f"grpo.environment must be 'package.module:Class' (or empty); got {g.environment!r}")
    return errs
