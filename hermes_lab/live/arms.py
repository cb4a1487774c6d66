"""The two arms of the live gateway: an OpenAI-compatible upstream, or a policy served in-process (the latter in
``hermes_lab.live.local``).

Stage: validate (live A/B, ``hermes-lab serve``). Reads the arms' models (a model dir, a LoRA adapter dir,
a train output dir, ``embedded:tiny``) or talks to their upstream servers; writes nothing.

An arm spec, on the command line (``--baseline`` / ``--candidate``) or in ``serve.baseline`` /
``serve.candidate``:

- ``http(s)://host[:port][/v1]``: an upstream (TaoToken, vLLM, SGLang, LiteLLM, another gateway). Its model
  id is ``--baseline-model`` / ``serve.baseline_model`` (required); its key is read at start from the env
  var named by ``--baseline-key-env`` / ``serve.baseline_key_env`` and sent only to that upstream.
- ``embedded:tiny``, a model dir or hub id, a LoRA adapter dir (its base from adapter_config.json), or a
  train output dir (``runs/round-NN/train``): served in-process (``live.local.LocalArm``), exactly as trained: the
  request's messages and ``tools`` rendered with the policy's chat template, the answer read by TRL's parser
  into OpenAI ``tool_calls`` (``hermes_lab.policy.turn``), its token ids and logprobs in the log. Generation
  runs in one worker thread, micro-batched (requests that arrive within ``serve.batch_wait_ms`` share one
  ``generate``), never on the event loop; the rendering and parsing run in that thread too. One thread for
  both arms: torch's RNG is global and the machine has few cores.
- ``latest`` (candidate default): the newest round's trained adapter, else ``embedded:tiny`` (an A/A).

Both arms of one vLLM server (the gateway only picks the model name per arm; the request, ``tools`` included,
goes to vLLM as the client sent it). vLLM answers tool calls with its tool-call parser on, and must render
with the chat template the policy was trained with (the one in its tokenizer dir; ``--chat-template`` names
it when the served dir has another). For a policy that writes Hermes-style ``<tool_call>`` blocks (Qwen2.5/3,
Hermes 2/3; vLLM's ``hermes`` parser needs ``<tool_call>`` to be a token of the tokenizer, which the tiny
policy's byte-level one has not: serve it in-process)::

    vllm serve Qwen/Qwen2.5-0.5B-Instruct --enable-auto-tool-choice --tool-call-parser hermes \\
        --chat-template runs/round-01/train/adapter/chat_template.jinja \\
        --enable-lora --lora-modules round-01=runs/round-01/train/adapter
    hermes-lab serve --baseline http://127.0.0.1:8000 --baseline-model Qwen/Qwen2.5-0.5B-Instruct \\
        --candidate http://127.0.0.1:8000 --candidate-model round-01

Upstream HTTP client (``serve.upstream_client``): the gateway's own kept-alive client by default
(``hermes_lab.live.upstream``, httptools' parser; aiohttp for an arm behind a proxy); aiohttp and httpx are kept
switchable because the choice is a measurement (``benchmarks/bench_gateway.py --variants`` prints each).
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import orjson

from hermes_lab.config.schema import EMBEDDED_MODEL, ConfigError, HermesConfig
from hermes_lab.core.layout import RunsLayout, TrainLayout
from hermes_lab.live.sse import Chunk, read_piece
from hermes_lab.live.wire import ChatBody
from hermes_lab.llm.client import normalize_base_url, proxy_for, redact, safe_url

ARMS = ("baseline", "candidate")
log = logging.getLogger("hermes_lab.serve")


class UpstreamError(RuntimeError):
    """No usable answer from an arm (connection failed, non-JSON body, mid-stream break). Redacted."""

    def __init__(self, message: str, status: int = 502):
        super().__init__(message)
        self.status = status


# ------------------------------------------------------------------------------------------ arm specs
@dataclass
class ArmSpec:
    """What an arm is: ``kind`` 'upstream' (url, model, key_env) or 'local' (base, adapter)."""

    name: str
    kind: str
    spec: str
    url: str = ""
    model: str = ""
    key_env: str = ""
    base: str = ""
    adapter: str | None = None
    lora: str = ""  # upstream arms of serve.lora_upstream: the adapter dir loaded into it under ``model``

    def describe(self) -> dict[str, Any]:
        """For experiment.json and the log: never a key, never a URL's credentials or query."""
        if self.kind == "upstream":
            out = {"kind": "upstream", "url": safe_url(self.url), "model": self.model, "key_env": self.key_env}
            return out | ({"lora": self.lora} if self.lora else {})
        return {"kind": "local", "base": self.base, "adapter": self.adapter}

    @property
    def served_model(self) -> str:
        return self.model if self.kind == "upstream" else (self.adapter or self.base)

    @property
    def slug(self) -> str:
        """A short name for the default experiment name: round-NN, the model id, or the dir name."""
        text = self.model if self.kind == "upstream" else (self.adapter or self.base)
        m = re.search(r"round-\d+", text)
        if m:
            return m.group(0)
        if text == EMBEDDED_MODEL:
            return "tiny"
        return re.sub(r"[^A-Za-z0-9._-]+", "-", Path(text).name or text).strip("-") or "arm"


