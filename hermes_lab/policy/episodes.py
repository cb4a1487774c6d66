"""Run and score agent episodes with a policy: the agent family's evaluation (greedy or sampled).

Reads and writes nothing; the policy build records the base policy's episode success (build.json), train's
before/after evaluation, validate and the simulated A/B call ``evaluate_episodes``; execute logs the episodes
``run_episodes`` returns as conversation records.

An episode is played the way TRL's multi-turn loop plays it in training (``GRPOTrainer`` with an
``environment_factory``), with the loop's one rendering and parser (``hermes_lab.policy.turn``): the user turn is
rendered with the policy's chat template and the environment's tool, the policy completes one assistant turn, TRL's
``parse_response`` reads its tool calls, each call runs on the episode's environment (an exception becomes the tool
message ``{'error': ...}``, counted), and the next turn's prompt is the turn's prompt, its completion's tokens and the
results' suffix (``turn.continue_ids``: no re-rendering), for at most ``max_turns`` tool-calling turns. Each turn's
prompt and completion ids stay on the episode (``Episode.turn_ids``). All episodes of a batch advance turn by turn
together, so a turn is one batched ``generate``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hermes_lab.policy import turn
from hermes_lab.tasks import agent as A
from hermes_lab.tasks import hermes as H
from hermes_lab.tasks import suite as T
from hermes_lab.tasks import workspace as W

# the embedded agent families by their environment (grpo.environment): the time tool, Hermes's workspace tools
FAMILIES = {A.ENVIRONMENT: A, H.ENVIRONMENT: H}


def family_of_environment(environment: str) -> Any:
    """The embedded agent family module a ``grpo.environment`` names (``tasks.agent`` or ``tasks.hermes``), or None
    for a user's own environment (no held-out tasks known here)."""
    return FAMILIES.get(environment or "")


def _env(task: Any, seed: int, episode_seed: int) -> tuple[Any, list[Any]]:
    """A reset environment for the task and its tools (what TRL collects: the public methods)."""
    if isinstance(task, H.HermesTask):
        env = H.WorkspaceEnv(seed=seed)
        env.reset(question=task.question)
        return env, W.env_tools(env)
    env = A.TimeEnv(seed=seed)
    env.reset(city=task.city, episode_seed=episode_seed)
    return env, [env.time]


@dataclass
class Episode:
    task: Any  # tasks.agent.AgentTask or tasks.hermes.HermesTask
    messages: list[dict[str, Any]]
    reward: float = 0.0
    answer: str | None = None
    turns: int = 0  # assistant turns
    tool_calls: int = 0
    tool_errors: int = 0
    invalid_calls: int = 0  # turns that opened a <tool_call> the parser could not read
    env: Any = field(default=None, repr=False)
    turn_ids: list[tuple[list[int], list[int]]] = field(default_factory=list, repr=False)  # (prompt, completion)

    @property
    def success(self) -> bool:
        return self.reward >= 3.0


def run_episodes(
    policy: Any,
    tasks: list[Any],
    temperature: float = 0.9,
    seed: int = 0,
    max_turns: int = 2,
    max_new_tokens: int = 128,
    batch_size: int = 128,
) -> list[Episode]:
    """Play one episode per task (``episode_seed``: the task's index, so a seed's tool results are fixed)."""
    import torch

    tok, model = policy.tokenizer, policy.model
    out: list[Episode] = []
    for start in range(0, len(tasks), batch_size):
        chunk = tasks[start : start + batch_size]
        eps, tools = [], []
        for i, t in enumerate(chunk):
            env, tl = _env(t, seed, start + i)
            eps.append(Episode(t, t.prompt(), env=env))
            tools.append(tl)
        prompts = [turn.prompt_ids(tok, e.messages, tl) for e, tl in zip(eps, tools)]
        live = list(range(len(eps)))
        for k in range(max_turns + 1):
            if not live or model.config.max_position_embeddings <= max(len(prompts[i]) for i in live):
                break
            torch.manual_seed(seed * 1_000_003 + start * 31 + k)
            done = turn.sample(model, tok, [prompts[i] for i in live], temperature, max_new_tokens)
            still = []
            for i, (completion, _) in zip(live, done):
                ep = eps[i]
                ep.turn_ids.append((prompts[i], completion))
                msg = turn.parse(tok, completion, prompts[i], tools[i], completion_form=False)
                ep.turns += 1
                ep.messages.append(msg)
                if "<tool_call>" in (msg.get("content") or ""):
                    ep.invalid_calls += 1
                calls = msg.get("tool_calls") or []
                if not calls or k == max_turns:
                    continue
                results = []
                by_name = {fn.__name__: fn for fn in tools[i]}
                for c in calls:
                    f = c.get("function", c)
                    ep.tool_calls += 1
                    errors = getattr(ep.env, "errors", 0)
                    try:
                        if f.get("name") not in by_name:
                            raise ValueError(f"Tool {f.get('name')} not found.")
                        result: Any = by_name[f["name"]](**(f.get("arguments") or {}))
                        ep.tool_errors += getattr(ep.env, "errors", 0) - errors  # an error result (workspace tools)
                    except Exception as e:  # shown to the policy, as TRL does
                        ep.tool_errors += 1
                        result = {"error": str(e)}
                    results.append({"role": "tool", "name": f.get("name") or "", "content": str(result)})
                ep.messages += results
                prompts[i] = turn.continue_ids(tok, prompts[i], completion, results)  # TRL: no re-rendering
                still.append(i)
            live = still
        for ep in eps:
            ep.answer = A.final_answer(ep.messages)
            ep.reward = ep.env._hermes_score(ep.answer)
            if isinstance(ep.env, W.Workspace):
                ep.env._close()  # the verdict is in: the workspace goes
        out.extend(eps)
    return out


