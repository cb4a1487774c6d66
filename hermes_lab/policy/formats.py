"""A policy's chat format: the template it renders with and the reader its answers' tool calls are parsed with.

Reads and writes nothing (it sets attributes on a tokenizer in memory). Every place that loads a policy's tokenizer
calls ``prepare(tok, cfg.model.tool_parser)`` once: the gateway's in-process arms (``live.local``), execute, validate,
the A/B stage and both training phases (``train.grpo``); ``policy.turn`` renders and parses through what it set, so
all of them read a completion alike, and alike with TRL's GRPOTrainer. ``check`` is the same resolution as a
named error (``ChatFormatError``) for ``hermes-lab doctor`` and the start of a round; ``describe`` is doctor's line.

The reader, first that applies:

1. the tokenizer's own ``response_template`` / ``response_schema`` (the embedded tiny policy's, ``policy.chat``; a
   hub tokenizer that ships one): kept, as GRPOTrainer keeps it;
2. TRL's for a template TRL knows (``trl.chat_template_utils.add_response_schema``: Qwen2.5, Qwen3, Llama 3.1/3.2,
   GPT-OSS, GLM-4-MoE, Qwen3.5, Gemma 4, ...), the reader GRPOTrainer sets for those;
3. ``model.tool_parser``, named as vLLM's ``--tool-call-parser`` (``TOOL_PARSERS``: hermes, llama3_json, mistral,
   qwen3_coder), anchored at the template's own generation prompt and closed by its eos token.

Otherwise ``ChatFormatError``: a tokenizer with no chat template, a template no reader knows, an unknown
``tool_parser``, or a reader that cannot read back a tool call its own template rendered (``probe``). Never the
silent fallback of answers read as plain text.

The template: the tokenizer's own, unless it is not prefix-preserving (TRL's ``is_chat_template_prefix_preserving``:
e.g. Qwen3's, which drops earlier turns' reasoning). GRPOTrainer then trains with TRL's training template for that
family (``get_training_chat_template``), so every rendering here uses that one too (``render_template``), and vLLM
serves it with ``--chat-template`` (docs/gpu.md). A non-prefix-preserving template TRL has no training template for
cannot continue a turn after tool results without re-tokenizing: ``describe`` says so.

    hermes-lab doctor --params params/my_model.yaml       # template, reader, renders tools, prefix-preserving
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any

from hermes_lab.config.training import TOOL_PARSERS
from hermes_lab.core.command import CommandError

__all__ = ["TOOL_PARSERS", "ChatFormatError", "Reader", "check", "describe", "prepare"]
_READER = "_hermes_reader"  # the Reader prepare resolved, kept on the tokenizer
_RENDER = "_hermes_render_template"  # the template to render with (None: the tokenizer's own)


class ChatFormatError(CommandError):
    """A policy whose answers cannot be read as its family writes them; ``code`` names which problem."""

    def __init__(self, code: str, message: str):
        self.code = code
        super().__init__(f"chat format ({code}): {message}")


@dataclass(frozen=True)
class Reader:
    """Where a tokenizer's response reader came from: ``tokenizer`` (its own), ``trl`` (add_response_schema),
    ``tool_parser:<name>`` (model.tool_parser), or ``text`` (no chat template: answers are text)."""

    source: str
    template: str  # the template's name (``template_name``)


# ------------------------------------------------------------------------------------------------ naming
def _trl_templates() -> dict[str, str]:
    """TRL's shipped chat templates by name (trl/chat_templates/*.jinja, training variants excluded)."""
    import trl.chat_template_utils as ctu

    return {
        k.removesuffix("_chat_template"): v
        for k, v in vars(ctu).items()
        if k.endswith("_chat_template") and not k.endswith("_training_chat_template") and isinstance(v, str)
    }


def template_name(tok: Any) -> str:
    """``trl:<family>`` for a template TRL ships, ``embedded`` for the tiny policy's, ``custom:<sha256 prefix>``
    for any other, ``none`` without one."""
    tpl = getattr(tok, "chat_template", None)
    if not tpl:
        return "none"
    if not isinstance(tpl, str):  # named variants: the default one
        tpl = tpl.get("default", "")
    from hermes_lab.policy.chat import CHAT_TEMPLATE

    if tpl == CHAT_TEMPLATE:
        return "embedded"
    for name, text in _trl_templates().items():
        if tpl == text:
            return f"trl:{name}"
    return "custom:" + hashlib.sha256(tpl.encode()).hexdigest()[:12]


