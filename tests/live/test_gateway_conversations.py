"""The gateway for agents (issue 28): one conversation, one arm; every tool call logged; feedback and statistics
per conversation; the log through prep as whole conversations.

The tracker on its own (linking by message prefixes, explicit ids, eviction), then a real gateway
(`python -m hermes_lab.live.serve` on 127.0.0.1, both arms the scripted tool-calling upstream of
tests/fake_openai.py) driven by the openai SDK with tools: sync, async, streamed and not.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import httpx
import openai
import orjson
import pytest
from gateway_process import Gateway, formula_arm

from hermes_lab.live.conversations import Tracker, encode

from fake_openai import FakeOpenAI
from repo_paths import FIXTURES

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "terminal",
            "description": "Run a shell command",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
        },
    }
]
SYSTEM = {"role": "system", "content": "You are a careful agent. " + "Context. " * 20}


# ------------------------------------------------------------------------------------------ the tracker
def _answer(text="", calls=None):
    m = {"role": "assistant", "content": text or None}
    if calls:
        m["tool_calls"] = calls
    return m


def test_tracker_links_by_prefix_and_forgets_idle_conversations():
    tr = Tracker(idle_s=60, tool_wait_s=600, max_open=100)
    msgs = [SYSTEM, {"role": "user", "content": "list /tmp"}]
    lk = tr.link(msgs, None)
    assert lk.conv is None and lk.history == 0
    c = tr.open_new("c1", 1, False)
    tr.started(c)
    call = {"id": "call_0", "type": "function", "function": {"name": "terminal", "arguments": '{"command": "ls"}'}}
    tr.answered(c, lk.hasher, len(msgs), _answer(calls=[call]))
    # the client echoes the answer with its own id, arguments re-serialised, content "" and reasoning
    echoed = {
        "role": "assistant",
        "content": "",
        "reasoning": "thinking",
        "tool_calls": [
            {"id": "x9", "type": "function", "function": {"name": "terminal", "arguments": '{"command":"ls"}'}}
        ],
    }
    nxt = [*msgs, echoed, {"role": "tool", "tool_call_id": "x9", "content": "a b"}]
    lk2 = tr.link(nxt, None)
    assert lk2.conv is c and lk2.history == 3 and lk2.turn == 1
    assert tr.state("c1") == "waiting for tool results"
    # another agent with the same opening but a different answer is not this conversation
    other = [*msgs, _answer("I refuse"), {"role": "user", "content": "please"}]
    assert tr.link(other, None).conv is None
    # an explicit id wins; an unknown explicit id opens a new conversation
    assert tr.link([{"role": "user", "content": "hi"}], "c1").conv is c
    assert tr.link(nxt, "c2").conv is None
    # feedback closes it: the same continuation now opens a new conversation
    assert tr.close("c1") and tr.link(nxt, None).conv is None and not tr.by_key


def test_tracker_memory_is_bounded():
    tr = Tracker(idle_s=60, tool_wait_s=600, max_open=100)
    for i in range(1000):
        msgs = [{"role": "user", "content": f"task {i}"}]
        lk = tr.link(msgs, None)
        c = tr.open_new(f"c{i}", 0, False)
        tr.started(c)
        tr.answered(c, lk.hasher, 1, _answer("done"))
    tr.sweep()
    assert len(tr.open) <= 100 and len(tr.by_key) <= 100 and tr.ended >= 900
    # idle conversations end: a text answer after idle_s
    c = tr.open["c999"]
    c.last -= 61
    assert tr.get("c999") is None and tr.state("c999") == "ended"


def test_encoding_ignores_what_clients_change():
    a = {
        "role": "assistant",
        "content": " hi ",
        "tool_calls": [{"id": "1", "function": {"name": "t", "arguments": '{"b": 1, "a": 2}'}}],
    }
    b = {
        "role": "assistant",
        "content": "hi",
        "reasoning_content": "x",
        "tool_calls": [{"id": "zz", "type": "function", "function": {"name": "t", "arguments": {"a": 2, "b": 1}}}],
    }
    assert encode(a) == encode(b)
    assert encode({"role": "user", "content": "hi"}) != encode({"role": "assistant", "content": "hi"})


def _split(body: bytes):
    from hermes_lab.live.wire import ChatBody

    return ChatBody(body)


def test_raw_messages_are_parsed_once_and_link_as_parsed_ones():
    """The gateway's path for a large body (``wire.ChatBody`` slices, ``Tracker.keys``): the encodings parsed
    messages give, a history seen at the last turn not parsed again, and a client that re-serialises its history
    (other spacing, key order, escapes) still linked, its messages parsed anew. A small body is parsed whole and
    linked in one pass (``Tracker.link``), to the same digests."""
    from hermes_lab.live.wire import SMALL

    tr = Tracker(idle_s=60, tool_wait_s=600, max_open=100)
    system = {"role": "system", "content": "You are a careful agent. " * 300}  # a body past wire.SMALL
    msgs = [system, {"role": "user", "content": "list /tmp, café"}]
    req = _split(json.dumps({"model": "m", "messages": msgs, "tools": TOOLS}).encode())
    assert len(req.body) > SMALL and req.raws is not None
    keys, last, parsed = tr.keys(req.raws)
    assert keys == [encode(m) for m in msgs] and last == -1 and parsed == {0: msgs[0], 1: msgs[1]}
    lk = req.link(tr, None)
    assert lk.conv is None and lk.hasher.digest() == tr.link(msgs, None).hasher.digest()
    c = tr.open_new("c1", 1, False)
    tr.started(c)
    call = {"id": "call_0", "type": "function", "function": {"name": "terminal", "arguments": '{"command": "ls"}'}}
    tr.answered(c, lk.hasher, len(msgs), _answer(calls=[call]))
    echoed = {"role": "assistant", "content": None, "tool_calls": [{**call, "id": "x9"}]}
    nxt = [*msgs, echoed, {"role": "tool", "tool_call_id": "x9", "content": "a b"}]
    req2 = _split(json.dumps({"model": "m", "messages": nxt, "tools": TOOLS}).encode())
    req2.encode_messages(tr)
    keys2, last2, parsed2 = req2._keys
    assert sorted(parsed2) == [2, 3] and last2 == 2  # the history's two messages: looked up, not parsed
    lk2 = req2.link(tr, None)
    assert lk2.conv is c and lk2.history == 3 and req2.messages(lk2.history) == nxt[3:] and req2.messages() == nxt
    assert tr.link(nxt, None).conv is c  # parsed, the same conversation
    # the same turn written by another serialiser: every message's bytes are new, the conversation the same
    again = json.dumps({"tools": TOOLS, "messages": nxt, "model": "m"}, separators=(",", ":"), ensure_ascii=True)
    keys3, last3, parsed3 = tr.keys(_split(again.encode()).raws)
    assert sorted(parsed3) == [0, 1, 2, 3] and keys3 == keys2
    assert tr.link_keys(keys3, last3, None).conv is c
    # a small body (parsed whole) and its continuation as a large one: one conversation
    short = [{"role": "user", "content": "hi"}]
    small = _split(json.dumps({"model": "m", "messages": short}).encode())
    assert small.raws is None and small.messages() == short
    lk4 = small.link(tr, None)
    c2 = tr.open_new("c2", 0, False)
    tr.answered(c2, lk4.hasher, 1, _answer("hello"))
    grown = [*short, {"role": "assistant", "content": "hello"}, system]
    big = _split(json.dumps({"model": "m", "messages": grown}).encode())
    assert big.raws is not None and big.link(tr, None).conv is c2


def test_a_body_of_the_known_fields_splits_in_one_pass_as_in_two():
    """A body of the chat fields alone is split in one pass (``wire.FIELDS``); one with any other field in two: the
    same messages, tools and fields either way, the other field kept for the upstream, whose body is the client's
    messages and tools with the arm's model."""
    from hermes_lab.live import wire

    msgs = [{"role": "system", "content": "be careful " * 600}, {"role": "user", "content": "go", "name": "u"}]
    sent = {"model": "m", "messages": msgs, "tools": TOOLS, "temperature": 0.5, "stream": False, "top_k": 5}
    one, two = _split(json.dumps(sent).encode()), _split(json.dumps({**sent, "vendor": {"x": [1]}}).encode())
    assert set(sent) - {"messages"} <= set(wire.FIELDS) and "vendor" not in wire.FIELDS
    assert [bytes(r) for r in one.raws] == [bytes(r) for r in two.raws] and len(one.raws) == 2
    assert bytes(one.tools) == bytes(two.tools) and json.loads(bytes(one.tools)) == TOOLS
    # the upstream's body: the fields with the arm's model, the messages and tools as they came, in parts of one write
    assert orjson.loads(b"".join(one.upstream("arm"))) == {**sent, "model": "arm"}
    assert orjson.loads(b"".join(two.upstream("arm", {"stream": True}))) == {
        **sent,
        "vendor": {"x": [1]},
        "model": "arm",
        "stream": True,
    }
    assert bytes(one.raws[0]) in b"".join(one.upstream("arm"))  # the client's bytes, not re-serialised
    no_tools = _split(json.dumps({"model": "m", "messages": msgs}).encode())
    assert orjson.loads(b"".join(no_tools.upstream("arm"))) == {"model": "arm", "messages": msgs}
    assert one.messages() == two.messages() == msgs


