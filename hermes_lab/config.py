"""Typed configuration: the user's hermes_grpo_lora.yaml, plus the workbench's own sections.

Reads one YAML file (``params/*.yaml``); writes nothing. Every stage module takes a ``HermesConfig``.

The user's file (model / lora / grpo / reward / data) is accepted exactly as SPEC.md shows it. The
workbench adds optional sections (execute / review / validate / ab / round / tracking) whose defaults
fit the embedded task suite, so the user's file alone is a complete config.

Rules, the way TRL's GRPOConfig documents itself and open-r1 maps YAML onto it:
- every field has a help text (``field_help`` / ``hermes-lab config --explain``);
- ``${VAR}`` and ``${VAR:-default}`` are filled from the environment; a missing variable is an error
  naming the variable, the key and the file line;
- an unknown key is an error naming it and listing the valid keys of its section;
- a bad value (wrong type, out of range) is an error naming the key.

Secrets never live here: ``api_key_env`` holds the *name* of the environment variable with the key.

    hermes-lab config --params params/hermes_grpo_lora.yaml      # print the resolved config
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

import yaml

from hermes_lab import paths

EMBEDDED_MODEL = "embedded:tiny"  # builds the tiny local policy under runs/policies/ (no hub download)


class ConfigError(ValueError):
    """A config problem, phrased so the user can fix it from the message alone."""


def _f(default: Any = dataclasses.MISSING, help: str = "", **kw: Any) -> Any:
    if isinstance(default, (list, dict)):
        value = default
        return field(default_factory=lambda: type(value)(value), metadata={"help": help}, **kw)
    return field(default=default, metadata={"help": help}, **kw)


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
    dtype: str = _f("auto", "Torch dtype to load the policy in: auto, float32, bfloat16, float16.")
    trust_remote_code: bool = _f(False, "Pass trust_remote_code to from_pretrained (off: never run hub code).")
    seed: int = _f(0, "Seed of the embedded tiny policy (its build is deterministic by seed).")


@dataclass
class LoraSection:
    r: int = _f(16, "LoRA rank.")
    lora_alpha: int = _f(32, "LoRA scaling alpha (effective scale alpha/r).")
    lora_dropout: float = _f(0.05, "Dropout on the LoRA path.")
    target_modules: list[str] = _f(["q_proj", "v_proj", "k_proj", "o_proj"], "Module names LoRA wraps.")
    bias: str = _f("none", "Which biases train: none, all, lora_only.")
    task_type: str = _f("CAUSAL_LM", "PEFT task type.")


@dataclass
class GrpoSection:
    group_size: int = _f(8, "Completions sampled per prompt (TRL num_generations).")
    kl_coefficient: float = _f(
        0.04, "KL penalty (TRL beta). TRL's default 0.0 disables KL and the reference model; we always pass this value."
    )
    clip_range: float = _f(0.2, "Policy-ratio clipping (TRL epsilon).")
    learning_rate: float = _f(1.0e-5, "AdamW learning rate (TRL's default 1e-6 is too low for LoRA).")
    max_steps: int = _f(300, "Optimizer steps.")
    per_device_batch_size: int = _f(
        2, "Prompts per device per micro-batch (TRL counts completions: we multiply by group_size when mapping)."
    )
    gradient_accumulation: int = _f(8, "Micro-batches per optimizer step.")
    temperature: float = _f(0.9, "Sampling temperature; 0.8-1.0 keeps groups diverse.")
    max_completion_length: int = _f(256, "Max new tokens per completion (prompt + this <= data.max_seq_len).")
    num_iterations: int = _f(1, "PPO-style updates per generation batch (TRL num_iterations).")
    loss_type: str = _f("dapo", "TRL loss_type: grpo, dr_grpo, dapo, bnpo.")
    scale_rewards: str = _f("group", "TRL scale_rewards: group, batch or none.")
    logging_steps: int = _f(1, "Log every N steps (every TRL metric goes to MLflow).")
    seed: int = _f(0, "Training seed.")
    gradient_checkpointing: bool = _f(True, "Trade compute for memory (TRL's default). Off for tiny models on CPU.")
    use_vllm: bool = _f(False, "GPU only: generate with vLLM (TRL use_vllm).")
    vllm_mode: str = _f("colocate", "vLLM mode when use_vllm: colocate or server.")
    kl_warn: float = _f(0.5, "Health guard: warn 'raise kl_coefficient' when KL exceeds this.")
    zero_std_warn: float = _f(0.8, "Health guard: warn 'raise temperature' when frac_reward_zero_std exceeds this.")
    max_train_prompts: int = _f(0, "Cap on GRPO prompts per round (0: all).")
    save_steps: int = _f(
        0,
        "Save a checkpoint (LoRA adapter + optimizer state) under <output>/trl/ every N steps, so `train "
        "--resume` continues from the last one. 0: about four times a run (ceil(max_steps / 4), at most 50).",
    )
    save_total_limit: int = _f(2, "Checkpoints kept under <output>/trl/ (the oldest are deleted).")


@dataclass
class RewardSection:
    model: str | None = _f(
        None, "Judge model id for the comparison reward (OpenAI-compatible). Empty or 'local': the local judge."
    )
    base_url: str | None = _f(None, "OpenAI-compatible API root of the judge.")
    api_key_env: str = _f("TAOTOKEN_API_KEY", "NAME of the environment variable holding the judge's key.")
    types: list[str] = _f(
        ["system", "comparison"],
        "Reward functions: system (tests pass / verifier), "
        "comparison (judge vs the reference response), or 'module:function'.",
    )
    weights: list[float] | None = _f(None, "One weight per entry of types (default: all 1).")
    system: str = _f("verifier", "System feedback: 'verifier' (embedded task verifiers) or 'module:function'.")
    scale: float = _f(5, "Reward scale: rewards lie in 0..scale.")
    success_threshold: float = _f(3, "A score >= this is a success (SPEC: 3 on the 5 scale).")
    judge_concurrency: int = _f(8, "Concurrent judge requests.")
    judge_timeout_s: float = _f(30.0, "Judge request timeout in seconds.")
    judge_retries: int = _f(4, "Retries on 429/5xx/timeouts, with exponential backoff.")
    max_judge_failure_rate: float = _f(
        0.2,
        "Training stops when more than this share of the last judge_failure_window judged samples failed "
        "(a 429/5xx after the retries, a timeout, a reply without a score). Below it a failed sample falls "
        "back to its group's mean judge score, or to the system reward alone (see hermes_lab.rewards).",
    )
    judge_failure_window: int = _f(200, "Judged samples over which max_judge_failure_rate is measured.")


@dataclass
class DataSection:
    min_samples: int = _f(500, "New samples needed to trigger a training round.")
    cooldown_hours: float = _f(24, "Minimum hours between two trainings (hard constraint).")
    max_seq_len: int = _f(4096, "Max tokens of prompt + completion; longer prompts are flagged and left out.")
    max_bad_fraction: float = _f(0.2, "Stop ingest when more than this share of lines is rejected.")
    holdout_fraction: float = _f(0.1, "Share of task_ids held out as the regression set.")
    review_fraction: float = _f(0.1, "Share of new records sampled for human spot-check.")
    outlier_z: float = _f(4.0, "Robust z-score (median/MAD) past which a reward counts as an outlier.")
    negative_weight: int = _f(2, "Times a negative (rolled-back round) prompt is repeated as a hard prompt.")
    max_line_bytes: int = _f(
        16 * 2**20,
        "Trajectory lines longer than this many bytes are rejected as 'line too "
        "long' (read in bounded memory); valid lines below it are accepted however long.",
    )
    seed: int = _f(0, "Seed of the human review sample (the same data and seed give the same sample).")
    memory_budget_mb: int = _f(
        512,
        "Prep's memory budget for record text, in MiB: lines are read in batches and the per-prompt tables "
        "are built in on-disk partitions sized to fit it, so peak memory does not grow with the input's size "
        "(only ~60 bytes of fixed-size fields per accepted record are kept for the whole input).",
    )


@dataclass
class ExecuteSection:
    num_tasks: int = _f(640, "Tasks the policy executes per round on the embedded default (>= min_samples).")
    temperature: float = _f(0.9, "Sampling temperature when executing.")
    max_new_tokens: int = _f(16, "Max new tokens per response.")
    batch_size: int = _f(64, "Generation batch size.")
    families: list[str] = _f([], "Task families to draw (empty: all).")


@dataclass
class ReviewSection:
    simulate: bool = _f(
        False, "Unattended rounds only: the task verifier acts as a simulated reviewer (labels marked simulated)."
    )
    min_labels: int = _f(
        0,
        "Labels needed before the agreement gate can decide (the whole queue when the queue is smaller). "
        "0: enough for a Wilson interval of +-max_ci_halfwidth around min_agreement (73 at 90% and 0.07).",
    )
    max_ci_halfwidth: float = _f(
        0.07,
        "Precision the gate needs: the default min_labels gives a 95% Wilson interval this wide either side, "
        "and max_items is sized by it. Pass needs the interval entirely above min_agreement, blocked entirely "
        "below; otherwise the verdict is 'inconclusive: label N more' and the round waits.",
    )
    max_items: int = _f(
        0,
        "Cap on the review items the gate counts (the queue's first items, in prep's random order): a large "
        "10% sample need not be labelled whole. 0: enough for +-max_ci_halfwidth at 50% agreement (193).",
    )
    min_agreement: float = _f(0.9, "Reward-model/human agreement needed to train.")
    label_mode: str = _f("score", "Label buttons: score (0..5) or passfail.")
    agreement_metric: str = _f(
        "threshold",
        "Raw agreement the gate compares with min_agreement: threshold "
        "(reward model and reviewer on the same side of reward.success_threshold) or "
        "within1 (|reward - label| <= 1; score labels only).",
    )
    min_kappa: float = _f(
        0.0,
        "Also block when Cohen's kappa on pass/fail is below this (0: report only). Kappa "
        "discounts chance agreement: with 95% passes on both sides, 90% raw agreement can be "
        "kappa ~0.",
    )
    kappa_weights: str = _f(
        "quadratic",
        "Weights of the ordinal kappa on integer-binned scores: quadratic "
        "(a 5-vs-0 miss costs 25x a 1-point miss) or linear.",
    )


@dataclass
class ValidateSection:
    eval_tasks_per_family: int = _f(64, "Held-out tasks per family for the regression gate.")
    samples_per_task: int = _f(1, "Samples per task (sampled pass rate).")
    tolerance: float = _f(
        0.05,
        "Non-inferiority margin: the candidate passes a family only if the upper confidence bound of its drop "
        "in pass rate (paired on the same tasks and seeds) is below this.",
    )
    temperature: float = _f(0.9, "Sampling temperature of the regression eval, the same for baseline and candidate.")
    seed: int = _f(0, "Seed of the regression eval (task generation and sampling), the same for both arms.")
    alpha: float = _f(
        0.05,
        "One-sided error level of each family's upper bound on the drop (a family that regressed by the "
        "tolerance passes with probability <= alpha; every family must pass, so no multiplicity correction), "
        "and of the reward-trend test in the curve diagnostics.",
    )
    power_drop: float = _f(
        0.10, "Drop in pass rate whose chance of being stopped the gate reports per family (its power)."
    )
    min_power: float = _f(
        0.8,
        "Warn when a family's set is too small: a power_drop drop stopped, or an equally good candidate "
        "passed, less often than this.",
    )
    kl_spike_k: float = _f(
        6.0,
        "Diagnostics: a KL value more than k robust std (1.4826*MAD) above the rolling "
        "median of the previous steps is a spike.",
    )
    kl_spike_min_jump: float = _f(0.02, "Diagnostics: a KL spike must also jump by at least this much (absolute).")
    kl_spike_ratio: float = _f(
        3.0,
        "Diagnostics: a KL spike must also reach this many times the value the "
        "previous steps predict (per-batch KL wiggles 1.5x in a healthy run).",
    )
    curve_window: int = _f(10, "Diagnostics: rolling window (logging steps) for the KL spike median/MAD.")
    trend_window: float = _f(
        0.25, "Diagnostics: share of steps in the first/last window compared to decide whether the reward rises."
    )
    reward_outlier_z: float = _f(
        6.0,
        "Diagnostics: robust z (residual from a rolling median over MAD) past which a per-step reward is an outlier.",
    )


@dataclass
class ABSection:
    traffic_ratio: float = _f(0.1, "Candidate share in the first stage.")
    stages: list[list[float]] = _f(
        [[0.1, 7200], [0.3, 14400], [1.0, 0]], "Rollout stages as [ratio, seconds]; a final ratio 1.0 means promoted."
    )
    request_rate: float = _f(0.25, "Simulated requests per second.")
    salt: str = _f("", "Per-experiment salt for the router (empty: the user's bucket formula bit for bit).")
    alpha: float = _f(0.05, "Significance level.")
    srm_alpha: float = _f(0.001, "Sample-ratio-mismatch threshold: below it, hold.")
    max_error_rate: float = _f(0.02, "Guardrail: candidate error rate above baseline by more than this rolls back.")
    max_latency_ratio: float = _f(1.5, "Guardrail: candidate p95 latency over baseline p95 above this rolls back.")
    rule: str = _f("sequential", "Decision rule: sequential (always-valid) or user (the SPEC's p<0.05 rule).")
    look_every: float = _f(
        900.0,
        "Seconds between two interim looks within a stage. Harm, guardrails and SRM are "
        "checked at every look; promotion only from the stage's planned end.",
    )
    max_extension: float = _f(
        1.0,
        "An inconclusive stage is extended by up to this many times its planned length; "
        "still inconclusive then: the rollout stops at 'keep observing'.",
    )
    min_per_arm: int = _f(30, "Units (requests, or users when unit is user) each arm needs before any decision.")
    guardrail_alpha: float = _f(
        0.01,
        "Error level of each guardrail's always-valid one-sided bound (error rate, p95 latency): a guardrail "
        "rolls back only when the candidate is worse by the margin AND the bound shows it is worse at all.",
    )
    unit: str = _f(
        "request",
        "Randomisation unit: request, or user (requests of one user share an arm). Decisions count units: "
        "SRM, min_per_arm and the always-valid bounds use one observation per unit.",
    )
    num_users: int = _f(2000, "Simulated user pool when unit is user.")
    task_split: str = _f("heldout", "Tasks the simulated traffic draws: heldout (never trained on) or any.")
    latency_median_ms: float = _f(120.0, "Simulated latency: median of the lognormal base latency (ms).")
    latency_sigma: float = _f(0.35, "Simulated latency: sigma of the lognormal base latency.")
    latency_ms_per_char: float = _f(
        4.0, "Simulated latency: extra ms per response character (longer answers are slower)."
    )


@dataclass
class ServeSection:
    host: str = _f("127.0.0.1", "Address `hermes-lab serve` binds (loopback: only this machine can reach the gateway).")
    port: int = _f(8700, "Port of the gateway (0: any free port, printed at start).")
    experiment: str = _f(
        "",
        "Name of the live experiment; its log dir is runs/live/<experiment>. Empty: "
        "'<baseline>-vs-<candidate>' from the arms (a restart with the same arms continues it).",
    )
    log_dir: str = _f("", "Log dir (requests.jsonl, feedback.jsonl, experiment.json). Empty: runs/live/<experiment>.")
    baseline: str = _f(
        "embedded:tiny",
        "Baseline arm: embedded:tiny, a model dir, a LoRA adapter dir, a train output dir "
        "(runs/round-NN/train), or the http(s) root of an OpenAI-compatible server (then set baseline_model).",
    )
    candidate: str = _f(
        "latest",
        "Candidate arm, as baseline; 'latest': the newest round's trained adapter, else embedded:tiny (an A/A test).",
    )
    baseline_model: str = _f(
        "", "Model id the baseline upstream serves (required for a URL arm, e.g. a vLLM LoRA name)."
    )
    candidate_model: str = _f("", "Model id the candidate upstream serves (required for a URL arm).")
    baseline_key_env: str = _f("", "NAME of the env var with the baseline upstream's key (empty: no key sent).")
    candidate_key_env: str = _f("", "NAME of the env var with the candidate upstream's key (empty: no key sent).")
    public_model: str = _f("hermes", "The one model name clients ask for; which arm answers is the gateway's business.")
    api_key_env: str = _f(
        "", "NAME of the env var with the gateway's own key; set: every /v1 call needs 'Authorization: Bearer <key>'."
    )
    max_body_bytes: int = _f(4 * 2**20, "Largest request body accepted (bigger: 413).")
    durability: str = _f(
        "write",
        "write: a request's record is written to the log file before the last byte of its answer, fsync "
        "follows within fsync_ms (a kill -9 loses nothing; a power loss may lose the last fsync_ms). fsync: the "
        "answer also waits for the fsync covering its record (group commit; survives power loss, +1 fsync).",
    )
    fsync_ms: float = _f(100.0, "durability write: longest a written log record waits for its fsync.")
    upstream_client: str = _f("aiohttp", "HTTP client of URL arms: aiohttp (measured faster) or httpx.")
    upstream_timeout_s: float = _f(600.0, "Timeout of one upstream request (a long generation included).")
    upstream_connections: int = _f(256, "Open connections kept per upstream arm.")
    batch_wait_ms: float = _f(5.0, "In-process arms: collect requests this long into one batched generate.")
    max_batch: int = _f(32, "In-process arms: most requests in one batched generate.")
    max_new_tokens: int = _f(
        256, "In-process arms: cap on a request's max_tokens (a request without one gets execute.max_new_tokens)."
    )
    feedback_source: str = _f(
        "system",
        "Feedback source that counts as the reward (the latest such feedback of a request wins); "
        "'any': the latest feedback of any source.",
    )
    score_unrewarded: str = _f(
        "none",
        "Answered requests without feedback in prep: none (kept aside, counted as unrewarded) or judge "
        "(scored by the comparison judge against the best rewarded response to the same prompt).",
    )
    mlflow_traces: bool = _f(
        False, "Also write each request as an MLflow trace and each feedback as an assessment (off the request path)."
    )
    access_log: bool = _f(False, "uvicorn's access log (one line per request; never headers or bodies).")


@dataclass
class RoundSection:
    runs_dir: str = _f("runs", "Where rounds, the MLflow store and the policies live.")
    simulated_clock: bool = _f(False, "Use a simulated clock (embedded flywheel: cooldown without waiting a day).")
    experiment: str = _f("hermes-lab", "MLflow experiment name.")
    registered_model: str = _f("hermes-policy", "MLflow registered model holding the 'champion' alias.")


@dataclass
class HermesConfig:
    model: ModelSection = field(default_factory=ModelSection, metadata={"help": "The policy."})
    lora: LoraSection = field(default_factory=LoraSection, metadata={"help": "PEFT LoraConfig."})
    grpo: GrpoSection = field(default_factory=GrpoSection, metadata={"help": "GRPO (TRL GRPOConfig)."})
    reward: RewardSection = field(default_factory=RewardSection, metadata={"help": "Reward functions."})
    data: DataSection = field(default_factory=DataSection, metadata={"help": "Data gates and distillation."})
    execute: ExecuteSection = field(default_factory=ExecuteSection, metadata={"help": "Execute step."})
    review: ReviewSection = field(default_factory=ReviewSection, metadata={"help": "Human review gate."})
    validate: ValidateSection = field(default_factory=ValidateSection, metadata={"help": "Regression gate."})
    ab: ABSection = field(default_factory=ABSection, metadata={"help": "A/B test and rollout."})
    round: RoundSection = field(default_factory=RoundSection, metadata={"help": "Round orchestration."})
    serve: ServeSection = field(default_factory=ServeSection, metadata={"help": "Live A/B gateway (hermes-lab serve)."})
    source: str | None = field(default=None, metadata={"help": "File this config was read from."})

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("source", None)
        return d

    def flat_params(self) -> dict[str, Any]:
        """Flat 'section.key' -> value for MLflow params. Holds no secret: keys live in the env only."""
        out: dict[str, Any] = {}
        for sec, vals in self.to_dict().items():
            for k, v in vals.items():
                out[f"{sec}.{k}"] = v
        return out


# ---------------------------------------------------------------------------------------------- loading
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
_COMMENT = re.compile(r"(?:^|\s)#")


def _interpolate(text: str, source: str, env: dict[str, str]) -> str:
    lines = text.splitlines(keepends=True)
    for i, line in enumerate(lines):
        # comments may mention ${VAR}: only the part before a YAML comment ('#' at the line start or after
        # whitespace, a tab included) is interpolated
        m_comment = _COMMENT.search(line)
        cut = m_comment.start() if m_comment else len(line)
        code, sep, comment = line[:cut], "", line[cut:]

        def sub(m: re.Match[str], code: str = code, i: int = i) -> str:
            name, default = m.group(1), m.group(2)
            if name in env and env[name] != "":
                return env[name]
            if default is not None:
                return default
            key = code.split(":", 1)[0].strip() or "?"
            raise ConfigError(
                f"{source}:{i + 1}: environment variable {name} is not set (used by key '{key}'). "
                f"Set it, e.g. `export {name}=...`, or write ${{{name}:-default}}."
            )

        lines[i] = _VAR.sub(sub, code) + sep + comment
    return "".join(lines)


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp)).replace("typing.", "")


def _coerce(value: Any, tp: Any, where: str) -> Any:
    origin, args = get_origin(tp), get_args(tp)
    if value is None:
        if type(None) in args:
            return None
        raise ConfigError(f"{where}: must not be empty (expected {_type_name(tp)})")
    if args and type(None) in args:  # Optional[X]
        (inner,) = [a for a in args if a is not type(None)]
        return _coerce(value, inner, where)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        return [_coerce(v, args[0], f"{where}[{j}]") for j, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in {"true", "false", "1", "0", "yes", "no"}:
            return value.lower() in {"true", "1", "yes"}
        raise ConfigError(f"{where}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, bool) or not (
            isinstance(value, int) or (isinstance(value, str) and value.strip().lstrip("-").isdigit())
        ):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return int(value)
    if tp is float:
        try:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: expected a number, got {value!r}") from None
    if tp is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return str(value)
    return value


def _build(cls: type, raw: Any, where: str) -> Any:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping of keys, got {raw!r}")
    hints = get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.name != "source"]
    unknown = [k for k in raw if k not in names]
    if unknown:
        raise ConfigError(f"{where or 'top level'}: unknown key '{unknown[0]}'. Valid keys: {', '.join(names)}")
    kwargs = {}
    for k, v in raw.items():
        tp = hints[k]
        key_where = f"{where}.{k}" if where else k
        kwargs[k] = _build(tp, v, key_where) if dataclasses.is_dataclass(tp) else _coerce(v, tp, key_where)
    return cls(**kwargs)


def _check(cfg: HermesConfig, src: str) -> None:
    def bad(key: str, msg: str) -> None:
        raise ConfigError(f"{src}: {key} {msg}")

    g, r, d = cfg.grpo, cfg.reward, cfg.data
    if g.group_size < 2:
        bad("grpo.group_size", f"must be >= 2 (GRPO needs a group to compute advantages), got {g.group_size}")
    if g.kl_coefficient < 0:
        bad("grpo.kl_coefficient", "must be >= 0")
    if not 0 < g.clip_range < 1:
        bad("grpo.clip_range", f"must lie in (0, 1), got {g.clip_range}")
    if not 0 < g.learning_rate < 1:
        bad("grpo.learning_rate", f"must lie in (0, 1), got {g.learning_rate}")
    for k in ("max_steps", "per_device_batch_size", "gradient_accumulation", "max_completion_length"):
        if getattr(g, k) < 1:
            bad(f"grpo.{k}", "must be >= 1")
    if not 0 < g.temperature <= 2:
        bad("grpo.temperature", f"must lie in (0, 2], got {g.temperature}")
    if g.loss_type not in {"grpo", "dr_grpo", "dapo", "bnpo"}:
        bad("grpo.loss_type", "must be one of grpo, dr_grpo, dapo, bnpo")
    if g.scale_rewards not in {"group", "batch", "none"}:
        bad("grpo.scale_rewards", "must be one of group, batch, none")
    if r.scale <= 0:
        bad("reward.scale", "must be > 0")
    if not r.types:
        bad("reward.types", "must name at least one reward")
    if r.weights is not None and len(r.weights) != len(r.types):
        bad("reward.weights", f"needs one weight per reward type ({len(r.types)}), got {len(r.weights)}")
    if d.min_samples < 1 or d.cooldown_hours < 0 or d.max_seq_len < 8:
        bad("data", "min_samples >= 1, cooldown_hours >= 0 and max_seq_len >= 8 are required")
    for k in ("max_bad_fraction", "holdout_fraction", "review_fraction"):
        if not 0 <= getattr(d, k) <= 1:
            bad(f"data.{k}", "must lie in [0, 1]")
    if d.max_line_bytes < 1024:
        bad("data.max_line_bytes", f"must be >= 1024, got {d.max_line_bytes}")
    if d.memory_budget_mb < 64:
        bad("data.memory_budget_mb", f"must be >= 64 (MiB), got {d.memory_budget_mb}")
    if not 0 <= r.max_judge_failure_rate <= 1:
        bad("reward.max_judge_failure_rate", f"must lie in [0, 1], got {r.max_judge_failure_rate}")
    if r.judge_failure_window < 1:
        bad("reward.judge_failure_window", "must be >= 1")
    if g.save_steps < 0:
        bad("grpo.save_steps", "must be >= 0 (0: about four checkpoints a run)")
    if g.save_total_limit < 1:
        bad("grpo.save_total_limit", "must be >= 1 (--resume needs the last checkpoint)")
    if cfg.lora.r < 1:
        bad("lora.r", "must be >= 1")
    if not 0 < cfg.ab.traffic_ratio <= 1:
        bad("ab.traffic_ratio", "must lie in (0, 1]")
    if cfg.ab.rule not in {"sequential", "user"}:
        bad("ab.rule", "must be sequential or user")
    if not 0 < cfg.ab.guardrail_alpha < 1:
        bad("ab.guardrail_alpha", f"must lie in (0, 1), got {cfg.ab.guardrail_alpha}")
    if cfg.review.label_mode not in {"score", "passfail"}:
        bad("review.label_mode", "must be score or passfail")
    rv, v = cfg.review, cfg.validate
    if rv.agreement_metric not in {"threshold", "within1"}:
        bad("review.agreement_metric", f"must be threshold or within1, got {rv.agreement_metric!r}")
    if rv.kappa_weights not in {"quadratic", "linear"}:
        bad("review.kappa_weights", f"must be quadratic or linear, got {rv.kappa_weights!r}")
    if not 0 <= rv.min_agreement <= 1:
        bad("review.min_agreement", f"must lie in [0, 1], got {rv.min_agreement}")
    if rv.min_kappa > 1:
        bad("review.min_kappa", f"must be <= 1, got {rv.min_kappa}")
    if rv.min_labels < 0 or rv.max_items < 0:
        bad("review.min_labels / review.max_items", "must be >= 0 (0: sized by review.max_ci_halfwidth)")
    if not 0 < rv.max_ci_halfwidth < 0.5:
        bad("review.max_ci_halfwidth", f"must lie in (0, 0.5), got {rv.max_ci_halfwidth}")
    if not 0 < v.tolerance < 1:
        bad("validate.tolerance", f"must lie in (0, 1), got {v.tolerance}")
    for k in ("alpha", "min_power"):
        if not 0 < getattr(v, k) < 1:
            bad(f"validate.{k}", f"must lie in (0, 1), got {getattr(v, k)}")
    if not 0 < v.power_drop <= 1:
        bad("validate.power_drop", f"must lie in (0, 1], got {v.power_drop}")
    if v.samples_per_task < 1 or v.eval_tasks_per_family < 1:
        bad("validate.samples_per_task / validate.eval_tasks_per_family", "must be >= 1")
    _check_serve(cfg, bad)


_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _check_serve(cfg: HermesConfig, bad: Any) -> None:
    """The gateway's keys, cross-field included (a URL arm needs its model id)."""
    s = cfg.serve
    for key, ok in (
        ("port", 0 <= s.port <= 65535),
        ("host", bool(s.host.strip())),
        ("public_model", bool(s.public_model.strip())),
        ("feedback_source", bool(s.feedback_source.strip())),
        ("experiment", "/" not in s.experiment and s.experiment not in {".", ".."}),
        ("max_body_bytes", s.max_body_bytes >= 1024),
        ("fsync_ms", 0 < s.fsync_ms <= 10_000),
        ("upstream_timeout_s", s.upstream_timeout_s > 0),
        ("upstream_connections", s.upstream_connections >= 1),
        ("batch_wait_ms", 0 <= s.batch_wait_ms <= 1000),
        ("max_batch", s.max_batch >= 1),
        ("max_new_tokens", s.max_new_tokens >= 1),
    ):
        if not ok:
            bad(f"serve.{key}", f"has an invalid value: {getattr(s, key)!r}")
    for key, allowed in (("durability", ("fsync", "write")), ("upstream_client", ("aiohttp", "httpx"))):
        if getattr(s, key) not in allowed:
            bad(f"serve.{key}", f"must be one of {', '.join(allowed)}, got {getattr(s, key)!r}")
    if s.score_unrewarded not in ("none", "judge"):
        bad("serve.score_unrewarded", f"must be none or judge, got {s.score_unrewarded!r}")
    for key in ("api_key_env", "baseline_key_env", "candidate_key_env"):
        if getattr(s, key) and not _ENV_NAME.match(getattr(s, key)):
            bad(f"serve.{key}", "must be the NAME of an environment variable, not the key itself")
    for arm in ("baseline", "candidate"):
        spec = getattr(s, arm).strip()
        if not spec:
            bad(f"serve.{arm}", "must name an arm (embedded:tiny, a model/adapter/train dir or an http(s) URL)")
        if spec.startswith(("http://", "https://")) and not getattr(s, f"{arm}_model").strip():
            bad(
                f"serve.{arm}_model", f"is required: serve.{arm} is an upstream URL, which needs the model id it serves"
            )


