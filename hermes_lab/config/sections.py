"""The workbench's own config sections: execute, conversations, review, validate, ab, round, serve (the gateway),
sandbox.

Part of the config layer: ``hermes_lab.config.schema`` holds the user's sections (model / lora / grpo / reward /
data, accepted exactly as docs/SPEC.md shows them), ``HermesConfig``, the loader and the cross-field checks
(``config._problems``); this module holds the sections the workbench adds, each field with its help text and
the bounds its value must meet (``_f(..., ge=...)``), choices as ``Literal`` types enforced by the loader, and
the gateway's own cross-field checks (``serve_problems``, called by ``config._problems``). Split out of
config.py so that each stays readable; reads and writes nothing.

    hermes-lab config --explain        # every key, with its choices and bounds
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from typing import Literal

from hermes_lab.core.yaml_typed import field_with as _f


@dataclass
class ExecuteSection:
    num_tasks: int = _f(
        640, "Tasks the policy executes per round on the embedded default (x samples_per_task >= min_samples).", ge=1
    )
    samples_per_task: int = _f(
        1,
        "Responses per task (the same prompt sampled k times, as a GRPO group would be): with k >= 2 prep's "
        "data.select sees each prompt's group outcome (mixed, all pass, all fail) and targets the mixed ones.",
        ge=1,
    )
    temperature: float = _f(0.9, "Sampling temperature when executing.", gt=0, le=2)
    max_new_tokens: int = _f(16, "Max new tokens per response.", ge=1)
    batch_size: int = _f(64, "Generation batch size.", ge=1)
    families: list[str] = _f([], "Task families to draw (empty: all).")
    source: Literal["tasks", "live"] = _f(
        "tasks",
        "Where a round's data comes from. tasks: the policy executes the embedded tasks. live: a gateway log "
        "(execute.live_dir) joined with its feedback; round 1 with an empty live_dir executes the tasks (no "
        "traffic yet).",
    )
    live_dir: str = _f(
        "",
        "execute.source live: the gateway log dir (requests.jsonl, feedback.jsonl). Empty: the previous round's "
        "live experiment, runs/live/round-<NN-1>.",
    )
    agent_tasks: int = _f(
        0,
        "Embedded agent family (hermes_lab.tasks.agent): episodes the policy plays per round, logged as OpenAI "
        "chat conversations to round-NN/agent_episodes.jsonl for prep's conversations. 0: none.",
        ge=0,
    )


@dataclass
class ConversationsSection:
    format: Literal[
        "auto",
        "seed",
        "openai",
        "hermes_trajectory",
        "hermes_session",
        "hermes_state",
        "hermes_export",
        "claude_code",
        "atropos",
    ] = _f(
        "auto",
        "Shape of prep's inputs (hermes-lab prep --format). auto: per input, a folder of session_*.json is "
        "hermes_session, any other folder what it holds (its Claude Code traces one input), a SQLite file "
        "hermes_state, JSONL by its first line ('conversations': Hermes ShareGPT trajectories; sessionId / uuid / "
        "parentUuid: claude_code, Claude Code or Agent Trace JSONL; 'scores' with tokens or messages: atropos "
        "scored groups; messages with system_prompt and started_at: hermes_export, `hermes sessions export`; "
        "'messages': OpenAI chat; else the seed's {prompt, response, reward, task_id}).",
    )
    reward: Literal["outcome", "judge"] = _f(
        "outcome",
        "Reward of a conversation whose log has none and no feedback joined: outcome (the rules below) or "
        "judge (the comparison judge, reward.model or the local one, scores its final answer against the best "
        "outcome-scored conversation of the same task; a task with no other conversation keeps the outcome "
        "reward). Every record says which source set its reward (reward_source).",
    )
    feedback: list[str] = _f(
        [],
        "JSONL files of later feedback, {conversation_id, reward (0..reward.scale), source?} a line (the latest "
        "line of an id wins): joined into conversations by id before any rule (reward_source feedback:<source>).",
    )
    completed_reward: float = _f(
        1.0,
        "Outcome rule: share of reward.scale for a completed conversation without tool errors (Hermes: "
        "completed true; other logs: ends on a text answer).",
        ge=0,
        le=1,
    )
    partial_reward: float = _f(
        0.4,
        "Outcome rule: share of reward.scale for a partial conversation (Hermes's partial flag, or one that "
        "ends on a tool call or result, or was cut off), and the floor of a completed one with tool errors.",
        ge=0,
        le=1,
    )
    failed_reward: float = _f(
        0.0,
        "Outcome rule: share of reward.scale for a failed conversation (Hermes: completed false, not partial; "
        "failed_trajectories.jsonl), and the floor of a partial one with tool errors.",
        ge=0,
        le=1,
    )
    tool_error_penalty: float = _f(
        0.1,
        "Outcome rule: share of reward.scale taken off per tool error (Hermes's rule: a result with a "
        "non-null 'error' or success false, or text starting 'error:'; or its logged tool_error_counts).",
        ge=0,
        le=1,
    )
    atropos_scores: list[float] = _f(
        [-1.0, 1.0],
        "Atropos scored groups: the [low, high] range of the environment's scores, mapped linearly onto "
        "0..reward.scale (low -> 0, high -> scale); a group holding a score outside it is rejected. Atropos "
        "environments score on their own scale: gsm8k's -1 / 1 (the default), most others 0..1.",
    )
    max_message_chars: int = _f(
        1_000_000,
        "A conversation holding a message (a tool result, most often) longer than this many characters is "
        "rejected as 'message too long': no training context holds it. Raise it for long tool outputs.",
        ge=1000,
    )


@dataclass
class ReviewSection:
    simulate: bool = _f(
        False, "Unattended rounds only: the task verifier acts as a simulated reviewer (labels marked simulated)."
    )
    min_labels: int = _f(
        0,
        "Labels needed before the agreement gate can decide (the whole queue when the queue is smaller). "
        "0: enough for a Wilson interval of +-max_ci_halfwidth around min_agreement (73 at 90% and 0.07).",
        ge=0,
    )
    max_ci_halfwidth: float = _f(
        0.07,
        "Precision the gate needs: the default min_labels gives a 95% Wilson interval this wide either side, "
        "and max_items is sized by it. Pass needs the interval entirely above min_agreement, blocked entirely "
        "below; otherwise the verdict is 'inconclusive: label N more' and the round waits.",
        gt=0,
        lt=0.5,
    )
    max_items: int = _f(
        0,
        "Cap on the review items the gate counts (the queue's first items, in prep's random order): a large "
        "10% sample need not be labelled whole. 0: enough for +-max_ci_halfwidth at 50% agreement (193).",
        ge=0,
    )
    min_agreement: float = _f(0.9, "Reward-model/human agreement needed to train.", ge=0, le=1)
    label_mode: Literal["score", "passfail"] = _f("score", "Label buttons: score (0..5) or passfail.")
    agreement_metric: Literal["threshold", "within1"] = _f(
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
        le=1,
    )
    kappa_weights: Literal["quadratic", "linear"] = _f(
        "quadratic",
        "Weights of the ordinal kappa on integer-binned scores: quadratic (a 5-vs-0 miss costs 25x a 1-point miss).",
    )


@dataclass
class ValidateSection:
    eval_tasks_per_family: int = _f(64, "Held-out tasks per family for the regression gate.", ge=1)
    gain_tasks_per_family: int = _f(
        200,
        "Held-out tasks per family of the train stage's before/after pass rate (2 samples each): the round's headline "
        "gain and its paired interval. 200 x 6 families resolves a later round's 3-point gain. The agent family's "
        "before/after episode success runs as many held-out episodes.",
        ge=1,
    )
    samples_per_task: int = _f(1, "Samples per task (sampled pass rate).", ge=1)
    tolerance: float = _f(
        0.05,
        "Non-inferiority margin: the candidate passes a family only if the upper confidence bound of its drop "
        "in pass rate (paired on the same tasks and seeds) is below this.",
        gt=0,
        lt=1,
    )
    temperature: float = _f(
        0.9, "Sampling temperature of the regression eval, the same for baseline and candidate.", gt=0, le=2
    )
    seed: int = _f(0, "Seed of the regression eval (task generation and sampling), the same for both arms.")
    alpha: float = _f(
        0.05,
        "One-sided error level of each family's upper bound on the drop (a family that regressed by the "
        "tolerance passes with probability <= alpha; every family must pass, so no multiplicity correction), "
        "and of the reward-trend test in the curve diagnostics.",
        gt=0,
        lt=1,
    )
    power_drop: float = _f(
        0.10, "Drop in pass rate whose chance of being stopped the gate reports per family (its power).", gt=0, le=1
    )
    min_power: float = _f(
        0.8,
        "Warn when a family's set is too small: a power_drop drop stopped, or an equally good candidate "
        "passed, less often than this.",
        gt=0,
        lt=1,
    )
    kl_spike_k: float = _f(
        6.0,
        "Diagnostics: a KL value more than k robust std (1.4826*MAD) above the rolling "
        "median of the previous steps is a spike.",
        gt=0,
    )
    kl_spike_min_jump: float = _f(
        0.02, "Diagnostics: a KL spike must also jump by at least this much (absolute).", ge=0
    )
    kl_spike_ratio: float = _f(
        3.0,
        "Diagnostics: a KL spike must also reach this many times the value the "
        "previous steps predict (per-batch KL wiggles 1.5x in a healthy run).",
        ge=1,
    )
    curve_window: int = _f(10, "Diagnostics: rolling window (logging steps) for the KL spike median/MAD.", ge=2)
    trend_window: float = _f(
        0.25,
        "Diagnostics: share of steps in the first/last window compared to decide whether the reward rises.",
        gt=0,
        le=0.5,
    )
    reward_outlier_z: float = _f(
        6.0,
        "Diagnostics: robust z (residual from a rolling median over MAD) past which a per-step reward is an outlier.",
        gt=0,
    )


@dataclass
class ABSection:
    traffic_ratio: float = _f(
        0.1, "Candidate share in the first stage: an alias of ab.stages[0][0] (set one, or both equal).", gt=0, le=1
    )
    stages: list[list[float]] = _f(
        [[0.1, 7200], [0.3, 14400], [1.0, 0]], "Rollout stages as [ratio, seconds]; a final ratio 1.0 means promoted."
    )
    request_rate: float = _f(
        0.25,
        "Simulated requests per second (ab.plan_power > 0: the planned rate instead); a live rollout (serve) "
        "takes it as the expected rate per experiment second, which tunes where its confidence sequence is "
        "tightest (never its validity).",
        gt=0,
    )
    plan_power: float = _f(
        0.0,
        "Simulated traffic (ab-run, ab.mode simulated): plan the request rate for this power, the chance that the "
        "staged rollout promotes a candidate ab.plan_effect points better (hermes_lab.ab.plan simulates the "
        "rollout's own test); the planned rate replaces ab.request_rate. 0: no plan, ab.request_rate as set.",
        ge=0,
        lt=1,
    )
    plan_effect: float = _f(
        0.0,
        "ab.plan_power: the gain to detect, in points of success share (reward >= reward.success_threshold). "
        "0: this round's held-out gain (train/eval.json gain_points), else ab.plan_fallback_effect.",
        ge=0,
        le=100,
    )
    plan_fallback_effect: float = _f(
        5.0,
        "ab.plan_power: the gain planned for when ab.plan_effect is 0 and no positive held-out gain is known.",
        gt=0,
        le=100,
    )
    plan_max_rate: float = _f(
        2.0,
        "ab.plan_power: cap on the planned rate (requests per simulated second; a rollout generates rate x "
        "stage lengths responses). When it binds the plan reports the power it reaches.",
        gt=0,
    )
    covariates: list[Literal["family_level", "opening_turn", "task", "history"]] = _f(
        ["family_level", "opening_turn", "task", "history"],
        "Regression adjustment of the sequential rule (request and conversation units, not user; "
        "hermes_lab.ab.adjust): what is known about a request before it is routed and predicts its reward, so"
        " the confidence sequence can leave that variance out. family_level: the embedded task's family and "
        "level. opening_turn: a conversation's opening turn (system prompt, number of tools, length of the "
        "first user message). task: the prompt itself (a conversation's first user message), whose mean the "
        "rule learns from the stage's earlier requests. history: the cell's and the task's mean reward in "
        "earlier logs (this round's execution log and ab.history_rounds rounds' A/B logs). Fitted on earlier "
        "looks only, so the guarantee holds; a request without any keeps the plain estimate. Empty: no "
        "adjustment.",
    )
    history_rounds: int = _f(
        3, "ab.covariates history: how many earlier rounds' A/B request logs give the prior (0: none).", ge=0, le=100
    )
    salt: str = _f("", "Per-experiment salt for the router (empty: the user's bucket formula bit for bit).")
    alpha: float = _f(0.05, "Significance level.", gt=0, lt=1)
    srm_alpha: float = _f(0.001, "Sample-ratio-mismatch threshold: below it, hold.", gt=0, lt=1)
    max_error_rate: float = _f(
        0.02, "Guardrail: candidate error rate above baseline by more than this rolls back.", ge=0, le=1
    )
    max_latency_ratio: float = _f(
        1.5, "Guardrail: candidate p95 latency over baseline p95 above this rolls back.", gt=0
    )
    rule: Literal["sequential", "user"] = _f(
        "sequential", "Decision rule: sequential (always-valid) or user (docs/SPEC.md's p<0.05 rule)."
    )
    mode: Literal["simulated", "live"] = _f(
        "simulated",
        "A round's A/B stage. simulated: ab-run on a simulated clock. live: the gateway (hermes-lab serve) runs "
        "the rollout on real traffic; the round waits ('awaiting live A/B', --resume) until it is decided.",
    )
    look_every: float = _f(
        900.0,
        "Seconds between two interim looks within a stage. Harm, guardrails and SRM are "
        "checked at every look; promotion only from the stage's planned end.",
        gt=0,
    )
    max_extension: float = _f(
        1.0,
        "An inconclusive stage is extended by up to this many times its planned length; "
        "still inconclusive then: the rollout stops at 'keep observing'.",
        ge=0,
    )
    min_per_arm: int = _f(
        30, "Units (conversations, requests, or users: ab.unit) each arm needs before any decision.", ge=2
    )
    guardrail_alpha: float = _f(
        0.01,
        "Error level of each guardrail's always-valid one-sided bound (error rate, p95 latency): a guardrail "
        "rolls back only when the candidate is worse by the margin AND the bound shows it is worse at all.",
        gt=0,
        lt=1,
    )
    unit: Literal["conversation", "request", "user"] = _f(
        "conversation",
        "Randomisation unit: conversation (every turn of an agent's conversation goes to the arm of its first "
        "turn; a single-turn request is a conversation of one turn), request (each request on its own), or user "
        "(requests of one user share an arm). Decisions count units: SRM, min_per_arm and the always-valid "
        "bounds use one observation per unit. The simulated ab-run's traffic is single-turn: conversation and "
        "request are the same there.",
    )
    num_users: int = _f(2000, "Simulated user pool when unit is user.", ge=1)
    task_split: Literal["heldout", "any", "train"] = _f(
        "heldout", "Tasks the simulated traffic draws: heldout (never trained on) or any."
    )
    latency_median_ms: float = _f(120.0, "Simulated latency: median of the lognormal base latency (ms).", gt=0)
    latency_sigma: float = _f(0.35, "Simulated latency: sigma of the lognormal base latency.", ge=0)
    latency_ms_per_char: float = _f(
        4.0, "Simulated latency: extra ms per response character (longer answers are slower).", ge=0
    )


@dataclass
class RoundSection:
    runs_dir: str = _f("runs", "Where rounds, the MLflow store and the policies live.")
    simulated_clock: bool = _f(False, "Use a simulated clock (embedded flywheel: cooldown without waiting a day).")
    experiment: str = _f("hermes-lab", "MLflow experiment name.")
    registered_model: str = _f("hermes-policy", "MLflow registered model holding the 'champion' alias.")
    on_held: Literal["new", "continue"] = _f(
        "new",
        "A candidate whose A/B stage reached its hard end undecided ('candidate held: undecided'). new: the next "
        "round trains a new candidate from the champion. continue: the next round continues that experiment "
        "instead (the same candidate, its stage's data kept, its confidence sequence carried on for another "
        "stage length with extension; no training, so no cooldown). A continued experiment that ends undecided "
        "again is not continued twice.",
    )


_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass
class ServeSection:
    host: str = _f("127.0.0.1", "Address `hermes-lab serve` binds (loopback: only this machine can reach the gateway).")
    port: int = _f(8700, "Port of the gateway (0: any free port, printed at start).", ge=0, le=65535)
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
    lora_upstream: str = _f(
        "",
        "The http(s) root of a vLLM server started with --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True: "
        "arms that name a local adapter or train dir (a round's candidate, the champion) are served by it, "
        "the adapter loaded at the arm's start with POST /v1/load_lora_adapter under the name hermes-round-NN; "
        "a bare base arm asks it for lora_base_model. Empty: such arms run in-process.",
    )
    lora_base_model: str = _f("", "serve.lora_upstream: the model id of its base (empty: model.base_model).")
    lora_upstream_key_env: str = _f("", "serve.lora_upstream: NAME of the env var with its key (empty: none).")
    public_model: str = _f("hermes", "The one model name clients ask for; which arm answers is the gateway's business.")
    api_key_env: str = _f(
        "", "NAME of the env var with the gateway's own key; set: every /v1 call needs 'Authorization: Bearer <key>'."
    )
    max_body_bytes: int = _f(4 * 2**20, "Largest request body accepted (bigger: 413).", ge=1024)
    durability: Literal["write", "fsync"] = _f(
        "write",
        "write: a request's record is written to the log file before the last byte of its answer, fsync "
        "follows within fsync_ms (a kill -9 loses nothing; a power loss may lose the last fsync_ms). fsync: the "
        "answer also waits for the fsync covering its record (group commit; survives power loss, +1 fsync).",
    )
    fsync_ms: float = _f(100.0, "durability write: longest a written log record waits for its fsync.", gt=0, le=10_000)
    upstream_client: Literal["aiohttp", "httpx"] = _f(
        "aiohttp", "HTTP client of URL arms: aiohttp (measured faster) or httpx."
    )
    upstream_timeout_s: float = _f(600.0, "Timeout of one upstream request (a long generation included).", gt=0)
    upstream_connections: int = _f(256, "Open connections kept per upstream arm.", ge=1)
    batch_wait_ms: float = _f(
        5.0, "In-process arms: collect requests this long into one batched generate.", ge=0, le=1000
    )
    max_batch: int = _f(32, "In-process arms: most requests in one batched generate.", ge=1)
    max_new_tokens: int = _f(
        256,
        "In-process arms: cap on a request's max_tokens. A request without one: a lone user message without tools "
        "(a string task) gets execute.max_new_tokens, any other chat what a turn is trained with "
        "(grpo.turn_completion_length, else grpo.max_completion_length); always within the policy's context.",
        ge=1,
    )
    agent_share: float = _f(
        0.3,
        "The stand-in agent (hermes-lab agent, make live-demo): share of its conversations that are episodes of the "
        "embedded agent family, played as a client-side agent loop (the tool's schema sent, its calls executed by "
        "the agent, the results sent back, the episode's success posted as feedback by conversation id); the rest "
        "are single-turn string tasks scored by their verifiers.",
        ge=0,
        le=1,
    )
    feedback_source: str = _f(
        "system",
        "Feedback source that counts as the reward (the latest such feedback of a request wins); "
        "'any': the latest feedback of any source.",
    )
    score_unrewarded: Literal["none", "judge"] = _f(
        "none",
        "Answered requests without feedback in prep: none (kept aside, counted as unrewarded) or judge "
        "(scored by the comparison judge against the best rewarded response to the same prompt).",
    )
    mlflow_traces: bool = _f(
        False, "Also write each request as an MLflow trace and each feedback as an assessment (off the request path)."
    )
    access_log: bool = _f(False, "uvicorn's access log (one line per request; never headers or bodies).")
    rollout: bool = _f(
        True,
        "Run the staged rollout live: the stages of ab.stages on the wall clock, a look every ab.look_every, "
        "decided by hermes_lab.ab.stats; the candidate share changes in place. false: a fixed share, no looks.",
    )
    time_scale: float = _f(
        1.0,
        "Experiment clock speed: K runs the stages and looks K times faster than the wall clock (demos, "
        "tests; --time-scale). The report says so. A restart must keep the experiment's time scale.",
        gt=0,
        le=1e6,
    )
    models: list[str] = _f(
        [],
        "Model names the gateway accepts besides public_model (others get 404 model_not_found). Empty: any "
        "model name a client asks for is served by the experiment (an agent keeps its own model name).",
    )
    conversation_idle_s: float = _f(
        900.0,
        "A conversation whose last answer had no tool call ends when no new turn follows within this many "
        "seconds (or when feedback closes it); a later request that continues it opens a new conversation.",
        gt=0,
        le=7 * 86400,
    )
    conversation_tool_wait_s: float = _f(
        3600.0,
        "A conversation whose last answer asked for tool calls waits this long for their results before it "
        "ends (tools may run long).",
        gt=0,
        le=7 * 86400,
    )
    max_conversations: int = _f(
        200_000,
        "Open conversations the gateway tracks at most (memory bound); the longest idle ends first.",
        ge=100,
    )
    conversation_from_user: bool = _f(
        False,
        "The OpenAI 'user' field (or X-Hermes-User) names the conversation, when a client sends one per "
        "conversation. An X-Hermes-Conversation header or metadata.conversation_id always does.",
    )
    fallback: Literal["none", "baseline"] = _f(
        "none",
        "baseline: a failed candidate call (upstream error, timeout, 5xx) is answered by the baseline and "
        "still counted as a candidate error. none: the client gets the error.",
    )


def conversations_problems(c: ConversationsSection) -> list[str]:
    """The outcome rules must order failed <= partial <= completed: a failed run never outscores a finished one."""
    if not c.failed_reward <= c.partial_reward <= c.completed_reward:
        return [
            "conversations: the outcome rewards must satisfy failed_reward <= partial_reward <= completed_reward, got "
            f"{c.failed_reward:g}, {c.partial_reward:g}, {c.completed_reward:g}"
        ]
    empty = [i for i, f in enumerate(c.feedback) if not str(f).strip()]
    errs = [f"conversations.feedback: empty file name at entry {i}" for i in empty]
    lo_hi = c.atropos_scores
    if (
        len(lo_hi) != 2
        or not all(isinstance(v, (int, float)) and math.isfinite(v) for v in lo_hi)
        or lo_hi[0] >= lo_hi[1]
    ):
        errs.append(f"conversations.atropos_scores must be [low, high] with low < high (finite numbers); got {lo_hi!r}")
    return errs


@dataclass
class SandboxSection:
    executor: Literal["local", "fusion"] = _f(
        "local",
        "Where the tests reward runs completions' code. local: this machine, no extra service (runs forked from a "
        "warm launcher, each in bubblewrap's root of its own with namespaces, a seccomp filter, a cgroup; Landlock "
        "where there are no namespaces: hermes_lab.sandbox.isolation). fusion: a sandbox service speaking "
        "SandboxFusion's POST /run_code API at sandbox.url.",
    )
    url: str = _f("", "executor fusion: the service's http(s) root (e.g. http://sandbox:8080; /run_code is appended).")
    api_key_env: str = _f(
        "", "executor fusion: NAME of an env var holding a key sent as 'Authorization: Bearer' (empty: none)."
    )
    workers: int = _f(0, "Programs run at once (0: one per CPU core; fusion: concurrent requests, 0 means 8).", ge=0)
    timeout_s: float = _f(
        4.0, "Wall-clock limit of one run (all of a completion's tests; one stdin/stdout case).", gt=0, le=600
    )
    cpu_s: float = _f(4.0, "CPU-seconds limit of each process of a run (RLIMIT_CPU; local executor).", gt=0, le=600)
    memory_mb: int = _f(
        512,
        "Memory of one run, MiB: its cgroup's limit for all its processes, tmpfs files and shared memory together, "
        "and each process's address space (RLIMIT_AS; fusion: memory_limit_MB).",
        ge=32,
    )
    file_mb: int = _f(
        16,
        "Largest file a run may write, MiB (RLIMIT_FSIZE; also the size of each of its tmpfs: work dir, /tmp).",
        ge=1,
    )
    max_processes: int = _f(
        16, "Processes and threads a run may have at once (its cgroup's pids limit).", ge=1, le=4096
    )
    max_output_kb: int = _f(
        1024, "Output a run may print, KiB (stdout and stderr each); past it the run is stopped.", ge=1
    )
    cache_size: int = _f(
        100_000, "Completions whose results are kept by (code, tests) hash; duplicates run once.", ge=0
    )
    python: str = _f(
        "",
        "local executor: the interpreter programs run with, a virtualenv's bin/python whose packages they may "
        "import (numpy, pandas); read-only in the sandbox. Empty: this interpreter, the standard library only.",
    )
    require_isolation: bool = _f(
        True,
        "local executor: refuse to score completions (training with the tests reward stops before it starts, "
        "naming what is missing) unless every layer is kernel-enforced here: seccomp, a cgroup per run, and a root "
        "of its own (bubblewrap) or Landlock. false: go on without them, and say in the round's output what is "
        "then not enforced.",
    )
    max_error_rate: float = _f(
        0.2,
        "Training stops when more than this share of the last 200 scored completions met a sandbox error (the "
        "executor failed, not the completion: scored None, counted in health.json).",
        ge=0,
        le=1,
    )


def sandbox_problems(s: SandboxSection) -> list[str]:
    out = []
    if s.executor == "fusion" and not s.url.startswith(("http://", "https://")):
        out.append(
            f"sandbox.url must be the http(s) root of a run_code server when sandbox.executor is fusion, got {s.url!r}"
        )
    if s.api_key_env and not _ENV_NAME.match(s.api_key_env):  # never echo it: it may be the key
        out.append("sandbox.api_key_env must be the NAME of an environment variable, not the key itself")
    if s.python and not (os.path.isfile(s.python) and os.access(s.python, os.X_OK)):
        out.append(f"sandbox.python must be a Python interpreter (a virtualenv's bin/python), got {s.python!r}")
    return out


def serve_problems(s: ServeSection) -> list[str]:
    """The gateway's cross-field checks (a URL arm needs its model id) and names; bounds and choices are the
    loader's."""
    out = []
    for key in ("host", "public_model", "feedback_source"):
        if not getattr(s, key).strip():
            out.append(f"serve.{key} must not be empty")
    bad = [m for m in s.models if not isinstance(m, str) or not m.strip()]
    if bad:
        out.append("serve.models: every entry must be a non-empty model name")
    if s.conversation_tool_wait_s < s.conversation_idle_s:
        out.append(
            f"serve.conversation_tool_wait_s ({s.conversation_tool_wait_s:g}) must be >= serve.conversation_idle_s "
            f"({s.conversation_idle_s:g}): a conversation waiting for tool results is never ended sooner"
        )
    if "/" in s.experiment or s.experiment in {".", ".."}:
        out.append(f"serve.experiment must be a plain name (it is a folder under runs/live/), got {s.experiment!r}")
    if s.lora_upstream and not s.lora_upstream.startswith(("http://", "https://")):
        out.append(f"serve.lora_upstream must be the http(s) root of a vLLM server, got {s.lora_upstream!r}")
    for key in ("api_key_env", "baseline_key_env", "candidate_key_env", "lora_upstream_key_env"):
        if getattr(s, key) and not _ENV_NAME.match(getattr(s, key)):  # never echo it: it may be the key
            out.append(f"serve.{key} must be the NAME of an environment variable, not the key itself")
    for arm in ("baseline", "candidate"):
        spec = getattr(s, arm).strip()
        if not spec:
            out.append(f"serve.{arm} must name an arm (embedded:tiny, a model/adapter/train dir or an http(s) URL)")
        if spec.startswith(("http://", "https://")) and not getattr(s, f"{arm}_model").strip():
            out.append(f"serve.{arm}_model is required: serve.{arm} is an upstream URL, which needs its model id")
    return out
