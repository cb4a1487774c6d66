"""One assistant turn of a policy, the same everywhere: render the conversation, sample the turn, read it back.

Reads and writes nothing. This is the loop's one rendering and one parser: execute's and validate's string tasks
(``policy.model.Policy.generate``, the completion form), the episode runner (``policy.episodes``: execute's agent
episodes, train's and validate's held-out episodes), turn-level training (``train.turns``: the rows' prompts and the
trainer's prompt tokens) and the gateway's in-process arms (``live.local.LocalArm``) all call it; TRL's GRPOTrainer
renders and parses the same way in the episode phase (the parity test checks both, tests/policy/test_turn.py).

Rendering a conversation (OpenAI chat messages and tool schemas) into the prompt's token ids, ``prompt_ids``:

- the completion form, one user message and no tools (the seed's ``{prompt, response}`` records, the embedded string
  tasks): the message's text, its tokens without special tokens added. That is how the policy is trained on them (TRL
  samples a string prompt as it is; ``train.turns.trainer_class`` tokenizes it with ``completion_ids``) and how
  ``Policy.generate`` runs them;
- every other conversation: the policy's chat template with the conversation's tools and the generation prompt,
  ``tok.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True, tokenize=True)``, which is what
  TRL does with a conversational prompt or an environment's tools;
- a policy without a chat template: ``role: content`` lines ending in ``assistant:`` (tools are not shown to it), its
  answers read as text, everywhere alike.

Continuing an episode, ``continue_ids``: the next turn's prompt is this turn's prompt, the completion's own token ids
and the tool results' suffix, concatenated as TRL's multi-turn loop does it (``GRPOTrainer._tool_call_loop``): the
policy sees the tokens it sampled, never a re-rendering of them (the field's most reported agent-RL bug). The gateway
does the same across requests (``Splicer``): an assistant message it answered is continued from its tokens.

Reading a completion, ``parse``: TRL's ``parse_response`` (the tokenizer's response template, e.g. the tiny policy's
``policy.chat.RESPONSE_TEMPLATE``; a malformed call is plain text); the completion form decodes as TRL decodes a string
prompt's completion (special tokens skipped). ``to_openai`` turns the parsed message into OpenAI's form: ``tool_calls``
with ids, type ``function`` and the arguments as JSON text (``json.dumps``, what chat templates' ``tojson`` writes, so
the echoed message renders back to the same text).
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections import OrderedDict
from typing import Any

from hermes_lab.policy import formats

# ------------------------------------------------------------------------------------------- messages


def text_of(content: Any) -> str:
    """A message's text: a string, the text parts of a list of content parts, '' for None."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return json.dumps(content, ensure_ascii=False)


