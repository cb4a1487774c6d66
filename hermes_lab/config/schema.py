"""Typed configuration: the user's hermes_grpo_lora.yaml, plus the workbench's own sections, and every check.

Reads one YAML file (``params/*.yaml``); writes nothing. Every stage module takes a ``HermesConfig``.

The user's file (model / lora / grpo / reward / data) is accepted exactly as docs/SPEC.md shows it. The
workbench adds optional sections (execute / conversations / review / validate / ab / round / serve, declared in
hermes_lab.config.sections with their bounds) whose defaults fit the embedded task suite, so the user's file
alone is a complete config.

Rules, the way TRL's GRPOConfig documents itself and open-r1 maps YAML onto it:
- every field has a help text (``field_help`` / ``hermes-lab config --explain``);
- ``${VAR}`` and ``${VAR:-default}`` are filled from the environment; a missing variable is an error
  naming the variable, the key and the file line;
- an unknown key is an error naming it and listing the valid keys of its section;
- a bad value is an error naming the key. Every check lives here, next to the fields: types and choices
  (``Literal``) are enforced by the loader, ranges by each field's bounds (``_f(..., ge=2)``), the rest
  (cross-field, registry names, TRL's accepted values) by ``_problems``. Every problem is reported, not
  just the first. ``config.check.check_config(cfg, deep=True)`` (``hermes-lab config --check``, and the round before
  its first stage) adds what needs TRL/PEFT imported: their own config classes built from ours.

Secrets never live here: ``api_key_env`` holds the *name* of the environment variable with the key.

    hermes-lab config --params params/hermes_grpo_lora.yaml      # print the resolved config
    hermes-lab config --check --params params/hermes_grpo_lora.yaml   # every problem, exit 0 / 2
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import re
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints

import yaml

from hermes_lab.config.sections import (
    ABSection,
    ConversationsSection,
    ExecuteSection,
    ReviewSection,
    RoundSection,
    SandboxSection,
    ServeSection,
    ValidateSection,
    conversations_problems,
    sandbox_problems,
    serve_problems,
)
from hermes_lab.core import paths
from hermes_lab.core.yaml_typed import ConfigError, bound_problems, build, read_yaml
from hermes_lab.core.yaml_typed import field_with as _f
from hermes_lab.tasks import suite as tasks

EMBEDDED_MODEL = "embedded:tiny"  # builds the tiny local policy under runs/policies/ (no hub download)
META = ("source", "explicit")  # HermesConfig fields that are not config keys
# The names reward.types accepts, with their help. hermes_lab.rewards.registry implements exactly these (a test
# pins it); they are named here, below the rewards, so that a config is checked without importing them.
REWARD_TYPES: dict[str, str] = {
    "system": "system feedback, 'the tests pass' (reward.system: the embedded verifiers or 'module:function')",
    "comparison": "comparison feedback: the completion judged against the logged reference (reward.model's judge, "
    "or the local one)",
    "tests": "system feedback from execution: the completion's code runs against its task's tests in the sandbox "
    "(sandbox.*); the share passed on reward.scale (reward.tests_score); rows without tests score None",
    "group_comparison": "the group-relative comparison judge (RULER-like): one judge call scores a group's "
    "samples together on 0..scale; malformed replies are retried (reward.group_judge_retries), then the group "
    "falls back to the pointwise local judge; no reward.model: the local judge",
    "tool_call": "tool-call validity of a sampled assistant turn (turn-level GRPO, grpo.turns): its <tool_call> "
    "blocks parse, name a tool of the conversation's schema, and their arguments satisfy it; no call: None",
}


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


@dataclass
class LoraSection:
    r: int = _f(16, "LoRA rank.", ge=1)
    lora_alpha: int = _f(32, "LoRA scaling alpha (effective scale alpha/r).", gt=0)
    lora_dropout: float = _f(0.05, "Dropout on the LoRA path.", ge=0, lt=1)
    target_modules: list[str] = _f(["q_proj", "v_proj", "k_proj", "o_proj"], "Module names LoRA wraps.")
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
        "The embedded agent family: hermes_lab.tasks.agent:TimeEnv.",
    )
    max_turns: int = _f(
        2, "Episode mode: tool-calling turns per episode at most (TRL max_tool_calling_iterations).", ge=1, le=16
    )
    episode_steps: int = _f(0, "Episode mode: optimizer steps of the episode phase (0: grpo.max_steps).", ge=0)
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


@dataclass
class RewardSection:
    model: str | None = _f(
        None, "Judge model id for the comparison reward (OpenAI-compatible). Empty or 'local': the local judge."
    )
    base_url: str | None = _f(None, "OpenAI-compatible API root of the judge.")
    api_key_env: str = _f("TAOTOKEN_API_KEY", "NAME of the environment variable holding the judge's key.")
    types: list[str] = _f(
        ["system", "comparison"],
        "Reward functions: system (tests pass / verifier), comparison (judge vs the reference response), "
        "tests (the task's tests run on the completion's code), or 'module:function'.",
    )
    weights: list[float] | None = _f(None, "One weight per entry of types (default: all 1).")
    system: str = _f("verifier", "System feedback: 'verifier' (embedded task verifiers) or 'module:function'.")
    scale: float = _f(5, "Reward scale: rewards lie in 0..scale.", gt=0)
    success_threshold: float = _f(3, "A score >= this is a success (docs/SPEC.md: 3 on the 5 scale).", gt=0)
    judge_concurrency: int = _f(8, "Concurrent judge requests.", ge=1)
    judge_timeout_s: float = _f(30.0, "Judge request timeout in seconds.", gt=0)
    judge_retries: int = _f(4, "Retries on 429/5xx/timeouts, with exponential backoff.", ge=0)
    max_judge_failure_rate: float = _f(
        0.2,
        "Training stops when more than this share of the last judge_failure_window judged samples failed "
        "(a 429/5xx after the retries, a timeout, a reply without a score). Below it a failed sample falls "
        "back to its group's mean judge score, or to the system reward alone (see hermes_lab.rewards.registry).",
        ge=0,
        le=1,
    )
    judge_failure_window: int = _f(200, "Judged samples over which max_judge_failure_rate is measured.", ge=1)
    group_judge_retries: int = _f(
        2,
        "group_comparison: times a group is asked again when the judge's reply has the wrong number of scores "
        "(or none it can read); then the group falls back to the pointwise local judge (counted, never fatal).",
        ge=0,
    )
    tests_score: Literal["share", "all"] = _f(
        "share",
        "The tests reward: share (scale x the share of tests passed) or all (scale when every test passes, else "
        "0). Compile errors, timeouts, crashes, memory and output limits score 0 either way.",
    )
    code_from: Literal["auto", "fenced", "whole"] = _f(
        "auto",
        "The tests reward: the code of a completion. fenced: its last ```python block (none: scores 0, no_code); "
        "whole: the completion as it is; auto: the fenced block if there is one, else the whole completion.",
    )
    audit: Literal["block", "warn"] = _f(
        "block",
        "The reward audit before every training (hermes_lab.rewards.audit): each reward scores built-in adversarial "
        "completions (attacks on the tests' grader, requests for a high score, useless tool calls, an empty answer, "
        "the prompt echoed...). block: a completion paid above audit_threshold stops the round before training, "
        "named with its reward; warn: they are named and the round goes on.",
    )
    audit_threshold: float = _f(
        0.4,
        "The reward audit: an adversarial completion paid more than this share of scale is a finding (2 on the 5 "
        "scale). The verifier's partial credit and the local judge pay an echoed embedded prompt up to 0.32 of it.",
        ge=0,
        le=1,
    )


@dataclass
class DataSection:
    min_samples: int = _f(500, "New samples needed to trigger a training round.", ge=1)
    cooldown_hours: float = _f(24, "Minimum hours between two trainings (hard constraint).", ge=0)
    max_seq_len: int = _f(4096, "Max tokens of prompt + completion; longer prompts are flagged and left out.", ge=8)
    max_bad_fraction: float = _f(0.2, "Stop ingest when more than this share of lines is rejected.", ge=0, le=1)
    holdout_fraction: float = _f(0.1, "Share of task_ids held out as the regression set.", ge=0, le=1)
    review_fraction: float = _f(0.1, "Share of new records sampled for human spot-check.", ge=0, le=1)
    outlier_z: float = _f(4.0, "Robust z-score (median/MAD) past which a reward counts as an outlier.", gt=0)
    negative_weight: int = _f(2, "Times a negative (rolled-back round) prompt is repeated as a hard prompt.", ge=1)
    select: Literal["all", "mixed"] = _f(
        "mixed",
        "GRPO prompt selection from each prompt's logged outcomes (its samples grouped by prompt text). all: "
        "every prompt once. mixed: prompts whose samples both pass and fail (the groups GRPO learns from) are "
        "repeated mixed_weight times; prompts whose samples all pass or all fail (zero-signal groups) keep at "
        "most uniform_share of the set, the rest is left out and listed in left_out.jsonl; one-sample "
        "prompts (outcome unknown) weigh 1, negatives negative_weight (a mixed negative: the larger weight). "
        "Report: selection.json.",
    )
    mixed_weight: int = _f(
        2, "select: mixed: times a prompt with mixed outcomes (some samples pass, some fail) is repeated.", ge=1
    )
    uniform_share: float = _f(
        0.2,
        "select: mixed: most share of the GRPO prompt set's weight that prompts whose samples all pass or all "
        "fail may take (1: keep them all); which ones stay is a seeded hash of the prompt (data.seed).",
        ge=0,
        le=1,
    )
    max_line_bytes: int = _f(
        16 * 2**20,
        "Trajectory lines longer than this many bytes are rejected as 'line too "
        "long' (read in bounded memory); valid lines below it are accepted however long.",
        ge=1024,
    )
    memory_budget_mb: int = _f(
        512,
        "Prep's memory budget for record text, in MiB: lines are read in batches and the per-prompt tables "
        "are built in on-disk partitions sized to fit it, so peak memory does not grow with the input's size "
        "(only ~60 bytes of fixed-size fields per accepted record are kept for the whole input).",
        ge=64,
    )
    seed: int = _f(0, "Seed of the human review sample (the same data and seed give the same sample).")


@dataclass
class HermesConfig:
    model: ModelSection = field(default_factory=ModelSection, metadata={"help": "The policy."})
    lora: LoraSection = field(default_factory=LoraSection, metadata={"help": "PEFT LoraConfig."})
    grpo: GrpoSection = field(default_factory=GrpoSection, metadata={"help": "GRPO (TRL GRPOConfig)."})
    reward: RewardSection = field(default_factory=RewardSection, metadata={"help": "Reward functions."})
    data: DataSection = field(default_factory=DataSection, metadata={"help": "Data gates and distillation."})
    execute: ExecuteSection = field(default_factory=ExecuteSection, metadata={"help": "Execute step."})
    conversations: ConversationsSection = field(
        default_factory=ConversationsSection,
        metadata={"help": "Agent conversations in prep: input shapes and the rewards of logs that carry none."},
    )
    review: ReviewSection = field(default_factory=ReviewSection, metadata={"help": "Human review gate."})
    validate: ValidateSection = field(default_factory=ValidateSection, metadata={"help": "Regression gate."})
    ab: ABSection = field(default_factory=ABSection, metadata={"help": "A/B test and rollout."})
    round: RoundSection = field(default_factory=RoundSection, metadata={"help": "Round orchestration."})
    serve: ServeSection = field(default_factory=ServeSection, metadata={"help": "Live A/B gateway (hermes-lab serve)."})
    sandbox: SandboxSection = field(
        default_factory=SandboxSection, metadata={"help": "Where and under which limits the tests reward runs code."}
    )
    source: str | None = field(default=None, metadata={"help": "File this config was read from."})
    explicit: frozenset[str] = field(
        default=frozenset(), metadata={"help": "Dotted keys set by the file or overrides."}, repr=False
    )

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for k in META:
            d.pop(k, None)
        return d

    def flat_params(self) -> dict[str, Any]:
        """Flat 'section.key' -> value for MLflow params. Holds no secret: keys live in the env only."""
        out: dict[str, Any] = {}
        for sec, vals in self.to_dict().items():
            for k, v in vals.items():
                out[f"{sec}.{k}"] = v
        return out


# ------------------------------------------------------------------------------------------- checks
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


def ab_stage_problems(stages: Any, where: str = "ab.stages") -> list[str]:
    """The rollout plan: [ratio, seconds] pairs; ratios in (0, 1], starting below 1, never decreasing."""
    if not stages or any(not isinstance(s, list) or len(s) != 2 for s in stages):
        return [f"{where} must be a list of [ratio, seconds] pairs, got {stages!r}"]
    ratios, secs = [s[0] for s in stages], [s[1] for s in stages]
    out = []
    if any(not 0 < r <= 1 for r in ratios) or ratios[0] >= 1 or any(b < a for a, b in itertools.pairwise(ratios)):
        out.append(
            f"{where} ratios must lie in (0, 1], start below 1 (a test needs a baseline) and never decrease "
            f"(a monotone ramp keeps candidate units candidates), got {ratios}"
        )
    if any(s < 0 for s in secs) or secs[0] <= 0:
        out.append(f"{where} seconds must be >= 0, and > 0 for the first stage (it is tested), got {secs}")
    return out


def _callable_spec(value: str) -> bool:
    mod, _, fn = value.partition(":")
    return bool(re.fullmatch(r"[A-Za-z_][\w.]*", mod) and re.fullmatch(r"[A-Za-z_]\w*", fn))


def config_problems(cfg: HermesConfig) -> tuple[list[str], list[str]]:
    """(errors, warnings) of a built config: bounds, registry names, TRL's values, cross-field rules."""
    errs: list[str] = []
    warns: list[str] = []
    for f in dataclasses.fields(cfg):
        if f.name not in META:
            errs += bound_problems(f.name, getattr(cfg, f.name))
    m, g, r, d, a = cfg.model, cfg.grpo, cfg.reward, cfg.data, cfg.ab
    for key, value in (("model.api_key_env", m.api_key_env), ("reward.api_key_env", r.api_key_env)):
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", value or ""):  # never echo it: it may be the key
            errs.append(f"{key} must be the NAME of an environment variable (letters, digits, _), not the key")
    if not m.base_model.strip():
        errs.append("model.base_model must not be empty")
    if not cfg.lora.target_modules:
        errs.append("lora.target_modules must name at least one module")
    choices = trl_choices("loss_type")
    if choices and g.loss_type not in choices:
        errs.append(f"grpo.loss_type must be one of the installed TRL's: {', '.join(choices)}; got {g.loss_type!r}")
    if g.turns and g.turn_completion_length >= d.max_seq_len:
        errs.append(
            f"grpo.turn_completion_length={g.turn_completion_length} leaves no room for a turn's context within "
            f"data.max_seq_len={d.max_seq_len}: raise data.max_seq_len or lower grpo.turn_completion_length"
        )
    if g.max_completion_length >= d.max_seq_len:
        errs.append(
            f"grpo.max_completion_length={g.max_completion_length} leaves no room for a prompt within "
            f"data.max_seq_len={d.max_seq_len}: raise data.max_seq_len or lower grpo.max_completion_length"
        )
    if g.environment and not _callable_spec(g.environment):
        errs.append(f"grpo.environment must be 'package.module:Class' (or empty); got {g.environment!r}")
    if not r.types:
        errs.append("reward.types must name at least one reward")
    for t in r.types:
        if t not in REWARD_TYPES and not _callable_spec(t):
            errs.append(
                f"reward.types entry '{t}' is unknown: use {', '.join(REWARD_TYPES)} or 'package.module:function'"
            )
    if r.weights is not None and len(r.weights) != len(r.types):
        errs.append(f"reward.weights needs one weight per reward type ({len(r.types)}), got {len(r.weights)}")
    if r.system != "verifier" and not _callable_spec(r.system):
        errs.append(f"reward.system must be 'verifier' or 'package.module:function', got {r.system!r}")
    if r.success_threshold > r.scale:
        errs.append(f"reward.success_threshold {r.success_threshold:g} lies above reward.scale {r.scale:g}")
    if "comparison" in r.types and r.model and r.model.strip().lower() != "local":
        from hermes_lab.llm.base import ApiConfigError, normalize_base_url

        try:
            normalize_base_url(r.base_url, "reward.base_url (the judge API for reward.model)")
        except ApiConfigError as e:
            errs.append(str(e))
    bad_fams = [x for x in cfg.execute.families if x not in tasks.FAMILIES]
    if bad_fams:
        errs.append(f"execute.families: unknown family '{bad_fams[0]}'; valid: {', '.join(tasks.FAMILIES)}")
    if cfg.review.agreement_metric == "within1" and cfg.review.label_mode == "passfail":
        errs.append("review.agreement_metric within1 needs score labels: review.label_mode passfail gives only 0/5")
    errs += ab_stage_problems(a.stages)
    if not cfg.round.registered_model.strip() or "'" in cfg.round.registered_model:
        errs.append("round.registered_model must be a non-empty name without quotes")
    errs += serve_problems(cfg.serve)
    errs += conversations_problems(cfg.conversations)
    errs += sandbox_problems(cfg.sandbox)
    if "tests" in cfg.reward.types and cfg.sandbox.executor == "local" and not cfg.sandbox.require_isolation:
        warns.append(
            "sandbox.require_isolation is false: completions run even where this machine lacks a sandbox layer "
            "(the train stage and inspect's sandbox diagnostic name what is then not enforced; so does "
            "hermes-lab doctor --params FILE)"
        )
    if a.plan_power > 0 and a.mode == "live":
        warns.append(
            "ab.plan_power plans simulated traffic only: with ab.mode live the gateway's traffic sets the rate"
        )
    ex = cfg.execute
    if m.base_model == EMBEDDED_MODEL and ex.num_tasks * ex.samples_per_task < d.min_samples:
        warns.append(
            f"execute.num_tasks {ex.num_tasks} x execute.samples_per_task {ex.samples_per_task} < data.min_samples "
            f"{d.min_samples}: a first round on the embedded default has too few new samples and stops at the data gate"
        )
    return errs, warns


