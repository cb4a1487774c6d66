"""Tiny random models of real chat-model families, built here (nothing downloaded): the tests' user models.

Each family is a real architecture (Qwen2, Qwen3, Llama, GPT-OSS) at hidden size 32 and 2 layers, with a byte-level
BPE tokenizer trained on a few renderings of the family's own chat template (so its boilerplate is a few tokens)
and carrying the family's real special tokens (as added tokens, ``<|im_end|>`` / ``<|eot_id|>`` / ``<|call|>``...),
its eos and pad, and its chat template: TRL's copy of the real one (``trl/chat_templates/``), or for ``hermes3`` a
Hermes 3 style ChatML tool template (``<tools>``, ``<tool_call>``, ``<tool_response>``: vLLM's ``hermes`` parser),
which TRL does not know.

The model is *teacher-forced*: ``ForcedLM`` (``forced_lm.py``, loaded with ``trust_remote_code`` through
``auto_map`` as a user's custom-code model is) is the family's real ``*ForCausalLM`` whose next-token logits are
overridden by a script, ``forced.json``: a list of ``[prompt_ids, completion_ids]``; when the ids so far end with a
script prompt followed by a prefix of its completion, the next completion token gets all the mass. Any other prompt
is answered by the random network itself. A script's prompt ids are computed with TRL (``trl_prompt_ids``), so a
served answer is the scripted one only when the gateway rendered what GRPOTrainer renders, token for token.

    from families import build_family
    path = build_family("qwen2_5", tmp_dir)     # cached under tmp_dir/<family>-<recipe hash>/

Writes under the directory it is given only.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent

# A Hermes 3 style ChatML tool template: the tools as JSON inside <tools></tools> in the system prompt, each call a
# <tool_call> JSON block, tool results as <tool_response> blocks in a "tool" turn (NousResearch's tool_use format).
HERMES3_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- 'You are a function calling AI model. You are provided with function signatures within <tools></tools> XML tags. \
Here are the available tools: <tools>\\n' }}
{%- for t in tools %}{{- t | tojson + '\\n' }}{%- endfor %}
{{- '</tools>\\nFor each function call return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": <args-dict>}\\n\
</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for m in messages %}
{%- if m.role == 'user' or (m.role == 'assistant' and not m.tool_calls) %}
{{- '<|im_start|>' + m.role + '\\n' + (m.content or '') + '<|im_end|>\\n' }}
{%- elif m.role == 'assistant' %}
{{- '<|im_start|>assistant\\n' }}
{%- if m.content %}{{- m.content + '\\n' }}{%- endif %}
{%- for tc in m.tool_calls %}
{%- set f = tc.function or tc %}
{{- '<tool_call>\\n{"name": "' + f.name + '", "arguments": ' }}
{%- if f.arguments is string %}{{- f.arguments }}{%- else %}{{- f.arguments | tojson }}{%- endif %}
{{- '}\\n</tool_call>' }}
{%- if not loop.last %}{{- '\\n' }}{%- endif %}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif m.role == 'tool' %}
{%- if loop.previtem and loop.previtem.role != 'tool' %}{{- '<|im_start|>tool\\n' }}{%- endif %}
{{- '<tool_response>\\n' + m.content + '\\n</tool_response>\\n' }}
{%- if loop.last or loop.nextitem.role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""


@dataclass(frozen=True)
class Family:
    name: str
    arch: str  # transformers config class
    specials: tuple[str, ...]  # added as special tokens (one id each)
    added: tuple[str, ...]  # added as ordinary added tokens (Qwen's <tool_call> ...)
    eos: str
    pad: str
    bos: str | None = None
    stop: tuple[str, ...] = ()  # generation_config.eos_token_id beside eos
    multi_call: bool = True  # the template renders two calls in one assistant turn (Llama 3.x, GPT-OSS: one)
    tool_parser: str | None = None  # the family's vLLM tool-call parser when TRL does not know its template

    def template(self) -> str:
        if self.name == "hermes3":
            return HERMES3_TEMPLATE
        import trl

        return (Path(trl.__file__).parent / "chat_templates" / f"{self.name}.jinja").read_text(encoding="utf-8")


_QWEN = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_QWEN_ADDED = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
_LLAMA = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|python_tag|>",
)
_GPTOSS = ("<|startoftext|>", "<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>")
_GPTOSS += ("<|return|>", "<|call|>", "<|constrain|>")

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("qwen2_5", "Qwen2Config", _QWEN, _QWEN_ADDED, eos="<|im_end|>", pad="<|endoftext|>"),
        Family("qwen3", "Qwen3Config", _QWEN, (*_QWEN_ADDED, "<think>", "</think>"), "<|im_end|>", "<|endoftext|>"),
        *(  # Llama 3.1 and 3.2: the same tokens, two templates
            Family(
                name,
                "LlamaConfig",
                _LLAMA,
                (),
                "<|eot_id|>",
                "<|end_of_text|>",
                bos="<|begin_of_text|>",
                multi_call=False,
            )
            for name in ("llama3_1", "llama3_2")
        ),
        Family(
            "gptoss", "GptOssConfig", _GPTOSS, (), "<|return|>", "<|endoftext|>", stop=("<|call|>",), multi_call=False
        ),
        Family(
            "hermes3",
            "LlamaConfig",
            (*_LLAMA, "<|im_start|>", "<|im_end|>"),
            ("<tool_call>", "</tool_call>", "<tools>", "</tools>", "<tool_response>", "</tool_response>"),
            eos="<|im_end|>",
            pad="<|end_of_text|>",
            bos="<|begin_of_text|>",
            tool_parser="hermes",
        ),
    )
}


def get_weather(city: str, days: int | None = None) -> str:
    """
    The weather in a city.

    Args:
        city: The city.
        days: How many days ahead.
    """
    return f"{city}: {len(city) + (days or 0)} C, rain"


def read_file(path: str) -> str:
    """
    Read a file.

    Args:
        path: The file's path.
    """
    return f"# {path}\nthe answer is {len(path) * 7}"


TOOL_FUNCS = [get_weather, read_file]  # what GRPOTrainer calls (tools=...)


def tool_schemas() -> list[dict[str, Any]]:
    """The tools' JSON schemas as TRL renders them from the functions (what a client sends as ``tools``)."""
    from transformers.utils import get_json_schema

    return [get_json_schema(f) for f in TOOL_FUNCS]


