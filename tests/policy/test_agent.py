"""The embedded agent family (``hermes``: workspace tasks on the Hermes Agent's own tools): the tiny policy's chat
template with Hermes-style tool calls, its environment (``WorkspaceEnv``), episodes played as TRL plays them, and
episode-level GRPO with TRL's environment_factory on the tiny policy. The ``time`` family's module (``TimeEnv``, kept
as a minimal example environment) is tested on its own below."""

from __future__ import annotations

import json
import random

import pytest

from hermes_lab.policy.chat import MARKERS, TOOL_CHARS, add_chat_template, assistant_spans
from hermes_lab.policy.model import HERMES_EVAL, build_tokenizer
from hermes_lab.tasks import agent as A
from hermes_lab.tasks import hermes as H
from hermes_lab.tasks import workspace as W

from repo_paths import REPO

READ = "first line of kelo.txt?"
CALL = '<tool_call>{"name": "read_file", "arguments": {"path": "kelo.txt"}}</tool_call><eos>'
# the hermes family in build.json (70 held-out tasks): v12 greedy 44%, sampled 27% (it never copied from a tool's
# result); v13 greedy 81%, sampled 56%. The floors leave room for a build that learns the copy later than these did
GREEDY_MIN, HEADROOM = 0.25, 0.08


def _tok():
    return add_chat_template(build_tokenizer())


def _env(question=READ):
    env = H.WorkspaceEnv()
    env.reset(question=question)
    return env, W.env_tools(env)


def test_chat_template_passes_trls_tool_checks_and_parses_back():
    from trl.chat_template_utils import is_chat_template_prefix_preserving, parse_response, supports_tool_calling

    tok = _tok()
    assert supports_tool_calling(tok)
    assert is_chat_template_prefix_preserving(tok)  # what TRL's multi-turn loop needs
    env, tools = _env()
    user = [{"role": "user", "content": READ}]
    prompt = tok.apply_chat_template(user, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False)
    # no system message and no tool list rendered; each marker one token
    assert tok.decode(prompt) == f"<|user|>{READ}<|assistant|>"
    assert all(len(tok(m, add_special_tokens=False)["input_ids"]) == 1 for m in MARKERS)
    assert len(prompt) == len(READ) + 2
    system = [{"role": "system", "content": "You are Hermes."}, *user]
    assert tok.apply_chat_template(system, tools=tools, add_generation_prompt=True, tokenize=False) == tok.decode(
        prompt
    )
    msg = parse_response(tok, tok(CALL, add_special_tokens=False)["input_ids"], prefix=prompt, tools=tools)
    assert msg["tool_calls"] == [
        {"type": "function", "function": {"name": "read_file", "arguments": {"path": "kelo.txt"}}}
    ]
    answer = parse_response(tok, tok("bien<eos>", add_special_tokens=False)["input_ids"], prefix=prompt)
    assert answer == {"role": "assistant", "content": "bien"}
    broken = tok(
        '<tool_call>{"name": "read_file", "arguments": {"path": "kelo.txt"}</tool_call><eos>', add_special_tokens=False
    )["input_ids"]
    assert "tool_calls" not in parse_response(tok, broken, prefix=prompt)  # invalid JSON: plain text, no call
    # a tool result is cut to its head; the arguments of a call render with sorted keys (as the teacher's do)
    result = env.read_file(path="kelo.txt")
    assert len(result) > TOOL_CHARS
    call = {"type": "function", "function": {"name": "write_file", "arguments": {"path": "a.txt", "content": "x"}}}
    convo = [*user, {"role": "assistant", "content": "", "tool_calls": [call]}, {"role": "tool", "content": result}]
    text = tok.apply_chat_template(convo, tools=tools, add_generation_prompt=True, tokenize=False)
    assert text.endswith(f"<|tool|>{result[:TOOL_CHARS]}<|assistant|>")
    assert '{"name": "write_file", "arguments": {"content": "x", "path": "a.txt"}}' in text
    env._close()


