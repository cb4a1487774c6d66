"""The gateway's in-process arms: a policy in this process, answered as it is trained, and the one generation thread.

Stage: validate (live A/B, ``hermes-lab serve``). Reads the arms' models (a model dir, a LoRA adapter dir, a train
output dir, ``embedded:tiny``: ``hermes_lab.live.arms.resolve_arm``); writes nothing (the gateway logs what an answer
returns, its tokens included).

``LocalArm`` answers with the loop's one rendering and parser (``hermes_lab.policy.turn``); ``GenerationWorker`` is the
one thread that renders, samples (micro-batched: requests within ``serve.batch_wait_ms`` share one ``generate``) and
parses for every in-process arm, never on the event loop; ``ArmPool`` keeps the loaded policies of a process across
experiments (``hermes_lab.live.switch``); ``build_arms`` makes an experiment's two arms, upstream or in-process.
"""

from __future__ import annotations

import asyncio
import os
import queue
import threading
import time
import unicodedata
from array import array
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
import xxhash

from hermes_lab.config.schema import HermesConfig
from hermes_lab.live.arms import ARMS, Answer, ArmSpec, UpstreamArm
from hermes_lab.live.sse import Chunk


@dataclass
class _Job:
    """One request for the generation thread. ``prepare`` renders its prompt ids and ``finish`` reads the sampled
    turn back, both in the thread (the arm's rendering and parsing, never on the event loop); the future gets what
    ``finish`` returns."""

    policy: Any
    prepare: Callable[[], list[int]]
    finish: Callable[[list[int], list[int], list[float] | None], dict[str, Any]]
    temperature: float
    max_new_tokens: int
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    prompt: list[int] = field(default_factory=list)
    seed: int | None = None  # the request's own (OpenAI's ``seed``): its sample drawn with random numbers of its own
    seed_from_prompt: bool = False  # no seed given: one from the prompt's tokens (serve.seed_from_prompt)


class GenerationWorker:
    """One thread generating for every in-process arm: jobs that arrive within ``wait_s`` of the first
    one form a batch (split by policy and sampling settings), one ``generate`` each (``policy.turn.sample``)."""

    def __init__(self, wait_s: float, max_batch: int):
        self.wait_s, self.max_batch = wait_s, max_batch
        self._q: queue.Queue[_Job | None] = queue.Queue()
        self._seed = 0
        self._thread = threading.Thread(target=self._run, name="hermes-generate", daemon=True)
        self._thread.start()

    def submit(self, job: _Job) -> None:
        self._q.put(job)

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        import torch

        # one core stays with the event loop: torch's default (every core) made a 16-token generate of the
        # tiny policy ~10x slower on a busy 2-core machine (1.1 s vs 0.12 s), its threads spin-waiting
        torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))
        while True:
            job = self._q.get()
            if job is None:
                return
            batch, deadline = [job], time.monotonic() + self.wait_s
            while len(batch) < self.max_batch:
                try:
                    nxt = self._q.get(timeout=max(deadline - time.monotonic(), 0))
                except queue.Empty:
                    break
                if nxt is None:
                    self._q.put(None)
                    break
                batch.append(nxt)
            groups: dict[tuple[int, float, int], list[_Job]] = {}
            for j in batch:
                try:
                    j.prompt = j.prepare()
                except Exception as e:  # a conversation the template cannot render: that request's 500
                    j.loop.call_soon_threadsafe(_settle, j.future, None, e)
                    continue
                if j.seed is None and j.seed_from_prompt:
                    j.seed = xxhash.xxh3_64_intdigest(array("i", j.prompt).tobytes()) >> 2
                groups.setdefault((id(j.policy), j.temperature, j.max_new_tokens), []).append(j)
            for jobs in groups.values():
                self._generate(jobs)

    def _generate(self, jobs: list[_Job]) -> None:
        from hermes_lab.policy import turn

        p = jobs[0].policy
        room = p.model.config.max_position_embeddings
        for j in [j for j in jobs if len(j.prompt) >= room]:
            msg = f"the conversation renders to {len(j.prompt)} tokens: the policy's context holds {room}"
            j.loop.call_soon_threadsafe(_settle, j.future, None, ValueError(msg))
        jobs = [j for j in jobs if len(j.prompt) < room]
        if not jobs:
            return
        self._seed += 1
        try:
            import torch

            torch.manual_seed(self._seed)
            done = turn.sample(
                p.model,
                p.tokenizer,
                [j.prompt for j in jobs],
                jobs[0].temperature,
                jobs[0].max_new_tokens,
                True,
                seeds=[j.seed for j in jobs],
            )
        except Exception as e:  # the requests get a 500 naming it; the worker lives on
            for j in jobs:
                j.loop.call_soon_threadsafe(_settle, j.future, None, e)
            return
        for j, (completion, logprobs) in zip(jobs, done):
            try:
                out, exc = j.finish(j.prompt, completion, logprobs), None
            except Exception as e:
                out, exc = None, e
            j.loop.call_soon_threadsafe(_settle, j.future, out, exc)


