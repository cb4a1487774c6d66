"""Run and score agent episodes with a policy: the agent family's evaluation (greedy or sampled).

Reads and writes nothing; the policy build records the base policy's episode success (build.json), train's
before/after evaluation, validate and the simulated A/B call ``evaluate_episodes``; execute logs the episodes
``run_episodes`` returns as conversation records.

An episode is played the way TRL's multi-turn loop plays it in training (``GRPOTrainer`` with an
``environment_factory``): the conversation is rendered with the policy's chat template and the environment's
tool, the policy completes one assistant turn, TRL's ``parse_response`` reads its tool calls, each call runs on
the episode's environment (an exception becomes the tool message ``{'error': ...}``, counted), and the next turn
sees the result, for at most ``max_turns`` tool-calling turns. All episodes of a batch advance turn by turn
together, so a turn is one batched ``generate``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hermes_lab.tasks import agent as A


@dataclass
class Episode:
    task: A.AgentTask
    messages: list[dict[str, Any]]
    reward: float = 0.0
    answer: str | None = None
    turns: int = 0  # assistant turns
    tool_calls: int = 0
    tool_errors: int = 0
    invalid_calls: int = 0  # turns that opened a <tool_call> the parser could not read
    env: Any = field(default=None, repr=False)

    @property
    def success(self) -> bool:
        return self.reward >= 3.0


def _parse(tok: Any, ids: list[int], prefix: list[int], tools: list[Any]) -> dict[str, Any]:
    """The assistant turn as TRL's multi-turn loop reads it (``trl.chat_template_utils.parse_response``): a tool
    call missing its name or arguments is no call but plain text (TRL validates them), so the next turn's
    template never renders a call it cannot (a trained policy's slip, ``{"name": "time"}``, once ended an A/B)."""
    from trl.chat_template_utils import parse_response

    msg = parse_response(tok, ids, prefix=prefix, tools=tools)
    msg["content"] = (msg.get("content") or "").removesuffix(tok.eos_token)
    return msg


def run_episodes(
    policy: Any,
    tasks: list[A.AgentTask],
    temperature: float = 0.9,
    seed: int = 0,
    max_turns: int = 2,
    max_new_tokens: int = 80,
    batch_size: int = 128,
) -> list[Episode]:
    """Play one episode per task (``episode_seed``: the task's index, so a seed's tool results are fixed)."""
    import torch

    tok, model = policy.tokenizer, policy.model
    tok.padding_side = "left"
    out: list[Episode] = []
    for start in range(0, len(tasks), batch_size):
        chunk = tasks[start : start + batch_size]
        eps = []
        for i, t in enumerate(chunk):
            env = A.TimeEnv(seed=seed)
            env.reset(city=t.city, episode_seed=start + i)
            eps.append(Episode(t, t.prompt(), env=env))
        live = list(range(len(eps)))
        for turn in range(max_turns + 1):
            if not live:
                break
            tools = [[eps[i].env.time] for i in live]
            prompt_ids = [
                tok.apply_chat_template(
                    eps[i].messages, tools=tl, add_generation_prompt=True, tokenize=True, return_dict=False
                )
                for i, tl in zip(live, tools)
            ]
            width = max(len(p) for p in prompt_ids)
            ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in prompt_ids])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids])
            budget = min(max_new_tokens, model.config.max_position_embeddings - width)
            if budget <= 0:
                break
            kw: dict[str, Any] = dict(
                max_new_tokens=budget, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id
            )
            kw.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else kw.update(
                do_sample=False
            )
            torch.manual_seed(seed * 1_000_003 + start * 31 + turn)
            with torch.no_grad():
                gen = model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device), **kw)
            still = []
            for row, i in enumerate(live):
                new = gen[row, width:].tolist()
                if tok.eos_token_id in new:
                    new = new[: new.index(tok.eos_token_id) + 1]
                ep = eps[i]
                msg = _parse(tok, new, prompt_ids[row], tools[row])
                ep.turns += 1
                ep.messages.append(msg)
                if "<tool_call>" in (msg.get("content") or ""):
                    ep.invalid_calls += 1
                calls = msg.get("tool_calls") or []
                if not calls or turn == max_turns:
                    continue
                for c in calls:
                    f = c.get("function", c)
                    ep.tool_calls += 1
                    try:
                        if f.get("name") != A.TOOL:
                            raise ValueError(f"Tool {f.get('name')} not found.")
                        result: Any = ep.env.time(**(f.get("arguments") or {}))
                    except Exception as e:  # shown to the policy, as TRL does
                        ep.tool_errors += 1
                        result = {"error": str(e)}
                    ep.messages.append({"role": "tool", "name": f.get("name") or "", "content": str(result)})
                still.append(i)
            live = still
        for ep in eps:
            ep.answer = A.final_answer(ep.messages)
            ep.reward = ep.env._hermes_score(ep.answer)
        out.extend(eps)
    return out


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
    policy: Any, tasks: list[A.AgentTask], temperature: float = 0.9, seed: int = 0, max_turns: int = 2
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
