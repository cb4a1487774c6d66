"""The embedded agent family: the tiny policy's chat template with Hermes-style tool calls, its environment,
episodes played as TRL plays them, and episode-level GRPO with TRL's environment_factory on the tiny policy."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from hermes_lab.policy.chat import add_chat_template, assistant_spans
from hermes_lab.policy.model import build_tokenizer
from hermes_lab.tasks import agent as A

ROOT = Path(__file__).resolve().parents[1]


def _tok():
    return add_chat_template(build_tokenizer())


def test_chat_template_passes_trls_tool_checks_and_parses_back():
    from trl.chat_template_utils import is_chat_template_prefix_preserving, parse_response, supports_tool_calling

    tok = _tok()
    assert supports_tool_calling(tok)
    assert is_chat_template_prefix_preserving(tok)  # what TRL's multi-turn loop needs
    env = A.TimeEnv()
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "time kelo?"}],
        tools=[env.time],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    call = tok('<tool_call>{"name": "time", "arguments": {"city": "kelo"}}</tool_call><eos>', add_special_tokens=False)[
        "input_ids"
    ]
    msg = parse_response(tok, call, prefix=prompt, tools=[env.time])
    assert msg["tool_calls"] == [{"type": "function", "function": {"name": "time", "arguments": {"city": "kelo"}}}]
    answer = parse_response(tok, tok("14:05<eos>", add_special_tokens=False)["input_ids"], prefix=prompt)
    assert answer == {"role": "assistant", "content": "14:05"}
    broken = tok(
        '<tool_call>{"name": "time", "arguments": {"city": "kelo"}</tool_call><eos>', add_special_tokens=False
    )["input_ids"]
    assert "tool_calls" not in parse_response(tok, broken, prefix=prompt)  # invalid JSON: plain text, no call


def test_a_slipped_tool_call_is_read_as_trl_reads_it_and_the_next_turn_renders():
    """A trained policy's slips (a call without arguments, without a name, not an object): each turn is what TRL's
    loop would make of it, and the conversation with it renders again (a call the template cannot render once
    ended a round's A/B)."""
    from hermes_lab.policy import turn

    tok, env = _tok(), A.TimeEnv()
    user = [{"role": "user", "content": "time kelo?"}]
    prompt = tok.apply_chat_template(
        user, tools=[env.time], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    seen = {}
    for text in (
        '{"name": "time"}',
        '{"name": "time", "arguments": null}',
        '{"arguments": {"city": "kelo"}}',
        "[1, 2]",
    ):
        ids = tok(f"<tool_call>{text}</tool_call><eos>", add_special_tokens=False)["input_ids"]
        msg = turn.parse(tok, ids, prompt, [env.time], completion_form=False)
        seen[text] = msg.get("tool_calls")
        convo = [*user, msg, {"role": "tool", "name": "time", "content": "{'error': 'x'}"}]
        assert tok.apply_chat_template(convo, tools=[env.time], add_generation_prompt=True, tokenize=False)
    call = [{"type": "function", "function": {"name": "time", "arguments": {}}}]
    assert seen['{"name": "time"}'] == seen['{"name": "time", "arguments": null}'] == call  # called without arguments
    assert seen['{"arguments": {"city": "kelo"}}'] is None and seen["[1, 2]"] is None  # no name: text, not a call


def test_teacher_episodes_train_only_the_assistant_turns():
    tok = _tok()
    rng = random.Random(3)
    kinds = set()
    for _ in range(60):
        conv = A.teacher_conversation(rng, noise=0.65)
        pieces = assistant_spans(tok, conv, [A.TimeEnv.time])
        trained = "".join(t for t, on in pieces if on)
        context = "".join(t for t, on in pieces if not on)
        assert "<|user|>" in context and "<|user|>" not in trained
        assert "<|tool|>" not in trained and "<|assistant|>" not in trained
        assert trained.endswith("<eos>")
        rendered = tok.apply_chat_template(conv, tools=[A.TimeEnv.time], tokenize=False)
        assert "".join(t for t, _ in pieces) == rendered  # the pieces are exactly the template's text
        kinds.add(len(conv))
    assert kinds == {2, 4}  # clean and slipped episodes both occur


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
    train = {t.question for t in A.generate_tasks(300, "train")}
    held = {t.question for t in A.generate_tasks(100, "heldout")}
    assert not train & held
    assert A.parse_question("time kelo?").city == "kelo" and A.parse_question("up abc=") is None


@pytest.fixture(scope="module")
def tiny_policy():
    from hermes_lab.policy.model import build_tiny_policy

    return build_tiny_policy(ROOT / "runs", 0, quiet=True)


@pytest.mark.slow
def test_built_policy_knows_the_agent_task_greedily_and_slips_when_sampling(tiny_policy):
    from hermes_lab.policy import episodes as E
    from hermes_lab.policy.model import load_policy

    report = json.loads((tiny_policy / "build.json").read_text())["agent"]
    assert report["greedy_episode_success"] >= 0.7
    assert report["greedy_episode_success"] - report["episode_success"] >= 0.15  # the headroom GRPO is for
    policy = load_policy(str(tiny_policy))
    eps = E.run_episodes(policy, A.generate_tasks(24, "heldout", seed=5), temperature=0, seed=5)
    ok = [e for e in eps if e.success]
    assert ok, "greedy episodes should mostly succeed"
    e = ok[0]
    # user, the call, the tool's result, the answer copied from it
    assert [m["role"] for m in e.messages] == ["user", "assistant", "tool", "assistant"]
    assert e.messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": e.task.city}
    assert e.answer == e.messages[2]["content"] == e.env.value


@pytest.mark.slow
def test_episode_level_grpo_trains_the_tiny_policy_with_trls_environment_factory(tiny_policy, tmp_path, mlflow_store):
    from hermes_lab.config.schema import load_config
    from hermes_lab.train import grpo

    cfg = load_config(
        ROOT / "params" / "embedded.yaml",
        {
            "grpo.environment": "hermes_lab.tasks.agent:TimeEnv",
            "grpo.episode_steps": 3,
            "grpo.per_device_batch_size": 2,
            "round.runs_dir": str(ROOT / "runs"),
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


def test_a_logged_conversation_is_scored_as_its_environment_scores_the_episode():
    """policy.episodes.score_messages: the simulated reviewer's label of an agent-family conversation (prep's review
    queue), read off the OpenAI messages alone, is what TimeEnv scored the episode."""
    from hermes_lab.policy.episodes import score_messages

    env = A.TimeEnv(seed=3)
    env.reset(city="kelo", episode_seed=1)
    value = env.time(city="kelo")

    def call(city, cid="c1"):
        args = json.dumps({"city": city})
        return {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": cid, "type": "function", "function": {"name": "time", "arguments": args}}],
        }

    q = {"role": "user", "content": "time kelo?"}
    good = [q, call("kelo"), {"role": "tool", "tool_call_id": "c1", "content": value}]
    assert score_messages([*good, {"role": "assistant", "content": value}]) == env._hermes_score(value) == A.SCALE
    assert 0 < score_messages([*good, {"role": "assistant", "content": value + "."}]) < 3  # a format slip
    wrong = [q, call("kelx"), {"role": "tool", "tool_call_id": "c1", "content": str({"error": A.ERROR})}]
    assert score_messages([*wrong, {"role": "assistant", "content": value}]) == 0.0  # no good call: a guess
    assert score_messages([q, {"role": "assistant", "content": value}]) == 0.0
    assert score_messages(good) == 0.0  # it ran out of turns after the result: no answer
    assert score_messages([{"role": "user", "content": "up abc="}, {"role": "assistant", "content": "ABC"}]) is None
