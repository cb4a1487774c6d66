"""The live flywheel's hot swap (hermes_lab.live.switch): one gateway server on 127.0.0.1, one experiment after
another, under load. In-process arms: the tiny policy and a LoRA adapter of it (the adapter loaded beside the
running policy, the base not loaded twice). vLLM arms: tests/fake_openai.py with vLLM's runtime LoRA API
(POST /v1/load_lora_adapter), the gateway switching the model name.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path

import httpx
import pytest

from hermes_lab.config.schema import load_config
from hermes_lab.live.arms import UpstreamError, resolve_arm
from hermes_lab.live.gateway import Gateway
from hermes_lab.live.local import ArmPool
from hermes_lab.live.serve import bind
from hermes_lab.live.server import Server
from hermes_lab.live.switch import Switchboard
from hermes_lab.tasks import suite as T
from hermes_lab.tasks import workspace as W

from fake_openai import FakeOpenAI, free_port
from repo_paths import REPO


def config(**extra):
    over = {"round.runs_dir": str(REPO / "runs"), "serve.conversation_idle_s": 10.0, "serve.rollout": False}
    return load_config(None, overrides=over | extra)


@pytest.fixture(scope="module")
def adapter(tmp_path_factory) -> Path:
    """A LoRA adapter of the tiny policy with random B (so it answers differently), as a round would save one."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from hermes_lab.policy.model import build_tiny_policy

    base = build_tiny_policy(str(REPO / "runs"), 0)
    model = AutoModelForCausalLM.from_pretrained(base)
    peft = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    out = tmp_path_factory.mktemp("adapters") / "round-07" / "adapter"
    peft.save_pretrained(out)
    return out


class Served:
    """A switchboard under the gateway's server (hermes_lab.live.server, as the supervisor runs it) on its own event
    loop in a thread; ``swap`` runs on that loop as the supervisor's does."""

    def __init__(self, board: Switchboard):
        self.board, self.port = board, free_port()
        self.server = Server(board, board.chat, board.refuse, board.current.max_body)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self) -> Served:
        self.thread.start()
        sock = bind("127.0.0.1", self.port)
        asyncio.run_coroutine_threadsafe(self.board.startup(), self.loop).result(120)
        asyncio.run_coroutine_threadsafe(self.server.start(sock), self.loop).result(30)
        return self

    def __exit__(self, *a) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop).result(60)
        asyncio.run_coroutine_threadsafe(self.board.shutdown(), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(60)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def swap(self, build) -> Gateway:
        return asyncio.run_coroutine_threadsafe(self.board.swap(build), self.board.loop).result(180)


def records(log_dir: Path) -> list[dict]:
    p = log_dir / "requests.jsonl"
    return [json.loads(x) for x in p.read_text().splitlines() if x.strip()] if p.exists() else []


class Load:
    """Clients sending single requests and two-turn conversations until stopped; every answer recorded."""

    def __init__(self, url: str, clients: int = 4):
        self.url, self.clients, self.stop = url, clients, threading.Event()
        self.done: list[dict] = []
        self.lock = threading.Lock()
        self.pool = ThreadPoolExecutor(clients)

    def _one(self, k: int) -> None:
        tasks = T.generate_tasks(400, split="train", seed=k)
        with httpx.Client(base_url=self.url, timeout=120, trust_env=False) as c:
            i = 0
            while not self.stop.is_set():
                t = tasks[i % len(tasks)]
                i += 1
                msgs = [{"role": "user", "content": t.prompt}]
                body = {"model": "hermes", "messages": msgs, "max_tokens": 8, "stream": i % 3 == 0}
                r = c.post("/v1/chat/completions", json=body)
                self._keep(r, 1)
                if i % 2 == 0 and r.status_code == 200 and not body["stream"]:  # a second turn continuing it
                    answer = r.json()["choices"][0]["message"]["content"]
                    msgs += [{"role": "assistant", "content": answer}, {"role": "user", "content": "again"}]
                    self._keep(c.post("/v1/chat/completions", json={**body, "messages": msgs}), 2)

    def _keep(self, r: httpx.Response, turn: int) -> None:
        with self.lock:
            self.done.append(
                {
                    "status": r.status_code,
                    "rid": r.headers.get("x-request-id"),
                    "conv": r.headers.get("x-hermes-conversation"),
                    "arm": r.headers.get("x-hermes-arm"),
                    "turn": turn,
                    "text": r.text[:300],
                }
            )

    def __enter__(self) -> Load:
        self.futures = [self.pool.submit(self._one, k) for k in range(self.clients)]
        return self

    def __exit__(self, *a) -> None:
        self.stop.set()
        for f in self.futures:
            f.result(120)
        self.pool.shutdown()


def chat(url: str, messages: list[dict]) -> httpx.Response:
    body = {"model": "hermes", "messages": messages, "max_tokens": 8}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=120, trust_env=False)