def ab_stages(cfg: HermesConfig, ratio: float | None = None) -> list[list[float]]:
    """The rollout plan, with the first ratio replaced by ``ratio`` (ab_run --ratio), checked."""
    stages = [[float(x) for x in s] for s in cfg.ab.stages]
    if ratio is not None:
        stages[0][0] = float(ratio)
        problems = ab_stage_problems(stages, "--ratio with ab.stages")
        if problems:
            raise ConfigError("; ".join(problems), problems)
    return stages


def problems_error(src: str, problems: list[str]) -> ConfigError:
    if len(problems) == 1:
        return ConfigError(f"{src}: {problems[0]}", problems)
    return ConfigError(f"{src}: {len(problems)} problems: " + "; ".join(problems), problems)


# ---------------------------------------------------------------------------------------------- loading
def _resolve_alias(cfg: HermesConfig, problems: list[str]) -> None:
    """ab.traffic_ratio is ab.stages[0][0] by another name: the one set explicitly wins; both set, they must agree."""
    a = cfg.ab
    if ab_stage_problems(a.stages):
        return  # reported by the checks
    ratio_set, stages_set = "ab.traffic_ratio" in cfg.explicit, "ab.stages" in cfg.explicit
    if ratio_set and stages_set and a.traffic_ratio != a.stages[0][0]:
        problems.append(
            f"ab.traffic_ratio ({a.traffic_ratio}) and the first ratio of ab.stages ({a.stages[0][0]}) "
            f"disagree: they are the same setting, set one of them"
        )
    elif ratio_set:
        a.stages = [[a.traffic_ratio, a.stages[0][1]], *a.stages[1:]]
    else:
        a.traffic_ratio = a.stages[0][0]