def chat_message(m: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI (or conversation record) message as chat templates take it: text content, tool-call arguments as
    objects (templates ``tojson`` them; a text that is not JSON is kept as ``{"_raw": text}``), no empty fields."""
    role = m.get("role") or "user"
    out: dict[str, Any] = {"role": role, "content": text_of(m.get("content"))}
    calls = []
    for c in m.get("tool_calls") or []:
        f = dict((c or {}).get("function") or {})
        args = f.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                args = {"_raw": args}
        calls.append({"id": c.get("id"), "type": "function", "function": {"name": f.get("name"), "arguments": args}})
    if calls:
        out["tool_calls"] = calls
    if role == "tool":
        out["name"] = m.get("name") or ""
        if m.get("tool_call_id"):
            out["tool_call_id"] = m["tool_call_id"]
    return out


def chat_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """A request's (or record's) messages as ``chat_message`` returns them, a tool result without a ``name`` (OpenAI
    clients send ``tool_call_id`` only) named after the call it answers (by id, else by its place after the
    assistant's calls): templates that name the tool in a result's header (GPT-OSS) render it as TRL does."""
    out = [chat_message(m) for m in messages if isinstance(m, dict)]
    calls: list[dict[str, Any]] = []
    k = 0
    for m in out:
        if m["role"] == "assistant":
            calls, k = m.get("tool_calls") or [], 0
        elif m["role"] == "tool":
            if not m.get("name"):
                by_id = next((c for c in calls if m.get("tool_call_id") and c.get("id") == m["tool_call_id"]), None)
                c = by_id or (calls[k] if k < len(calls) else None)
                if c is not None:
                    m["name"] = (c.get("function") or {}).get("name") or ""
            k += 1
    return out


def tool_list(tools: Any) -> list[Any] | None:
    """A request's ``tools`` as apply_chat_template takes them (OpenAI function schemas or callables), or None."""
    if not isinstance(tools, list) or not tools:
        return None
    return [t for t in tools if isinstance(t, dict) or callable(t)] or None


def is_completion(messages: list[dict[str, Any]], tools: Any) -> bool:
    """The completion form: one user message and no tools (the seed's records, the embedded string tasks)."""
    return len(messages) == 1 and messages[0].get("role") == "user" and not tools


# ------------------------------------------------------------------------------------------- rendering
def has_template(tok: Any) -> bool:
    return bool(getattr(tok, "chat_template", None))


def completion_ids(tok: Any, text: str) -> list[int]:
    """A completion-form prompt's token ids: the text's tokens, no special tokens added."""
    return tok(text, add_special_tokens=False)["input_ids"]


def _lines(messages: list[dict[str, Any]]) -> str:
    """The rendering of a policy without a chat template (module docstring)."""
    return "\n".join(f"{m['role']}: {m.get('content') or ''}" for m in messages) + "\nassistant:"


def render_text(tok: Any, messages: list[dict[str, Any]], tools: Any = None, generation_prompt: bool = True) -> str:
    """The prompt's text (``messages`` as ``chat_message`` returns them)."""
    tools = tool_list(tools)
    if generation_prompt and is_completion(messages, tools):
        return messages[0].get("content") or ""
    if not has_template(tok):
        return _lines(messages)
    return tok.apply_chat_template(
        messages,
        tools=tools,
        add_generation_prompt=generation_prompt,
        tokenize=False,
        chat_template=formats.render_template(tok),
    )


def _ids(tok: Any, messages: list[dict[str, Any]], tools: list[Any] | None, generation_prompt: bool) -> list[int]:
    """The chat template's token ids (the one ``formats.render_template`` names: GRPOTrainer's)."""
    return tok.apply_chat_template(
        messages,
        tools=tools,
        add_generation_prompt=generation_prompt,
        tokenize=True,
        return_dict=False,
        chat_template=formats.render_template(tok),
    )


def prompt_ids(tok: Any, messages: list[dict[str, Any]], tools: Any = None) -> list[int]:
    """The prompt's token ids (the module docstring's rules; ``messages`` as ``chat_message`` returns them)."""
    tools = tool_list(tools)
    if is_completion(messages, tools):
        return completion_ids(tok, messages[0].get("content") or "")
    if not has_template(tok):
        return completion_ids(tok, _lines(messages))
    return list(_ids(tok, messages, tools, True))


def fit(tok: Any, messages: list[dict[str, Any]], tools: Any, budget: int) -> tuple[list[dict[str, Any]], bool]:
    """``messages`` whose prompt fits ``budget`` tokens: the oldest messages dropped first (a system prompt first),
    then the front of the oldest kept message's text; (the messages, whether any was cut). Turn-level training's
    prompts and the gateway's in-process arms cut a long conversation the same way: its latest context decides."""

    def size(msgs: list[dict[str, Any]]) -> int:
        return len(prompt_ids(tok, msgs, tools))

    if size(messages) <= budget:
        return messages, False
    msgs = list(messages)
    while len(msgs) > 1 and size(msgs) > budget:
        msgs.pop(0)
    while size(msgs) > budget and msgs[0].get("content"):
        over = size(msgs) - budget
        msgs[0] = {**msgs[0], "content": msgs[0]["content"][over + 8 :]}  # the tail of the oldest kept message
    return msgs, True


def tool_suffix_ids(tok: Any, tool_messages: list[dict[str, Any]]) -> list[int]:
    """The tokens the template puts after an assistant turn's EOS for these tool results, up to the next assistant
    header: TRL's ``GRPOTrainer._get_tool_suffix_ids`` (a dummy conversation, so the suffix does not depend on what
    came before; the prefix is trimmed at its last EOS)."""
    calls = [{"type": "function", "function": {"name": tool_messages[0].get("name") or "", "arguments": {}}}]
    dummy = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": calls}]
    prefix = _ids(tok, dummy, None, False)
    full = _ids(tok, dummy + tool_messages, None, True)
    eos = [i for i, t in enumerate(prefix) if t == tok.eos_token_id]
    if eos:
        prefix = prefix[: eos[-1] + 1]
    if full[: len(prefix)] != prefix:
        raise ValueError("the chat template is not prefix-preserving: tool results cannot be appended to a turn")
    return list(full[len(prefix) :])


def continue_ids(tok: Any, prompt: list[int], completion: list[int], tool_messages: list[dict[str, Any]]) -> list[int]:
    """The next turn's prompt after tool results: prompt + the completion's own ids + the results' suffix (TRL)."""
    return [*prompt, *completion, *tool_suffix_ids(tok, tool_messages)]


# ------------------------------------------------------------------------------------------------ reading
def parse(tok: Any, completion: list[int], prompt: list[int], tools: Any, completion_form: bool) -> dict[str, Any]:
    """The sampled turn as an assistant message (tool-call arguments as objects), read as TRL reads it."""
    if completion_form or not has_template(tok) or not formats.reader(tok):  # TRL decodes these as text
        return {"role": "assistant", "content": tok.decode(completion, skip_special_tokens=True)}
    from trl.chat_template_utils import parse_response

    msg = parse_response(tok, completion, prefix=prompt, tools=tool_list(tools))
    if tok.eos_token:
        msg["content"] = (msg.get("content") or "").removesuffix(tok.eos_token)
    if not msg.get("tool_calls"):
        msg.pop("tool_calls", None)
    return msg


def call_id(seed: str, k: int) -> str:
    return "call_" + hashlib.sha1(f"{seed}:{k}".encode()).hexdigest()[:24]


def to_openai(msg: dict[str, Any], id_seed: str) -> dict[str, Any]:
    """An assistant message in OpenAI's form: content (None beside tool calls when empty), ``tool_calls`` with ids
    (``call_`` + a hash of ``id_seed`` and the call's index), type function, arguments as JSON text."""
    calls = []
    for k, c in enumerate(msg.get("tool_calls") or []):
        f = c.get("function", c)
        args = f.get("arguments")
        text = args if isinstance(args, str) else json.dumps(args if args is not None else {}, ensure_ascii=False)
        calls.append(
            {
                "id": call_id(id_seed, k),
                "type": "function",
                "function": {"name": f.get("name") or "", "arguments": text},
            }
        )
    content = msg.get("content") or ""
    out: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
    if calls:
        out["tool_calls"] = calls
    return out


# ---------------------------------------------------------------------------------------------- sampling
def sample(
    model: Any,
    tok: Any,
    prompts: list[list[int]],
    temperature: float,
    max_new_tokens: int,
    logprobs: bool = False,
    seeds: list[int | None] | None = None,
) -> list[tuple[list[int], list[float] | None]]:
    """One completion per prompt (left-padded batch, one ``generate``; temperature 0: greedy), cut after its EOS;
    with ``logprobs``, each sampled token's log-probability under the sampling distribution (logits / temperature).
    Seed torch's RNG before calling for a reproducible draw. ``max_new_tokens`` is capped by the model's context.
    ``seeds``: a row with a seed is sampled with random numbers of its own (``RowSampler``), the same whatever
    else is in the batch; rows without one draw theirs from torch's RNG."""
    import torch

    width = max(len(p) for p in prompts)
    budget = min(max_new_tokens, model.config.max_position_embeddings - width)
    if budget <= 0:
        raise ValueError(
            f"the prompt has {width} tokens: no room left in the policy's context of "
            f"{model.config.max_position_embeddings} positions"
        )
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    stops = formats.stop_ids(model, tok)  # GRPOTrainer's: the tokenizer's eos and the model's generation_config's
    eos: Any = stops[0] if len(stops) == 1 else (stops or None)  # one id: passed as the int it always was
    kw: dict[str, Any] = dict(max_new_tokens=budget, pad_token_id=pad, eos_token_id=eos)
    rows = RowSampler(seeds, temperature) if temperature > 0 and seeds and any(x is not None for x in seeds) else None
    if temperature > 0 and rows is None:
        kw.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
    else:  # greedy, or the rows' own draws made by RowSampler (the token it picks is the only one left)
        kw.update(do_sample=False)
    rec = _Logprobs(temperature) if logprobs else None
    procs = [x for x in (rec, rows) if x is not None]  # the log-probabilities read before RowSampler masks
    if procs:
        from transformers import LogitsProcessorList

        kw["logits_processor"] = LogitsProcessorList(procs)
    with torch.no_grad():
        gen = model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device), **kw)
    new = gen[:, width:]
    lps = rec.finish(new) if rec is not None else None
    out = []
    for row in range(len(prompts)):
        c = new[row].tolist()
        end = next((i for i, t in enumerate(c) if t in stops), None)
        if end is not None:
            c = c[: end + 1]
        out.append((c, [round(x, 5) for x in lps[row][: len(c)]] if lps is not None else None))
    return out


