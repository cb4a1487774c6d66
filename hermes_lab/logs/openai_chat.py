"""OpenAI chat JSONL as canonical conversation records (stage: prep, format ``openai``).

Reads, never writes: one JSON object a line, ``{"messages": [...], "tools": [...]}`` (OpenAI fine-tuning, TRL's
conversational datasets, most agent frameworks; also TRL's ``{"prompt": [...], "completion": [...]}`` and prep's own
accepted records), handed over by the ingest (``hermes_lab.logs.readers.parse_line``). A malformed line raises
``record.Invalid``. Run through ``hermes-lab prep``.
"""

from __future__ import annotations

import json
from typing import Any

from hermes_lab.logs.record import Invalid, check_messages, make_record, outcome_of, tool_schema, where


def _reward(obj: dict[str, Any], scale: float) -> tuple[float | None, str | None]:
    r = obj.get("reward")
    if r is None:
        return None, None
    if type(r) is not float and type(r) is not int:
        raise Invalid("reward not a number", f"reward is {json.dumps(r)[:40]}")
    if not 0 <= r <= scale:
        raise Invalid("reward out of range", f"reward {r} outside 0..{scale:g}")
    src = obj.get("reward_source")
    return float(r), src if isinstance(src, str) and src else "log"


def tools_of(raw: Any, at: str) -> list[dict[str, Any]]:
    if raw is None:
        return []
    if isinstance(raw, str):  # a JSON text column (prep's own conversations dataset)
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError:
            raise Invalid("bad tool schema", f"{at}tools is text that is not JSON") from None
    if not isinstance(raw, list):
        raise Invalid("bad tool schema", f"{at}tools is not a list")
    return [tool_schema(t, f"{at}tool {k}") for k, t in enumerate(raw)]


def from_openai(obj: dict[str, Any], file: str, line: int | None, scale: float, max_chars: int) -> dict[str, Any]:
    """``{"messages", "tools"?, "id" | "conversation_id"?, "task_id"?, "reward"?, "model"?, ...}``."""
    raw = obj.get("messages")
    if raw is None and isinstance(obj.get("prompt"), list):  # TRL's conversational prompt / completion
        raw = obj["prompt"] + (obj.get("completion") or [])
    if raw is None:
        raise Invalid("missing field 'messages'", f"present: {', '.join(list(obj)[:12])}")
    msgs = check_messages(raw, max_chars)
    tools = tools_of(obj.get("tools"), "")
    reward, rsrc = _reward(obj, scale)
    logged = obj.get("outcome") if isinstance(obj.get("outcome"), dict) else {}
    signals = {k: obj.get(k, logged.get(k)) for k in ("completed", "partial", "end_reason", "api_calls")}
    signals = {k: v for k, v in signals.items() if v is not None}
    meta = obj.get("meta") if isinstance(obj.get("meta"), dict) else {}
    if isinstance(obj.get("source"), dict):
        meta = {**meta, "logged_source": obj["source"]}
    return make_record(
        msgs,
        tools,
        where("openai", file, line),
        conversation_id=obj.get("conversation_id") or obj.get("id"),
        task_id=obj.get("task_id"),
        model=obj.get("model"),
        started_at=obj.get("started_at") or obj.get("timestamp"),
        ended_at=obj.get("ended_at"),
        outcome=outcome_of(msgs, tools, **signals),
        reward=reward,
        reward_source=rsrc,
        family=obj.get("family"),
        parent_conversation_id=obj.get("parent_conversation_id"),
        meta=meta,
    )
