"""Execute: the policy's execution logs in the user's trajectory format, rewards from the verifiers."""

import json
import subprocess
import sys

from hermes_lab.config.schema import load_config
from hermes_lab.data.execute import execute
from hermes_lab.tasks import suite as T


def test_execute_writes_user_format_with_verifier_rewards(tmp_path):
    cfg = load_config("params/embedded.yaml", {"execute.num_tasks": 520, "execute.samples_per_task": 1})
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
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "hermes_lab.data.execute",
            "--params",
            "params/embedded.yaml",
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
    cfg = load_config("params/embedded.yaml", {"execute.num_tasks": 40, "execute.samples_per_task": 4})
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
