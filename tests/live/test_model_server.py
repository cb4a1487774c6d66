"""The gateway answers an agent as a model server does (issue 55): the context length it states and holds to, the
probes an agent makes before a session, a retry of the same messages kept in its conversation, the conversation's
id on every answer.

A real gateway (`python -m hermes_lab.live.serve` on 127.0.0.1, tests/gateway_process.py's Gateway) with the scripted
upstream of tests/fake_openai.py, or the embedded policy in-process (embedded:tiny on both arms), driven by the
openai SDK and httpx; one slow test runs the real Hermes Agent CLI (hermes-agent 0.19.0) against it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import orjson
import pytest
from gateway_process import Gateway

from fake_openai import FakeOpenAI
from repo_paths import FIXTURES, REPO

PROBES = [("GET", "/v1/props"), ("GET", "/props"), ("GET", "/api/tags"), ("POST", "/api/show")]
PROBES += [("GET", "/api/v1/models")]


def hermes_request(n_tools: int = 28) -> dict:
    """A request shaped as Hermes Agent's with its default toolsets: a ~6.7k-character system prompt, 28 tool
    schemas (~55 KB), max_tokens 65536; about 60 KB in all."""
    system = ("You are Hermes Agent, an intelligent AI assistant created by Nous Research. " * 90)[:6700]
    tools = []
    for k in range(n_tools):
        props = {
            f"arg_{j}": {"type": "string", "description": f"Argument {j} of tool {k}: " + "what it is for. " * 6}
            for j in range(9)
        }
        tools.append(
            {
                "type": "function",
                "function": {
                    "name": f"tool_{k}",
                    "description": f"Tool {k} does its one job. " * 12,
                    "parameters": {"type": "object", "properties": props, "required": ["arg_0"]},
                },
            }
        )
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": "What is in notes.txt?"}]
    return {"messages": msgs, "tools": tools, "max_tokens": 65536}


def client(gw: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="sk-unused", max_retries=0, timeout=120)


def records_of(gw: Gateway, cid: str) -> list[dict]:
    return [r for r in gw.records() if r["conversation_id"] == cid]


# -------------------------------------------------------------------------------- an upstream arm (fast)
@pytest.fixture(scope="module")
def stub():
    s = FakeOpenAI(models=("base-model", "cand-model")).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def sgw(stub, tmp_path_factory):
    """Both arms the fake upstream (two model names), half the conversations each, no rollout."""
    tmp = tmp_path_factory.mktemp("sgw")
    args = ["--ratio", "0.5", "--set", "serve.rollout=false"]
    args += ["--baseline", stub.url, "--baseline-model", "base-model"]
    args += ["--candidate", stub.url, "--candidate-model", "cand-model"]
    gw = Gateway(tmp, args).start()
    yield gw
    gw.stop()


def test_models_state_the_context_length_and_the_other_probes_404_at_once(sgw):
    with httpx.Client(base_url=sgw.url, trust_env=False, timeout=10) as http:
        models = http.get("/v1/models").json()["data"]
        assert [m["id"] for m in models] == ["hermes"] and models[0]["max_model_len"] == 65536  # serve.context_length
        one = http.get("/v1/models/hermes")
        assert one.status_code == 200 and one.json() == models[0]
        # serve.models is empty: any name is served, and its object says so
        assert http.get("/v1/models/hermes-agent-model").json()["max_model_len"] == 65536
        v = http.get("/version")
        assert v.status_code == 200 and isinstance(v.json()["version"], str)
        for method, path in PROBES:
            t0 = time.perf_counter()
            r = http.request(method, path, json={"name": "hermes"} if method == "POST" else None)
            took = time.perf_counter() - t0
            assert r.status_code == 404 and r.json()["error"]["code"] == "not_found" and took < 1, (path, r.text)
        r = http.post("/v1/models")
        assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"


def test_an_upstream_states_its_own_length_and_unknown_names_404(tmp_path):
    """An upstream arm states its server's max_model_len (the least of the two arms'); serve.models limits the
    names /v1/models/{name} answers."""
    a = FakeOpenAI(models=("base-model",), max_model_len=131072).start()
    b = FakeOpenAI(models=("cand-model",), max_model_len=100000).start()
    args = ["--ratio", "0.5", "--set", "serve.rollout=false", "--set", "serve.models=[agent-model]"]
    args += ["--baseline", a.url, "--baseline-model", "base-model", "--candidate", b.url, "--candidate-model"]
    args += ["cand-model", "--set", "serve.context_length=70000"]
    gw = Gateway(tmp_path, args).start()
    try:
        with httpx.Client(base_url=gw.url, trust_env=False, timeout=10) as http:
            models = http.get("/v1/models").json()["data"]
            assert [m["id"] for m in models] == ["hermes", "agent-model"]
            assert {m["max_model_len"] for m in models} == {100000}
            assert http.get("/v1/models/agent-model").json()["max_model_len"] == 100000
            r = http.get("/v1/models/other")
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    finally:
        gw.stop()
        a.stop()
        b.stop()


def test_every_answer_names_its_conversation_and_feedback_takes_it(sgw):
    c = client(sgw)
    msgs = [{"role": "user", "content": "Say something."}]
    raw = c.chat.completions.with_raw_response.create(model="hermes", messages=msgs)
    plain = raw.headers["x-hermes-conversation"]
    assert raw.parse().choices[0].message.content == "OK" and plain == raw.headers["x-request-id"]
    msgs2 = [{"role": "user", "content": "Say something else."}]
    with c.chat.completions.with_streaming_response.create(model="hermes", messages=msgs2, stream=True) as s:
        streamed = s.headers["x-hermes-conversation"]
        assert "".join(ch.choices[0].delta.content or "" for ch in s.parse() if ch.choices) == "OK"
    assert streamed and streamed != plain
    with httpx.Client(base_url=sgw.url, trust_env=False, timeout=10) as http:
        for cid in (plain, streamed):
            r = http.post("/v1/feedback", json={"conversation_id": cid, "reward": 4.0})
            assert r.status_code == 202 and r.json()["conversation_id"] == cid
            assert http.get(f"/v1/conversations/{cid}").json()["reward"] == 4.0


def test_a_retry_of_the_same_messages_stays_in_its_conversation_and_arm(sgw, stub, tmp_path):
    """An empty answer, then a failed one: the agent resends the same messages, and each resend is the same turn
    of the same conversation on the same arm (retry 1, 2, ...); once answered, the same messages again are a new
    conversation. A later turn's retry keeps its turn number too. logs.gateway reads one conversation of it."""
    c = client(sgw)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "retry me please"}]
    stub.configure(chat_reply="")
    try:
        first = c.chat.completions.with_raw_response.create(model="hermes", messages=msgs)
        cid, arm = first.headers["x-hermes-conversation"], first.headers["x-hermes-arm"]
        assert first.parse().choices[0].message.content == ""
        stub.configure(fail_500=1)
        with pytest.raises(openai.InternalServerError) as e:
            c.chat.completions.create(model="hermes", messages=msgs)
        assert e.value.response.headers["x-hermes-conversation"] == cid
    finally:
        stub.reset()
    third = c.chat.completions.with_raw_response.create(model="hermes", messages=msgs)
    assert third.headers["x-hermes-conversation"] == cid and third.headers["x-hermes-arm"] == arm
    answer = third.parse().choices[0].message
    # the next turn, its empty answer and its retry
    nxt = [*msgs, {"role": "assistant", "content": answer.content}, {"role": "user", "content": "and now?"}]
    stub.configure(chat_reply="   ")
    try:
        assert (
            c.chat.completions.with_raw_response.create(model="hermes", messages=nxt).headers["x-hermes-conversation"]
            == cid
        )
    finally:
        stub.reset()
    assert (
        c.chat.completions.with_raw_response.create(model="hermes", messages=nxt).headers["x-hermes-conversation"]
        == cid
    )
    # answered: the very same opening again is someone else's request
    again = c.chat.completions.with_raw_response.create(model="hermes", messages=msgs)
    assert again.headers["x-hermes-conversation"] != cid

    recs = records_of(sgw, cid)
    assert [(r["turn"], r["retry"], r["status"]) for r in recs] == [
        (0, 0, "ok"),
        (0, 1, "error"),
        (0, 2, "ok"),
        (1, 0, "ok"),
        (1, 1, "ok"),
    ]
    assert len({r["arm"] for r in recs}) == 1 and len({r["unit"] for r in recs}) == 1
    assert [r["response"].strip() for r in recs] == ["", "", "OK", "", "OK"]
    turns = sgw.http().get(f"/v1/conversations/{cid}").json()["turns"]
    assert [t["turn"] for t in turns] == [0, 0, 0, 1, 1]

    from hermes_lab.config.schema import load_config
    from hermes_lab.logs.gateway import gateway_trajectories

    gateway_trajectories(sgw.log_dir, tmp_path, load_config(None))
    lines = [json.loads(x) for x in (tmp_path / f"{sgw.log_dir.name}.conversations.jsonl").read_text().splitlines()]
    line = next(x for x in lines if x["conversation_id"] == cid)
    assert [(m["role"], m["content"]) for m in line["messages"]] == [
        ("system", "Be brief."),
        ("user", "retry me please"),
        ("assistant", "OK"),
        ("user", "and now?"),
        ("assistant", "OK"),
    ]
    assert line["meta"]["failed_turns"] == 1 and line["api_calls"] == 5


