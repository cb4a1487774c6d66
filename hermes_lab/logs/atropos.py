"""Atropos scored groups as canonical conversation records (stage: prep, format ``atropos``).

Reads, never writes: what an atroposlib environment writes in ``process`` mode (``python env.py process
--env.data_path_to_save_groups groups.jsonl ...``; atroposlib 0.4.0, ``BaseEnv.handle_send_to_api``'s jsonlines
writer): one ``ScoredDataGroup`` a line, ``{"tokens": [[int]], "masks": [[int]], "scores": [float],
"messages": [[{"role", "content"}]], "advantages", "ref_logprobs", "generation_params", "inference_logprobs",
"group_overrides", "overrides", "images", ...}``: one prompt sampled G times and scored, exactly a GRPO group.

Each completion of a group is one record: its messages (an environment's own, OpenAI-style or in the Hermes
function-calling format: ``<tools>`` in the system prompt, ``<think>`` / ``<tool_call>`` in assistant text,
``<tool_response>`` in tool messages, read as ``hermes_lab.logs.readers`` reads a Hermes trajectory; or, when the
environment gave none, process mode's decoding of the tokens as one user message, split back into messages by its
ChatML or Llama 3 chat template), its score as the reward (``reward_source: atropos``; the scores' range
``conversations.atropos_scores`` mapped linearly onto 0..reward.scale). The completions of a group share one
task_id (its prompt's digest: the train / held-out split keeps a group together) and their first user message is
the GRPO prompt set's prompt, so the group is one prompt's group there too. A group whose scores are all equal
carries no signal, as GRPO sees it (zero advantage): counted per input (``atropos.no_signal``) and marked in each
record's ``meta.atropos``.

A group is rejected whole, by its line (GRPO needs every sample of a group): a line that is no JSON object, no
scores, a score that is no number or lies outside the range, messages and scores (or tokens) of different
lengths, no messages or messages in no template known, and any completion whose messages prep refuses (the
completion named).

    hermes-lab prep --input data/gsm8k.jsonl --output DIR
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hermes_lab.logs.grouping import Bad, read_lines
from hermes_lab.logs.hermes_trajectory import trajectory_messages
from hermes_lab.logs.record import Invalid, check_messages, make_record, outcome_of, where

ROLE_OF = {"system": "system", "user": "human", "assistant": "gpt", "tool": "tool"}
HERMES_TAGS = ("<tool_call>", "<tool_response>", "<think>", "</think>")
# process mode with include_messages and an environment that gave no messages: the decoded tokens, one user message
CHATML = re.compile(r"<\|im_start\|>(\w+)\n(.*?)(?:<\|im_end\|>|$)", re.S)
LLAMA3 = re.compile(r"<\|start_header_id\|>(\w+)<\|end_header_id\|>\n\n(.*?)(?:<\|eot_id\|>|$)", re.S)
END_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<|im_end|>", "<|eot_id|>")


def iter_groups(
    path: Path, max_chars: int, cap: int, scores: tuple[float, float], scale: float, info: dict[str, Any]
) -> Iterator[tuple[Any, ...]]:
    """(session, file, line, raw, record or Invalid) for every completion of every group (a rejected group: once)."""
    st = info.setdefault("atropos", {"groups": 0, "completions": 0, "no_signal": 0, "rejected_groups": 0})
    for ln, _, obj in read_lines(path, cap):
        if obj is None:
            info["blank"] = info.get("blank", 0) + 1
            continue
        if isinstance(obj, Bad):
            st["rejected_groups"] += 1
            yield None, str(path), ln, obj.raw, obj.error
            continue
        try:
            recs = group_records(obj, str(path), ln, max_chars, scores, scale)
        except Invalid as e:
            st["rejected_groups"] += 1
            yield None, str(path), ln, json.dumps(obj, ensure_ascii=False)[: 1 << 20], e
            continue
        st["groups"] += 1
        st["completions"] += len(recs)
        st["no_signal"] += recs[0]["meta"]["atropos"]["no_signal"]
        for r in recs:
            yield r["conversation_id"], str(path), None, "", r


def group_records(
    obj: Any, file: str, line: int, max_chars: int, scores: tuple[float, float], scale: float
) -> list[dict[str, Any]]:
    """A ScoredDataGroup's completions as records; Invalid names what is wrong with the group."""
    if not isinstance(obj, dict):
        raise Invalid("not a JSON object", f"got a JSON {type(obj).__name__}")
    got = obj.get("scores")
    if not isinstance(got, list) or not got:
        raise Invalid(
            "missing field 'scores'",
            f"a scored group needs a non-empty scores list; present: {', '.join(list(obj)[:12])}",
        )
    lo, hi = scores
    for i, s in enumerate(got):
        if type(s) is not int and type(s) is not float:
            raise Invalid("score not a number", f"score {i} is {json.dumps(s)[:40]}")
        if not lo <= s <= hi:
            raise Invalid(
                "score out of range", f"score {i} ({s}) outside conversations.atropos_scores [{lo:g}, {hi:g}]"
            )
    msgs = obj.get("messages")
    if msgs is None:
        raise Invalid(
            "no messages", "a tokens-only group (process mode with include_messages off): the text needs the tokenizer"
        )
    if not isinstance(msgs, list) or len(msgs) != len(got):
        n = len(msgs) if isinstance(msgs, list) else type(msgs).__name__
        raise Invalid("group size mismatch", f"{n} message lists for {len(got)} scores")
    toks = obj.get("tokens")
    if isinstance(toks, list) and len(toks) != len(got):
        raise Invalid("group size mismatch", f"{len(toks)} token lists for {len(got)} scores")
    convs = []
    for i, m in enumerate(msgs):
        try:
            convs.append(completion_messages(m, max_chars))
        except Invalid as e:
            raise Invalid(e.reason, f"completion {i}: {e.detail}") from None
    gid = hashlib.blake2b(
        json.dumps([msgs, got], sort_keys=True, ensure_ascii=False).encode("utf-8", "surrogatepass"), digest_size=8
    ).hexdigest()
    first = convs[0][0]
    prompt = first[: next((k for k, m in enumerate(first) if m["role"] == "assistant"), len(first))]
    task = (
        "atropos-"
        + hashlib.blake2b(
            json.dumps(prompt, sort_keys=True).encode("utf-8", "surrogatepass"), digest_size=6
        ).hexdigest()
    )
    flat = len(set(got)) == 1
    out = []
    for i, ((m, tl), s) in enumerate(zip(convs, got)):
        reward = round((s - lo) / (hi - lo) * scale, 6)
        meta = {"atropos": {"group": gid, "index": i, "group_size": len(got), "score": s, "no_signal": flat}}
        out.append(
            make_record(
                m,
                tl,
                where("atropos", file, line),
                conversation_id=f"atropos-{gid}-{i}",
                task_id=task,
                outcome=outcome_of(m, tl),
                reward=reward,
                reward_source="atropos",
                meta=meta,
            )
        )
    return out