def latest_round_adapter(runs_dir: str | os.PathLike[str]) -> Path | None:
    """The newest runs/round-NN/train that holds a trained adapter, or None."""
    found = [
        rd.train.root for rd in RunsLayout(runs_dir).rounds() if (rd.train.adapter / "adapter_config.json").is_file()
    ]
    return found[-1] if found else None


def resolve_arm(
    cfg: HermesConfig, name: str, spec: str | None = None, model: str | None = None, key_env: str | None = None
) -> ArmSpec:
    """An ArmSpec from a CLI value (or ``serve.<name>``); errors name the key or flag to fix."""
    s = cfg.serve
    spec = (spec if spec is not None else getattr(s, name)).strip()
    model = (model if model is not None else getattr(s, f"{name}_model")).strip()
    key_env = (key_env if key_env is not None else getattr(s, f"{name}_key_env")).strip()
    if spec.startswith(("http://", "https://")):
        if not model:
            raise ConfigError(
                f"--{name} {safe_url(spec)} is an upstream URL: pass --{name}-model (the model id it serves)"
            )
        url = normalize_base_url(spec, f"--{name}") + "/v1/chat/completions"
        return ArmSpec(name, "upstream", spec, url=url, model=model, key_env=key_env)
    if spec == "latest":
        td = latest_round_adapter(cfg.round.runs_dir)
        spec = str(td) if td else EMBEDDED_MODEL
    if TrainLayout(spec).run.is_file() or (TrainLayout(spec).adapter / "adapter_config.json").is_file():
        from hermes_lab.policy.arms import candidate_from_train_dir

        base, adapter = candidate_from_train_dir(spec, cfg)
        return lora_upstream(cfg, ArmSpec(name, "local", spec, base=base, adapter=adapter))
    if (Path(spec) / "adapter_config.json").is_file():  # an adapter's own folder: on model.base_model
        return lora_upstream(cfg, ArmSpec(name, "local", spec, base=cfg.model.base_model, adapter=spec))
    if spec != EMBEDDED_MODEL and spec.startswith((".", "/", "runs")) and not Path(spec).exists():
        raise ConfigError(f"--{name} {spec}: no such model, adapter or train dir")
    return lora_upstream(cfg, ArmSpec(name, "local", spec, base=spec))


def lora_upstream(cfg: HermesConfig, local: ArmSpec) -> ArmSpec:
    """``serve.lora_upstream`` set: a local arm is served by that vLLM server instead of in-process. An adapter
    is loaded into it at the arm's start (``POST /v1/load_lora_adapter``, vLLM's runtime LoRA API) under a
    name of its own (round-NN), which the arm then asks for; a bare base is the server's base model."""
    s = cfg.serve
    if not s.lora_upstream:
        return local
    url = normalize_base_url(s.lora_upstream, "serve.lora_upstream") + "/v1/chat/completions"
    adapter = local.adapter or (local.base if Path(local.base, "adapter_config.json").is_file() else None)
    if adapter:
        model, lora = f"hermes-{local.slug}", str(Path(adapter).resolve())
    else:
        model, lora = s.lora_base_model or local.base, ""
    return ArmSpec(local.name, "upstream", local.spec, url=url, model=model, key_env=s.lora_upstream_key_env, lora=lora)


