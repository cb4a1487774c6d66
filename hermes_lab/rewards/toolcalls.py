"""The tool-call validity reward: does a sampled assistant turn make tool calls the tools' schemas accept?

Stage: train (turn-level GRPO on logged conversations, ``grpo.turns``). Reads nothing. A turn's calls are its
Hermes-style ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (the format of the Hermes Agent,
Qwen2.5/3 and the embedded tiny policy's chat template). Every call of a turn is checked, in order:

| kind             | the call                                                               | reward       |
|------------------|------------------------------------------------------------------------|--------------|
| ``valid``        | parses, names a tool of the row's schema, arguments satisfy its schema | scale        |
| ``bad_arguments``| parses and names a known tool, arguments fail its JSON schema          | 0.5 x scale  |
| ``unknown_tool`` | parses, names no tool of the schema                                    | 0.25 x scale |
| ``unparsable``   | a ``<tool_call>`` block that is not a JSON object with name/arguments  | 0            |
| ``no_call``      | the turn makes no call                                                 | None (n/a)   |

None is "not applicable": TRL leaves that sample out of this reward.

A turn with several calls scores its worst call. The schema check is ``jsonschema`` (Draft 2020-12) on the
tool's ``parameters``; a schema that is itself invalid counts the call as valid (the log's fault, not the
policy's).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from typing import Any

KINDS = ("valid", "bad_arguments", "unknown_tool", "unparsable", "no_call")
SHARE = {"valid": 1.0, "bad_arguments": 0.5, "unknown_tool": 0.25, "unparsable": 0.0}
_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)


def _tools_by_name(tools: Any) -> dict[str, dict[str, Any]]:
    if isinstance(tools, str):
        try:
            tools = json.loads(tools) if tools.strip() else []
        except json.JSONDecodeError:
            tools = []
    out = {}
    for t in tools or []:
        f = t.get("function", t) if isinstance(t, dict) else {}
        if isinstance(f, dict) and isinstance(f.get("name"), str):
            out[f["name"]] = f.get("parameters") or {}
    return out


def check_call(body: str, tools: dict[str, dict[str, Any]]) -> str:
    """The kind of one ``<tool_call>`` block's body."""
    try:
        call = json.loads(body.strip())
    except json.JSONDecodeError:
        return "unparsable"
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return "unparsable"
    args = call.get("arguments", {})
    if isinstance(args, str):  # some models write the arguments as JSON text
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return "unparsable"
    if not isinstance(args, dict):
        return "unparsable"
    if call["name"] not in tools:
        return "unknown_tool"
    import jsonschema

    try:
        jsonschema.validate(args, tools[call["name"]])
    except jsonschema.ValidationError:
        return "bad_arguments"
    except jsonschema.SchemaError:
        return "valid"
    return "valid"


def check_turn(text: str, tools: Any) -> str:
    """The kind of a whole turn: its worst call, or ``no_call``."""
    bodies = _BLOCK.findall(text or "")
    if not bodies:
        return "no_call"
    by_name = _tools_by_name(tools)
    kinds = [check_call(b, by_name) for b in bodies]
    return min(kinds, key=lambda k: SHARE[k])


def make_tool_call_reward(scale: float) -> Any:
    """The ``tool_call`` reward: reads each row's ``tools`` column (JSON text of OpenAI function schemas)."""
    tally: Counter[str] = Counter()

    def tool_call(prompts: list[Any], completions: list[Any], tools: list[Any] | None = None, **kw: Any):
        out: list[float | None] = []
        for i, c in enumerate(completions):
            text = c if isinstance(c, str) else "".join(m.get("content") or "" for m in c if isinstance(m, dict))
            kind = check_turn(text, tools[i] if tools else [])
            tally[kind] += 1
            out.append(None if kind == "no_call" else round(scale * SHARE[kind], 4))
        return out

    tool_call.tally = tally  # type: ignore[attr-defined]
    return tool_call
