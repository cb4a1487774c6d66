"""The tiny policy's chat template: Hermes-style ``<tool_call>`` blocks, parsed back by transformers.

Reads and writes nothing; ``hermes_lab.policy.model.build_tiny_policy`` sets it on the tokenizer it saves (so
``AutoTokenizer`` loads it with the policy), the build's teacher renders its agent episodes with it, TRL renders
prompts and tool results with it and parses completions with ``response_template``. A conversation renders as::

    <|user|>first line of kelo.txt?<|assistant|><tool_call>{"name": "read_file", "arguments": {"path": "kelo.txt"}}
    </tool_call><eos><|tool|>{"content": "1|mor\\n2|zip\\n3|", "total_lines": 2, "file_size": 8, "truncat
    <|assistant|>mor<eos>

(one line: it is broken here after the call and after the tool result's 64 characters).

No newlines, and a compact rendering of what an agent sends: every character is a token of a 0.3M-parameter policy
with 512 positions, and a real Hermes Agent request is ~60 KB (a 6.7k-character system prompt, up to 28 tool
schemas). So the template leaves out system messages and the tool list (the policy knows the tools it was taught
by their calls), cuts a tool result to its first ``TOOL_CHARS`` characters (what the tasks read is at its head),
and renders tool-call arguments with sorted keys (Hermes echoes a call's arguments sorted: the echo renders to
the tokens the policy sampled). Its markers (``MARKERS``) are one token each, as a real family's ``<tool_call>``
is. The template passes TRL's ``supports_tool_calling`` and is prefix-preserving (what TRL's multi-turn loop
needs to append tool results to a completion without re-tokenizing it).
"""

from __future__ import annotations

from typing import Any

MARKERS = ("<|user|>", "<|assistant|>", "<|tool|>", "<tool_call>", "</tool_call>")  # one token each (policy.model)
TOOL_CHARS = 64  # of a tool result: the head holds what the tasks need (a line, a match, a count)
CHAT_TEMPLATE = (
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}<|user|>{{ m.content }}"
    "{%- elif m.role == 'assistant' %}<|assistant|>{{ m.content or '' }}"
    "{%- for tc in m.tool_calls or [] %}{% set f = tc.function or tc %}"
    '<tool_call>{"name": "{{ f.name }}", "arguments": '
    "{%- if f.arguments is string %} {{ f.arguments }}{% else %} {{ f.arguments | tojson(sort_keys=True) }}{% endif %}}"
    "</tool_call>"
    "{%- endfor %}<eos>"
    "{%- elif m.role == 'tool' %}<|tool|>{{ (m.content or '')[:TOOL_CHARS] }}"
    "{%- endif %}{% endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{% endif %}"
).replace("TOOL_CHARS", str(TOOL_CHARS))

# transformers' response parsing (``tokenizer.parse_response``): what TRL reads tool calls with
RESPONSE_TEMPLATE: dict[str, Any] = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|assistant|>",
    "fields": {
        "tool_calls": {
            "open": "<tool_call>",
            "close_pattern": r"</tool_call>\s*",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": r"<eos>\s*", "content": "text"},
    },
}


def add_chat_template(tok: Any) -> Any:
    """Set the tiny policy's chat and response templates on a tokenizer; returns it."""
    tok.chat_template = CHAT_TEMPLATE
    tok.response_template = RESPONSE_TEMPLATE
    return tok


def render(tok: Any, messages: list[dict[str, Any]], tools: list[Any] | None, generation_prompt: bool) -> str:
    return tok.apply_chat_template(
        messages, tools=tools or None, add_generation_prompt=generation_prompt, tokenize=False
    )


def assistant_spans(tok: Any, messages: list[dict[str, Any]], tools: list[Any] | None) -> list[tuple[str, bool]]:
    """The rendered conversation as (text, trained) pieces: the assistant turns (after their ``<|assistant|>``
    header, through their ``<eos>``) are trained, the rest is context. Rendered prefix by prefix, so the pieces
    are exactly the template's (it is prefix-preserving)."""
    pieces: list[tuple[str, bool]] = []
    done = ""
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            head = render(tok, messages[:i], tools, True)
            pieces.append((head[len(done) :], False))
            full = render(tok, messages[: i + 1], tools, False)
            pieces.append((full[len(head) :], True))
            done = full
        else:
            full = render(tok, messages[: i + 1], tools, False)
            pieces.append((full[len(done) :], False))
            done = full
    return [(t, trained) for t, trained in pieces if t]
