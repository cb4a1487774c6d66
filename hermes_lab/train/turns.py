"""Stage 20, train, turn-level: GRPO prompts from logged agent conversations, one per chosen assistant turn.

Reads prep's ``conversations/`` dataset (``runs/round-NN/prep/conversations/``, or the one prep writes for a
trajectories file given to ``train --data``); writes nothing itself: ``hermes_lab.train.grpo`` trains on the rows
``turn_dataset`` returns when ``grpo.turns`` is set, and writes what it always writes under ``--output``. Beside a
prompt set (a live round's traffic: string tasks and conversations) the turns are a phase of their own after the
prompt set's: ``grpo.turn_steps`` steps under ``<output>/turns/``, continuing its adapter, before the episode phase.

    hermes-lab train --config params/embedded.yaml --data tests/fixtures/hermes/trajectory_samples.jsonl \\
        --output runs/turns --set grpo.turns=all --set reward.types=[tool_call,comparison]

The seam is ``turn_prompts(record, ...)``: a canonical conversation record (``hermes_lab.logs.record``) ->
one row per chosen assistant turn k: ``prompt_ids`` (the tokens the trainer samples turn k after: the ones the
policy saw, logged by the gateway's in-process arm for that answer (``meta.turns[].tokens``), else ``messages[:k]``,
the real tool results included, rendered with the loop's one rendering, ``hermes_lab.policy.turn``: the policy's chat
template and the record's ``tools``, ending in the assistant header), ``prompt`` (their text), ``prompt_source``
(``logged`` / ``rendered``), ``reference`` (turn k as the template renders it: the comparison judge's reference),
``ref_reward`` (the conversation's reward: the outcome credited to each of its turns, which the judge reads as "a
good / a bad reference"), ``tools`` (JSON text, for the ``tool_call`` validity reward), ``conversation_id``,
``task_id``, ``turn``. The prompt is a string, so TRL samples one turn per completion and its loss covers that turn
only; ``trainer_class`` makes TRL take the row's ``prompt_ids`` as they are (no re-tokenization). The completions may
be ``grpo.turn_completion_length`` long (a tool call is longer than a string task's answer).

A context longer than ``data.max_seq_len`` minus the completion length loses its earliest messages (the system
prompt first), then the front of its oldest kept message: the turn's most recent context is what decides it. Such
rows carry ``truncated: true`` (and rendered tokens).
"""

from __future__ import annotations

import json
from typing import Any

from hermes_lab.config.schema import HermesConfig
from hermes_lab.policy import turn

WHICH = ("all", "last", "failed", "first_tool")


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


def logged_tokens(record: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """The tokens an in-process arm logged per answer (``meta.turns[].tokens``, ``hermes_lab.logs.gateway``), by
    the index of the assistant message they answered with."""
    meta = record.get("meta") or {}
    if isinstance(meta, str):
        meta = json.loads(meta) if meta.strip() else {}
    out = {}
    for t in (meta.get("turns") if isinstance(meta, dict) else None) or []:
        tok = t.get("tokens") if isinstance(t, dict) else None
        if isinstance(tok, dict) and isinstance(t.get("message"), int) and tok.get("prompt_ids"):
            out[t["message"]] = tok
    return out


def turn_prompts(
    record: dict[str, Any], which: str, tok: Any, budget: int, threshold: float = 3.0
) -> list[dict[str, Any]]:
    """One GRPO row per chosen assistant turn of a conversation record (the module docstring)."""
    tools = record.get("tools") or []
    if isinstance(tools, str):
        tools = json.loads(tools) if tools.strip() else []
    messages = turn.chat_messages(record["messages"])
    logged = logged_tokens(record)
    rows = []
    for k in chosen_turns(messages, which, record.get("reward"), threshold):
        head = turn.render_text(tok, messages[:k], tools)
        full = turn.render_text(tok, messages[: k + 1], tools, generation_prompt=False)
        reference = full[len(head) :] if full.startswith(head) else (messages[k].get("content") or "")
        reference = reference.strip()
        if tok.eos_token:
            reference = reference.removesuffix(tok.eos_token).strip()
        ids = list(logged[k]["prompt_ids"]) if k in logged else None
        if ids is not None and len(ids) <= budget:  # what the policy saw, token for token
            prompt, truncated, source = tok.decode(ids, skip_special_tokens=False), False, "logged"
        else:  # another upstream's answer (or a context cut to fit): the loop's one rendering
            context, truncated = turn.fit(tok, messages[:k], tools, budget)
            prompt, ids = turn.render_text(tok, context, tools), turn.prompt_ids(tok, context, tools)
            source = "rendered"
        rows.append(
            {
                "prompt": prompt,
                "prompt_ids": ids,
                "prompt_source": source,
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
    """The ``grpo.turns`` rows of a conversations dataset's train split (a ``datasets.Dataset``; none: ValueError).
    ``cfg``: the turn phase's (``train.prompts.turn_config``: its completion length is the turns')."""
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


def trainer_class(ds: Any) -> type:
    """TRL's GRPOTrainer, its string prompts tokenized as the loop tokenizes them: a row's ``prompt_ids`` when it has
    them (the logged tokens of an in-process answer, or the chat template's rendering), else the completion form
    (``policy.turn.completion_ids``: the text's tokens, no special tokens added, as ``Policy.generate`` and the
    gateway do). Conversational prompts (the episode phase) are TRL's own. TRL hands ``_tokenize_prompts`` the prompt
    texts only, so a row's ids are found by its prompt text (a text logged twice with other ids: the first)."""
    from trl import GRPOTrainer

    ids: dict[str, list[int]] = {}
    if "prompt_ids" in ds.column_names:
        for p, x in zip(ds["prompt"], ds["prompt_ids"]):
            if x:
                ids.setdefault(p, list(x))

    class LoopTrainer(GRPOTrainer):
        def _tokenize_prompts(self, prompts: list[Any]) -> Any:
            if prompts and isinstance(prompts[0], str):
                tok = self.processing_class
                return [list(ids[p]) if p in ids else turn.completion_ids(tok, p) for p in prompts], None, {}
            return super()._tokenize_prompts(prompts)

    return LoopTrainer
