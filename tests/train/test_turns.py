"""Turn-level GRPO from logged agent conversations (hermes_lab.train.turns): a Hermes Agent trajectory file's
assistant turns become GRPO prompts rendered with the policy's chat template, and a real TRL training on the tiny
policy with the local judge and the tool_call reward logs its metrics."""

from __future__ import annotations

import json

import pytest

from hermes_lab.logs import readers
from hermes_lab.policy.chat import add_chat_template
from hermes_lab.policy.model import build_tokenizer
from hermes_lab.train.turns import chosen_turns, turn_prompts

from repo_paths import FIXTURES, REPO

HERMES = FIXTURES / "hermes" / "trajectory_samples.jsonl"


def _records(path=HERMES):
    lines = path.read_text(encoding="utf-8").splitlines()
    return [
        readers.parse_line(json.loads(x), "hermes_trajectory", str(path), i + 1, 5.0, 100_000)
        for i, x in enumerate(lines)
    ]


def test_a_conversations_turns_become_prompts_with_the_real_tool_results():
    tok = add_chat_template(build_tokenizer())
    rec = _records()[0]
    rows = turn_prompts(rec, "all", tok, budget=10_000)
    turns = [i for i, m in enumerate(rec["messages"]) if m["role"] == "assistant"]
    assert [r["turn"] for r in rows] == turns and len(rows) == 2
    first, second = rows
    assert first["prompt"].endswith("<|assistant|>") and "<|tool|>" not in first["prompt"]
    assert first["reference"].startswith("<tool_call>{") and '"name": "terminal"' in first["reference"]
    # the second turn's context holds the first turn's call and the real tool result that came back
    tool_msg = next(m for m in rec["messages"] if m["role"] == "tool")
    assert first["reference"] in second["prompt"] and tool_msg["content"] in second["prompt"]
    assert json.loads(first["tools"])[0]["function"]["name"] in {"process", "terminal"}
    assert not first["truncated"]
    # a small budget drops the oldest messages first (the long system prompt), keeping the latest context
    small = turn_prompts(rec, "all", tok, budget=160)
    assert all(len(tok(r["prompt"])["input_ids"]) <= 160 for r in small)
    assert small[1]["truncated"] and small[1]["prompt"].endswith("<|assistant|>")


def test_a_turn_the_gateway_answered_is_trained_on_its_logged_tokens():
    """meta.turns[].tokens (an in-process arm's answer, logs.gateway): the row's prompt_ids are the logged ones, even
    where a re-rendering would differ (the policy's own spacing), and the trainer takes them as they are; a record
    without them (another upstream) is rendered; a logged prompt longer than the budget is cut and rendered."""
    from types import SimpleNamespace

    from datasets import Dataset

    from hermes_lab.policy import turn
    from hermes_lab.tasks import workspace as W
    from hermes_lab.train.turns import trainer_class

    tok = add_chat_template(build_tokenizer())
    tools = W.tool_schema()  # Hermes's own schemas, as its requests send them
    q = [{"role": "user", "content": "first line of kelo.txt?"}]
    first = turn.prompt_ids(tok, q, tools)
    slip = tok(
        '<tool_call>{"name":"read_file","arguments":{"path":"kelo.txt"}}</tool_call><eos>', add_special_tokens=False
    )
    call = {"id": "c1", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "kelo.txt"}'}}
    content = '{"content": "1|bien\\n2|nxq\\n3|", "total_lines": 2, "file_size": 9, "truncated": false}'
    result = {"role": "tool", "tool_call_id": "c1", "name": "read_file", "content": content}
    second = turn.continue_ids(tok, first, slip["input_ids"], [result])
    rec = {
        "messages": [
            *q,
            {"role": "assistant", "content": None, "tool_calls": [call]},
            result,
            {"role": "assistant", "content": "bien"},
        ],
        "tools": json.dumps(tools),
        "reward": 5.0,
        "meta": json.dumps(
            {
                "turns": [
                    {"message": 1, "tokens": {"prompt_ids": first}},
                    {"message": 3, "tokens": {"prompt_ids": second}},
                ]
            }
        ),
    }
    rows = turn_prompts(rec, "all", tok, budget=200)
    assert [r["prompt_ids"] for r in rows] == [first, second] and {r["prompt_source"] for r in rows} == {"logged"}
    assert rows[1]["prompt"] == tok.decode(second) and '"name":"read_file"' in rows[1]["prompt"]  # what it saw
    bare = turn_prompts({**rec, "meta": "{}"}, "all", tok, budget=200)
    assert bare[0]["prompt_ids"] == first and bare[1]["prompt_ids"] != second  # re-rendered: canonical spacing
    assert {r["prompt_source"] for r in bare} == {"rendered"}
    short = turn_prompts(rec, "all", tok, budget=100)[1]
    assert short["truncated"] and short["prompt_source"] == "rendered" and len(short["prompt_ids"]) <= 100
    ds = Dataset.from_list([*rows, {"prompt": "up abc=", "prompt_ids": None}])
    got, _, _ = trainer_class(ds)._tokenize_prompts(SimpleNamespace(processing_class=tok), list(ds["prompt"]))
    assert got == [first, second, tok("up abc=", add_special_tokens=False)["input_ids"]]