# ----------------------------------------------------------------------------------------- tool parsers
def generation_prompt(tok: Any) -> str:
    """The text the template adds as the generation prompt (the assistant header): the anchor a reader starts at."""
    msgs = [{"role": "user", "content": "x"}]
    with_gp = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    without = tok.apply_chat_template(msgs, add_generation_prompt=False, tokenize=False)
    if not with_gp.startswith(without) or with_gp == without:
        raise ChatFormatError(
            "no_generation_prompt",
            f"the chat template ({template_name(tok)}) adds no assistant header for add_generation_prompt: "
            "no reader can find where an answer starts",
        )
    return with_gp[len(without) :]


def parser_template(tok: Any, name: str) -> dict[str, Any]:
    """The transformers response template of vLLM's tool-call parser ``name`` for this tokenizer."""
    if name not in TOOL_PARSERS:
        raise ChatFormatError(
            "unknown_tool_parser", f"model.tool_parser {name!r} is not one of {', '.join(TOOL_PARSERS)}"
        )
    if not tok.eos_token:
        raise ChatFormatError("no_eos", "the tokenizer has no eos_token: an answer's end cannot be read")
    eos = re.escape(tok.eos_token)
    content = {"close_pattern": rf"{eos}\s*|$", "content": "text"}
    call = {"type": "function", "function": "{content}"}
    fields: dict[str, Any]
    if name == "hermes":  # <tool_call>{"name": ..., "arguments": {...}}</tool_call>, as many as it makes
        fields = {
            "tool_calls": {
                "open": "<tool_call>",
                "close_pattern": r"</tool_call>\s*",
                "repeats": True,
                "content": "json",
                "transform": call,
            },
            "content": content,
        }
    elif name == "llama3_json":  # [<|python_tag|>]{"name": ..., "parameters": {...}} up to the eos (or ';')
        fields = {
            "tool_calls": {
                "open_pattern": r'(?:<\|python_tag\|>)?\{"name":\s*"(?P<name>[^"]+)",\s*"(?:parameters|arguments)":\s*',
                "close_pattern": rf"\}}\s*(?:;\s*|{eos}\s*|$)",
                "repeats": True,
                "content": "json",
                "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}},
            },
            "content": content,
        }
    elif name == "mistral":  # [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]
        fields = {
            "tool_calls": {
                "open": "[TOOL_CALLS]",
                "close_pattern": rf"{eos}\s*|$",
                "content": "json",
                "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{arguments}"}},
                "transform_each": True,
            },
            "content": content,
        }
    else:  # qwen3_coder: <tool_call><function=NAME><parameter=KEY>VALUE</parameter>...</function></tool_call>
        fields = {
            "tool_calls": {
                "open_pattern": r"<tool_call>\s*<function=(?P<name>[^\n>]+)>",
                "close_pattern": r"</function>\s*</tool_call>\s*",
                "repeats": True,
                "content": "xml-inline",
                "content_args": {
                    "tag_pattern": r"<parameter=(?P<key>[^>\n]+)>\s*(?P<value>.*?)\s*</parameter>",
                    "value_parser": {"name": "json", "args": {"allow_non_json": True}},
                },
                "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}},
            },
            "content": content,
        }
    return {"defaults": {"role": "assistant"}, "start_anchor": generation_prompt(tok), "fields": fields}


# --------------------------------------------------------------------------------------------- resolving
def has_reader(tok: Any) -> bool:
    return getattr(tok, "response_template", None) is not None or getattr(tok, "response_schema", None) is not None


