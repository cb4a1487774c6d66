"""Stage 20, train, episode phase: GRPO on whole tool-calling episodes in an environment (TRL's multi-turn loop).

Reads ``grpo.environment`` (``package.module:Class``) and, when a prep dir is given, the agent conversations prep
kept (``runs/round-NN/prep/conversations/``, the train split): their first user turns start the episodes. Writes,
through ``hermes_lab.train.grpo.train_episodes``, ``runs/round-NN/train/episodes/`` (``train_log.jsonl``: every TRL
line plus the episode metrics below, ``samples.jsonl``: whole episodes with their rewards, ``health.json``) and the
final adapter. The round's train stage runs it after the prompt set when ``grpo.environment`` is set:

    hermes-lab train --config params/embedded.yaml --data runs/round-01/prep --output runs/round-01/train

What this module holds are the pieces ``train.grpo`` puts together: the environment class (``load_environment``),
the episodes' dataset (``episode_dataset``), and the episode reward with its tally (``EpisodeReward``): the
environment's ``_hermes_score(final_answer)`` when it has one (the embedded ``TimeEnv``), else TRL calls its
``get_reward()`` itself. Errors a tool raises are shown to the policy as ``{'error': ...}`` tool messages by TRL
and counted here (``tool_errors``), never raised out of training. Per logged step: ``episode_success``,
``episode_reward``, ``turns_per_episode``, ``tool_calls_per_episode``, ``tool_error_rate``,
``invalid_call_rate`` (a ``<tool_call>`` the parser could not read), ``answered_without_tool``.
"""

from __future__ import annotations

import importlib
import inspect
import os
from collections import deque
from pathlib import Path
from typing import Any

from hermes_lab.config.schema import HermesConfig
from hermes_lab.core.layout import PrepLayout

METRICS = (
    "episode_success",
    "episode_reward",
    "turns_per_episode",
    "tool_calls_per_episode",
    "tool_error_rate",
    "invalid_call_rate",
    "answered_without_tool",
)


def load_environment(spec: str) -> type:
    """The class a ``grpo.environment`` names, checked against TRL's contract (a named error otherwise)."""
    mod_name, _, cls_name = spec.partition(":")
    try:
        cls = getattr(importlib.import_module(mod_name), cls_name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"grpo.environment {spec!r}: cannot import it ({type(e).__name__}: {e})") from e
    if not inspect.isclass(cls) or not callable(getattr(cls, "reset", None)):
        raise ValueError(f"grpo.environment {spec!r}: not a class with a reset() method (TRL's environment contract)")
    tools = [n for n, _ in inspect.getmembers(cls, inspect.isfunction) if not n.startswith("_")]
    tools = [n for n in tools if n not in ("reset", "get_reward")]
    if not tools:
        raise ValueError(f"grpo.environment {spec!r}: no public method to serve as a tool")
    if not callable(getattr(cls, "_hermes_score", None)) and not callable(getattr(cls, "get_reward", None)):
        raise ValueError(f"grpo.environment {spec!r}: needs _hermes_score(final_answer) or get_reward() (the reward)")
    return cls


def _agent_rows_from_prep(data: Path, cfg: HermesConfig) -> list[dict[str, Any]]:
    """First user turns of the train split's agent conversations in a prep dir (none there: [])."""
    conv = PrepLayout(data).conversations
    if not conv.is_dir():
        return []
    from datasets import load_from_disk

    from hermes_lab.policy.episodes import family_of_environment

    fam = family_of_environment(cfg.grpo.environment)
    if fam is None:  # a user's environment: its rows come from its own _hermes_rows or reset()
        return []
    try:
        ds = load_from_disk(str(conv))
    except (IndexError, FileNotFoundError, ValueError):  # prep wrote no conversation (an empty dataset dir)
        return []
    rows = []
    for r in ds:
        if r.get("family") != fam.FAMILY or r.get("split", "train") != "train":
            continue
        msgs = r["messages"]
        user = next((m for m in msgs if m.get("role") == "user"), None)
        task = fam.parse_question(user.get("content") if user else "")
        if task is not None:
            row = {"prompt": task.prompt(), "task_id": task.task_id}
            rows.append({**row, "city": task.city} if hasattr(task, "city") else row)
    return rows


def episode_dataset(cfg: HermesConfig, data: str | os.PathLike[str] | None, env_cls: type) -> Any:
    """The episodes' starting rows as a ``datasets.Dataset``: the agent conversations prep kept (their first user
    turns), topped up to ``grpo.episode_tasks`` from the environment's own ``_hermes_rows(n, seed)`` when it has one;
    ``episode_seed`` numbers the rows. None when neither gives a row: TRL then lets ``reset()`` write the prompt."""
    from datasets import Dataset

    rows = _agent_rows_from_prep(Path(data), cfg) if data and Path(data).is_dir() else []
    seen, uniq = set(), []
    for r in rows:  # a task logged several times is one starting point
        if r["task_id"] not in seen:
            seen.add(r["task_id"])
            uniq.append(r)
    rows = uniq[: cfg.grpo.episode_tasks]
    if len(rows) < cfg.grpo.episode_tasks and callable(getattr(env_cls, "_hermes_rows", None)):
        extra = [r for r in env_cls._hermes_rows(cfg.grpo.episode_tasks, cfg.grpo.seed) if r.get("task_id") not in seen]
        rows += extra[: cfg.grpo.episode_tasks - len(rows)]
    if not rows:
        return None
    return Dataset.from_list([{**r, "episode_seed": i} for i, r in enumerate(rows)])