class RowSampler:
    """A logits processor that samples each row from softmax(logits / temperature) with the row's own generator
    (the Gumbel-max draw: argmax of logits / T plus Gumbel noise is an exact sample) and leaves that token the only
    one possible, for greedy decoding to take. A row seeded alike samples alike in any batch: the same prompt under
    two policies gets the same random numbers (common random numbers, which is what pairs two arms' samples)."""

    def __init__(self, seeds: list[int | None], temperature: float):
        import torch

        self.t = temperature
        self.gens = []
        for s in seeds:
            g = torch.Generator()
            g.manual_seed(int(s) if s is not None else int(torch.randint(0, 2**62, (1,))))
            self.gens.append(g)

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        import torch

        u = torch.stack([torch.rand(scores.shape[1], generator=g) for g in self.gens]).to(scores.device)
        gumbel = -torch.log(-torch.log(u.clamp_(1e-20, 1.0 - 1e-7)))
        pick = (scores.float() / self.t + gumbel).argmax(dim=-1, keepdim=True)
        return torch.full_like(scores, -float("inf")).scatter_(1, pick, 0.0)


class _Logprobs:
    """A logits processor that keeps each step's log-softmax of logits / temperature for one step only and reads the
    token sampled from it at the next step (memory: one batch x vocab row, whatever the completion's length)."""

    def __init__(self, temperature: float):
        self.t = temperature if temperature > 0 else 1.0
        self.prev: Any = None
        self.got: list[Any] = []

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        import torch

        if self.prev is not None:
            self.got.append(self.prev.gather(1, input_ids[:, -1:]).squeeze(1))
        self.prev = torch.log_softmax(scores.float() / self.t, dim=-1)
        return scores

    def finish(self, new: Any) -> list[list[float]]:
        import torch

        if self.prev is not None and new.shape[1] > len(self.got):
            self.got.append(self.prev.gather(1, new[:, len(self.got) : len(self.got) + 1]).squeeze(1))
        if not self.got:
            return [[] for _ in range(new.shape[0])]
        return torch.stack(self.got, dim=1).tolist()