class ContextLengthExceeded(ValueError):
    """A request longer than what the gateway states it serves (``serve.context_length``): vLLM's 400."""

    def __init__(self, limit: int, asked: int):
        super().__init__(
            f"This model's maximum context length is {limit} tokens. However, you requested {asked} tokens in the "
            f"messages (their texts, tool calls and the tools' JSON). Please reduce the length of the messages."
        )
        self.limit, self.asked = limit, asked


def byte_level_specials(tok: Any) -> list[str] | None:
    """For a byte-level BPE tokenizer with no merges and no normaliser but NFC (one token per UTF-8 byte of the
    NFC text: the embedded policy's, ``policy.model.build_tokenizer``), the texts of its added tokens (a text
    holding one counts it as one token); None for any other tokenizer, whose texts are counted by tokenizing."""
    try:
        spec = orjson.loads(tok.backend_tokenizer.to_str())
    except Exception:  # a slow tokenizer, or none that says
        return None
    model, pre = spec.get("model") or {}, spec.get("pre_tokenizer") or {}
    byte_level = pre.get("type") == "ByteLevel" or any(
        p.get("type") == "ByteLevel" for p in pre.get("pretokenizers") or [] if isinstance(p, dict)
    )
    norm = spec.get("normalizer")
    if model.get("type") != "BPE" or model.get("merges") or not byte_level or norm not in (None, {"type": "NFC"}):
        return None
    if len(model.get("vocab") or {}) < 256:  # every byte must be a token of its own
        return None
    return [a["content"] for a in spec.get("added_tokens") or [] if a.get("content")]


def _settle(fut: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if fut.done():
        return  # the client went away
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)


class _Events:
    """A local arm's stream: the chunks, and the answer's tokens for the log (read once the stream ended)."""

    def __init__(self, chunks: AsyncIterator[Chunk], tokens: dict[str, Any]):
        self.chunks, self.tokens = chunks, tokens

    def __aiter__(self) -> AsyncIterator[Chunk]:
        return self.chunks


