"""The loop's one rendering and parser (hermes_lab.policy.turn) on the tiny policy's tokenizer: the completion form,
the chat template with tools, TRL's continuation of a turn after tool results (checked against TRL's own
GRPOTrainer methods), the gateway's continuation across requests (Splicer), the OpenAI form of a parsed answer, and a
conversation cut to a context."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from hermes_lab.policy import turn
from hermes_lab.policy.model import build_tokenizer
from hermes_lab.tasks import hermes as H
from hermes_lab.tasks import workspace as W

READ = "first line of kelo.txt?"
CALL = '<tool_call>{"name": "read_file", "arguments": {"path": "kelo.txt"}}</tool_call><eos>'
SLIP = '<tool_call>{"name":"read_file","arguments":{"path":"kelo.txt"}}</tool_call><eos>'  # no spaces


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def ids_of(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_completion_form_chat_form_and_no_template(tok):
    user = [{"role": "user", "content": "up abc="}]
    assert turn.is_completion(user, None) and not turn.is_completion(user, W.tool_schema())
    assert turn.prompt_ids(tok, user, None) == ids_of(tok, "up abc=")  # the seed's string prompt, as trained
    sysuser = [{"role": "system", "content": "be brief"}, *user]
    assert turn.render_text(tok, sysuser) == "<|user|>up abc=<|assistant|>"  # no system message rendered
    q = [{"role": "user", "content": READ}]
    assert turn.render_text(tok, q, W.tool_schema()) == f"<|user|>{READ}<|assistant|>"  # nor a tool list
    assert turn.prompt_ids(tok, q, W.tool_schema()) == [
        tok.convert_tokens_to_ids("<|user|>"),
        *ids_of(tok, READ),
        tok.convert_tokens_to_ids("<|assistant|>"),
    ]  # the markers: one token each
    # the same as TRL renders an environment's tools (callables): Hermes's schemas or WorkspaceEnv's methods
    env = H.WorkspaceEnv()
    assert turn.prompt_ids(tok, q, W.tool_schema()) == turn.prompt_ids(tok, q, W.env_tools(env))
    bare = build_tokenizer()
    bare.chat_template = None  # a policy without a chat template: role lines, everywhere alike
    assert turn.render_text(bare, sysuser) == "system: be brief\nuser: up abc=\nassistant:"
    assert turn.prompt_ids(bare, sysuser) == ids_of(bare, "system: be brief\nuser: up abc=\nassistant:")
    assert turn.prompt_ids(bare, user) == ids_of(bare, "up abc=")
    msg = turn.parse(bare, ids_of(bare, '<tool_call>{"name": "read_file"}</tool_call>'), [], None, False)
    assert msg == {"role": "assistant", "content": '<tool_call>{"name": "read_file"}</tool_call>'}


def test_parse_to_openai_and_back_renders_the_same_text(tok):
    q = [{"role": "user", "content": READ}]
    tools = W.tool_schema()
    prompt = turn.prompt_ids(tok, q, tools)
    text = CALL
    msg = turn.parse(tok, ids_of(tok, text), prompt, tools, False)
    oa = turn.to_openai(msg, "req-1")
    (call,) = oa["tool_calls"]
    assert oa["content"] is None and call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "read_file", "arguments": '{"path": "kelo.txt"}'}  # JSON text, OpenAI's form
    assert call["id"] != turn.to_openai(msg, "req-2")["tool_calls"][0]["id"]
    # the client echoes it: rendered back, the conversation is the policy's own text
    echoed = turn.chat_message(oa)
    full = turn.render_text(tok, [*q, echoed], tools, generation_prompt=False)
    assert full == turn.render_text(tok, q, tools) + text
    # a string task's completion: decoded as TRL decodes a string prompt's (special tokens skipped)
    assert turn.parse(tok, ids_of(tok, "ABC<eos>"), [], None, True) == {"role": "assistant", "content": "ABC"}
    # a malformed call is text, not a call (TRL's fallback)
    bad = turn.parse(tok, ids_of(tok, '<tool_call>{"name": "read_file", </tool_call><eos>'), prompt, tools, False)
    assert "tool_calls" not in bad and "<tool_call>" in bad["content"]


def trl_self(tok, env_tools):
    """What GRPOTrainer's _tokenize_prompts and _get_tool_suffix_ids read of the trainer, for an environment."""
    return SimpleNamespace(
        processing_class=tok,
        _tokenizer=tok,
        _is_vlm=False,
        environment_factories={"WorkspaceEnv": H.WorkspaceEnv},
        _batch_environments=["WorkspaceEnv"],
        _env_tools={"WorkspaceEnv": env_tools},
        tools=env_tools,
        chat_template=None,
        chat_template_kwargs={},
    )


