"""Config section of the live A/B gateway: ``serve`` (``hermes-lab serve``, ``hermes-lab flywheel --live``): its
address, arms, durability, in-process batching, conversations and rollout.

Part of the config layer (``hermes_lab.config.schema`` builds ``HermesConfig`` from the sections and loads it):
each field with its help text and bounds, choices as ``Literal`` types, and the gateway's own cross-field checks
(``serve_problems``). Reads and writes nothing.

    hermes-lab config --explain        # every key, with its choices and bounds
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from hermes_lab.core.yaml_typed import field_with as _f
from hermes_lab.tasks.hermes import HERMES_MIN_CONTEXT

ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass
class ServeSection:
    host: str = _f("127.0.0.1", "Address `hermes-lab serve` binds (loopback: only this machine can reach the gateway).")
    port: int = _f(8700, "Port of the gateway (0: any free port, printed at start).", ge=0, le=65535)
    experiment: str = _f(
        "",
        "Name of the live experiment; its log dir is runs/live/<experiment>. Empty: "
        "'<baseline>-vs-<candidate>' from the arms (a restart with the same arms continues it).",
    )
    log_dir: str = _f("", "Log dir (requests.jsonl, feedback.jsonl, experiment.json). Empty: runs/live/<experiment>.")
    baseline: str = _f(
        "embedded:tiny",
        "Baseline arm: embedded:tiny, a model dir, a LoRA adapter dir, a train output dir "
        "(runs/round-NN/train), or the http(s) root of an OpenAI-compatible server (then set baseline_model).",
    )
    candidate: str = _f(
        "latest",
        "Candidate arm, as baseline; 'latest': the newest round's trained adapter, else embedded:tiny (an A/A test).",
    )
    baseline_model: str = _f(
        "", "Model id the baseline upstream serves (required for a URL arm, e.g. a vLLM LoRA name)."
    )
    candidate_model: str = _f("", "Model id the candidate upstream serves (required for a URL arm).")
    baseline_key_env: str = _f("", "NAME of the env var with the baseline upstream's key (empty: no key sent).")
    candidate_key_env: str = _f("", "NAME of the env var with the candidate upstream's key (empty: no key sent).")
    lora_upstream: str = _f(
        "",
        "The http(s) root of a vLLM server started with --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True: "
        "arms that name a local adapter or train dir (a round's candidate, the champion) are served by it, "
        "the adapter loaded at the arm's start with POST /v1/load_lora_adapter under the name hermes-round-NN; "
        "a bare base arm asks it for lora_base_model. Empty: such arms run in-process.",
    )
    lora_base_model: str = _f("", "serve.lora_upstream: the model id of its base (empty: model.base_model).")
    lora_upstream_key_env: str = _f("", "serve.lora_upstream: NAME of the env var with its key (empty: none).")
    public_model: str = _f("hermes", "The one model name clients ask for; which arm answers is the gateway's business.")
    api_key_env: str = _f(
        "", "NAME of the env var with the gateway's own key; set: every /v1 call needs 'Authorization: Bearer <key>'."
    )
    max_body_bytes: int = _f(4 * 2**20, "Largest request body accepted (bigger: 413).", ge=1024)
    durability: Literal["write", "fsync"] = _f(
        "write",
        "write: a request's record is written to the log file before the last byte of its answer, fsync "
        "follows within fsync_ms (a kill -9 loses nothing; a power loss may lose the last fsync_ms). fsync: the "
        "answer also waits for the fsync covering its record (group commit; survives power loss, +1 fsync).",
    )
    fsync_ms: float = _f(100.0, "durability write: longest a written log record waits for its fsync.", gt=0, le=10_000)
    upstream_client: Literal["httptools", "aiohttp", "httpx"] = _f(
        "httptools",
        "HTTP client of URL arms: httptools (the gateway's own kept-alive client, hermes_lab.live.upstream; "
        "measured fastest; aiohttp behind a proxy), aiohttp or httpx.",
    )
    event_loop: Literal["uvloop", "asyncio"] = _f(
        "uvloop",
        "hermes-lab serve's event loop: uvloop (~10% less CPU a request) or Python's asyncio (the same answers; "
        "docs/performance.md).",
    )
    upstream_timeout_s: float = _f(600.0, "Timeout of one upstream request (a long generation included).", gt=0)
    upstream_connections: int = _f(256, "Open connections kept per upstream arm.", ge=1)
    batch_wait_ms: float = _f(
        5.0, "In-process arms: collect requests this long into one batched generate.", ge=0, le=1000
    )
    max_batch: int = _f(32, "In-process arms: most requests in one batched generate.", ge=1)
    seed_from_prompt: bool = _f(
        False,
        "In-process arms: a request without a seed of its own (OpenAI's `seed`, which is always honoured) is sampled "
        "with random numbers drawn from its prompt's tokens, so the same conversation state gets the same random "
        "numbers under every policy and on every run: two arms' answers to one task are paired (common random "
        "numbers), as the regression gate's built-in episodes are. For evaluation servers (validate's, with "
        "agent.runner hermes): a retry of the same messages is answered the same.",
    )
    max_new_tokens: int = _f(
        256,
        "In-process arms: cap on a request's max_tokens. A request without one: a lone user message without tools "
        "(a string task) gets execute.max_new_tokens, any other chat what a turn is trained with "
        "(grpo.turn_completion_length, else grpo.max_completion_length); always within the policy's context.",
        ge=1,
    )
    context_length: int = _f(
        65536,
        "The context length the gateway states for its models (max_model_len in GET /v1/models, as vLLM states it) "
        "and holds in-process arms to: a request whose messages' texts and tools' JSON count more tokens (the arm's "
        "tokenizer) is refused with 400 context_length_exceeded; below it the conversation is fitted into the "
        "policy's own window (oldest messages first). An upstream arm states its server's max_model_len where it "
        "says one. Hermes Agent refuses a stated length under 64000 (set model.context_length in its config.yaml "
        "for a smaller one: docs/live.md), so it is the least allowed.",
        ge=HERMES_MIN_CONTEXT,
    )
    agent_share: float = _f(
        0.3,
        "The stand-in agent (hermes-lab agent, make live-demo): share of its conversations that are episodes of the "
        "embedded agent family, played as a client-side agent loop (the tool's schema sent, its calls executed by "
        "the agent, the results sent back, the episode's success posted as feedback by conversation id); the rest "
        "are single-turn string tasks scored by their verifiers.",
        ge=0,
        le=1,
    )
    feedback_source: str = _f(
        "system",
        "Feedback source that counts as the reward (the latest such feedback of a request wins); "
        "'any': the latest feedback of any source.",
    )
    score_unrewarded: Literal["none", "judge"] = _f(
        "none",
        "Answered requests without feedback in prep: none (kept aside, counted as unrewarded) or judge "
        "(scored by the comparison judge against the best rewarded response to the same prompt).",
    )
    mlflow_traces: bool = _f(
        False, "Also write each request as an MLflow trace and each feedback as an assessment (off the request path)."
    )
    access_log: bool = _f(False, "The gateway's access log on stdout (one line per request; never headers or bodies).")
    rollout: bool = _f(
        True,
        "Run the staged rollout live: the stages of ab.stages on the wall clock, a look every ab.look_every, "
        "decided by hermes_lab.ab.stats; the candidate share changes in place. false: a fixed share, no looks.",
    )
    time_scale: float = _f(
        1.0,
        "Experiment clock speed: K runs the stages and looks K times faster than the wall clock (demos, "
        "tests; --time-scale). The report says so. A restart must keep the experiment's time scale.",
        gt=0,
        le=1e6,
    )
    models: list[str] = _f(
        [],
        "Model names the gateway accepts besides public_model (others get 404 model_not_found). Empty: any "
        "model name a client asks for is served by the experiment (an agent keeps its own model name).",
    )
    conversation_idle_s: float = _f(
        900.0,
        "A conversation whose last answer had no tool call ends when no new turn follows within this many "
        "seconds (or when feedback closes it); a later request that continues it opens a new conversation.",
        gt=0,
        le=7 * 86400,
    )
    conversation_tool_wait_s: float = _f(
        3600.0,
        "A conversation whose last answer asked for tool calls waits this long for their results before it "
        "ends (tools may run long).",
        gt=0,
        le=7 * 86400,
    )
    max_conversations: int = _f(
        200_000,
        "Open conversations the gateway tracks at most (memory bound); the longest idle ends first.",
        ge=100,
    )
    conversation_from_user: bool = _f(
        False,
        "The OpenAI 'user' field (or X-Hermes-User) names the conversation, when a client sends one per "
        "conversation. An X-Hermes-Conversation header or metadata.conversation_id always does.",
    )
    fallback: Literal["none", "baseline"] = _f(
        "none",
        "baseline: a failed candidate call (upstream error, timeout, 5xx) is answered by the baseline and "
        "still counted as a candidate error. none: the client gets the error.",
    )


def serve_problems(s: ServeSection) -> list[str]:
    """The gateway's cross-field checks (a URL arm needs its model id) and names; bounds and choices are the
    loader's."""
    out = []
    for key in ("host", "public_model", "feedback_source"):
        if not getattr(s, key).strip():
            out.append(f"serve.{key} must not be empty")
    bad = [m for m in s.models if not isinstance(m, str) or not m.strip()]
    if bad:
        out.append("serve.models: every entry must be a non-empty model name")
    if s.conversation_tool_wait_s < s.conversation_idle_s:
        out.append(
            f"serve.conversation_tool_wait_s ({s.conversation_tool_wait_s:g}) must be >= serve.conversation_idle_s "
            f"({s.conversation_idle_s:g}): a conversation waiting for tool results is never ended sooner"
        )
    if "/" in s.experiment or s.experiment in {".", ".."}:
        out.append(f"serve.experiment must be a plain name (it is a folder under runs/live/), got {s.experiment!r}")
    if s.lora_upstream and not s.lora_upstream.startswith(("http://", "https://")):
        out.append(f"serve.lora_upstream must be the http(s) root of a vLLM server, got {s.lora_upstream!r}")
    for key in ("api_key_env", "baseline_key_env", "candidate_key_env", "lora_upstream_key_env"):
        if getattr(s, key) and not ENV_NAME.match(getattr(s, key)):  # never echo it: it may be the key
            out.append(f"serve.{key} must be the NAME of an environment variable, not the key itself")
    for arm in ("baseline", "candidate"):
        spec = getattr(s, arm).strip()
        if not spec:
            out.append(f"serve.{arm} must name an arm (embedded:tiny, a model/adapter/train dir or an http(s) URL)")
        if spec.startswith(("http://", "https://")) and not getattr(s, f"{arm}_model").strip():
            out.append(f"serve.{arm}_model is required: serve.{arm} is an upstream URL, which needs its model id")
    return out