@pytest.mark.slow
def test_swap_in_process_under_load(tmp_path, adapter):
    cfg = config()
    pool = ArmPool()
    a_dir, b_dir = tmp_path / "collect-01", tmp_path / "round-07"
    tiny = {a: resolve_arm(cfg, a, "embedded:tiny") for a in ("baseline", "candidate")}
    gw_a = Gateway(cfg, tiny, ratio=0.0, log_dir=a_dir, experiment="collect-01", say=lambda m: None, pool=pool)
    board = Switchboard(gw_a, pool, status=lambda: {"phase": "experiment", "waiting_for": ["a test"]})
    specs_b = {"baseline": tiny["baseline"], "candidate": resolve_arm(cfg, "candidate", str(adapter))}
    with Served(board) as srv:
        first = chat(srv.url, [{"role": "user", "content": "add 2 3"}])  # a conversation open at the swap
        assert first.status_code == 200 and first.headers["x-hermes-arm"] == "baseline"
        with Load(srv.url) as load:
            time.sleep(2)
            before = len(load.done)
            gw_b = srv.swap(lambda: Gateway(cfg, specs_b, ratio=0.5, log_dir=b_dir, experiment="round-07", pool=pool))
            swapped = time.time()
            # the open conversation's next turn finishes where it started: gw_a's experiment, the same arm
            msgs = [
                {"role": "user", "content": "add 2 3"},
                {"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]},
            ]
            second = chat(srv.url, [*msgs, {"role": "user", "content": "and 4?"}])
            time.sleep(3)
        assert board.current is gw_b and before > 0 and len(load.done) > before
        # the base policy object is the one gw_a loaded: the adapter was loaded beside it, not the base again
        assert gw_b.arms["baseline"].policy is gw_a.arms["baseline"].policy
        assert gw_b.arms["candidate"].policy is not gw_a.arms["baseline"].policy
        assert second.status_code == 200
        assert second.headers["x-hermes-conversation"] == first.headers["x-hermes-conversation"]
        fresh = [chat(srv.url, [{"role": "user", "content": f"reverse ab{i}"}]) for i in range(12)]
        # drained: the old experiment is closed once its conversations idle out (serve.conversation_idle_s 10)
        for _ in range(60):
            if not board.draining:
                break
            time.sleep(0.5)
        assert not board.draining
        page = httpx.get(srv.url + "/", timeout=30, trust_env=False)
        assert page.status_code == 200 and "a test" in page.text
        assert httpx.get(srv.url + "/v1/flywheel", trust_env=False).json()["swaps_in_process"] == 1
        exp = httpx.get(srv.url + "/v1/experiment", timeout=30, trust_env=False).json()
        assert exp["experiment"] == "round-07" and exp["flywheel"]["waiting_for"] == ["a test"]
        assert httpx.get(srv.url + "/healthz", trust_env=False).json()["pid"] == os.getpid()
    answered = load.done + [
        {"rid": r.headers["x-request-id"], "status": r.status_code} for r in [first, second, *fresh]
    ]
    failed = [d for d in answered if d["status"] != 200]
    assert not failed, failed[:3]
    logged_a, logged_b = {r["request_id"]: r for r in records(a_dir)}, {r["request_id"]: r for r in records(b_dir)}
    assert not set(logged_a) & set(logged_b)
    missing = [d["rid"] for d in answered if d["rid"] not in logged_a and d["rid"] not in logged_b]
    assert not missing, f"{len(missing)} answered requests are in no log"
    turn2 = logged_a[second.headers["x-request-id"]]
    assert turn2["conversation_id"] == first.headers["x-hermes-conversation"] and turn2["arm"] == "baseline"
    assert turn2["turn"] == 1
    new_b = [logged_b[r.headers["x-request-id"]] for r in fresh]
    assert {r["arm"] for r in new_b} <= {"baseline", "candidate"} and all(r["turn"] == 0 for r in new_b)
    assert any(r["arm"] == "candidate" and r["model"] == str(adapter) for r in logged_b.values())
    # after the swap no new conversation opened in the old experiment: its last first turns were in flight at the
    # switch (a record's time is its request's start, taken once its body is read)
    late = [
        r
        for r in logged_a.values()
        if r["turn"] == 0 and datetime.fromisoformat(r["timestamp"]).timestamp() > swapped + 1
    ]
    assert not late, late[:2]


VLLM_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}  # docs/gpu.md: the environment `vllm serve` runs in
TERMINAL = {"name": "terminal", "arguments": {"command": "echo hello from the fixture"}}  # the stand-in's scripted call
AGENT = {
    "messages": [{"role": "user", "content": "first line of kelo.txt?"}],
    "tools": W.tool_schema(),  # Hermes's own tool schemas
    "tool_choice": "auto",
    "temperature": 0.5,
    "max_tokens": 64,
}