def test_continuation_is_trls_own(tok):
    """A turn's continuation after tool results is TRL's: its first prompt (GRPOTrainer._tokenize_prompts with an
    environment) and the tool suffix it appends (GRPOTrainer._get_tool_suffix_ids) give the same ids; with a
    canonical answer they equal a re-rendering, with a slipped one (no spaces) only the concatenation keeps the
    policy's own tokens."""
    from trl import GRPOTrainer

    env = H.WorkspaceEnv()
    env.reset(question=READ)
    tools = W.env_tools(env)
    q = [{"role": "user", "content": READ}]
    me = trl_self(tok, tools)
    (trl_first,), _, _ = GRPOTrainer._tokenize_prompts(me, [q])
    first = turn.prompt_ids(tok, q, tools)
    assert list(trl_first) == first
    result = [{"role": "tool", "name": "read_file", "content": env.read_file(path="kelo.txt")}]  # Hermes's JSON
    assert turn.tool_suffix_ids(tok, result) == GRPOTrainer._get_tool_suffix_ids(me, result)
    for text, canonical in ((CALL, True), (SLIP, False)):
        completion = ids_of(tok, text)
        nxt = turn.continue_ids(tok, first, completion, result)
        assert nxt[: len(first) + len(completion)] == first + completion
        msg = turn.parse(tok, completion, first, tools, False)
        rendered = turn.prompt_ids(tok, [*q, msg, *result], tools)
        assert (nxt == rendered) is canonical
    env._close()


def test_splicer_continues_from_its_own_tokens(tok):
    tools = W.tool_schema()
    sp = turn.Splicer(tok, max_tokens=10_000)
    q = [{"role": "user", "content": READ}]
    prompt, spliced = sp.prompt_ids(q, tools)
    assert not spliced and prompt == turn.prompt_ids(tok, q, tools)
    completion = ids_of(tok, SLIP)  # a slip
    oa = turn.to_openai(turn.parse(tok, completion, prompt, tools, False), "r1")
    sp.remember(q, tools, turn.chat_message(oa), prompt + completion)
    # the client's next request: its echo (SDK-dumped, content dropped) and the tool's result
    echo = {"role": "assistant", "tool_calls": oa["tool_calls"]}
    result = {"role": "tool", "tool_call_id": oa["tool_calls"][0]["id"], "content": '{"content": "1|bien"}'}
    nxt = [turn.chat_message(m) for m in [*q, echo, result]]
    ids, spliced = sp.prompt_ids(nxt, tools)
    assert spliced and ids == turn.continue_ids(tok, prompt, completion, [nxt[-1]])
    assert ids != turn.prompt_ids(tok, nxt, tools)  # a re-rendering would have put spaces in the policy's mouth
    # a new user turn after a text answer continues with the template's own suffix
    answer = {"role": "assistant", "content": "bien"}
    done = ids + ids_of(tok, "bien<eos>")
    sp.remember(nxt, tools, answer, done)
    more, spliced = sp.prompt_ids([*nxt, answer, {"role": "user", "content": "which file has mor?"}], tools)
    assert spliced and more == done + ids_of(tok, "<|user|>which file has mor?<|assistant|>")
    # an edited history is not the policy's: rendered whole
    edited = [{**nxt[0], "content": "first line of kelx.txt?"}, *nxt[1:]]
    assert sp.prompt_ids(edited, tools) == (turn.prompt_ids(tok, edited, tools), False)
    # bounded: old turns are forgotten beyond max_tokens
    small = turn.Splicer(tok, max_tokens=len(done))
    small.remember(q, tools, turn.chat_message(oa), prompt + completion)
    small.remember(nxt, tools, answer, done)
    assert len(small.kept) == 1 and small.tokens == len(done)


def test_fit_keeps_the_latest_context(tok):
    tools = W.tool_schema()
    earlier = [{"role": "user", "content": "You are Hermes. " * 40}, {"role": "assistant", "content": "ok"}]
    msgs = [*earlier, {"role": "user", "content": READ}]
    assert len(turn.prompt_ids(tok, msgs, tools)) > 200
    cut, truncated = turn.fit(tok, msgs, tools, 100)
    assert truncated and cut == msgs[1:] and len(turn.prompt_ids(tok, cut, tools)) <= 100
    # a system prompt is not rendered: it costs no position, so nothing is cut
    sysmsg = [{"role": "system", "content": "You are Hermes. " * 40}, msgs[-1]]
    assert turn.fit(tok, sysmsg, tools, 100) == (sysmsg, False)
    long_user = [{"role": "user", "content": "x" * 300}]
    cut, truncated = turn.fit(tok, long_user, tools, 60)
    assert truncated and len(turn.prompt_ids(tok, cut, tools)) <= 60 and cut[0]["content"].endswith("x")
    assert turn.fit(tok, msgs[2:], tools, 100) == (msgs[2:], False)


def test_chat_message_normalises_openai_and_record_messages():
    m = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "t", "arguments": '{"a": 1}'}}],
    }
    assert turn.chat_message(m)["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    bad = {**m, "tool_calls": [{"function": {"name": "t", "arguments": "not json"}}]}
    assert turn.chat_message(bad)["tool_calls"][0]["function"]["arguments"] == {"_raw": "not json"}
    parts = {
        "role": "user",
        "content": [{"type": "text", "text": "a"}, {"type": "image_url"}, {"type": "text", "text": "b"}],
    }
    assert turn.chat_message(parts) == {"role": "user", "content": "ab"}
    tool = {"role": "tool", "tool_call_id": "c1", "content": json.dumps({"x": 1})}
    assert turn.chat_message(tool) == {"role": "tool", "content": '{"x": 1}', "name": "", "tool_call_id": "c1"}
