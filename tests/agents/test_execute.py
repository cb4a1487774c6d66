"""Execute: the policy's execution logs in the user's trajectory format, rewards from the verifiers."""

import json
import subprocess
import sys
from pathlib import Path

import yaml

from hermes_lab.agents.execute import execute
from hermes_lab.config.schema import load_config
from hermes_lab.tasks import suite as T


def test_execute_writes_user_format_with_verifier_rewards(tmp_path):
    # the string tasks are under test: no agent episodes (either runner's are tested below and in test_hermes_loop)
    over = {"execute.num_tasks": 520, "execute.samples_per_task": 1, "execute.agent_tasks": 0}
    cfg = load_config("params/embedded.yaml", over)
    out = tmp_path / "trajectories.jsonl"
    res = execute(cfg, out, seed=2, progress=False)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert res["records"] == len(rows) == 520
    for r in rows:
        assert {"prompt", "response", "reward", "task_id", "family", "request_id", "timestamp", "policy"} <= set(r)
        assert r["reward"] == T.verify(r["prompt"], r["response"])  # system feedback, not made up
        assert 0 <= r["reward"] <= 5
        assert T.split_of(r["prompt"]) == "train"  # held-out tasks stay held out
    assert len({r["request_id"] for r in rows}) == 520
    assert {r["family"] for r in rows} == set(T.FAMILIES)
    # a code task's record carries its hidden tests, as a user's code task would; the others carry none
    from hermes_lab.sandbox.shapes import parse_tests

    code = [r for r in rows if r["family"] == "code"]
    assert code and all(
        parse_tests(r, r["prompt"]) == parse_tests({"tests": T.tests_of(T.parse_prompt(r["prompt"]))}) for r in code
    )
    assert all("tests" not in r for r in rows if r["family"] != "code")
    passed = sum(r["reward"] >= 3 for r in rows) / len(rows)
    assert res["pass_rate"] == round(passed, 4)
    assert 0.05 < passed < 0.95  # sampled at temperature 0.9: a mix of passes and failures
    again = tmp_path / "again.jsonl"
    execute(cfg, again, seed=2, progress=False)
    assert [json.loads(x)["response"] for x in again.read_text().splitlines()] == [r["response"] for r in rows]


def test_execute_cli(tmp_path):
    out = tmp_path / "t.jsonl"
    params = tmp_path / "params.yaml"  # embedded.yaml with the string tasks alone (its 64 agent episodes: below)
    cfg = yaml.safe_load(Path("params/embedded.yaml").read_text())
    cfg["execute"]["agent_tasks"] = 0
    params.write_text(yaml.safe_dump(cfg))
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "hermes_lab.agents.execute",
            "--params",
            str(params),
            "--output",
            str(out),
            "--num-tasks",
            "10",
        ],
        capture_output=True,
        text=True,
    )
    assert p.returncode == 0, p.stderr
    assert "wrote 40 trajectories" in p.stdout  # 10 tasks x embedded.yaml's 4 samples each
    assert len(out.read_text().splitlines()) == 40


def test_samples_per_task_logs_each_prompt_as_a_group(tmp_path):
    cfg = load_config(
        "params/embedded.yaml", {"execute.num_tasks": 40, "execute.samples_per_task": 4, "execute.agent_tasks": 0}
    )
    out = tmp_path / "trajectories.jsonl"
    res = execute(cfg, out, seed=3, progress=False)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert res["records"] == len(rows) == 160
    groups = [rows[i : i + 4] for i in range(0, 160, 4)]
    assert all(len({r["prompt"] for r in g}) == 1 for g in groups)  # neighbours: one prompt, four samples
    # the 40 tasks in order (two draws of a small family, e.g. tool's 48 level-1 prompts, may coincide)
    want = [t.prompt for t in T.generate_tasks(40, split="train", seed=3)]
    assert [g[0]["prompt"] for g in groups] == want and len({r["request_id"] for r in rows}) == 160
    # sampled, not copied: some prompt's group holds different responses
    assert any(len({r["response"] for r in g}) > 1 for g in groups)


def test_the_agent_familys_episodes_are_logged_as_hermes_conversations(tmp_path):
    """execute.agent_tasks: the round's agent family (hermes, grpo.environment) played as whole episodes on Hermes's
    own tools, each written as an OpenAI conversation record whose reward is what its workspace verified: the logged
    calls, replayed in a fresh workspace, score the same."""
    from hermes_lab.core.layout import RoundLayout
    from hermes_lab.tasks import hermes as H
    from hermes_lab.tasks import workspace as W

    over = {"execute.num_tasks": 6, "execute.agent_tasks": 21, "agent.runner": "builtin"}  # the built-in runner's
    cfg = load_config("params/embedded.yaml", over)
    assert cfg.grpo.environment == H.ENVIRONMENT  # the round's agent family
    out = tmp_path / "trajectories.jsonl"
    res = execute(cfg, out, seed=4, progress=False)
    path = RoundLayout(tmp_path).agent_episodes
    assert res["agent_episodes"] == 21 and res["agent_output"] == str(path)
    recs = [json.loads(x) for x in path.read_text().splitlines()]
    assert len(recs) == 21 and {r["family"] for r in recs} == {H.FAMILY}
    kinds = set()
    for r in recs:
        assert r["tools"] == W.tool_schema()  # Hermes's schemas, as its requests send them
        user = r["messages"][0]
        assert user["role"] == "user" and T.split_of(user["content"]) == "train"  # held-out tasks stay held out
        task = H.parse_question(user["content"])
        assert task is not None and r["task_id"] == task.task_id
        kinds.add(task.kind)
        for m in r["messages"]:
            for c in m.get("tool_calls") or []:
                assert c["type"] == "function" and isinstance(json.loads(c["function"]["arguments"]), dict)
        assert H.replay_score(r["messages"]) == r["reward"], r["messages"]
    assert kinds == set(H.KINDS)  # round-robin over the kinds
    assert any(m.get("tool_calls") for r in recs for m in r["messages"])  # the base policy calls Hermes's tools
    assert res["agent_success"] == round(sum(r["reward"] >= 3 for r in recs) / 21, 4)