CITIES = ("Paris", "Oslo", "Lima", "Kyiv", "Quito", "Hanoi", "Accra")


def conversation(i: int, multi_call: bool = True) -> dict[str, Any]:
    """The i-th test conversation: a question, the assistant's tool call(s) (two in one turn every third
    conversation where the family's template can render that), the answer after the tool results."""
    city = f"{CITIES[i % len(CITIES)]}{i}"
    if i % 3 == 2:
        calls = [{"name": "read_file", "arguments": {"path": f"notes/{i}.txt"}}]
    elif i % 3 == 1 and multi_call:
        calls = [
            {"name": "get_weather", "arguments": {"city": city, "days": i % 5 + 1}},
            {"name": "read_file", "arguments": {"path": f"{city.lower()}.md"}},
        ]
    else:
        calls = [{"name": "get_weather", "arguments": {"city": city}}]
    return {
        "user": f"Question {i}: what about {city}?",
        "calls": [{"type": "function", "function": c} for c in calls],
        "answer": f"It is {10 + i} degrees in {city}.",
    }


def tool_results(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The tool messages of parsed calls, as GRPOTrainer's tool loop builds them (name, str(result))."""
    by_name = {f.__name__: f for f in TOOL_FUNCS}
    out = []
    for c in calls:
        f = c.get("function", c)
        out.append({"role": "tool", "name": f["name"], "content": str(by_name[f["name"]](**f["arguments"]))})
    return out


def _corpus(fam: Family) -> list[str]:
    """Texts to train the byte-level BPE on: renderings of the test conversations through the family's template."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(x, indent=indent, ensure_ascii=False, **kw)
    env.globals["raise_exception"] = lambda m: (_ for _ in ()).throw(ValueError(m))
    env.globals["strftime_now"] = lambda f: "26 Jul 2024"
    tpl = env.from_string(fam.template())
    out = []
    for i in range(12):
        c = conversation(i)
        msgs = [
            {"role": "user", "content": c["user"]},
            {"role": "assistant", "content": "", "tool_calls": c["calls"]},
            *tool_results(c["calls"]),
            {"role": "assistant", "content": c["answer"]},
        ]
        for tools in (tool_schemas(), None):
            try:
                out.append(
                    tpl.render(
                        messages=msgs,
                        tools=tools,
                        add_generation_prompt=False,
                        bos_token=fam.bos or "",
                        eos_token=fam.eos,
                    )
                )
            except Exception:  # a template that wants other arguments: the texts alone still train the BPE
                out.append(json.dumps(msgs))
    return out


def build_tokenizer(fam: Family) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=700,
        special_tokens=list(fam.specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = _corpus(fam)
    for s in (*fam.specials, *fam.added):  # the markers are tokens of their own, never learned from the texts
        text = [t.replace(s, " ") for t in text]
    tk.train_from_iterator(text, trainer)
    if fam.bos:
        tk.post_processor = TemplateProcessing(
            single=f"{fam.bos} $A",
            pair=f"{fam.bos} $A {fam.bos} $B",
            special_tokens=[(fam.bos, tk.token_to_id(fam.bos))],
        )
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token=fam.eos, pad_token=fam.pad, bos_token=fam.bos)
    tok.add_tokens(list(fam.added))
    tok.chat_template = fam.template()
    return tok


def _config(fam: Family, tok: Any) -> Any:
    import transformers

    cls = getattr(transformers, fam.arch)
    kw: dict[str, Any] = dict(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        eos_token_id=tok.convert_tokens_to_ids(fam.eos),
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=True,
    )
    if fam.arch == "GptOssConfig":
        kw.update(
            num_local_experts=2, num_experts_per_tok=1, head_dim=8, layer_types=["sliding_attention", "full_attention"]
        )
    if fam.arch == "Qwen3Config":
        kw.update(head_dim=8)
    return cls(**kw)


def recipe() -> str:
    """A hash of what a build depends on (this file, forced_lm.py): a cached build of another recipe is rebuilt."""
    h = hashlib.sha256()
    for p in (Path(__file__), HERE / "forced_lm.py"):
        h.update(p.read_bytes())
    return h.hexdigest()[:12]


def build_family(name: str, root: str | Path) -> Path:
    """The family's tiny model dir under ``root`` (built once per recipe; an empty script: ``write_script``)."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    fam = FAMILIES[name]
    out = Path(root) / f"{name}-{recipe()}"
    if (out / "config.json").is_file():
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tok = build_tokenizer(fam)
    cfg = _config(fam, tok)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    model.generation_config = GenerationConfig(
        eos_token_id=[tok.convert_tokens_to_ids(t) for t in (fam.eos, *fam.stop)],
        pad_token_id=tok.pad_token_id,
    )
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    shutil.copy(HERE / "forced_lm.py", tmp / "forced_lm.py")
    conf = json.loads((tmp / "config.json").read_text())
    base = type(model).__name__
    conf["auto_map"] = {"AutoModelForCausalLM": f"forced_lm.Forced{base}"}
    (tmp / "config.json").write_text(json.dumps(conf, indent=2))
    (tmp / "forced.json").write_text("[]")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def write_script(model_dir: str | Path, script: list[tuple[list[int], list[int]]]) -> None:
    """The forced completions (``[prompt_ids, completion_ids]`` pairs) a model dir's ``ForcedLM`` answers with."""
    Path(model_dir, "forced.json").write_text(json.dumps([[list(p), list(c)] for p, c in script]))