def test_a_split_body_is_still_checked_whole(tmp_path):
    """msgspec's slices check a body's structure only: each part is checked by orjson when first seen (a top-level
    field always, a message or a tool list once), so no byte reaches the upstream or the log unchecked."""
    from hermes_lab.live.log import ToolsLog
    from hermes_lab.live.wire import BadBody

    for body, code in [
        (b"[1, 2]", "invalid_body"),
        (b'{"model": "m", "messages": [}', "invalid_json"),
        (b'{"model": "m"}', "invalid_messages"),
        (b'{"model": "m", "messages": []}', "invalid_messages"),
        (b'{"model": "m", "messages": {"role": "user"}}', "invalid_messages"),
        (b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]} trailing', "invalid_json"),
        (b'{"model": "\xff", "messages": [{"role": "user", "content": "hi"}]}', "invalid_json"),
        (b'{"model": 1e999, "messages": [{"role": "user", "content": "hi"}]}', "invalid_json"),
    ]:
        for padded in (body, body + b" " * 5000):  # parsed whole, and sliced (past wire.SMALL)
            with pytest.raises(BadBody) as e:
                _split(padded)
            assert e.value.code == code, padded
    tr = Tracker(idle_s=60, tool_wait_s=600, max_open=100)
    good = b'{"role": "user", "content": "' + b"x" * 5000 + b'"}'  # bodies past wire.SMALL: sliced
    for bad_msg in (b'{"role": "user", "content": "\xff"}', b'{"role": "user", "content": "hi", "n": 1e999}'):
        req = _split(b'{"model": "m", "messages": [' + good + b", " + bad_msg + b"]}")
        with pytest.raises(orjson.JSONDecodeError):
            req.encode_messages(tr)  # the good one is remembered, the bad one not
        with pytest.raises(orjson.JSONDecodeError):
            req.encode_messages(tr)
        small = b'{"model": "m", "messages": [' + bad_msg + b"]}"  # parsed whole: refused at once
        with pytest.raises(BadBody):
            _split(small)
    tools = ToolsLog(tmp_path)
    try:
        req = _split(b'{"model": "m", "messages": [' + good + b'], "tools": [{"name": "\xff"}]}')
        with pytest.raises(orjson.JSONDecodeError):
            tools.add_raw(req.tools)
        ok = _split(
            json.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * 5000}], "tools": TOOLS}).encode()
        )
        assert tools.add_raw(ok.tools) == tools.add(TOOLS) and tools.add_raw(None) is None
    finally:
        tools.close()
    assert [json.loads(x)["tools"] for x in (tmp_path / "tools.jsonl").read_text().splitlines()] == [TOOLS]