# ---------------------------------------------------------------------------------------------- splicing
class Splicer:
    """A conversation continued across requests from the tokens of the turns this process answered (the gateway's
    in-process arms): ``remember`` keeps an answered turn's prompt + completion ids under the text of the
    conversation through that answer as the template renders it (which the client's echo renders to again);
    ``prompt_ids`` continues a request from the latest such turn (TRL's tool suffix after tool results, the
    template's own suffix after other messages), else renders it whole. Bounded: the least recently used turns are
    forgotten beyond ``max_tokens`` kept tokens."""

    def __init__(self, tok: Any, max_tokens: int = 8_000_000):
        self.tok, self.max_tokens = tok, max_tokens
        self.kept: OrderedDict[bytes, array] = OrderedDict()
        self.tokens = 0
        self.hits = self.misses = 0

    def _key(self, messages: list[dict[str, Any]], tools: Any) -> bytes:
        text = render_text(self.tok, messages, tools, generation_prompt=False)
        return hashlib.sha1(text.encode("utf-8", "surrogatepass")).digest()

    def remember(self, messages: list[dict[str, Any]], tools: Any, answer: dict[str, Any], ids: list[int]) -> None:
        if is_completion(messages, tool_list(tools)) or not has_template(self.tok):
            return  # a single-turn request: nothing continues it
        key = self._key([*messages, answer], tools)
        if key in self.kept:
            self.tokens -= len(self.kept.pop(key))
        self.kept[key] = array("l", ids)
        self.tokens += len(ids)
        while self.tokens > self.max_tokens and self.kept:
            self.tokens -= len(self.kept.popitem(last=False)[1])

    def prompt_ids(self, messages: list[dict[str, Any]], tools: Any) -> tuple[list[int], bool]:
        """(the prompt's ids, whether they continue an answered turn's tokens)."""
        tok = self.tok
        if has_template(tok) and not is_completion(messages, tool_list(tools)):
            k = next((i for i in range(len(messages) - 1, -1, -1) if messages[i]["role"] == "assistant"), None)
            key = self._key(messages[: k + 1], tools) if k is not None else b""
            hit = self.kept.get(key)
            if hit is not None:
                self.kept.move_to_end(key)
                rest = messages[k + 1 :]
                if rest and all(m["role"] == "tool" for m in rest):
                    suffix = tool_suffix_ids(tok, rest)
                else:
                    suffix = self._suffix(messages, k, tools)
                if suffix is not None:
                    self.hits += 1
                    return [*hit, *suffix], True
        self.misses += 1
        return prompt_ids(tok, messages, tools), False

    def _suffix(self, messages: list[dict[str, Any]], k: int, tools: Any) -> list[int] | None:
        """The template's tokens for what follows the answer ``k`` (a new user turn), or None when the rendering of
        the conversation does not extend the rendering up to the answer."""
        tok, tl = self.tok, tool_list(tools)
        head = _ids(tok, messages[: k + 1], tl, False)
        full = _ids(tok, messages, tl, True)
        eos = [i for i, t in enumerate(head) if t == tok.eos_token_id]
        if eos:
            head = head[: eos[-1] + 1]
        return list(full[len(head) :]) if full[: len(head)] == head else None