@pytest.fixture(scope="module", params=["embedded", "qwen2_5", "llama3_1"])
def served(request, adapter) -> tuple[str, object]:
    """(family, the tokenizer of the model a vLLM server serves): the embedded tiny policy's, or a real family's
    (tests/families.py: its real template and special tokens, built here, nothing downloaded)."""
    if request.param == "embedded":
        from transformers import AutoTokenizer

        from hermes_lab.policy.model import build_tiny_policy

        return request.param, AutoTokenizer.from_pretrained(build_tiny_policy(str(REPO / "runs"), 0))
    from families import FAMILIES, build_tokenizer

    return request.param, build_tokenizer(FAMILIES[request.param])


def vllm_stub(tok, flags: list[str], env: dict | None = None) -> FakeOpenAI:
    """tests/fake_openai.py as `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True vllm serve base-model <flags>`."""
    return FakeOpenAI(models=("base-model",), vllm_flags=flags, env=VLLM_ENV if env is None else env, tokenizer=tok)


def calls_of(message: dict) -> list[dict]:
    return [{"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])} for c in message]


def streamed(r: httpx.Response) -> tuple[str, list[dict], str | None]:
    """(content, tool calls, finish_reason) joined from an OpenAI event stream's deltas."""
    content, calls, finish = "", {}, None
    for line in r.text.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        for ch in json.loads(line[6:]).get("choices", []):
            d = ch.get("delta") or {}
            content += d.get("content") or ""
            for tc in d.get("tool_calls") or []:
                c = calls.setdefault(tc["index"], {"name": "", "arguments": ""})
                c["name"] += (tc.get("function") or {}).get("name") or ""
                c["arguments"] += (tc.get("function") or {}).get("arguments") or ""
            finish = ch.get("finish_reason") or finish
    return content, [{"name": c["name"], "arguments": json.loads(c["arguments"])} for c in calls.values()], finish


@pytest.mark.slow
def test_swap_vllm_runtime_lora(tmp_path, adapter, served):
    """serve.lora_upstream: the new adapter goes into the vLLM server through its runtime LoRA API and the
    candidate asks for it by name; a server without runtime updating refuses, and the old experiment serves on.
    The server is a vLLM stand-in started with the flags policy.formats.vllm_flags gives for the served model
    (docs/gpu.md's table), for the embedded policy and for real families: an agent's tool request comes back as
    structured tool_calls (streamed and not), read by the parser those flags name."""
    family, tok = served
    from hermes_lab.policy import formats

    flags = formats.vllm_flags(tok)
    doc = (REPO / "docs" / "gpu.md").read_text().splitlines()
    assert f"`{' '.join(flags)}`" in next(row for row in doc if row.startswith(f"| {family} "))  # the documented row
    vllm = vllm_stub(tok, flags).start()
    off = vllm_stub(tok, flags, env={}).start()  # the same flags, without VLLM_ALLOW_RUNTIME_LORA_UPDATING
    try:
        assert vllm.loras == {} and off.loras is None
        cfg = config(**{"serve.lora_upstream": vllm.url, "serve.lora_base_model": "base-model"})
        pool = ArmPool()
        base = {a: resolve_arm(cfg, a, "embedded:tiny") for a in ("baseline", "candidate")}
        assert base["baseline"].kind == "upstream" and base["baseline"].model == "base-model"
        gw_a = Gateway(cfg, base, ratio=0.0, log_dir=tmp_path / "a", experiment="a", say=lambda m: None, pool=pool)
        board = Switchboard(gw_a, pool)
        cand = resolve_arm(cfg, "candidate", str(adapter))
        assert cand.kind == "upstream" and cand.model == "hermes-round-07" and cand.lora == str(adapter.resolve())
        specs_b = {"baseline": base["baseline"], "candidate": cand}
        with Served(board) as srv, Load(srv.url, clients=3) as load:
            time.sleep(1)
            bad = config(**{"serve.lora_upstream": off.url})
            specs_bad = {"baseline": base["baseline"], "candidate": resolve_arm(bad, "candidate", str(adapter))}
            with pytest.raises(UpstreamError, match="VLLM_ALLOW_RUNTIME_LORA_UPDATING"):
                srv.swap(lambda: Gateway(bad, specs_bad, ratio=0.5, log_dir=tmp_path / "bad", pool=pool))
            assert board.current is gw_a  # the refused swap changed nothing
            srv.swap(lambda: Gateway(cfg, specs_b, ratio=0.5, log_dir=tmp_path / "b", experiment="b", pool=pool))
            time.sleep(3)
            # an agent's request (tools, tool_choice, sampling settings) reaches vLLM as the client sent it, and
            # its answer is the model's tool call as vLLM's parser reads it: tool_calls, not text
            answers = []
            with httpx.Client(base_url=srv.url, trust_env=False, timeout=30) as h:
                for i in range(8):
                    r = h.post(
                        "/v1/chat/completions",
                        json={"model": "my-agent", **AGENT, "stream": i % 4 == 3},
                        headers={"X-Request-ID": f"tools-{i}"},
                    )
                    assert r.status_code == 200, r.text[:300]
                    answers.append(r)
        for r in answers:
            if r.headers["content-type"].startswith("text/event-stream"):
                content, got, finish = streamed(r)
            else:
                choice = r.json()["choices"][0]
                content, got, finish = (
                    choice["message"]["content"],
                    calls_of(choice["message"]["tool_calls"]),
                    choice["finish_reason"],
                )
            assert got == [TERMINAL] and finish == "tool_calls" and not content, (family, r.text[:300])
        assert vllm.loras == {"hermes-round-07": str(adapter.resolve())}
        sent = [q.body for q in vllm.requests if q.path == "/v1/chat/completions" and q.body.get("tools")]
        assert len(sent) == 8 and {b["model"] for b in sent} <= {"base-model", "hermes-round-07"}
        assert all({k: b[k] for k in AGENT} == AGENT for b in sent)  # tools passed through, untouched
        assert not [d for d in load.done if d["status"] != 200]
        logged = records(tmp_path / "a") + records(tmp_path / "b")
        assert {d["rid"] for d in load.done} <= {r["request_id"] for r in logged}
        tool_recs = [r for r in logged if str(r["request_id"]).startswith("tools-")]
        assert len(tool_recs) == 8 and all(calls_of(r["tool_calls"]) == [TERMINAL] for r in tool_recs)
        cand_recs = [r for r in records(tmp_path / "b") if r["arm"] == "candidate"]
        assert cand_recs and all(r["model"] == "hermes-round-07" for r in cand_recs)
        text_recs = [r for r in cand_recs if r["status"] == "ok" and not r["tool_calls"]]
        assert text_recs and all(r["response"].startswith("hermes-round-07: ") for r in text_recs)
        asked = {q.body["model"] for q in vllm.requests if q.path == "/v1/chat/completions"}
        assert asked == {"base-model", "hermes-round-07"}
    finally:
        vllm.stop()
        off.stop()


def _without(flags: list[str], *drop: str) -> list[str]:
    """``flags`` less the named flags (with the value of one that takes one)."""
    out, skip = [], False
    for i, f in enumerate(flags):
        if skip:
            skip = False
            continue
        if f in drop:
            skip = i + 1 < len(flags) and not flags[i + 1].startswith("--")
            continue
        out.append(f)
    return out


@pytest.mark.parametrize(
    "family, change, expect",
    [
        ("qwen2_5", ("drop", "--enable-auto-tool-choice"), "400 auto"),
        ("llama3_1", ("drop", "--enable-auto-tool-choice"), "400 auto"),
        ("qwen2_5", ("parser", "llama3_json"), "text"),  # the wrong family's parser: the call stays text
        ("llama3_1", ("parser", "hermes"), "400 parser"),  # hermes' markers are not in Llama's vocabulary
        ("qwen2_5", ("drop", "--enable-lora"), "lora"),
        ("qwen2_5", ("env", None), "no route"),
    ],
)
def test_the_vllm_stand_in_refuses_without_its_flags(tmp_path, adapter, family, change, expect):
    """The control of test_swap_vllm_runtime_lora: the same gateway against the stand-in started with one of
    vllm_flags' flags missing or wrong gets no tool_calls (a 400 naming the flag, or the call as raw text) or
    cannot load the round's adapter (a refused swap, the old experiment serving on)."""
    from hermes_lab.policy import formats

    from families import FAMILIES, build_tokenizer

    tok = build_tokenizer(FAMILIES[family])
    flags, env = formats.vllm_flags(tok), VLLM_ENV
    kind, arg = change
    if kind == "drop":
        flags = _without(flags, arg)
    elif kind == "parser":
        flags[flags.index("--tool-call-parser") + 1] = arg
    else:
        env = {}
    stub = vllm_stub(tok, flags, env).start()
    try:
        cfg = config(**{"serve.lora_upstream": stub.url, "serve.lora_base_model": "base-model"})
        pool = ArmPool()
        base = {a: resolve_arm(cfg, a, "embedded:tiny") for a in ("baseline", "candidate")}
        gw_a = Gateway(cfg, base, ratio=0.0, log_dir=tmp_path / "a", experiment="a", say=lambda m: None, pool=pool)
        board = Switchboard(gw_a, pool)
        specs_b = {"baseline": base["baseline"], "candidate": resolve_arm(cfg, "candidate", str(adapter))}
        with Served(board) as srv:
            swap = lambda: Gateway(cfg, specs_b, ratio=0.5, log_dir=tmp_path / "b", experiment="b", pool=pool)  # noqa: E731
            if expect in ("lora", "no route"):
                match = "LoRA is not enabled" if expect == "lora" else "status 404.*VLLM_ALLOW_RUNTIME_LORA_UPDATING"
                with pytest.raises(UpstreamError, match=match):
                    srv.swap(swap)
                assert board.current is gw_a and stub.loras in (None, {})
                r = httpx.post(
                    srv.url + "/v1/chat/completions", json={"model": "m", **AGENT}, trust_env=False, timeout=30
                )
                assert r.status_code == 200 and calls_of(r.json()["choices"][0]["message"]["tool_calls"]) == [TERMINAL]
                return
            r = httpx.post(srv.url + "/v1/chat/completions", json={"model": "m", **AGENT}, trust_env=False, timeout=30)
        if expect == "400 auto":
            assert r.status_code == 400 and "--enable-auto-tool-choice and --tool-call-parser" in r.text
        elif expect == "400 parser":
            assert r.status_code == 400 and "could not locate <tool_call>" in r.text
        else:  # the family's call, unread: content holding its raw text, no tool_calls, finish_reason stop
            msg = r.json()["choices"][0]
            assert r.status_code == 200 and not msg["message"].get("tool_calls") and msg["finish_reason"] == "stop"
            assert "<tool_call>" in msg["message"]["content"] and "terminal" in msg["message"]["content"]
        (rec,) = [
            x
            for x in records(tmp_path / "a")
            if x["messages"] and x["messages"][0]["content"] == "first line of kelo.txt?"
        ]
        assert not rec["tool_calls"]
    finally:
        stub.stop()


def test_the_vllm_stand_in_starts_as_vllm_serve_does(adapter):
    """vLLM's CLI checks at start: an unknown flag, a rank not in MaxLoRARanks, --enable-auto-tool-choice without
    --tool-call-parser, a --chat-template path that cannot be opened; and the runtime LoRA route's answers."""
    from families import FAMILIES, build_tokenizer

    tok = build_tokenizer(FAMILIES["qwen2_5"])
    for flags, err in [
        (["--enable-lora", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        (["--max-lora-rank", "48"], "invalid choice"),
        (["--enable-auto-tool-choice"], "requires --tool-call-parser"),
        (["--chat-template", "/nowhere/t.jinja"], "looks like a file path"),
    ]:
        with pytest.raises((ValueError, TypeError), match=err):
            vllm_stub(tok, flags)
    with pytest.raises(ValueError, match="tokenizer"):
        vllm_stub(None, ["--enable-lora"])
    assert vllm_stub(tok, ["--enable-lora"], env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}).loras == {}
    assert vllm_stub(tok, ["--enable-lora"], env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "yes"}).loras is None
    body = {"lora_name": "round-07", "lora_path": str(adapter)}  # an adapter of rank 4
    for flags, env, status, said in [
        (["--enable-lora", "--max-lora-rank", "8"], VLLM_ENV, 200, "added successfully"),
        (["--enable-lora", "--max-lora-rank", "1"], VLLM_ENV, 400, "LoRA rank 4 is greater than max_lora_rank 1."),
        (["--max-lora-rank", "8"], VLLM_ENV, 400, "LoRA is not enabled."),
        (["--enable-lora"], {}, 404, "Not Found"),
    ]:
        with vllm_stub(tok, flags, env) as stub:
            r = httpx.post(stub.url + "/v1/load_lora_adapter", json=body, trust_env=False, timeout=30)
            assert (r.status_code, said in r.text) == (status, True), (flags, env, r.text)
            assert ("round-07" in stub.models) == (status == 200)