# ----------------------------------------------------------------------------------------- answers
@dataclass
class Answer:
    """One finished answer: the bytes for the client and what the log keeps of them."""

    status: int
    body: bytes
    text: str = ""
    usage: dict[str, Any] | None = None
    error: str | None = None
    finish_reason: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    reasoning: str | None = None
    tokens: dict[str, Any] | None = None  # in-process arms: prompt_ids, completion_ids, logprobs (the log keeps them)


def read_completion(status: int, body: bytes, content_type: str) -> Answer:
    """The text and usage of an upstream chat.completion; a body that is not one is an error answer."""
    if status != 200:
        return Answer(status, body, error=f"upstream status {status}: {body[:300].decode('utf-8', 'replace')}")
    try:
        obj = orjson.loads(body)
        choice = obj["choices"][0]
        msg = choice.get("message") or {}
        text = msg.get("content") or ""
    except (orjson.JSONDecodeError, KeyError, IndexError, TypeError, AttributeError):
        head = body[:300].decode("utf-8", "replace")
        raise UpstreamError(
            f"Error reading choices: upstream body is not a chat completion ({content_type}): {head!r}"
        ) from None
    calls = msg.get("tool_calls") if isinstance(msg, dict) else None
    reasoning = (msg.get("reasoning_content") or msg.get("reasoning")) if isinstance(msg, dict) else None
    return Answer(
        200,
        body,
        text=text if isinstance(text, str) else "",
        usage=obj.get("usage"),
        finish_reason=choice.get("finish_reason"),
        tool_calls=calls if isinstance(calls, list) and calls else None,
        reasoning=reasoning if isinstance(reasoning, str) and reasoning else None,
    )


def flatten_messages(messages: list[Any]) -> str:
    """The log's ``prompt`` of a conversation's opening: a lone user message as is (the embedded string tasks'
    form, which prep joins with its feedback as a trajectory), otherwise one 'role: content' line per message and
    a final 'assistant:' (for people and the per-family counts; no arm generates from it: an in-process arm
    renders the messages with the policy's chat template, ``LocalArm``)."""
    parts = []
    for m in messages:
        m = m if isinstance(m, dict) else {}
        c = m.get("content")
        if isinstance(c, list):  # content parts: keep the text ones
            c = "".join(p.get("text", "") for p in c if isinstance(p, dict) and p.get("type") == "text")
        parts.append((str(m.get("role", "user")), c if isinstance(c, str) else ""))
    if len(parts) == 1 and parts[0][0] == "user":
        return parts[0][1]
    return "\n".join(f"{r}: {c}" for r, c in parts) + "\nassistant:"