class LocalArm:
    """A policy in this process, answered in OpenAI's chat.completion / chunk format with the loop's one rendering
    and parser (``hermes_lab.policy.turn``): the request's messages and tools through the policy's chat template
    (a lone user message without tools: its text, the string tasks' form), a conversation continued from the
    tokens of the turns this arm answered (``turn.Splicer``), the answer read by TRL's parser into ``tool_calls``
    (ids, type function, arguments as JSON text; ``finish_reason: tool_calls``; streamed as tool-call deltas).
    A conversation longer than the policy's context (less a string answer's ``execute.max_new_tokens``) loses its
    earliest messages first (``turn.fit``, as turn-level training cuts one; what still does not fit, its front
    tokens); one over ``serve.context_length`` (``count_tokens``) is refused with vLLM's 400
    ``context_length_exceeded``, as the gateway states that length in GET /v1/models. Every answer carries its
    prompt and completion token ids and the sampled tokens' logprobs for the log."""

    needs_prompt = False  # it renders the request's messages itself, in the generation thread
    wire = False  # so it is called with the body parsed whole

    def __init__(self, spec: ArmSpec, policy: Any, worker: GenerationWorker, cfg: HermesConfig):
        from hermes_lab.policy.turn import Splicer

        self.spec, self.name, self.policy, self.worker = spec, spec.name, policy, worker
        self.served_model, self.public = spec.served_model, cfg.serve.public_model
        self.temperature, self.default_tokens = cfg.execute.temperature, cfg.execute.max_new_tokens
        self.turn_tokens = cfg.grpo.turn_completion_length or cfg.grpo.max_completion_length  # as turns are trained
        self.cap = cfg.serve.max_new_tokens
        self.splicer = Splicer(policy.tokenizer)  # touched only in the generation thread
        self.context_length = cfg.serve.context_length  # what the gateway states and holds a request to
        self.seed_from_prompt = cfg.serve.seed_from_prompt
        self._specials = byte_level_specials(policy.tokenizer)  # not None: a text's UTF-8 bytes are its tokens

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def _generate(self, payload: dict[str, Any], rid: str) -> dict[str, Any]:
        from hermes_lab.policy import formats, turn

        t = payload.get("temperature")
        temperature = float(t) if isinstance(t, (int, float)) and not isinstance(t, bool) else self.temperature
        sd = payload.get("seed")
        seed = sd if isinstance(sd, int) and not isinstance(sd, bool) else None
        messages = payload.get("messages") or []
        tools = turn.tool_list(payload.get("tools"))
        m0 = messages[0] if len(messages) == 1 and isinstance(messages[0], dict) else {}
        single = m0.get("role") == "user" and not tools  # the completion form: the string tasks' answer length
        mt = payload.get("max_completion_tokens") or payload.get("max_tokens")
        asked = int(mt) if isinstance(mt, int) and not isinstance(mt, bool) and mt > 0 else None
        tokens = min(asked or (self.default_tokens if single else self.turn_tokens), self.cap)
        tok, seen = self.policy.tokenizer, {}
        stops = formats.stop_ids(self.policy.model, tok)
        room = self.policy.model.config.max_position_embeddings - self.default_tokens  # a string answer's room left

        def prepare() -> list[int]:
            n = self.count_tokens(messages, tools)
            if n > self.context_length:  # what the gateway states it serves: beyond it, vLLM's 400
                raise ContextLengthExceeded(self.context_length, n)
            seen["msgs"] = msgs = turn.chat_messages(messages)
            ids, seen["spliced"] = self.splicer.prompt_ids(msgs, tools)
            seen["truncated"] = len(ids) > room
            if seen["truncated"]:  # longer than the context: its latest part, cut as turn-level training cuts it
                ids, seen["spliced"] = turn.prompt_ids(tok, turn.fit(tok, msgs, tools, room)[0], tools), False
                # what fit cannot cut (a template's fixed part, e.g. a header naming many tools, over the window
                # by itself) is cut from the front of the tokens: a request within context_length is answered
                ids = ids[-room:]
            return ids

        def finish(prompt: list[int], completion: list[int], logprobs: list[float] | None) -> dict[str, Any]:
            msgs = seen["msgs"]
            form = turn.is_completion(msgs, tools)
            msg = turn.parse(tok, completion, prompt, tools, form)
            if msg.get("tool_calls") and not tools:  # no tools offered: no tool calls (OpenAI's rule), the text
                msg = {"role": "assistant", "content": tok.decode(completion, skip_special_tokens=True)}
            answer = turn.to_openai(msg, rid)
            self.splicer.remember(msgs, tools, turn.chat_message(answer), prompt + completion)
            ended = bool(completion) and completion[-1] in stops
            finish_reason = "tool_calls" if answer.get("tool_calls") else ("stop" if ended else "length")
            ids = {"prompt_ids": prompt, "completion_ids": completion, "logprobs": logprobs}
            ids.update(spliced=seen["spliced"], truncated=seen["truncated"])
            return {"message": answer, "finish_reason": finish_reason, "tokens": ids}

        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        job = _Job(
            self.policy,
            prepare,
            finish,
            temperature,
            tokens,
            fut,
            loop,
            seed=seed,
            seed_from_prompt=self.seed_from_prompt,
        )
        self.worker.submit(job)
        return await fut

    def count_tokens(self, messages: list[Any], tools: list[Any] | None) -> int:
        """A request's length as the gateway holds it to ``serve.context_length``: the tokens of its messages'
        texts (and tool calls' names and arguments) plus its tools' JSON, by the arm's tokenizer. For a byte-level
        tokenizer without merges (the embedded policy's) a text's tokens are its UTF-8 bytes, one each, unless
        it holds a special token's text (then the tokenizer counts it): no 60 KB request is tokenized to count it."""
        from hermes_lab.policy import turn

        texts = [orjson.dumps(tools).decode()] if tools else []
        for m in messages:
            if isinstance(m, dict):
                texts.append(turn.text_of(m.get("content")))
                for c in m.get("tool_calls") or []:
                    f = (c.get("function") if isinstance(c, dict) else None) or {}
                    texts.append(f"{f.get('name') or ''}{turn.text_of(f.get('arguments'))}")
        tok, specials, n = self.policy.tokenizer, self._specials, 0
        for t in texts:
            if specials is not None and not any(sp in t for sp in specials):
                if not unicodedata.is_normalized("NFC", t):  # its normaliser composes first (e + U+0301: é)
                    t = unicodedata.normalize("NFC", t)
                n += len(t.encode("utf-8", "surrogatepass"))
            elif t:
                n += len(tok(t, add_special_tokens=False)["input_ids"])
        return n

    def _refusal(self, e: ContextLengthExceeded) -> Answer:
        """vLLM's answer to a conversation over its max_model_len (an OpenAI-shaped 400 Hermes Agent reads)."""
        err = {"message": str(e), "type": "BadRequestError", "param": None, "code": "context_length_exceeded"}
        return Answer(400, orjson.dumps({"error": err}), error=str(e))

    def _usage(self, out: dict[str, Any]) -> dict[str, int]:
        p, c = len(out["tokens"]["prompt_ids"]), len(out["tokens"]["completion_ids"])
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    async def complete(self, payload: dict[str, Any], prompt: str, rid: str) -> Answer:
        try:
            out = await self._generate(payload, rid)
        except ContextLengthExceeded as e:
            return self._refusal(e)
        usage, msg = self._usage(out), out["message"]
        body = {
            "id": f"chatcmpl-{rid}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.public,
            "choices": [{"index": 0, "message": msg, "finish_reason": out["finish_reason"]}],
            "usage": usage,
        }
        text, calls = msg.get("content") or "", msg.get("tool_calls")
        return Answer(200, orjson.dumps(body), text, usage, None, out["finish_reason"], calls, tokens=out["tokens"])

    async def stream(
        self, payload: dict[str, Any], prompt: str, rid: str
    ) -> tuple[Answer | None, AsyncIterator[Chunk] | None]:
        """The finished answer as OpenAI chunks: a role chunk, content pieces, each tool call as deltas (its id,
        type and name first, then its arguments in pieces), the finish, usage."""
        so = payload.get("stream_options") if isinstance(payload.get("stream_options"), dict) else {}
        try:
            out = await self._generate(payload, rid)
        except ContextLengthExceeded as e:  # refused before the first byte: a plain JSON error, as vLLM answers
            return self._refusal(e), None
        usage, created, msg = self._usage(out), int(time.time()), out["message"]

        def ev(delta: dict[str, Any] | None, finish: str | None = None, **extra: Any) -> bytes:
            choice = {"index": 0, "delta": delta, "finish_reason": finish}
            obj = {"id": f"chatcmpl-{rid}", "object": "chat.completion.chunk", "created": created, "model": self.public}
            obj.update(choices=[choice] if delta is not None else [], **extra)
            return b"data: " + orjson.dumps(obj) + b"\n\n"

        async def events() -> AsyncIterator[Chunk]:
            text = msg.get("content") or ""
            yield Chunk(ev({"role": "assistant", "content": ""}))
            for i in range(0, len(text), 8):  # a few characters a chunk, as a token stream would come
                yield Chunk(ev({"content": text[i : i + 8]}), text=text[i : i + 8])
            for k, c in enumerate(msg.get("tool_calls") or []):
                f = c["function"]
                head = [
                    {"index": k, "id": c["id"], "type": "function", "function": {"name": f["name"], "arguments": ""}}
                ]
                yield Chunk(ev({"tool_calls": head}), calls=head)
                for i in range(0, len(f["arguments"]), 8):
                    piece = [{"index": k, "function": {"arguments": f["arguments"][i : i + 8]}}]
                    yield Chunk(ev({"tool_calls": piece}), calls=piece)
            yield Chunk(ev({}, out["finish_reason"]), finish_reason=out["finish_reason"])
            yield Chunk(ev(None, usage=usage) if so.get("include_usage") else b"", usage=usage)

        return None, _Events(events(), out["tokens"])