def test_a_slipped_tool_call_is_read_as_trl_reads_it_and_the_next_turn_renders():
    """A trained policy's slips (a call without arguments, without a name, not an object): each turn is what TRL's
    loop would make of it, and the conversation with it renders again (a call the template cannot render once
    ended a round's A/B)."""
    from hermes_lab.policy import turn

    tok, (env, tools) = _tok(), _env()
    user = [{"role": "user", "content": READ}]
    prompt = tok.apply_chat_template(user, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False)
    seen = {}
    for text in (
        '{"name": "read_file"}',
        '{"name": "read_file", "arguments": null}',
        '{"arguments": {"path": "kelo.txt"}}',
        "[1, 2]",
    ):
        ids = tok(f"<tool_call>{text}</tool_call><eos>", add_special_tokens=False)["input_ids"]
        msg = turn.parse(tok, ids, prompt, tools, completion_form=False)
        seen[text] = msg.get("tool_calls")
        convo = [*user, msg, {"role": "tool", "name": "read_file", "content": '{"error": "x"}'}]
        assert tok.apply_chat_template(convo, tools=tools, add_generation_prompt=True, tokenize=False)
    call = [{"type": "function", "function": {"name": "read_file", "arguments": {}}}]
    assert seen['{"name": "read_file"}'] == seen['{"name": "read_file", "arguments": null}'] == call  # no arguments
    assert seen['{"arguments": {"path": "kelo.txt"}}'] is None and seen["[1, 2]"] is None  # no name: text, not a call
    env._close()


def test_teacher_episodes_train_only_the_assistant_turns():
    tok = _tok()
    rng = random.Random(3)
    lengths, tools = set(), set()
    for _ in range(80):
        conv = H.teacher_conversation(rng, noise=0.65)
        pieces = assistant_spans(tok, conv, None)  # as the build renders them: no tool list
        trained = "".join(t for t, on in pieces if on)
        context = "".join(t for t, on in pieces if not on)
        assert "<|user|>" in context and "<|user|>" not in trained
        assert "<|tool|>" not in trained and "<|assistant|>" not in trained
        assert trained.endswith("<eos>")
        rendered = tok.apply_chat_template(conv, tokenize=False)
        assert "".join(t for t, _ in pieces) == rendered  # the pieces are exactly the template's text
        assert len(tok(rendered, add_special_tokens=False)["input_ids"]) <= 320  # PACK_WIDTH: an episode fits a row
        lengths.add(len(conv))
        tools |= {c["function"]["name"] for m in conv for c in m.get("tool_calls") or []}
    assert lengths == {2, 4, 6}  # slipped (no call, broken call), one-call and two-step episodes all occur
    assert tools == set(H.TOOLS)  # every Hermes tool the family uses is taught


def test_workspace_env_plays_a_task_on_hermess_tools_and_scores_the_end_state():
    env = H.WorkspaceEnv(seed=1)
    env.reset(prompt=[{"role": "user", "content": "write mor to kelo.txt"}])
    assert env._hermes_score("done") == 0.0  # nothing written yet: a claim is not paid
    assert json.loads(env.write_file(path="kelo.txt", content="mox"))["bytes_written"] == 3
    assert 0 < env._hermes_score("done") < 3  # a near miss: partial credit, not a success
    env.write_file(path="kelo.txt", content="mor")
    assert env._hermes_score("done") == H.SCALE and env.calls == 2 and env.errors == 0
    assert "error" in json.loads(env.read_file(path="../outside.txt"))  # confined to its workspace
    assert env.errors == 1
    root = env.workspace
    env.reset(question=READ)  # a fresh workspace per episode, the old one removed
    assert env.workspace != root and not root.exists()
    assert (env.workspace / "kelo.txt").read_text() == H.parse_question(READ).files["kelo.txt"]
    with pytest.raises(ValueError, match="not a hermes task"):
        env.reset(prompt=[{"role": "user", "content": "hello"}])
    env._close()


def test_time_env_tool_error_and_scores():
    env = A.TimeEnv(seed=1)
    env.reset(city="kelo", episode_seed=0)
    assert env._hermes_score("12:00") == 0.0  # no call yet: a guess scores nothing
    with pytest.raises(ValueError, match=A.ERROR):
        env.time(city="kelx")
    value = env.time(city="kelo")
    assert env.errors == 1 and env.good_calls == 1
    assert env._hermes_score(value) == A.SCALE
    assert 0 < env._hermes_score(value + ".") < 3  # a format slip: partial credit, not a success
    env.reset(prompt=[{"role": "user", "content": "time abc?"}])
    assert env.city == "abc"
    with pytest.raises(ValueError, match="not an agent question"):
        env.reset(prompt=[{"role": "user", "content": "hello"}])