def test_which_turns():
    msgs = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "thinking"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "t", "arguments": "{}"}}]},
        {"role": "tool", "content": "r"},
        {"role": "assistant", "content": "done"},
    ]
    assert chosen_turns(msgs, "all", 5.0, 3.0) == [1, 2, 4]
    assert chosen_turns(msgs, "last", 5.0, 3.0) == [4]
    assert chosen_turns(msgs, "first_tool", 5.0, 3.0) == [2]
    assert chosen_turns(msgs, "failed", 5.0, 3.0) == [] and chosen_turns(msgs, "failed", 1.0, 3.0) == [1, 2, 4]
    with pytest.raises(ValueError, match="grpo.turns"):
        chosen_turns(msgs, "some", 5.0, 3.0)


@pytest.mark.slow
def test_turn_level_grpo_on_a_hermes_trajectory_file_trains_and_logs(tmp_path, mlflow_store):
    from hermes_lab.config.schema import load_config
    from hermes_lab.policy.model import build_tiny_policy
    from hermes_lab.train import grpo

    build_tiny_policy(REPO / "runs", 0, quiet=True)
    data = tmp_path / "hermes.jsonl"  # a Hermes Agent batch run's trajectories, and one failed run
    data.write_text(
        "".join(
            (FIXTURES / "hermes" / f).read_text() for f in ("batch_trajectories.jsonl", "failed_trajectories.jsonl")
        )
    )
    cfg = load_config(
        REPO / "params" / "embedded.yaml",
        {
            "grpo.turns": "all",
            "reward.types": ["tool_call", "comparison"],  # validity + the local judge against the logged turn
            "reward.weights": [1.0, 1.0],
            "data.max_seq_len": 224,
            "grpo.max_completion_length": 48,
            "grpo.turn_completion_length": 0,  # the turns' completions: max_completion_length
            "grpo.max_steps": 2,
            # the episode phase that follows a conversations-only training (grpo.environment, embedded.yaml's 20
            # steps) once: that it runs after the turns is what is tested here, not what it learns
            "grpo.episode_steps": 1,
            "grpo.per_device_batch_size": 2,
            "grpo.group_size": 4,
            "round.runs_dir": str(REPO / "runs"),
        },
    )
    res = grpo.train(cfg, data, tmp_path / "train", evaluate_heldout=False)
    assert res.steps == 2 and (res.adapter_dir / "adapter_config.json").is_file()
    assert res.episodes["steps"] == 1  # then the episode phase, from the turns' adapter
    log = [json.loads(x) for x in (tmp_path / "train" / "train_log.jsonl").read_text().splitlines()]
    steps = [x for x in log if "loss" in x]
    assert len(steps) == 2
    for x in steps:  # both rewards' curves, the usual TRL metrics
        assert "rewards/tool_call/mean" in x and "rewards/comparison/mean" in x and "kl" in x
    samples = [json.loads(x) for x in (tmp_path / "train" / "samples.jsonl").read_text().splitlines()]
    assert {s["reward_fn"] for s in samples} == {"tool_call", "comparison"}
    assert all(s["prompt"].endswith("<|assistant|>") for s in samples)  # rendered turn prompts
    health = json.loads((tmp_path / "train" / "health.json").read_text())
    assert health["status"] == "completed" and health["group_judge"] is None