def set_overrides(items: list[str]) -> dict[str, Any]:
    """The ``--set KEY=VALUE`` flags of a command as ``load_config`` overrides. Values stay strings (typing
    coerces them, as it does the YAML's); one in brackets is a YAML list: --set 'reward.types=[system,tests]'."""
    out: dict[str, Any] = {}
    for kv in items:
        k, sep, v = kv.partition("=")
        if not sep:
            raise ConfigError(f"--set {kv!r}: use KEY=VALUE")
        if v.strip().startswith("["):
            try:
                v = yaml.safe_load(v)
            except yaml.YAMLError as e:
                raise ConfigError(f"--set {kv!r}: not a YAML list ({e})") from None
        out[k] = v
    return out


def load_config(
    path: str | os.PathLike[str] | None = None,
    overrides: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
) -> HermesConfig:
    """Read, interpolate, type and check a config. ``overrides`` are dotted keys ('grpo.max_steps': 5)."""
    # as given relative to the cwd if it is there, else relative to the project root (a notebook's kernel
    # runs in notebooks/, a shell anywhere): hermes_lab.core.paths
    if path is not None:
        given, path = path, paths.config_file(path)
        if not path.is_file():
            raise ConfigError(
                f"config file not found: {given} (looked in {Path.cwd()} "
                f"and in the project root {paths.project_root()})"
            )
    src = str(path) if path is not None else "<defaults>"
    raw = read_yaml(path, dict(os.environ) if env is None else env, overrides)
    problems: list[str] = []
    cfg = build(HermesConfig, raw, "", problems, skip=META)
    cfg.source = src if path is not None else None
    cfg.explicit = frozenset(f"{s}.{k}" for s, kv in raw.items() if isinstance(kv, dict) for k in kv)
    _resolve_alias(cfg, problems)
    problems += config_problems(cfg)[0]  # a key that failed to load kept its default: no false alarm from it
    if problems:  # name the file too: the key alone does not say which YAML to fix
        raise problems_error(src, problems)
    from hermes_lab.core.redaction import register_secret_env  # their values are masked wherever we log or print

    s = cfg.serve
    register_secret_env(
        cfg.model.api_key_env,
        cfg.reward.api_key_env,
        s.api_key_env,
        s.baseline_key_env,
        s.candidate_key_env,
        s.lora_upstream_key_env,
        cfg.sandbox.api_key_env,
    )
    _resolve_paths(cfg)
    return cfg