def test_held_out_tasks_never_train():
    for fam in (H, A):
        train = {t.question for t in fam.generate_tasks(300, "train")}
        held = {t.question for t in fam.generate_tasks(100, "heldout")}
        assert len(train) > 250 and len(held) > 90 and not train & held
    assert A.parse_question("time kelo?").city == "kelo" and A.parse_question("up abc=") is None
    assert H.parse_question(READ).kind == "read" and H.parse_question("time kelo?") is None


@pytest.fixture(scope="module")
def tiny_policy():
    from hermes_lab.policy.model import build_tiny_policy

    return build_tiny_policy(REPO / "runs", 0, quiet=True)


@pytest.mark.slow
def test_built_policy_knows_the_agent_task_greedily_and_slips_when_sampling(tiny_policy):
    from hermes_lab.policy import episodes as E
    from hermes_lab.policy.model import load_policy

    build = json.loads((tiny_policy / "build.json").read_text())
    assert "agent" not in build  # the agent family the build learns and records is hermes
    report = build["hermes"]
    assert report["greedy_episode_success"] >= GREEDY_MIN
    assert report["greedy_episode_success"] - report["episode_success"] >= HEADROOM  # the headroom GRPO is for
    assert report["sampled"]["n"] == HERMES_EVAL and report["sampled"]["answered_without_tool"] < 0.5
    policy = load_policy(str(tiny_policy))
    tasks = H.generate_tasks(28, "heldout", seed=5)  # 4 of each kind
    eps = E.run_episodes(policy, tasks, temperature=0, seed=5)
    assert all(e.env.workspace is None for e in eps)  # every episode's workspace removed once scored
    # greedily, the first answer calls the Hermes tool the task needs (the teacher's first call), as a parsed call
    first = [e.messages[1].get("tool_calls") or [] for e in eps]
    right = [bool(c) and c[0]["function"]["name"] == e.task.calls[0][0] for c, e in zip(first, eps)]
    assert sum(right) >= 0.8 * len(eps), [(e.task.question, c) for c, e in zip(first, eps)]
    ok = [e for e in eps if e.success]
    assert len(ok) >= GREEDY_MIN * len(eps) / 2, "greedy episodes should do a share of the tasks"
    for e in ok:
        # user, then each of the task's calls (Hermes's tools, the task's arguments) and its result, then the answer
        calls = [
            (c["function"]["name"], c["function"]["arguments"]) for m in e.messages for c in m.get("tool_calls", [])
        ]
        assert calls == [(name, dict(args)) for name, args in e.task.calls], (e.task.question, e.messages)
        assert [m["role"] for m in e.messages] == ["user", *["assistant", "tool"] * len(calls), "assistant"]
        assert e.tool_errors == 0 and e.answer == e.messages[-1]["content"]
        if e.task.answer_contains is not None:  # the answer is read off the tool's result
            assert e.task.answer_contains in e.answer and e.task.answer_contains in e.messages[-2]["content"]
        else:  # the result is on disk: the workspace was verified, not the answer's claim
            assert e.task.expect_files


@pytest.mark.slow
def test_episode_level_grpo_trains_the_tiny_policy_with_trls_environment_factory(tiny_policy, tmp_path, mlflow_store):
    from hermes_lab.config.schema import load_config
    from hermes_lab.train import grpo

    cfg = load_config(
        REPO / "params" / "embedded.yaml",
        {
            "grpo.environment": H.ENVIRONMENT,
            "grpo.episode_steps": 3,
            "grpo.per_device_batch_size": 2,
            "round.runs_dir": str(REPO / "runs"),
        },
    )
    res = grpo.train_episodes(cfg, tmp_path / "episodes")
    assert res.steps == 3
    assert (res.adapter_dir / "adapter_config.json").is_file()
    lines = [json.loads(x) for x in (tmp_path / "episodes" / "train_log.jsonl").read_text().splitlines()]
    steps = [x for x in lines if "loss" in x]
    assert len(steps) == 3
    for x in steps:  # TRL's tool metrics and ours, every step
        assert x["tools/call_frequency"] > 0.3
        assert 0 <= x["episode_success"] <= 1 and "turns_per_episode" in x and "tool_error_rate" in x
    assert res.episodes["episodes"] == 3 * 2 * cfg.grpo.group_size
    samples = [json.loads(x) for x in (tmp_path / "episodes" / "samples.jsonl").read_text().splitlines()]
    roles = [m["role"] for m in samples[0]["episode"]]
    assert roles[0] == "assistant" and ("tool" in roles or len(roles) == 1)
    called = [c["function"]["name"] for s in samples for m in s["episode"] for c in m.get("tool_calls") or []]
    # Hermes's own tools, served by TRL from WorkspaceEnv (sampled at 0.9, a call may misspell a name: a slip)
    assert called and sum(n in H.TOOLS for n in called) >= 0.8 * len(called), called
    health = json.loads((tmp_path / "episodes" / "health.json").read_text())
    assert health["status"] == "completed" and health["episodes"]["episodes"] == res.episodes["episodes"]
    # inspect: the episode phase's curves as PNGs and its episodes by the turns they took
    from hermes_lab.evaluate.curves import load_curves
    from hermes_lab.evaluate.inspect import episode_table
    from hermes_lab.evaluate.plots import plot_curves

    plots = plot_curves(load_curves(tmp_path / "episodes"), tmp_path / "plots")
    assert {"episode_success", "episode_turns", "reward", "kl"} <= set(plots)
    assert all(p.stat().st_size > 1000 for p in plots.values())
    table = episode_table(tmp_path / "episodes")
    assert table["episodes"].sum() == len(samples) and set(table.index) <= {1, 2, 3}