def score_messages(messages: list[dict[str, Any]], scale: float = A.SCALE) -> float | None:
    """A logged agent-family conversation scored as its environment scores the episode, from its messages alone.
    The time family (``TimeEnv._hermes_score``): the final answer against the result of a good call (the tool, the
    asked city) that came back without an error; no good call: 0. The hermes family: its tool calls replayed in a
    fresh workspace of the task and the end state verified (``tasks.hermes.replay_score``). None: not an embedded
    agent task (the simulated reviewer's label for one, as the task verifier labels a string task)."""
    user = next((m for m in messages if m.get("role") == "user"), None)
    task = A.parse_question(turn.text_of(user.get("content")) if user else "")
    if task is None:  # a hermes workspace task: its calls replayed in a fresh workspace, the end state verified
        return H.replay_score([{**m, "content": turn.text_of(m.get("content"))} for m in messages], scale)
    value, good, order = None, {}, iter(())  # the last exchange's calls: id -> good?, and in order
    for m in messages:
        if m.get("role") == "assistant":
            calls = turn.chat_message(m).get("tool_calls") or []
            ok = [c["function"].get("name") == A.TOOL and _city(c) == task.city for c in calls]
            good, order = {c.get("id"): g for c, g in zip(calls, ok) if c.get("id")}, iter(ok)
        elif m.get("role") == "tool" and value is None:
            hit = good.get(m.get("tool_call_id")) if m.get("tool_call_id") in good else next(order, False)
            text = turn.text_of(m.get("content"))
            if hit and not text.startswith("{'error'"):
                value = text
    if value is None:
        return 0.0
    return T.score(value, A.final_answer(messages) or "", scale)


def _city(call: dict[str, Any]) -> Any:
    args = call["function"].get("arguments")
    return args.get("city") if isinstance(args, dict) else None


def summarize(episodes: list[Episode]) -> dict[str, Any]:
    """Episode success and the per-episode shape: turns, tool calls, their validity and errors."""
    n = max(1, len(episodes))
    calls = sum(e.tool_calls for e in episodes)
    return {
        "episode_success": round(sum(e.success for e in episodes) / n, 4),
        "mean_reward": round(sum(e.reward for e in episodes) / n, 4),
        "turns_per_episode": round(sum(e.turns for e in episodes) / n, 3),
        "tool_calls_per_episode": round(calls / n, 3),
        "tool_error_rate": round(sum(e.tool_errors for e in episodes) / calls, 4) if calls else 0.0,
        "invalid_call_rate": round(sum(e.invalid_calls for e in episodes) / n, 4),
        "answered_without_tool": round(sum(e.tool_calls == 0 for e in episodes) / n, 4),
        "n": len(episodes),
        "passes": "".join("1" if e.success else "0" for e in episodes),
    }


def evaluate_episodes(
    policy: Any, tasks: list[Any], temperature: float = 0.9, seed: int = 0, max_turns: int = 2
) -> dict[str, Any]:
    """``summarize`` of one episode per task, with ``task_ids`` and ``samples_per_task`` so that two reports on
    the same tasks and seed pair up (``policy.model.paired_gain``)."""
    eps = run_episodes(policy, tasks, temperature=temperature, seed=seed, max_turns=max_turns)
    rep = summarize(eps)
    return {
        **rep,
        "pass_rate": rep["episode_success"],
        "temperature": temperature,
        "samples_per_task": 1,
        "task_ids": [t.task_id for t in tasks],
    }
