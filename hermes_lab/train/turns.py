"""Stage 20, train, turn-level: GRPO prompts from logged agent conversations, one per chosen assistant turn.

Reads prep's ``conversations/`` dataset (``runs/round-NN/prep/conversations/``, or the one prep writes for a
trajectories file given to ``train --data``); writes nothing itself: ``hermes_lab.train.grpo`` trains on the rows
``turn_dataset`` returns when ``grpo.turns`` is set, and writes what it always writes under ``--output``.

    hermes-lab train --config params/embedded.yaml --data tests/fixtures/hermes/trajectory_samples.jsonl \\
        --output runs/turns --set grpo.turns=all --set reward.types=[tool_call,comparison]

The seam is ``turn_prompts(record, ...)``: a canonical conversation record (``hermes_lab.data.conversation``) ->
one row per chosen assistant turn k: ``prompt`` (``messages[:k]``, the real tool results included, rendered with
the policy's chat template and the record's ``tools``, ending in the assistant header), ``reference`` (turn k as
the template renders it: the comparison judge's reference), ``ref_reward`` (the conversation's reward: the outcome
credited to each of its turns, which the judge reads as "a good / a bad reference"), ``tools`` (JSON text, for
the ``tool_call`` validity reward), ``conversation_id``, ``task_id``, ``turn``. The prompt is a rendered string, so
TRL samples one turn per completion and its loss covers that turn only.

A context longer than ``data.max_seq_len - grpo.max_completion_length`` tokens loses its earliest messages (the
system prompt first), then the front of its oldest kept message: the turn's most recent context is what decides
it. Such rows carry ``truncated: true``.
"""

from __future__ import annotations

import json
from typing import Any

from hermes_lab.config.schema import HermesConfig

WHICH = ("all", "last", "failed", "first_tool")


def _chat_message(m: dict[str, Any]) -> dict[str, Any]:
    """A record's message as chat templates take it: tool-call arguments as objects, no empty fields."""
    out: dict[str, Any] = {"role": m["role"], "content": m.get("content") or ""}
    calls = []
    for c in m.get("tool_calls") or []:
        f = dict(c.get("function") or {})
        args = f.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                args = {"_raw": args}
        calls.append({"id": c.get("id"), "type": "function", "function": {"name": f.get("name"), "arguments": args}})
    if calls:
        out["tool_calls"] = calls
    if m["role"] == "tool":
        out["name"] = m.get("name") or ""
        if m.get("tool_call_id"):
            out["tool_call_id"] = m["tool_call_id"]
    return out


def chosen_turns(messages: list[dict[str, Any]], which: str, reward: float | None, threshold: float) -> list[int]:
    """Indices of the assistant messages ``which`` picks (``grpo.turns``)."""
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if which == "all":
        return turns
    if which == "last":
        return turns[-1:]
    if which == "failed":
        return turns if reward is not None and reward < threshold else []
    if which == "first_tool":
        return (
            [next(i for i in turns if messages[i].get("tool_calls"))]
            if any(messages[i].get("tool_calls") for i in turns)
            else []
        )
    raise ValueError(f"grpo.turns must be one of {', '.join(WHICH)}; got {which!r}")


def _fit(tok: Any, context: list[dict[str, Any]], tools: Any, budget: int) -> tuple[str, bool]:
    """The rendered prompt of ``context`` within ``budget`` tokens, dropping the oldest messages first."""

    def render(msgs: list[dict[str, Any]]) -> str:
        return tok.apply_chat_template(msgs, tools=tools or None, add_generation_prompt=True, tokenize=False)

    def size(text: str) -> int:
        return len(tok(text, add_special_tokens=False)["input_ids"])

    text = render(context)
    if size(text) <= budget:
        return text, False
    msgs = list(context)
    while len(msgs) > 1 and size(render(msgs)) > budget:
        msgs.pop(0)
    text = render(msgs)
    while size(text) > budget and msgs[0].get("content"):
        over = size(text) - budget
        msgs[0] = {**msgs[0], "content": msgs[0]["content"][over + 8 :]}  # the tail of the oldest kept message
        text = render(msgs)
    return text, True


def turn_prompts(
    record: dict[str, Any], which: str, tok: Any, budget: int, threshold: float = 3.0
) -> list[dict[str, Any]]:
    """One GRPO row per chosen assistant turn of a conversation record (the module docstring)."""
    tools = record.get("tools") or []
    if isinstance(tools, str):
        tools = json.loads(tools) if tools.strip() else []
    messages = [_chat_message(m) for m in record["messages"]]
    rows = []
    for k in chosen_turns(messages, which, record.get("reward"), threshold):
        head = tok.apply_chat_template(messages[:k], tools=tools or None, add_generation_prompt=True, tokenize=False)
        full = tok.apply_chat_template(messages[: k + 1], tools=tools or None, tokenize=False)
        reference = full[len(head) :] if full.startswith(head) else (messages[k].get("content") or "")
        reference = reference.strip()
        if tok.eos_token:
            reference = reference.removesuffix(tok.eos_token).strip()
        prompt, truncated = _fit(tok, messages[:k], tools, budget)
        rows.append(
            {
                "prompt": prompt,
                "reference": reference,
                "ref_reward": record.get("reward"),
                "tools": json.dumps(tools),
                "conversation_id": record.get("conversation_id") or "",
                "task_id": record.get("task_id") or "",
                "turn": k,
                "truncated": truncated,
            }
        )
    return rows


def turn_dataset(conversations: Any, cfg: HermesConfig, tok: Any) -> Any:
    """The ``grpo.turns`` rows of a conversations dataset's train split (a ``datasets.Dataset``)."""
    from datasets import Dataset

    budget = cfg.data.max_seq_len - cfg.grpo.max_completion_length
    rows: list[dict[str, Any]] = []
    for rec in conversations:
        if rec.get("split", "train") != "train":
            continue
        rows += turn_prompts(rec, cfg.grpo.turns, tok, budget, cfg.reward.success_threshold)
    if not rows:
        raise ValueError(
            f"grpo.turns={cfg.grpo.turns!r}: no assistant turn to train on in the conversations' train split "
            f"({len(conversations)} conversations)"
        )
    return Dataset.from_list(rows)