def load_config(
    path: str | os.PathLike[str] | None = None,
    overrides: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
) -> HermesConfig:
    """Read, interpolate, type and check a config. ``overrides`` are dotted keys ('grpo.max_steps': 5)."""
    env = dict(os.environ) if env is None else env
    raw: dict[str, Any] = {}
    src = "<defaults>"
    if path is not None:
        # as given relative to the cwd if it is there, else relative to the project root (a notebook's
        # kernel runs in notebooks/, a shell anywhere): hermes_lab.paths
        p = paths.config_file(path)
        src = str(p)
        if not p.is_file():
            raise ConfigError(
                f"config file not found: {path} (looked in {Path.cwd()} and in the project root {paths.project_root()})"
            )
        text = _interpolate(p.read_text(encoding="utf-8"), src, env)
        try:
            raw = yaml.safe_load(text) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{src}: not valid YAML: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{src}: the top level must be a mapping of sections")
    for dotted, value in (overrides or {}).items():
        sec, _, key = dotted.partition(".")
        if not key:
            raise ConfigError(f"override '{dotted}': use section.key")
        raw.setdefault(sec, {})
        if raw[sec] is None:
            raw[sec] = {}
        raw[sec][key] = value
    try:
        cfg = _build(HermesConfig, raw, "")
    except ConfigError as e:  # name the file too: the key alone does not say which YAML to fix
        raise ConfigError(f"{src}: {e}") from None
    cfg.source = src if path is not None else None
    _check(cfg, src)
    from hermes_lab.redaction import register_secret_env  # their values are masked wherever we log or print

    s = cfg.serve
    register_secret_env(
        cfg.model.api_key_env, cfg.reward.api_key_env, s.api_key_env, s.baseline_key_env, s.candidate_key_env
    )
    _resolve_paths(cfg)
    return cfg


def _resolve_paths(cfg: HermesConfig) -> None:
    """Path-valued fields -> absolute, against the project root: one runs/ whatever the cwd (paths.py)."""
    cfg.round.runs_dir = str(paths.resolve(cfg.round.runs_dir))
    if cfg.model.adapter and paths.is_local_spec(cfg.model.adapter):
        cfg.model.adapter = str(paths.resolve(cfg.model.adapter))
    cfg.model.base_model = paths.resolve_spec(cfg.model.base_model)


def field_help(cls: type = HermesConfig, prefix: str = "") -> dict[str, str]:
    """'section.key' -> help text, for --explain and notebooks."""
    out: dict[str, str] = {}
    for f in dataclasses.fields(cls):
        if f.name == "source":
            continue
        tp = get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(tp):
            out.update(field_help(tp, f"{prefix}{f.name}."))
        else:
            out[f"{prefix}{f.name}"] = f.metadata.get("help", "")
    return out


def dump_config(cfg: HermesConfig, path: str | os.PathLike[str]) -> None:
    Path(path).write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False), encoding="utf-8")
