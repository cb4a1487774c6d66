"""Config sections of a round's data: ``data`` (the data gates, distillation, the GRPO prompt selection),
``execute`` (where the round's data comes from: the embedded tasks or a gateway's log), ``agent`` (who plays the
agent family's tasks: the built-in loop or the real Hermes Agent) and ``conversations`` (how prep reads agent
conversations, and the rewards of logs that carry none).

Part of the config layer (``hermes_lab.config.schema`` builds ``HermesConfig`` from the sections and loads it):
each field with its help text and bounds, choices as ``Literal`` types, and the checks: ``execute_problems``
(the suite's families), ``conversations_problems``, ``execute_warnings`` (a first round on the embedded policy
that the data gate would stop). Reads and writes nothing.

    hermes-lab config --explain        # every key, with its choices and bounds
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from hermes_lab.core.yaml_typed import field_with as _f
from hermes_lab.tasks import suite as tasks


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
class AgentSection:
    runner: Literal["builtin", "hermes"] = _f(
        "hermes",
        "Who plays the embedded agent family's tasks: execute's logged episodes (execute.agent_tasks) and "
        "validate's held-out ones. hermes: the real Hermes Agent (the pinned hermes-agent's own loop and tools, "
        "sandboxed by bubblewrap, a workspace per task, installed once from the package registry) against the "
        "policy served by `hermes-lab serve` on 127.0.0.1 (in validate each arm in turn), graded on disk by the "
        "task's verifier. builtin: the project's own loop, the policy in process (seconds), for a machine where "
        "Hermes or bubblewrap cannot be installed. A round says which it used in its first lines.",
    )
    heldout_tasks: int = _f(
        96,
        "agent.runner hermes: held-out tasks the real agent plays per arm in validate, once each (each server "
        "draws a request's random numbers from its prompt: serve.seed_from_prompt), paired by task between the arms; "
        "a candidate significantly worse for it is stopped (the family's non-inferiority is the built-in loop's, on "
        "validate.eval_tasks_per_family x samples_per_task pairs).",
        ge=1,
    )
    parallel: int = _f(2, "agent.runner hermes: tasks run at once in the sandboxed Hermes process.", ge=1)
    max_turns: int = _f(6, "agent.runner hermes: Hermes's max_iterations per task (model calls).", ge=1)
    timeout: float = _f(120.0, "agent.runner hermes: seconds a task may take before it is killed.", gt=0)


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
        0.5,
        "Outcome rule: share of reward.scale for a completed conversation without tool errors (Hermes: "
        "completed true; other logs: ends on a text answer). 'The run ended' is not success: nothing verified "
        "the answer, so the default pays half marks, below reward.success_threshold (an unverified completion "
        "never counts as a success and never outranks a verified one); a verifier, feedback, tests or the judge "
        "pays the rest. 1.0 pays completion as full marks (prep's first line then says so).",
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
    min_signal_share: float = _f(
        0.1,
        "Prep's learning_signal gate: least share of the accepted conversations that must carry a learning "
        "signal, i.e. a reward from a source that checks the task (log, feedback, judge, atropos; not the outcome "
        "rules, which only say how a run ended) that differs from another such reward of its task (the tasks with "
        "one rewarded conversation are compared with each other). Below it every task's conversations are paid the "
        "same: GRPO's group advantages are zero and an A/B on that score measures nothing, so prep says "
        "no_learning_signal, naming the reward source responsible, and the round stops. 0: no check.",
        ge=0,
        le=1,
    )
    no_signal: Literal["block", "warn"] = _f(
        "block",
        "What prep's learning_signal gate does below min_signal_share: block (the round stops at prep: 'stopped: "
        "no learning signal', prep exits 3) or warn (says so in the verdict and the reward audit, and goes on).",
    )
    max_message_chars: int = _f(
        1_000_000,
        "A conversation holding a message (a tool result, most often) longer than this many characters is "
        "rejected as 'message too long': no training context holds it. Raise it for long tool outputs.",
        ge=1000,
    )


def execute_problems(ex: ExecuteSection) -> list[str]:
    """The families execute samples must be the embedded suite's."""
    bad_fams = [x for x in ex.families if x not in tasks.FAMILIES]
    if bad_fams:
        return [f"execute.families: unknown family '{bad_fams[0]}'; valid: {', '.join(tasks.FAMILIES)}"]
    return []


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


def execute_warnings(ex: ExecuteSection, d: DataSection, embedded: bool) -> list[str]:
    """A first round on the embedded default policy (``embedded``: model.base_model is it) that would stop at the
    data gate: execute samples fewer than data.min_samples."""
    if embedded and ex.num_tasks * ex.samples_per_task < d.min_samples:
        return [
            f"execute.num_tasks {ex.num_tasks} x execute.samples_per_task {ex.samples_per_task} < data.min_samples "
            f"{d.min_samples}: a first round on the embedded default has too few new samples and stops at the data gate"
        ]
    return []