def completion_messages(raw: Any, max_chars: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """One completion's (messages, tools): OpenAI-style as they are, Hermes-tagged text through the trajectory
    reader, a template-decoded single message split back into messages."""
    if not isinstance(raw, list) or not raw:
        raise Invalid("empty conversation", "a completion's messages must be a non-empty list")
    if len(raw) == 1 and isinstance(raw[0], dict) and isinstance(raw[0].get("content"), str):
        decoded = _untemplate(raw[0]["content"])
        if decoded is not None:
            raw = decoded
    if any(not isinstance(m, dict) for m in raw):
        raise Invalid("bad message", "a message is not an object")
    tagged = any(isinstance(m.get("content"), str) and any(t in m["content"] for t in HERMES_TAGS) for m in raw)
    tagged |= any(m.get("role") == "system" and "<tools>" in str(m.get("content")) for m in raw)
    if not tagged or any(m.get("tool_calls") for m in raw):
        return check_messages([{k: v for k, v in m.items() if k != "reward"} for m in raw], max_chars), []
    turns = []
    for m in raw:
        role, content = m.get("role"), m.get("content")
        if role not in ROLE_OF or not isinstance(content, str):
            raise Invalid("bad message", f"role {str(role)[:20]!r} with {type(content).__name__} content")
        if role == "assistant" and "</think>" in content and "<think>" not in content:
            content = "<think>" + content  # the template opened it (reasoning models' generation prompt)
        if role == "tool" and "<tool_response>" not in content:
            content = f"<tool_response>\n{json.dumps({'content': content})}\n</tool_response>"
        turns.append({"from": ROLE_OF[role], "value": content})
    return trajectory_messages(turns, max_chars)


def _untemplate(text: str) -> list[dict[str, Any]] | None:
    """A ChatML or Llama 3 rendering as messages; None when it is neither (plain text stays one message)."""
    for pattern in (CHATML, LLAMA3):
        found = pattern.findall(text)
        if found:
            out = []
            for role, body in found:
                for end in END_TOKENS:
                    body = body.removesuffix(end)
                out.append({"role": role, "content": body.strip("\n") if role != "assistant" else body.strip()})
            return out
    return None