class EpisodeReward:
    """The episode reward for TRL (``reward_funcs``): ``env._hermes_score(final answer)`` per rollout, and the episode
    metrics of the last scored batch (``metrics()``, logged by the train callback) and of the run (``totals``)."""

    __name__ = "episode"

    def __init__(self, success_threshold: float, keep: int = 256) -> None:
        self.threshold = success_threshold
        self.last: dict[str, float] = {}
        self.totals = {"episodes": 0, "successes": 0, "tool_calls": 0, "tool_errors": 0, "invalid_calls": 0}
        self.rows: deque[dict[str, Any]] = deque(maxlen=keep)
        self.step = 0

    def __call__(self, prompts: list[Any], completions: list[Any], environments: list[Any] | None = None, **_: Any):
        from hermes_lab.tasks import agent as A

        envs = environments or [None] * len(completions)
        out: list[float | None] = []
        calls = errors = invalid = no_tool = turns = 0
        for prompt, msgs, env in zip(prompts, completions, envs):
            if env is None or not callable(getattr(env, "_hermes_score", None)):
                out.append(None)  # TRL scores it with the environment's get_reward()
                continue
            answer = A.final_answer(msgs)
            out.append(float(env._hermes_score(answer)))
            c = sum(len(m.get("tool_calls") or []) for m in msgs if m.get("role") == "assistant")
            e = sum(
                1
                for m in msgs
                if m.get("role") == "tool" and str(m.get("content", "")).startswith(("{'error'", '{"error"'))
            )
            bad = sum(1 for m in msgs if m.get("role") == "assistant" and "<tool_call>" in (m.get("content") or ""))
            calls, errors, invalid, no_tool = calls + c, errors + e, invalid + bad, no_tool + (c == 0)
            turns += sum(1 for m in msgs if m.get("role") == "assistant")
            self.rows.append(
                {
                    "step": self.step,
                    "prompt": prompt[-1]["content"] if isinstance(prompt, list) else str(prompt),
                    "episode": msgs,
                    "reward": out[-1],
                }
            )
        scored = [v for v in out if v is not None]
        if scored:
            k = len(scored)
            succ = sum(v >= self.threshold for v in scored)
            self.last = {
                "episode_success": succ / k,
                "episode_reward": sum(scored) / k,
                "turns_per_episode": turns / k,
                "tool_calls_per_episode": calls / k,
                "tool_error_rate": errors / calls if calls else 0.0,
                "invalid_call_rate": invalid / k,
                "answered_without_tool": no_tool / k,
            }
            t = self.totals
            t["episodes"] += k
            t["successes"] += succ
            t["tool_calls"] += calls
            t["tool_errors"] += errors
            t["invalid_calls"] += invalid
        return out

    def metrics(self) -> dict[str, float]:
        return {k: round(v, 4) for k, v in self.last.items()}

    def to_dict(self) -> dict[str, Any]:
        t = dict(self.totals)
        t["success_rate"] = round(t["successes"] / t["episodes"], 4) if t["episodes"] else None
        t["tool_error_rate"] = round(t["tool_errors"] / t["tool_calls"], 4) if t["tool_calls"] else 0.0
        return t


def eval_before_after(
    cfg: HermesConfig, base: str, start_adapter: str | None, adapter_dir: Path, n_tasks: int
) -> dict[str, Any]:
    """Held-out episode success (sampled at ``grpo.temperature``) of the starting policy and of the candidate,
    paired by task (the embedded agent family's episodes; same tasks, seeds and tool results for both)."""
    from hermes_lab.policy import episodes as E
    from hermes_lab.policy import model as P
    from hermes_lab.policy.episodes import family_of_environment

    tasks = family_of_environment(cfg.grpo.environment).generate_tasks(n_tasks, split="heldout", seed=cfg.grpo.seed + 1)
    kw = dict(temperature=cfg.grpo.temperature, seed=cfg.grpo.seed, max_turns=cfg.grpo.max_turns)
    before = E.evaluate_episodes(P.load_policy(base, adapter=start_adapter), tasks, **kw)
    after = E.evaluate_episodes(P.load_policy(base, adapter=str(adapter_dir)), tasks, **kw)
    gain = P.paired_gain(before, after)
    return {"before": before, "after": after, "gain_points": round(100 * gain["gain"], 1), "gain": gain}