# ---------------------------------------------------------------------------------------- upstreams
class UpstreamArm:
    """An OpenAI-compatible server. The client's headers are never forwarded; only this arm's key is sent."""

    needs_prompt = False  # the upstream gets the messages; the flattened prompt is only logged at an opening
    wire = True  # called with the request's ChatBody (live.wire): its messages and tools go on as the client's bytes

    def __init__(self, spec: ArmSpec, cfg: HermesConfig):
        self.spec, self.name, self.served_model = spec, spec.name, spec.model
        s = cfg.serve
        self.timeout, self.connections, self.client_kind = (
            s.upstream_timeout_s,
            s.upstream_connections,
            s.upstream_client,
        )
        self.headers = {"Content-Type": "application/json", "Accept": "application/json"}
        self._key = ""
        if spec.key_env:
            self._key = os.environ.get(spec.key_env, "")
            if not self._key:
                raise ConfigError(
                    f"{spec.key_env} is not set: the {spec.name} upstream's key must be in the environment"
                )
            self.headers["Authorization"] = f"Bearer {self._key}"
        self._session: Any = None
        self.context_length: int | None = None  # the upstream's max_model_len for this model (Gateway.startup)
        self._pool: Any = None  # serve.upstream_client httptools: hermes_lab.live.upstream.Pool
        self._proxy: str | None = None

    async def start(self) -> None:
        self._open()
        if self.spec.lora:
            await self.load_lora()

    async def stated_length(self) -> int | None:
        """The upstream's own context length for this arm's model: ``max_model_len`` (vLLM), or another key a
        server states it under, in its ``GET /v1/models`` listing; None when it states none or cannot be asked
        (the gateway then states ``serve.context_length``). The gateway asks once, at its start."""
        import httpx

        root = self.spec.url.removesuffix("/v1/chat/completions")
        auth = {"Authorization": self.headers["Authorization"]} if "Authorization" in self.headers else {}
        try:
            async with httpx.AsyncClient(timeout=5, headers=auth) as client:
                r = await client.get(root + "/v1/models")
            data = r.json().get("data") if r.status_code == 200 else None
        except Exception as e:  # a server without the listing still serves chats: nothing stated
            log.info("%s: %s/v1/models: %s", self.name, safe_url(root), redact(str(e), self._key))
            return None
        for m in data if isinstance(data, list) else []:
            if isinstance(m, dict) and m.get("id") == self.spec.model:
                for key in ("max_model_len", "context_length", "max_context_length"):
                    n = m.get(key)
                    if isinstance(n, int) and not isinstance(n, bool) and n > 0:
                        return n
        return None

    async def load_lora(self) -> None:
        """vLLM's runtime LoRA API: ``POST /v1/load_lora_adapter {lora_name, lora_path}`` (the server runs with
        ``--enable-lora`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``). A name it already holds is taken as
        loaded (a restarted gateway, or the champion loaded by an earlier experiment)."""
        root = self.spec.url.removesuffix("/v1/chat/completions")
        body = orjson.dumps({"lora_name": self.spec.model, "lora_path": self.spec.lora})
        try:
            status, text = await self._post(root + "/v1/load_lora_adapter", body)
        except Exception as e:
            raise self._error(e) from None
        if status == 200 or (status == 400 and "already" in text.lower()):
            return
        hint = " (is it started with --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True?)" if status == 404 else ""
        raise UpstreamError(
            redact(
                f"{self.name}: {safe_url(root)} refused to load adapter {self.spec.lora} as "
                f"{self.spec.model!r}: status {status}: {text[:300]}{hint}",
                self._key,
            )
        )

    async def _post(self, url: str, body: bytes) -> tuple[int, str]:
        if self._pool is not None:
            status, raw, _ = await self._pool.post(body, urlsplit(url).path)
            return status, raw.decode("utf-8", "replace")
        if self.client_kind == "httpx":
            r = await self._session.post(url, content=body, headers=self.headers)
            return r.status_code, r.text
        async with self._session.post(url, data=body, headers=self.headers, proxy=self._proxy) as r:
            return r.status, await r.text()

    def _open(self) -> None:
        found = proxy_for(self.spec.url)
        if self.client_kind == "httptools" and not found:  # through a proxy: aiohttp's client
            from hermes_lab.live.upstream import Pool

            self._pool = Pool(self.spec.url, self.headers, self.connections, self.timeout)
        elif self.client_kind == "httpx":
            import httpx

            lim = httpx.Limits(max_connections=self.connections, max_keepalive_connections=self.connections)
            self._session = httpx.AsyncClient(limits=lim, timeout=self.timeout)
        else:
            import aiohttp

            # trust_env would cost two thread hops per request (netrc, proxy lookup): the proxy is resolved
            # once here instead, with httpx's rules (HTTPS_PROXY / NO_PROXY), as every other client does
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.connections, ttl_dns_cache=300),
                timeout=aiohttp.ClientTimeout(total=self.timeout),
                cookie_jar=aiohttp.DummyCookieJar(),
            )
            self._proxy = found[1] if found else None

    async def close(self) -> None:
        if self._pool is not None:
            await self._pool.close()
        if self._session is not None:
            await (self._session.aclose() if self.client_kind == "httpx" else self._session.close())

    def _error(self, e: BaseException) -> UpstreamError:
        timeout = isinstance(e, (asyncio.TimeoutError, TimeoutError)) or "timeout" in type(e).__name__.lower()
        kind = "timeout" if timeout else type(e).__name__
        msg = redact(f"{self.name} upstream {safe_url(self.spec.url)}: {kind}: {e}", self._key)
        return UpstreamError(msg, 504 if timeout else 502)  # a timeout is the gateway's 504, as proxies answer

    def _payload(self, payload: dict[str, Any] | ChatBody, extra: dict[str, Any] | None = None) -> list[Any]:
        """The request's body with this arm's model, as the parts of one write: a ``ChatBody``'s own (the client's
        messages and tools as they came), a dict's serialised."""
        if isinstance(payload, ChatBody):
            return payload.upstream(self.spec.model, extra)
        return [orjson.dumps({**payload, **(extra or {}), "model": self.spec.model})]

    async def complete(self, payload: dict[str, Any] | ChatBody, prompt: str = "", rid: str = "") -> Answer:
        parts = self._payload(payload)
        try:
            if self._pool is not None:  # the parts written as they are; the other clients get them joined
                status, body, ctype = await self._pool.post(parts)
            elif self.client_kind == "httpx":
                r = await self._session.post(self.spec.url, content=_joined(parts), headers=self.headers)
                status, body, ctype = r.status_code, r.content, r.headers.get("content-type", "")
            else:
                data = _joined(parts)
                async with self._session.post(self.spec.url, data=data, headers=self.headers, proxy=self._proxy) as r:
                    status, body, ctype = r.status, await r.read(), r.headers.get("Content-Type", "")
        except Exception as e:  # any transport failure is a 502 with its kind
            raise self._error(e) from None
        ans = read_completion(status, body, ctype)
        if ans.error:
            ans.error = redact(ans.error, self._key)
        return ans

    async def stream(
        self, payload: dict[str, Any] | ChatBody, prompt: str = "", rid: str = ""
    ) -> tuple[Answer | None, AsyncIterator[Chunk] | None]:
        """(error answer, None) when the upstream refuses, else (None, the chunks as they arrive: one per upstream
        piece, read by ``hermes_lab.live.sse.read_piece``)."""
        so = payload.get("stream_options") if isinstance(payload.get("stream_options"), dict) else {}
        wants_usage = bool(so.get("include_usage"))
        parts = self._payload(payload, {"stream": True, "stream_options": {**so, "include_usage": True}})
        try:
            if self._pool is not None:
                status, chunks, closer = await self._pool.post_stream(parts)
            elif self.client_kind == "httpx":
                data = _joined(parts)
                req = self._session.build_request("POST", self.spec.url, content=data, headers=self.headers)
                r = await self._session.send(req, stream=True)
                status, chunks, closer = r.status_code, r.aiter_raw(), r.aclose
            else:
                data = _joined(parts)
                r = await self._session.post(self.spec.url, data=data, headers=self.headers, proxy=self._proxy)
                status, chunks, closer = r.status, r.content.iter_any(), r.release
        except Exception as e:
            raise self._error(e) from None
        if status != 200:
            body = b"".join([c async for c in chunks])
            await _maybe_await(closer())
            return Answer(status, body, error=redact(f"upstream status {status}: {body[:300]!r}", self._key)), None

        async def events() -> AsyncIterator[Chunk]:
            held = b""  # the start of an event whose end is in a later piece
            try:
                async for piece in chunks:
                    data = held + piece if held else piece
                    ch, rest, done = read_piece(data, wants_usage)
                    held = data[rest:]
                    if ch is not None:
                        yield ch
                    if done:
                        return
            except (asyncio.CancelledError, GeneratorExit):
                raise
            except Exception as e:
                raise self._error(e) from None
            finally:
                await _maybe_await(closer())

        return None, events()


def _joined(parts: list[Any]) -> bytes:
    return parts[0] if len(parts) == 1 else b"".join(parts)


async def _maybe_await(x: Any) -> None:
    if asyncio.iscoroutine(x):
        await x