class ArmPool:
    """The in-process policies and the one generation thread of a process. One pool serves every experiment
    of a long-running gateway (``hermes_lab.live.switch``): a new experiment's arms are loaded beside the
    running ones (the champion, already loaded, is not loaded again) and the switch is one reference swap."""

    def __init__(self) -> None:
        self.loaded: dict[tuple[str, str | None], Any] = {}
        self.worker: GenerationWorker | None = None

    def policy(self, cfg: HermesConfig, spec: ArmSpec) -> Any:
        key = (spec.base, spec.adapter)
        if key not in self.loaded:
            from hermes_lab.policy.formats import prepare
            from hermes_lab.policy.model import load_policy

            pol = load_policy(
                spec.base,
                adapter=spec.adapter,
                runs_dir=cfg.round.runs_dir,
                seed=cfg.model.seed,
                dtype=cfg.model.dtype,
                trust_remote_code=cfg.model.trust_remote_code,
            )
            prepare(pol.tokenizer, cfg.model.tool_parser)  # its reader (ChatFormatError: the arm is not served)
            self.loaded[key] = pol
        if self.worker is None:
            self.worker = GenerationWorker(cfg.serve.batch_wait_ms / 1000, cfg.serve.max_batch)
        return self.loaded[key]

    def keep(self, specs: list[ArmSpec]) -> None:
        """Unload the policies no listed arm serves (an experiment that drained)."""
        used = {(a.base, a.adapter) for a in specs if a.kind == "local"}
        for key in [k for k in self.loaded if k not in used]:
            del self.loaded[key]

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
            self.worker = None


def build_arms(
    cfg: HermesConfig, specs: dict[str, ArmSpec], pool: ArmPool | None = None
) -> tuple[dict[str, Any], GenerationWorker | None]:
    """The arm objects; in-process policies are loaded once per (base, adapter), so an A/A shares one. With
    a shared ``pool`` they come from (and stay in) it, and the worker returned is None: not this
    experiment's to close."""
    own = pool is None
    pool = pool or ArmPool()
    arms: dict[str, Any] = {}
    for name in ARMS:
        spec = specs[name]
        if spec.kind == "upstream":
            arms[name] = UpstreamArm(spec, cfg)
        else:
            policy = pool.policy(cfg, spec)
            arms[name] = LocalArm(spec, policy, pool.worker, cfg)
    return arms, (pool.worker if own else None)