# ------------------------------------------------------------------------------- a gateway, the openai SDK
@pytest.fixture(scope="module")
def agent_stub():
    s = FakeOpenAI(models=("base-model", "cand-model"))
    s.agent = True
    s.start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def agw(agent_stub, tmp_path_factory):
    """Both arms the scripted tool-calling upstream (two model names), half the conversations each, no rollout."""
    tmp = tmp_path_factory.mktemp("agw")
    args = ["--ratio", "0.5", "--set", "serve.rollout=false"]
    args += ["--baseline", agent_stub.url, "--baseline-model", "base-model"]
    args += ["--candidate", agent_stub.url, "--candidate-model", "cand-model"]
    gw = Gateway(tmp, args).start()
    yield gw
    gw.stop()


def _tool_result(call) -> dict:
    return {"role": "tool", "tool_call_id": call.id, "content": f"ran {json.loads(call.function.arguments)['command']}"}


def run_sync(client: openai.OpenAI, task: str, stream: bool) -> list[tuple[str, str, str]]:
    """An agent loop on the SDK: (request id, conversation id, arm) per turn, until a text answer."""
    msgs: list = [SYSTEM, {"role": "user", "content": task}]
    seen = []
    for _ in range(4):
        kw = {"model": "my-own-model-name", "messages": msgs, "tools": TOOLS}
        if stream:
            raw = client.chat.completions.with_raw_response.create(**kw, stream=True)
            calls: dict[int, dict] = {}
            text = ""
            for ch in raw.parse():
                d = ch.choices[0].delta if ch.choices else None
                if d is None:
                    continue
                text += d.content or ""
                for tc in d.tool_calls or []:
                    c = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                    c["id"] = tc.id or c["id"]
                    c["name"] = (tc.function.name if tc.function else None) or c["name"]
                    c["arguments"] += (tc.function.arguments if tc.function else None) or ""
            tool_calls = [
                {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                for _, c in sorted(calls.items())
            ]
            msg = {"role": "assistant", "content": text, **({"tool_calls": tool_calls} if tool_calls else {})}
            results = [
                {
                    "role": "tool",
                    "tool_call_id": c["id"],
                    "content": f"ran {json.loads(c['function']['arguments'])['command']}",
                }
                for c in tool_calls
            ]
        else:
            raw = client.chat.completions.with_raw_response.create(**kw)
            m = raw.parse().choices[0].message
            msg = m.model_dump(exclude_none=True)  # as an SDK agent appends it
            results = [_tool_result(c) for c in m.tool_calls or []]
        h = raw.headers
        seen.append((h["x-request-id"], h["x-hermes-conversation"], h["x-hermes-arm"]))
        msgs += [msg, *results]
        if not results:
            return seen
    raise AssertionError("the scripted model never answered in text")


async def run_async(client: openai.AsyncOpenAI, task: str) -> list[tuple[str, str, str]]:
    msgs: list = [SYSTEM, {"role": "user", "content": task}]
    seen = []
    for _ in range(4):
        raw = await client.chat.completions.with_raw_response.create(
            model="hermes", messages=msgs, tools=TOOLS, metadata={"task_id": "async-task"}
        )
        m = raw.parse().choices[0].message
        seen.append((raw.headers["x-request-id"], raw.headers["x-hermes-conversation"], raw.headers["x-hermes-arm"]))
        msgs += [m.model_dump(exclude_none=True), *[_tool_result(c) for c in m.tool_calls or []]]
        if not m.tool_calls:
            return seen
    raise AssertionError("the scripted model never answered in text")


@pytest.mark.slow
def test_sdk_conversations_one_arm_every_tool_call_logged(agw, tmp_path):
    client = openai.OpenAI(base_url=agw.url + "/v1", api_key="unused", max_retries=0)
    convs = [run_sync(client, f"sync task {i}: list the files", stream=False) for i in range(6)]
    convs += [run_sync(client, f"streamed task {i}: list the files", stream=True) for i in range(6)]

    async def many():
        ac = openai.AsyncOpenAI(base_url=agw.url + "/v1", api_key="unused", max_retries=0)
        return await asyncio.gather(*[run_async(ac, f"async task {i}: list the files") for i in range(6)])

    convs += asyncio.run(many())
    for turns in convs:  # one conversation, one arm: the md5 bucket of its id (its first request id)
        assert len(turns) == 2
        assert len({c for _, c, _ in turns}) == 1 and len({a for _, _, a in turns}) == 1
        assert turns[0][1] == turns[0][0] and turns[0][2] == formula_arm(turns[0][1], 0.5)
    assert len({t[0][1] for t in convs}) == 18 and {t[0][2] for t in convs} == {"baseline", "candidate"}
    recs = agw.records()
    by_conv: dict[str, list] = {}
    for r in recs:
        by_conv.setdefault(r["conversation_id"], []).append(r)
    assert len(by_conv) == 18
    for rs in by_conv.values():
        first, second = sorted(rs, key=lambda r: r["turn"])
        assert (first["turn"], second["turn"], first["history"], second["history"]) == (0, 1, 0, 3)
        assert [m["role"] for m in first["messages"]] == ["system", "user"]
        assert [m["role"] for m in second["messages"]] == ["tool"]  # only the new message, not the history
        call = first["tool_calls"][0]  # assembled from the stream's deltas too
        assert call["function"] == {"name": "terminal", "arguments": '{"command": "echo hello from the fixture"}'}
        assert call["id"] and first["finish_reason"] == "tool_calls" and first["reasoning"]
        assert second["response"].startswith("Done. The tools returned: ran echo hello")
        assert first["usage"]["total_tokens"] > 0 and second["usage"]["total_tokens"] > 0
        assert first["tools_hash"] == second["tools_hash"] and first["requested_model"] in (
            "my-own-model-name",
            "hermes",
        )
    tools = [json.loads(x) for x in (agw.log_dir / "tools.jsonl").read_text().splitlines()]
    assert len(tools) == 1 and tools[0]["tools"] == TOOLS  # once, not per request

    # feedback by the second turn's request id scores the whole conversation
    http = httpx.Client(base_url=agw.url, trust_env=False, timeout=30)
    scored = convs[:4]
    for k, turns in enumerate(scored):
        r = http.post("/v1/feedback", json={"request_id": turns[1][0], "reward": float(k + 1)})
        assert r.status_code == 202 and r.json()["conversation_id"] == turns[0][1]
    got = http.get(f"/v1/conversations/{scored[0][0][1]}").json()
    assert (
        got["reward"] == 1.0
        and got["state"] == "scored"
        and [t["request_id"] for t in got["turns"]]
        == [
            scored[0][0][0],
            scored[0][1][0],
        ]
    )
    assert http.get(f"/v1/conversations/{scored[0][1][0]}").json()["conversation_id"] == scored[0][0][1]
    assert http.get(f"/v1/conversations/{convs[-1][0][1]}").json()["state"] == "open"
    assert http.get("/v1/conversations/nope").status_code == 404
    assert http.post("/v1/feedback", json={"conversation_id": "nope", "reward": 1}).status_code == 404
    ex = http.get("/v1/experiment").json()
    st = ex["conversations"]
    assert st["baseline"]["conversations"] + st["candidate"]["conversations"] == 18
    for a in ("baseline", "candidate"):
        assert st[a]["turns_per_conversation"] == 2.0 and st[a]["tool_call_rate"] == 0.5
        assert st[a]["tool_calls"] == st[a]["conversations"] and st[a]["tokens"] > 0
    assert sum(st[a]["rewarded_conversations"] for a in st) == 4
    assert ex["feedback"]["baseline"] + ex["feedback"]["candidate"] == 4  # conversations, not turns

    # prep: one canonical record per conversation, never turn fragments
    from hermes_lab.config.schema import load_config
    from hermes_lab.prep.run import run_prep

    cfg = load_config(None, {"data.min_samples": 1, "data.max_bad_fraction": 1.0})
    res = run_prep([agw.log_dir], tmp_path / "prep", cfg, make_plots=False)
    g = res.summary["gateway"][str(agw.log_dir)]
    assert (g["conversations"], g["conversation_turns"], g["with_feedback"], g["answered"]) == (18, 36, 4, 0)
    rows = [json.loads(x) for x in (tmp_path / "prep" / "accepted.jsonl").read_text().splitlines()]
    assert len(rows) == 18 and {r["conversation_id"] for r in rows} == set(by_conv)
    for r in rows:
        assert [m["role"] for m in r["messages"]] == ["system", "user", "assistant", "tool", "assistant"]
        assert r["messages"][2]["tool_calls"][0]["function"]["name"] == "terminal" and r["tools"] == TOOLS
        assert r["outcome"]["completed"] and r["outcome"]["tool_calls"] == 1
        assert len(r["meta"]["turns"]) == 2 and r["meta"]["arm"] in ("baseline", "candidate")
        assert all(t["latency_ms"] is not None and t["usage"] for t in r["meta"]["turns"])
    fb = {r["conversation_id"]: r for r in rows if r["reward_source"] == "feedback:system"}
    assert {fb[t[0][1]]["reward"] for t in scored} == {1.0, 2.0, 3.0, 4.0}
    assert sum(r["reward_source"] == "outcome" for r in rows) == 14


# ------------------------------------------------------------------------------ the real Hermes Agent
HERMES_DRIVER = r"""
import json, sys
from run_agent import AIAgent

base_url, model, key = sys.argv[1:4]
toolsets = (sys.argv[5] if len(sys.argv) > 5 else "terminal").split(",")
turns = int(sys.argv[6]) if len(sys.argv) > 6 else 6
out = []
for q in json.loads(sys.argv[4]):
    a = AIAgent(base_url=base_url, model=model, api_key=key, max_iterations=turns, enabled_toolsets=toolsets,
                quiet_mode=True, platform="cli")
    r = a.run_conversation(q)
    out.append(r["messages"])
    a.close()
print("MESSAGES " + json.dumps(out))
"""
HERMES_QUERIES = [
    "What does echo hello print? Use the terminal.",
    "Check two things at once: the year and the kernel name.",
    "Start a background listing and tell me what the process tool says.",
    "Which kernel release is this machine running?",
]


@pytest.fixture(scope="module")
def hermes_py():
    """hermes-agent 0.19.0 in its own cached virtualenv (tests/fixtures/hermes/make_fixtures.py's)."""
    sys.path.insert(0, str(FIXTURES / "hermes"))
    import make_fixtures as mf

    try:
        py = mf.hermes_python("0.19.0")
    except (SystemExit, OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"hermes-agent 0.19.0 cannot be installed here: {e}")
    return py, mf


@pytest.mark.slow
def test_real_hermes_agent_through_the_gateway(hermes_py, tmp_path):
    """Hermes Agent (streams, sends tools, no ids) pointed at `hermes-lab serve` under its own model name: each
    conversation on one arm, every tool call it made in the log, feedback by one request id each, prep whole."""
    py, mf = hermes_py
    stub = FakeOpenAI(models=("base-model", "cand-model"))
    stub.agent, stub.plans = True, {k: list(v) for k, v in mf.PLANS.items()}
    stub.start()
    args = ["--ratio", "0.5", "--set", "serve.rollout=false"]
    args += ["--baseline", stub.url, "--baseline-model", "base-model"]
    args += ["--candidate", stub.url, "--candidate-model", "cand-model"]
    gw = Gateway(tmp_path, args).start()
    try:
        home = tmp_path / "home"
        home.mkdir()
        env = {k: v for k, v in gw.env.items() if k != "PYTHONPATH"}
        env.update(HERMES_HOME=str(home), NO_COLOR="1", OPENAI_API_KEY="sk-unused")
        p = subprocess.run(
            [
                str(py),
                "-c",
                HERMES_DRIVER,
                gw.url + "/v1",
                "hermes-agent-model",
                "sk-unused",
                json.dumps(HERMES_QUERIES),
            ],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        agent_convs = json.loads(p.stdout.split("MESSAGES ", 1)[1].splitlines()[0])
        recs = [r for r in gw.records() if r.get("tools_hash")]  # the agent's conversations (tools offered)
        by_conv: dict[str, list] = {}
        for r in recs:
            by_conv.setdefault(r["conversation_id"], []).append(r)
        assert len(by_conv) == len(HERMES_QUERIES), {c: len(v) for c, v in by_conv.items()}
        for rs in by_conv.values():
            assert len({r["arm"] for r in rs}) == 1 and [r["turn"] for r in rs] == list(range(len(rs)))
            assert all(r["stream"] for r in rs) and rs[0]["requested_model"] == "hermes-agent-model"
        # every tool call the agent received is in the log, whole (id, name, arguments)
        made = {
            (c["id"], c["function"]["name"], c["function"]["arguments"])
            for msgs in agent_convs
            for m in msgs
            if m.get("role") == "assistant"
            for c in m.get("tool_calls") or []
        }
        logged = {
            (c["id"], c["function"]["name"], c["function"]["arguments"]) for r in recs for c in r["tool_calls"] or []
        }
        assert made and made == logged
        # feedback by one request id of each conversation (its last turn's) scores the whole conversation
        http = httpx.Client(base_url=gw.url, trust_env=False, timeout=30)
        for k, rs in enumerate(by_conv.values()):
            r = http.post("/v1/feedback", json={"request_id": rs[-1]["request_id"], "reward": float(k + 1)})
            assert r.status_code == 202 and r.json()["conversation_id"] == rs[0]["conversation_id"]
        st = http.get("/v1/experiment").json()["conversations"]
        assert sum(st[a]["rewarded_conversations"] for a in st) == len(HERMES_QUERIES)
    finally:
        gw.stop()
        stub.stop()
    from hermes_lab.config.schema import load_config
    from hermes_lab.prep.run import run_prep

    cfg = load_config(None, {"data.min_samples": 1, "data.max_bad_fraction": 1.0})
    run_prep([gw.log_dir], tmp_path / "prep", cfg, make_plots=False)
    rows = [json.loads(x) for x in (tmp_path / "prep" / "accepted.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["conversation_id"] in by_conv]
    assert len(rows) == len(HERMES_QUERIES) and all(r["reward_source"] == "feedback:system" for r in rows)
    for r in rows:  # the whole conversation: as many assistant messages as turns, every result after its call
        assert r["outcome"]["turns"] == len(by_conv[r["conversation_id"]]) and r["outcome"]["unanswered_calls"] == 0
        assert r["tools"] and r["outcome"]["tool_calls"] >= 1


def test_explicit_ids_and_accepted_model_names(agent_stub, tmp_path):
    """serve.models limits the names (others: 404 naming them); an X-Hermes-Conversation header or
    metadata.conversation_id joins requests whose messages share no prefix."""
    params = tmp_path / "p.yaml"
    params.write_text("serve:\n  models: [agent-model]\n  rollout: false\n")
    args = ["--params", str(params), "--ratio", "0.5"]
    args += ["--baseline", agent_stub.url, "--baseline-model", "base-model"]
    args += ["--candidate", agent_stub.url, "--candidate-model", "cand-model"]
    gw = Gateway(tmp_path, args).start()
    try:
        h = httpx.Client(base_url=gw.url, trust_env=False, timeout=30)
        assert [m["id"] for m in h.get("/v1/models").json()["data"]] == ["hermes", "agent-model"]
        ask = {"messages": [{"role": "user", "content": "hi"}]}
        solo = h.post("/v1/chat/completions", json={**ask, "model": "agent-model"})
        assert solo.status_code == 200 and solo.headers["x-hermes-conversation"] == solo.headers["x-request-id"]
        no = h.post("/v1/chat/completions", json={**ask, "model": "gpt-4o"})
        assert no.status_code == 404 and "agent-model" in no.json()["error"]["message"]
        a = h.post("/v1/chat/completions", json={**ask, "model": "hermes"}, headers={"X-Hermes-Conversation": "run-7"})
        b = h.post(
            "/v1/chat/completions",
            json={
                "model": "hermes",
                "messages": [{"role": "user", "content": "next"}],
                "metadata": {"conversation_id": "run-7"},
            },
        )
        assert a.headers["x-hermes-conversation"] == b.headers["x-hermes-conversation"] == "run-7"
        assert a.headers["x-hermes-arm"] == b.headers["x-hermes-arm"] == formula_arm("run-7", 0.5)
        bad = h.post("/v1/chat/completions", json=ask | {"model": "hermes"}, headers={"X-Hermes-Conversation": "a b"})
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "bad_conversation_id"
        turns = [(r["turn"], r["history"]) for r in gw.records() if r["conversation_id"] == "run-7"]
        assert turns == [(0, 0), (1, 0)]  # named: joined, its messages logged whole (no proven prefix)
        r = h.post(
            "/v1/feedback", json={"conversation_id": "run-7", "reward": 3, "request_id": b.headers["x-request-id"]}
        )
        assert r.status_code == 202
        mismatch = {"conversation_id": "run-7", "reward": 3, "request_id": solo.headers["x-request-id"]}
        assert h.post("/v1/feedback", json=mismatch).json()["error"]["code"] == "conversation_mismatch"
        assert h.get("/v1/conversations/run-7").json()["reward"] == 3.0
    finally:
        gw.stop()


def _inproc(agent_stub, tmp_path):
    """A Gateway object in this process (both arms the scripted upstream) and a way to ask it."""
    from hermes_lab.config.schema import load_config
    from hermes_lab.live.arms import resolve_arm
    from hermes_lab.live.gateway import Gateway as G

    cfg = load_config(None, {"serve.rollout": False, "round.runs_dir": str(tmp_path / "runs")})
    specs = {
        "baseline": resolve_arm(cfg, "baseline", agent_stub.url, "base-model", ""),
        "candidate": resolve_arm(cfg, "candidate", agent_stub.url, "cand-model", ""),
    }

    def make():
        return G(cfg, specs, ratio=0.5, log_dir=tmp_path / "log", say=lambda *a: None)

    async def ask(gw, messages, cid=None):
        body = json.dumps({"model": "x", "messages": messages, "tools": TOOLS}).encode()

        async def receive():
            return {"type": "http.request", "body": body, "more_body": False}

        hdr = {b"x-hermes-conversation": cid.encode()} if cid else {}
        r = await gw.chat(hdr, receive)
        return dict(r.raw_headers), json.loads(r.body)

    return make, ask


def test_a_restarted_gateway_continues_open_conversations(agent_stub, tmp_path):
    make, ask = _inproc(agent_stub, tmp_path)

    async def go():
        gw = make()
        await gw.startup()
        msgs = [{"role": "user", "content": "inspect"}]
        h1, a1 = await ask(gw, msgs)
        await gw.shutdown()
        msg = a1["choices"][0]["message"]
        msgs += [msg, {"role": "tool", "tool_call_id": msg["tool_calls"][0]["id"], "content": "ok"}]
        gw2 = make()  # the tracker rebuilt from the log
        await gw2.startup()
        try:
            h2, _ = await ask(gw2, msgs)
        finally:
            await gw2.shutdown()
        return h1, h2

    h1, h2 = asyncio.run(go())
    assert h2[b"x-hermes-conversation"] == h1[b"x-hermes-conversation"] and h2[b"x-hermes-arm"] == h1[b"x-hermes-arm"]
    recs = [json.loads(x) for x in (tmp_path / "log" / "requests.jsonl").read_text().splitlines()]
    assert [(r["turn"], r["history"], len(r["messages"])) for r in recs] == [(0, 0, 1), (1, 2, 1)]


def test_roll_back_switches_running_candidate_conversations(agent_stub, tmp_path):
    """In process: a candidate conversation's next turn goes to the baseline once the share is 0 (a roll back),
    marked switched."""
    make, ask = _inproc(agent_stub, tmp_path)
    cid = next(f"c-{i}" for i in range(100) if formula_arm(f"c-{i}", 0.5) == "candidate")

    async def go():
        gw = make()
        await gw.startup()
        try:
            msgs = [{"role": "user", "content": "inspect"}]
            h1, a1 = await ask(gw, msgs, cid)
            assert h1[b"x-hermes-arm"] == b"candidate"
            msg = a1["choices"][0]["message"]
            msgs += [msg, {"role": "tool", "tool_call_id": msg["tool_calls"][0]["id"], "content": "ok"}]
            gw.ratio = 0.0  # what the rollout's roll back sets
            h2, _ = await ask(gw, msgs)  # linked by prefix, no id
            assert h2[b"x-hermes-arm"] == b"baseline" and h2[b"x-hermes-conversation"] == cid.encode()
        finally:
            await gw.shutdown()

    asyncio.run(go())
    recs = [json.loads(x) for x in (tmp_path / "log" / "requests.jsonl").read_text().splitlines()]
    assert [(r["arm"], r["switched"], r["turn"]) for r in recs] == [("candidate", False, 0), ("baseline", True, 1)]


def test_the_upstream_gets_the_clients_body_and_a_bad_history_is_refused(agent_stub, tmp_path):
    """In process: what the upstream receives is the client's body with the arm's model (the messages and tools
    the client's own bytes, every other field as sent); a turn whose new message is not valid JSON is a 400
    that is not logged, and the conversation goes on with the next good turn."""
    make, _ = _inproc(agent_stub, tmp_path)

    async def post(gw, body: bytes):
        async def receive():
            return {"type": "http.request", "body": body, "more_body": False}

        r = await gw.chat({}, receive)
        return r.status_code, json.loads(r.body)

    async def go():
        gw = make()
        await gw.startup()
        try:
            msgs = [SYSTEM, {"role": "user", "content": "inspect, naïvely"}]
            sent = {"model": "x", "messages": msgs, "tools": TOOLS, "temperature": 0.25, "vendor_extra": {"k": [1]}}
            n0 = agent_stub.count()
            status, a1 = await post(gw, json.dumps(sent, indent=1).encode())
            assert status == 200
            got = agent_stub.requests[n0].body
            assert got == {**sent, "model": got["model"]} and got["model"] in ("base-model", "cand-model")
            msg = a1["choices"][0]["message"]
            history = json.dumps([*msgs, msg])[:-1].encode()
            bad = history + b', {"role": "tool", "tool_call_id": "1", "content": "\xff"}]'
            status, err = await post(gw, b'{"model": "x", "messages": ' + bad + b"}")
            assert status == 400 and err["error"]["code"] == "invalid_json"
            nxt = [*msgs, msg, {"role": "tool", "tool_call_id": msg["tool_calls"][0]["id"], "content": "ok"}]
            status, _ = await post(gw, json.dumps({"model": "x", "messages": nxt, "tools": TOOLS}).encode())
            assert status == 200
        finally:
            await gw.shutdown()

    asyncio.run(go())
    recs = [json.loads(x) for x in (tmp_path / "log" / "requests.jsonl").read_text().splitlines()]
    assert [(r["turn"], r["history"], len(r["messages"])) for r in recs] == [(0, 0, 2), (1, 3, 1)]
    assert recs[0]["conversation_id"] == recs[1]["conversation_id"]