def prepare(tok: Any, tool_parser: str | None = None) -> Reader:
    """Give ``tok`` its reader (the module docstring's order) and its render template; the Reader. Idempotent.
    A tokenizer without a chat template gets the ``text`` reader here (its answers are text, as ``policy.turn``
    renders it); ``check`` refuses it."""
    done = getattr(tok, _READER, None)
    if isinstance(done, Reader):
        return done
    name = template_name(tok)
    if name == "none":
        reader = Reader("text", name)
    elif has_reader(tok):
        reader = Reader("tokenizer", name)
    else:
        from trl.chat_template_utils import add_response_schema

        try:
            add_response_schema(tok)
            reader = Reader("trl", name)
        except ValueError:
            if not tool_parser:
                raise ChatFormatError(
                    "unknown_format",
                    f"TRL does not know this chat template ({name}) and model.tool_parser is not set: set it to "
                    f"the family's vLLM tool-call parser ({', '.join(TOOL_PARSERS)}), or use a tokenizer whose "
                    "template TRL ships (trl/chat_templates/)",
                ) from None
            tok.response_template = parser_template(tok, tool_parser)
            reader = Reader(f"tool_parser:{tool_parser}", name)
    if name != "none":
        setattr(tok, _RENDER, _training_template(tok))
    setattr(tok, _READER, reader)
    return reader


def _training_template(tok: Any) -> str | None:
    """None when the tokenizer's template is prefix-preserving; else TRL's training template for it (what
    GRPOTrainer renders with when it has tools), or None when TRL has none."""
    from trl.chat_template_utils import get_training_chat_template, is_chat_template_prefix_preserving

    try:
        if is_chat_template_prefix_preserving(tok):
            return None
        return get_training_chat_template(tok)
    except Exception:  # a template that cannot render a tool call, or one TRL has no training copy of
        return None


def render_template(tok: Any) -> str | None:
    """The chat template every rendering passes (``apply_chat_template(chat_template=...)``); None: the
    tokenizer's own. Resolved by ``prepare`` (called here for a tokenizer no loader prepared)."""
    if not hasattr(tok, _RENDER):
        if not getattr(tok, "chat_template", None):
            return None
        try:
            prepare(tok)
        except ChatFormatError:
            setattr(tok, _RENDER, _training_template(tok))
    return getattr(tok, _RENDER, None)


def reader(tok: Any) -> bool:
    """Whether ``tok`` has a reader, giving it TRL's when TRL knows its template and no loader prepared it."""
    if has_reader(tok):
        return True
    if getattr(tok, "chat_template", None) and not hasattr(tok, _READER):
        try:
            prepare(tok)
        except ChatFormatError:
            setattr(tok, _READER, None)
    return has_reader(tok)


def stop_ids(model: Any, tok: Any) -> list[int]:
    """The token ids a completion ends at, as GRPOTrainer's: the tokenizer's eos, then the model's
    ``generation_config.eos_token_id`` (GPT-OSS's ``<|call|>`` beside ``<|return|>``)."""
    ids = [tok.eos_token_id] if tok.eos_token_id is not None else []
    gen = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for i in [gen] if isinstance(gen, int) else list(gen or []):
        if i not in ids:
            ids.append(i)
    return ids


# ------------------------------------------------------------------------------------------------ checks
PROBE_CALL = {"name": "probe_tool", "arguments": {"city": "Oslo", "days": 3}}
PROBE_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "probe_tool",
            "description": "A probe.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
]


def _probe_turn(tok: Any) -> tuple[list[dict[str, Any]], list[int], list[int]]:
    """(the user message, its prompt ids, the tokens of the template's own tool-call answer to it up to its stop
    token): a completion as the policy would sample it."""
    tpl = render_template(tok)
    user = [{"role": "user", "content": "weather in Oslo?"}]
    call = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": dict(PROBE_CALL)}]}
    kw: dict[str, Any] = dict(tools=PROBE_TOOLS, chat_template=tpl)
    head = tok.apply_chat_template(user, add_generation_prompt=True, tokenize=False, **kw)
    full = tok.apply_chat_template([*user, call], tokenize=False, **kw)
    if not full.startswith(head):
        raise ChatFormatError(
            "unparseable",
            f"the template ({template_name(tok)}) renders an answer that does not extend its own generation prompt",
        )
    prompt = tok.apply_chat_template(user, add_generation_prompt=True, tokenize=True, return_dict=False, **kw)
    completion = tok(full[len(head) :], add_special_tokens=False)["input_ids"]
    stops = stop_ids(None, tok)
    end = next((i for i, t in enumerate(completion) if t in stops), len(completion) - 1)
    return user, list(prompt), completion[: end + 1]