def test_a_tool_call_left_as_text_is_retried_in_its_conversation(sgw, stub):
    """An answer whose tool call the server could not read (a `<tool_call>` left in the text, no tool_calls): Hermes
    Agent resends the same messages, as after an empty answer, and the resend is that turn again. A plain text
    answer ends the retries: the same messages again are a new conversation."""
    from hermes_lab.live.conversations import empty

    broken = '<tool_call>{"name": "read_file", "arguments": {"path": "a.txt"}</tool_call>'
    assert empty({"content": broken}) and empty({"content": " "}) and empty({"content": None})
    assert not empty({"content": "the answer"}) and not empty({"content": broken, "tool_calls": [{"id": "c"}]})
    c = client(sgw)
    tools = [{"type": "function", "function": {"name": "read_file", "parameters": {"type": "object"}}}]
    msgs = [{"role": "user", "content": "read a.txt, then say its first line"}]
    stub.configure(chat_reply=broken)
    try:
        first = c.chat.completions.with_raw_response.create(model="hermes", messages=msgs, tools=tools)
        cid = first.headers["x-hermes-conversation"]
        again = c.chat.completions.with_raw_response.create(model="hermes", messages=msgs, tools=tools)
        assert again.headers["x-hermes-conversation"] == cid
    finally:
        stub.reset()
    third = c.chat.completions.with_raw_response.create(model="hermes", messages=msgs, tools=tools)
    assert third.headers["x-hermes-conversation"] == cid  # the second retry, answered with text
    fresh = c.chat.completions.with_raw_response.create(model="hermes", messages=msgs, tools=tools)
    assert fresh.headers["x-hermes-conversation"] != cid
    assert [(r["turn"], r["retry"]) for r in records_of(sgw, cid)] == [(0, 0), (0, 1), (0, 2)]