def _resolve_paths(cfg: HermesConfig) -> None:
    """Path-valued fields -> absolute, against the project root: one runs/ whatever the cwd (paths.py)."""
    cfg.round.runs_dir = str(paths.resolve(cfg.round.runs_dir))
    cfg.conversations.feedback = [str(paths.resolve(f)) for f in cfg.conversations.feedback]
    if cfg.model.adapter and paths.is_local_spec(cfg.model.adapter):
        cfg.model.adapter = str(paths.resolve(cfg.model.adapter))
    cfg.model.base_model = paths.resolve_spec(cfg.model.base_model)


def field_help(cls: type = HermesConfig, prefix: str = "") -> dict[str, str]:
    """'section.key' -> help text with its choices and bounds, for --explain and notebooks."""
    out: dict[str, str] = {}
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if cls is HermesConfig and f.name in META:  # (a section may have a key named source: execute.source)
            continue
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            out.update(field_help(tp, f"{prefix}{f.name}."))
            continue
        text = f.metadata.get("help", "")
        choices = get_args(tp) if get_origin(tp) is Literal else None
        if f"{prefix}{f.name}" == "grpo.loss_type":
            choices = trl_choices("loss_type")
        if f"{prefix}{f.name}" == "reward.types":
            choices = tuple(f"{k} ({v})" for k, v in REWARD_TYPES.items())
        if choices:
            text += f" Choices: {', '.join(choices)}."
        ge, gt, le, lt = f.metadata.get("bounds", (None,) * 4)
        bounds = [f"{op} {b:g}" for op, b in ((">=", ge), (">", gt), ("<=", le), ("<", lt)) if b is not None]
        if bounds:
            text += f" ({', '.join(bounds)})"
        out[f"{prefix}{f.name}"] = text
    return out


def dump_config(cfg: HermesConfig, path: str | os.PathLike[str]) -> None:
    Path(path).write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False), encoding="utf-8")