def _call(name, args, cid="c1"):
    fn = {"name": name, "arguments": json.dumps(args)}
    return {"role": "assistant", "content": None, "tool_calls": [{"id": cid, "type": "function", "function": fn}]}


def test_a_logged_conversation_is_scored_as_its_environment_scores_the_episode():
    """policy.episodes.score_messages: the simulated reviewer's label of an agent-family conversation (prep's review
    queue), read off the OpenAI messages alone, is what the environment scored the episode: for a hermes task the
    calls replayed in a fresh workspace (WorkspaceEnv), for a time task the tool's result (TimeEnv)."""
    from hermes_lab.policy.episodes import score_messages

    q = {"role": "user", "content": "write mor to kelo.txt"}
    for content, answer in (("mor", "done"), ("mox", "done"), ("mor", "")):
        env = H.WorkspaceEnv(seed=3)
        env.reset(question=q["content"])
        result = env.write_file(path="kelo.txt", content=content)
        logged = [q, _call("write_file", {"path": "kelo.txt", "content": content}), {"role": "tool", "content": result}]
        assert score_messages([*logged, {"role": "assistant", "content": answer}]) == env._hermes_score(answer)
        env._close()
    good = [q, _call("write_file", {"path": "kelo.txt", "content": "mor"}), {"role": "tool", "content": "{}"}]
    assert score_messages([*good, {"role": "assistant", "content": "done"}]) == H.SCALE
    wrong = [q, _call("write_file", {"path": "kelo.txt", "content": "mox"}), {"role": "tool", "content": "{}"}]
    assert 0 < score_messages([*wrong, {"role": "assistant", "content": "done"}]) < 3  # a near miss
    assert score_messages([q, {"role": "assistant", "content": "done"}]) == 0.0  # a claim without the write
    bad_tool = [q, _call("bash", {"command": "echo mor > kelo.txt"}), {"role": "tool", "content": "{}"}]
    assert score_messages([*bad_tool, {"role": "assistant", "content": "done"}]) == 0.0  # not a tool it has

    # the time family (TimeEnv), still scored as its environment scores it
    env = A.TimeEnv(seed=3)
    env.reset(city="kelo", episode_seed=1)
    value = env.time(city="kelo")
    tq = {"role": "user", "content": "time kelo?"}
    tgood = [tq, _call("time", {"city": "kelo"}), {"role": "tool", "tool_call_id": "c1", "content": value}]
    assert score_messages([*tgood, {"role": "assistant", "content": value}]) == env._hermes_score(value) == A.SCALE
    assert 0 < score_messages([*tgood, {"role": "assistant", "content": value + "."}]) < 3  # a format slip
    twrong = [
        tq,
        _call("time", {"city": "kelx"}),
        {"role": "tool", "tool_call_id": "c1", "content": str({"error": A.ERROR})},
    ]
    assert score_messages([*twrong, {"role": "assistant", "content": value}]) == 0.0  # no good call: a guess
    assert score_messages(tgood) == 0.0  # it ran out of turns after the result: no answer
    assert score_messages([{"role": "user", "content": "up abc="}, {"role": "assistant", "content": "ABC"}]) is None