# ------------------------------------------------------------------------- the embedded policy in-process
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tiny")
    args = ["--params", str(REPO / "params/embedded.yaml"), "--ratio", "0.5", "--set", "serve.rollout=false"]
    args += ["--baseline", "embedded:tiny", "--candidate", "embedded:tiny", "--set", "serve.context_length=64000"]
    gw = Gateway(tmp, args).start(timeout=900)  # a fresh machine builds the tiny policy first
    yield gw
    gw.stop()


def test_the_byte_count_is_the_embedded_tokenizers_count():
    """The fast path of LocalArm.count_tokens: for the embedded tokenizer (byte-level, no merges) a text's tokens
    are its UTF-8 bytes, except where it holds a special token's text (those are left to the tokenizer)."""
    from hermes_lab.live.local import byte_level_specials
    from hermes_lab.policy.model import build_tokenizer

    tok = build_tokenizer()
    specials = byte_level_specials(tok)
    assert specials is not None and set(specials) >= set(tok.all_special_tokens) and "<tool_call>" in specials
    texts = ["", "plain ascii", "café, naïve, 日本語, emoji 🙂", json.dumps(hermes_request()["tools"]), "\x00\t\n"]
    for t in texts:
        assert len(tok(t, add_special_tokens=False)["input_ids"]) == len(t.encode()), t[:40]
    decomposed = "cafe\u0301"  # its normaliser (NFC) makes it café: 5 bytes, 5 tokens, not 6
    assert len(tok(decomposed, add_special_tokens=False)["input_ids"]) == 5 == len("café".encode())
    # LocalArm.count_tokens: the fast count is the tokenizer's, on a Hermes-style request with a tool call in it
    from types import SimpleNamespace

    from hermes_lab.live.local import LocalArm

    req = hermes_request()
    call = {"id": "c1", "type": "function", "function": {"name": "tool_1", "arguments": '{"arg_0": "né"}'}}
    msgs = [*req["messages"], {"role": "assistant", "content": "<tool_call>x", "tool_calls": [call]}]
    msgs.append({"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "cafe\u0301 日本"}]})
    fast = LocalArm.count_tokens(
        SimpleNamespace(policy=SimpleNamespace(tokenizer=tok), _specials=specials), msgs, req["tools"]
    )
    slow = LocalArm.count_tokens(
        SimpleNamespace(policy=SimpleNamespace(tokenizer=tok), _specials=None), msgs, req["tools"]
    )
    assert fast == slow > 55_000
    held = f"before {specials[0]} after"
    assert len(tok(held, add_special_tokens=False)["input_ids"]) < len(held.encode())  # why specials are checked


def answers(c: openai.OpenAI, n: int, **kw) -> list[str]:
    msgs = [{"role": "user", "content": "reverse kelomir"}]
    out = [
        c.chat.completions.create(model="hermes", messages=msgs, temperature=1.0, max_tokens=12, **kw) for _ in range(n)
    ]
    return [o.choices[0].message.content or "" for o in out]


def test_openai_s_seed_is_honoured_and_unseeded_requests_stay_random(tiny):
    """An in-process arm samples a request carrying OpenAI's ``seed`` with random numbers of its own: the same
    seed, the same answer, whatever else is in the batch; without one (serve.seed_from_prompt off) each draw is
    new."""
    c = client(tiny)
    assert len(set(answers(c, 5, seed=7))) == 1
    assert len(set(answers(c, 1, seed=s)[0] for s in range(8))) > 1
    assert len(set(answers(c, 8))) > 1


def test_seed_from_prompt_answers_the_same_state_alike(tmp_path):
    """serve.seed_from_prompt (validate's servers for the real agent): a request without a seed draws its random
    numbers from its prompt, so the same messages get the same answer, as two arms would on one task; a request's
    own seed still wins."""
    args = ["--params", str(REPO / "params/embedded.yaml"), "--ratio", "0", "--set", "serve.rollout=false"]
    args += ["--baseline", "embedded:tiny", "--candidate", "embedded:tiny", "--set", "serve.seed_from_prompt=true"]
    gw = Gateway(tmp_path, args).start(timeout=900)
    try:
        c = client(gw)
        assert len(set(answers(c, 4))) == 1
        assert len(set(answers(c, 1, seed=s)[0] for s in range(8))) > 1
    finally:
        gw.stop()


def test_an_over_long_conversation_is_refused_as_vllm_does_and_a_hermes_request_is_answered(tiny):
    """Over serve.context_length (64000 here): 400 context_length_exceeded with the numbers, plain or streamed,
    never a 500; a 60 KB Hermes-style request (its tool header alone longer than the tiny policy's 256 positions)
    and max_tokens 65536: answered 200, plain and streamed."""
    c = client(tiny)
    with httpx.Client(base_url=tiny.url, trust_env=False, timeout=10) as http:
        assert http.get("/v1/models").json()["data"][0]["max_model_len"] == 64000
    req = hermes_request()
    size = len(orjson.dumps(req))
    assert 55_000 < size < 65_000 and 6_500 < len(req["messages"][0]["content"]) < 7_000
    asked = sum(len(m["content"].encode()) for m in req["messages"]) + len(orjson.dumps(req["tools"]))
    assert asked < 64000
    out = c.chat.completions.create(model="hermes", **req)
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")
    with c.chat.completions.with_streaming_response.create(model="hermes", stream=True, **req) as s:
        assert s.status_code == 200 and s.headers["x-hermes-conversation"]
        assert any(ch.choices and ch.choices[0].finish_reason for ch in s.parse())

    long = [{"role": "system", "content": "é" * 20000}, {"role": "user", "content": "x" * 25000}]
    tools = req["tools"]
    m = 40000 + 25000 + len(orjson.dumps(tools))
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="hermes", messages=long, tools=tools, stream=stream, max_tokens=65536)
        err = e.value.response.json()["error"]
        assert err["code"] == "context_length_exceeded" and err["type"] == "BadRequestError" and err["param"] is None
        assert err["message"].startswith(
            f"This model's maximum context length is 64000 tokens. However, you requested {m} tokens"
        )
        assert e.value.response.headers["x-hermes-conversation"]
    recs = tiny.records()
    assert not [r for r in recs if r["http_status"] >= 500]
    assert [r["http_status"] for r in recs if r["status"] == "error"] == [400, 400]


# ------------------------------------------------------------------------------- the real Hermes Agent
@pytest.fixture(scope="module")
def hermes_bin():
    sys.path.insert(0, str(FIXTURES / "hermes"))
    import make_fixtures as mf

    try:
        py = mf.hermes_python("0.19.0")
    except (SystemExit, OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"hermes-agent 0.19.0 cannot be installed here: {e}")
    return py


def run_hermes(py: Path, gw: Gateway, home: Path, query: str) -> subprocess.CompletedProcess:
    """``hermes chat -q QUERY -Q -t terminal,file`` with HERMES_HOME ``home``, its config.yaml pointing at the
    gateway as a custom provider."""
    home.mkdir(exist_ok=True)
    model = {"default": "hermes", "provider": "custom", "base_url": gw.url + "/v1", "api_key": "sk-unused"}
    (home / "config.yaml").write_text(json.dumps({"model": model}))  # JSON is YAML
    env = {k: v for k, v in gw.env.items() if k != "PYTHONPATH"}
    env.update(HERMES_HOME=str(home), NO_COLOR="1")
    cmd = [str(py.parent / "hermes"), "chat", "-q", query, "-Q", "-t", "terminal,file"]
    return subprocess.run(cmd, cwd=home, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_the_real_hermes_agent_runs_with_the_stated_length_and_its_retries_stay_one_conversation(hermes_bin, tmp_path):
    stub = FakeOpenAI(models=("base-model", "cand-model"), agent=True).start()
    args = ["--ratio", "0.5", "--set", "serve.rollout=false"]
    args += ["--baseline", stub.url, "--baseline-model", "base-model"]
    args += ["--candidate", stub.url, "--candidate-model", "cand-model"]
    gw = Gateway(tmp_path, args).start()
    try:
        # Hermes's own resolution of the context length, from the gateway's /v1/models
        code = "import sys; from agent.model_metadata import get_model_context_length as g; print(g(*sys.argv[1:]))"
        p = subprocess.run(
            [str(hermes_bin), "-c", code, "hermes", gw.url + "/v1", "sk-unused"],
            env={**gw.env, "HERMES_HOME": str(tmp_path / "probe")},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert p.returncode == 0 and p.stdout.split()[-1] == "65536", p.stdout[-2000:] + p.stderr[-2000:]

        p = run_hermes(hermes_bin, gw, tmp_path / "home", "What does echo hello print? Use the terminal.")
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        recs = [r for r in gw.records() if r.get("tools_hash")]
        assert recs and all(r["status"] == "ok" for r in recs) and len({r["conversation_id"] for r in recs}) == 1
        assert any(r["tool_calls"] for r in recs)

        # an upstream that answers nothing: Hermes resends the same messages, each resend the same turn
        stub.configure(agent=False, chat_reply="")
        before = {r["request_id"] for r in gw.records()}
        p = run_hermes(hermes_bin, gw, tmp_path / "home2", "Say hello.")
        new = [r for r in gw.records() if r["request_id"] not in before and r.get("tools_hash")]
        assert len(new) >= 2, (len(new), p.stdout[-2000:], p.stderr[-2000:])
        assert len({r["conversation_id"] for r in new}) == 1 and len({r["arm"] for r in new}) == 1
        assert [r["retry"] for r in new] == list(range(len(new))) and {r["turn"] for r in new} == {0}
    finally:
        gw.stop()
        stub.stop()