def probe(tok: Any) -> None:
    """Render one tool call with the policy's template and read it back with its reader: ChatFormatError when the
    reader does not return that call (a reader that cannot parse what the template writes)."""
    from trl.chat_template_utils import parse_response

    _, prompt, completion = _probe_turn(tok)
    msg = parse_response(tok, completion, prefix=prompt, tools=PROBE_TOOLS)
    got = [c.get("function", c) for c in msg.get("tool_calls") or []]
    if [(c.get("name"), c.get("arguments")) for c in got] != [(PROBE_CALL["name"], PROBE_CALL["arguments"])]:
        text = tok.decode(completion, skip_special_tokens=False)
        reader = getattr(tok, _READER, None)
        raise ChatFormatError(
            "unparseable",
            f"the reader ({reader.source if reader else None}) does not read back the tool call the template "
            f"({template_name(tok)}) writes: {text[:200]!r} parsed as {msg!r}",
        )


def rerender_stable(tok: Any) -> bool:
    """Whether a tool-result turn re-rendered from its messages is the token sequence TRL trains on (the prompt,
    the completion's own tokens, GRPOTrainer's tool suffix). When it is not, a logged conversation's later turns
    must come from the logged tokens (the gateway logs them), not from its messages."""
    from types import SimpleNamespace

    from trl import GRPOTrainer
    from trl.chat_template_utils import parse_response

    try:
        user, prompt, completion = _probe_turn(tok)
    except ChatFormatError:
        return False
    tpl = render_template(tok)
    msg = parse_response(tok, completion, prefix=prompt, tools=PROBE_TOOLS)
    result = [{"role": "tool", "name": PROBE_CALL["name"], "content": "Oslo: 3 C"}]
    me = SimpleNamespace(
        processing_class=tok, _tokenizer=tok, _is_vlm=False, chat_template=tpl, chat_template_kwargs={}
    )
    concat = [*prompt, *completion, *GRPOTrainer._get_tool_suffix_ids(me, result)]
    again = tok.apply_chat_template(
        [*user, msg, *result],
        tools=PROBE_TOOLS,
        chat_template=tpl,
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    return list(again) == concat


def check(tok: Any, tool_parser: str | None = None) -> Reader:
    """``prepare`` and ``probe`` as named errors: a tokenizer with no chat template, an unknown format, or a reader
    that cannot read its template's tool calls raise ChatFormatError (doctor, the start of a round)."""
    from trl.chat_template_utils import supports_tool_calling

    if not getattr(tok, "chat_template", None):
        raise ChatFormatError(
            "no_chat_template",
            "the tokenizer has no chat template: conversations and tool calls cannot be rendered or read (use the "
            "model's instruct tokenizer, or set tokenizer.chat_template)",
        )
    r = prepare(tok, tool_parser)
    if supports_tool_calling(tok):
        probe(tok)
    return r


def describe(tok: Any, tool_parser: str | None = None) -> dict[str, Any]:
    """What doctor prints: template, reader, whether the template renders tools and is prefix-preserving, whether
    a tool-result turn re-renders to TRL's concatenation (``rerender_stable``), the template rendered with
    (``render``), and ``error`` (a ChatFormatError's message) when ``check`` fails."""
    from trl.chat_template_utils import is_chat_template_prefix_preserving, supports_tool_calling

    out: dict[str, Any] = {"template": template_name(tok), "reader": None, "error": None}
    try:
        out["reader"] = check(tok, tool_parser).source
    except ChatFormatError as e:
        out["error"] = str(e)
    has = bool(getattr(tok, "chat_template", None))
    out["renders_tools"] = bool(has and supports_tool_calling(tok))
    try:
        out["prefix_preserving"] = bool(has and out["renders_tools"] and is_chat_template_prefix_preserving(tok))
    except Exception:
        out["prefix_preserving"] = False
    out["rerender_stable"] = bool(out["renders_tools"] and out["error"] is None and rerender_stable(tok))
    tpl = getattr(tok, _RENDER, None)
    out["render"] = "own" if tpl is None else (template_name_of(tpl) or "trl training template")
    out["multi_turn"] = bool(out["prefix_preserving"] or tpl is not None)
    return out


def template_name_of(text: str) -> str | None:
    """The name of TRL's training template ``text`` is (``trl:<family>_training``), else None."""
    import trl.chat_template_utils as ctu

    for k, v in vars(ctu).items():
        if k.endswith("_training_chat_template") and v == text:
            return "trl:" + k.removesuffix("_chat_template")
    return None


def model_tokenizer(cfg: Any, local_only: bool = False) -> Any | None:
    """The tokenizer of ``cfg.model.base_model`` (its ``model.adapter``'s when that carries one), None for the
    embedded tiny policy (its own template and reader, ``policy.chat``: nothing to resolve, nothing built).
    ``local_only``: from disk or the hub cache only (doctor: no download)."""
    from pathlib import Path

    from hermes_lab.config.training import EMBEDDED_MODEL

    m = cfg.model
    if m.base_model == EMBEDDED_MODEL:
        return None
    from transformers import AutoTokenizer

    src = m.adapter if m.adapter and Path(m.adapter, "tokenizer_config.json").is_file() else m.base_model
    return AutoTokenizer.from_pretrained(src, trust_remote_code=m.trust_remote_code, local_files_only=local_only)


def check_model(cfg: Any) -> Reader | None:
    """``check`` on the config's policy (the start of a round): ChatFormatError before any stage runs; None for
    the embedded tiny policy, or for one whose tokenizer does not load here (a warning: the stage that loads the
    policy says why, and a round of stand-in stages never needs it)."""
    import warnings

    try:
        tok = model_tokenizer(cfg)
    except (OSError, ValueError) as e:  # a hub id with no hub and no cache, a path that is not there
        warnings.warn(
            f"model.base_model {cfg.model.base_model!r}: its chat format is not checked before the round, its "
            f"tokenizer does not load here ({type(e).__name__}: {str(e)[:160]})",
            stacklevel=2,
        )
        return None
    return None if tok is None else check(tok, cfg.model.tool_parser)


# ------------------------------------------------------------------------------------------------ vLLM
# vLLM's --tool-call-parser for each template TRL knows (vLLM's docs, tool_calling.md): Qwen2.5/Qwen3 write Hermes'
# <tool_call> JSON blocks, Llama 3.1/3.2 JSON with "parameters", GPT-OSS the harmony format (vLLM's openai parser).
# The embedded tiny policy writes Hermes' blocks too (policy.chat), its markers one token each as vLLM's hermes
# parser needs them. tests/live/test_switch.py serves each through a vLLM stand-in started with these flags.
VLLM_PARSERS = {
    "embedded": "hermes",
    "trl:qwen2_5": "hermes",
    "trl:qwen3": "hermes",
    "trl:qwen3_instruct_2507": "hermes",
    "trl:llama3_1": "llama3_json",
    "trl:llama3_2": "llama3_json",
    "trl:gptoss": "openai",
    "trl:qwen3_5_nothink": "qwen3_coder",
    "trl:qwen3_5_think": "qwen3_coder",
    "trl:glm4moe": "glm45",
}


def vllm_flags(tok: Any, tool_parser: str | None = None) -> list[str]:
    """The ``vllm serve <model>`` flags that serve this policy as the loop trains it: its tool-call parser
    (``VLLM_PARSERS``, else ``model.tool_parser``), the template GRPOTrainer renders with when it is not the
    model's own (``--chat-template`` TRL's file), runtime LoRA (with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` in
    its environment: the gateway loads each round's adapter). ChatFormatError when no parser is known."""
    from pathlib import Path

    import trl

    name = template_name(tok)
    parser = VLLM_PARSERS.get(name) or tool_parser
    if not parser:
        raise ChatFormatError(
            "unknown_format", f"no vLLM tool-call parser is known for template {name}: set model.tool_parser"
        )
    flags = ["--enable-auto-tool-choice", "--tool-call-parser", parser]
    prepare(tok, tool_parser)
    tpl = render_template(tok)
    if tpl is not None:
        trained = (template_name_of(tpl) or "").removeprefix("trl:")
        flags += ["--chat-template", str(Path(trl.__file__).parent / "chat_templates" / f"{trained}.jinja")]
    return [*flags, "--enable-lora", "--max-loras", "4", "--max-lora-rank", "64"]
