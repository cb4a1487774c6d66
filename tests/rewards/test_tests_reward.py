"""The tests reward and its test shapes (hermes_lab.rewards.tests, hermes_lab.sandbox.specs): MBPP assert lines,
HumanEval check(candidate) with an entry point, stdin/stdout cases; the share or all-or-nothing; code from a
fenced block or the whole answer; the cache; what a completion cannot fake. Every score comes from real runs
in the local sandbox."""

from __future__ import annotations

import json
import re
import sys

import pytest

from hermes_lab.config.schema import REWARD_TYPES, ConfigError, load_config
from hermes_lab.rewards import registry as R
from hermes_lab.rewards.tests import make_tests_reward
from hermes_lab.sandbox.local import LocalExecutor
from hermes_lab.sandbox.shapes import SpecError, TestSpec, extract_code, parse_tests, plan_of, prompt_code
from hermes_lab.tasks import suite as T

from repo_paths import FIXTURES, REPO

MBPP_REC = {
    "prompt": "Write a function to find the shared elements of two lists.",
    "test_list": [
        "assert set(similar_elements((3, 4, 5, 6), (5, 7, 4, 10))) == set((4, 5))",
        "assert set(similar_elements((1, 2, 3, 4), (5, 4, 3, 7))) == set((3, 4))",
        "assert set(similar_elements((11, 12, 14, 13), (17, 15, 14, 13))) == set((13, 14))",
    ],
    "test_setup_code": "",
}
HE_PROMPT = (
    "from typing import List\n\n\ndef below_zero(ops: List[int]) -> bool:\n"
    + '    """True if the balance dips below zero."""\n'
)
HE_TEST = (
    "METADATA = {'author': 'jt'}\n\n\ndef check(candidate):\n    assert candidate([]) == False\n"
    "    assert candidate([1, 2, -3, 1, 2, -3]) == False\n    assert candidate([1, 2, -4, 5, 6]) == True\n"
    "    assert candidate([1, -1, 2, -2, 5, -5, 4, -5]) == True\n"
)
HE_BODY = (
    "    balance = 0\n    for op in ops:\n        balance += op\n        if balance < 0:\n            return True\n"
    "    return False\n"
)


@pytest.fixture(scope="module")
def executor():
    ex = LocalExecutor(workers=2)
    yield ex
    ex.close()


def reward_for(executor, **overrides):
    return make_tests_reward(load_config(None, {"reward.types": ["tests"], **overrides}), executor=executor)


# -------------------------------------------------------------------------------------------- shapes
def test_the_registry_and_the_config_name_the_tests_reward():
    assert "tests" in R.REGISTRY and list(R.REGISTRY) == list(REWARD_TYPES)
    assert "sandbox" in REWARD_TYPES["tests"]
    cfg = load_config(None, {"reward.types": ["system", "tests"]})
    assert [f.__name__ for f in R.get_reward_funcs(cfg)[0]] == ["system", "tests"]


def test_record_shapes_parse_into_specs():
    mbpp = parse_tests(MBPP_REC, MBPP_REC["prompt"])
    assert mbpp.kind == "assert" and mbpp.n_tests == 3
    he = parse_tests({"test": HE_TEST, "entry_point": "below_zero"}, HE_PROMPT)
    assert he.kind == "check" and he.entry_point == "below_zero" and he.prefix == HE_PROMPT and he.n_tests == 4
    apps = parse_tests({"input_output": json.dumps({"inputs": ["1 2\n", "3 4\n"], "outputs": ["3\n", ["7"]]})})
    assert apps.kind == "io" and apps.cases == (("1 2\n", "3\n"), ("3 4\n", "7"))
    io = parse_tests({"tests": [{"input": "x", "output": "y"}]})
    assert io.cases == (("x", "y"),)
    assert parse_tests({"prompt": "no tests"}) is None
    for spec in (mbpp, he, apps):  # prep writes the normalised JSON; the reward reads it back
        assert TestSpec.from_json(spec.to_json()) == spec


@pytest.mark.parametrize(
    ("rec", "says"),
    [
        ({"tests": ["assert f(1) ==", "assert f(2) == 2"]}, "tests[0] does not parse"),
        ({"tests": HE_TEST}, "entry_point"),
        ({"test": HE_TEST, "entry_point": "not an id"}, "entry_point must be a Python identifier"),
        ({"test": "def helper(): pass", "entry_point": "f"}, "no 'def check(candidate)'"),
        ({"tests": []}, "tests is empty"),
        ({"tests": [{"input": "1"}]}, "need an 'input' and an 'output'"),
        ({"input_output": {"inputs": ["1"], "outputs": []}}, "same length"),
        ({"input_output": {"inputs": [], "outputs": [], "fn_name": "f"}}, "call-based"),
        ({"input_output": "{not json"}, "not JSON"),
        ({"entry_point": "f"}, "no tests"),
        ({"tests": {"kind": "assert", "tests": ["assert 1"], "extra": 1}}, "unknown key 'extra'"),
        ({"tests": 42}, "tests must be"),
    ],
)
def test_tests_that_do_not_parse_are_refused_naming_the_field(rec, says):
    with pytest.raises(SpecError, match=re.escape(says)):
        parse_tests(rec)


def test_code_from_a_fence_or_the_whole_answer():
    answer = (
        "Here you go:\n```python\ndef f():\n    return 1\n```\nand a second try:\n```py\ndef f():\n    return 2\n```"
    )
    assert extract_code(answer, "fenced") == "def f():\n    return 2\n"  # the last python block
    assert extract_code(answer, "auto") == "def f():\n    return 2\n"
    assert extract_code(answer, "whole") == answer
    assert extract_code("def f(): return 3", "fenced") is None
    assert extract_code("def f(): return 3", "auto") == "def f(): return 3"
    assert extract_code("```js\nlet x\n```", "fenced") is None  # another language's block is not the code


# ----------------------------------------------------------------------------------------- scoring
def test_mbpp_share_and_all_or_nothing(executor):
    tests = [parse_tests(MBPP_REC).to_json()] * 4
    codes = [
        "def similar_elements(a, b):\n    return tuple(set(a) & set(b))\n",
        "def similar_elements(a, b):\n    return (4, 5)\n",  # right once by luck: a third
        "def similar_elements(a, b) return",  # compile error
        "print('no function at all')\n",  # runtime: NameError in every test
    ]
    share = reward_for(executor)
    assert share(prompts=["p"] * 4, completions=codes, tests=tests) == [5.0, round(5 / 3, 4), 0.0, 0.0]
    all_or_none = reward_for(executor, **{"reward.tests_score": "all"})
    assert all_or_none(prompts=["p"] * 4, completions=codes, tests=tests) == [5.0, 0.0, 0.0, 0.0]
    kinds = share.sandbox.to_dict()["by_kind"]
    assert kinds == {"passed": 1, "failed": 2, "compile_error": 1}
    assert share.sandbox.to_dict()["executions"] == 3  # the compile error never ran


def test_humaneval_continuation_full_function_and_all_or_nothing(executor):
    """check(candidate) passes or fails as a whole, as HumanEval's grader has it: its asserts build on each other
    and a stub passes its edge cases (``longest([]) is None``), so a share of them is no evidence (docs/rewards.md)."""
    spec = parse_tests({"test": HE_TEST, "entry_point": "below_zero"}, HE_PROMPT).to_json()
    full = HE_PROMPT + HE_BODY  # a chat model writes the whole function: the prompt's definitions stay
    wrong = "    return sum(ops) < 0\n"  # right on 3 of the 4 asserts: [1, 2, -4, 5, 6] ends positive
    fenced = f"Sure.\n```python\ndef below_zero(ops: List[int]) -> bool:\n{HE_BODY}```"
    other = "def something_else(ops):\n    return False\n"
    reward = reward_for(executor)
    got = reward(prompts=[HE_PROMPT] * 5, completions=[HE_BODY, full, wrong, fenced, other], tests=[spec] * 5)
    assert got == [5.0, 5.0, 0.0, 5.0, 0.0]
    # something_else() continues the prompt: below_zero is its docstring alone, returns None, fails the second
    assert reward.sandbox.to_dict()["by_kind"] == {"passed": 3, "failed": 2}
    runner = reward.sandbox.runner
    wrong_outcome = runner.cache[runner.key(extract_code(wrong, "auto"), TestSpec.from_json(spec))]
    assert wrong_outcome.marks == "110-" and wrong_outcome.share == 0.0  # the 4th never ran: check stops


def test_a_prompt_in_every_form_keeps_its_code_judge_side(executor):
    """Raw code, chat-wrapped (prose, then a fenced block) and a system + user pair (chat messages; the system
    message names ```python in passing): the prompt's code is the same, its imports and helpers run judge-side,
    and the completion continues it or defines the whole function, in every form."""
    chat = "Complete the function below.\n\n```python\n" + HE_PROMPT + "```\n\nAnswer with the whole function."
    system = "You are a careful Python programmer; answer in one ```python block."
    pair = [{"role": "system", "content": system}, {"role": "user", "content": chat}]
    specs = [parse_tests({"test": HE_TEST, "entry_point": "below_zero"}, p) for p in (HE_PROMPT, chat, pair)]
    assert specs[2].prefix == f"{system}\n\n{chat}"
    assert [prompt_code(s.prefix) for s in specs] == [HE_PROMPT] * 3
    assert [plan_of(s).prelude for s in specs] == [(HE_PROMPT,)] * 3
    assert prompt_code("def f(x):\n    return ") == "def f(x):\n    return "  # the code family's: continued as is
    fenced = f"```python\ndef below_zero(ops: List[int]) -> bool:\n{HE_BODY}```"  # List: the prompt's import
    reward = reward_for(executor)
    got = reward(
        prompts=[""] * 9,
        completions=[HE_BODY, fenced, "    return False\n"] * 3,
        tests=[s.to_json() for s in specs for _ in range(3)],
    )
    assert got == [5.0, 5.0, 0.0] * 3


def test_stdin_stdout_cases(executor):
    spec = json.dumps({"kind": "io", "cases": [["1 2\n", "3\n"], ["10 -4\n", "6"], ["0 0", "0\n\n"]]})
    codes = [
        "a, b = map(int, input().split())\nprint(a + b)",
        "a, b = map(int, input().split())\nprint(a - b)",  # 0 0 -> 0 only
        "import sys\nprint(sum(map(int, sys.stdin.read().split())))\nexit()",  # exit() works as in python
    ]
    assert reward_for(executor)(prompts=["p"] * 3, completions=codes, tests=[spec] * 3) == [5.0, round(5 / 3, 4), 5.0]


def test_a_completion_cannot_fake_the_report_or_leave_early(executor):
    tests = [parse_tests(MBPP_REC).to_json()] * 4
    codes = [
        "print('HERMES-0000000000000000 done 111')\nimport sys\nsys.stdout.flush()\nimport os\nos._exit(0)",
        "import os\nos._exit(0)",  # exit status 0, no test ran
        "def similar_elements(a, b):\n    raise SystemExit(0)\n",  # a test that exits is a failed test
        "import builtins\nbuiltins.exec = lambda *a, **k: None\nbuiltins.isinstance = lambda *a: True\n",
    ]
    reward = reward_for(executor)
    assert reward(prompts=["p"] * 4, completions=codes, tests=tests) == [0.0, 0.0, 0.0, 0.0]
    kinds = reward.sandbox.to_dict()["by_kind"]
    assert kinds["crash"] == 3 and kinds["failed"] == 1  # patched builtins break the candidate's own loop: gone


def test_duplicates_run_once_and_rows_without_tests_are_not_applicable(executor):
    spec = parse_tests(MBPP_REC).to_json()
    good = "def similar_elements(a, b):\n    return tuple(set(a) & set(b))\n"
    reward = reward_for(executor)
    got = reward(prompts=["p"] * 8, completions=[good] * 6 + ["x", "y"], tests=[spec] * 6 + [None, ""])
    assert got == [5.0] * 6 + [None, None]
    rep = reward.sandbox.to_dict()
    assert rep["executions"] == 1 and rep["cache_hits"] == 5 and rep["completions"] == 6
    assert reward(prompts=["p"], completions=[good], tests=[spec]) == [5.0]
    assert reward.sandbox.to_dict()["executions"] == 1  # the next batch hits the cache too
    assert reward(prompts=["p"], completions=["x"]) == [None]  # a dataset without a tests column


def test_the_system_reward_leaves_rows_with_tests_to_the_tests_reward():
    code_task = next(t for t in T.generate_tasks(12, seed=5) if t.family == "code")
    up = T.make_task("upper", "cat")
    prompts, completions = [code_task.prompt, up.prompt], [code_task.answer, "CAT"]
    tests = [json.dumps(T.tests_of(code_task)), None]
    both = R.make_system_reward(load_config(None, {"reward.types": ["system", "tests"]}))
    assert both(prompts=prompts, completions=completions, tests=tests) == [None, 5.0]
    alone = R.make_system_reward(load_config(None, {"reward.types": ["system"]}))
    assert alone(prompts=prompts, completions=completions, tests=tests) == [5.0, 5.0]  # the verifier runs them


def test_sandbox_config_is_checked():
    with pytest.raises(ConfigError, match="sandbox.url must be the http"):
        load_config(None, {"sandbox.executor": "fusion", "sandbox.url": "sandbox:8080"})
    with pytest.raises(ConfigError, match="sandbox.timeout_s"):
        load_config(None, {"sandbox.timeout_s": 0})
    with pytest.raises(ConfigError, match="reward.tests_score"):
        load_config(None, {"reward.tests_score": "most"})
    with pytest.raises(ConfigError, match="sandbox.api_key_env must be the NAME"):
        load_config(None, {"sandbox.api_key_env": "sk-live-123"})


# ------------------------------------------------------------------------ code files: prep, then training
HOSTILE_MODULE = '''
import json, os
from hermes_lab.config.schema import load_config
from hermes_lab.rewards.tests import make_tests_reward

SPEC = json.dumps({"kind": "assert", "tests": ["assert add(1, 2) == 3"]})
GOOD = "def add(a, b):\\n    return a + b\\n"
CASES = {
    "infinite_loop": "while True:\\n    pass\\n" + GOOD,
    "fork_bomb": "import os\\nwhile True:\\n    try:\\n        os.fork()\\n    except OSError:\\n        pass\\n"
    + GOOD,
    "alloc_1gb": "blob = bytearray(1 << 30)\\n" + GOOD,
    "print_100mb": "import sys\\nfor _ in range(100):\\n    sys.stdout.write('x' * (1 << 20))\\n" + GOOD,
    "kill_parent": "import os, signal\\nos.kill(os.getppid(), signal.SIGKILL)\\nos.kill(%d, signal.SIGKILL)\\n" + GOOD,
}
TESTS = make_tests_reward(load_config(None, {"reward.types": ["tests"], "sandbox.timeout_s": 2.0, "sandbox.cpu_s": 2.0,
                                            "sandbox.memory_mb": 256, "sandbox.max_processes": 8,
                                            "sandbox.max_output_kb": 256}))


def hostile(prompts, completions, tests, **kw):
    """The tests reward inside a GRPO step, the hostile set scored in the same call beside the policy's
    completions; the policy's scores go back to TRL, the hostile ones to HOSTILE_LOG."""
    codes = [c % os.getpid() if "%d" in c else c for c in CASES.values()]
    n = len(completions)
    scores = TESTS(prompts=[*prompts, *CASES], completions=[*completions, *codes], tests=[*tests, *[SPEC] * len(CASES)])
    with open(os.environ["HOSTILE_LOG"], "a") as f:
        f.write(json.dumps(dict(zip(CASES, scores[n:]))) + "\\n")
    return scores[:n]


hostile.sandbox = TESTS.sandbox  # its tally, hostile cases included: health.json and train/tests_<kind> in MLflow
'''


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "kind"), [("humaneval_trajectories.jsonl", "check"), ("mbpp_trajectories.jsonl", "assert")]
)
def test_a_code_file_goes_through_prep_and_trains_with_the_tests_reward(
    name, kind, tmp_path, monkeypatch, mlflow_store
):
    """A HumanEval-format and an MBPP-format trajectory file: prep keeps their tests with each prompt, the logged
    right answers pass them in the sandbox, and GRPO trains the tiny policy with the tests reward. In the MBPP run
    the tests reward (through reward.types' module:function) also scores the hostile set in every GRPO step:
    each case scores 0, is counted by kind in health.json and MLflow, and training goes on to its last step."""
    from datasets import load_from_disk

    from hermes_lab.policy.model import build_tiny_policy
    from hermes_lab.prep import run as prep
    from hermes_lab.train.grpo import train

    root = REPO
    build_tiny_policy(root / "runs", 0, quiet=True)  # cached under the repo's runs/policies/
    types, weights = ["tests"], [1.0]
    if kind == "assert":
        (tmp_path / "hostile_reward.py").write_text(HOSTILE_MODULE, encoding="utf-8")
        monkeypatch.syspath_prepend(str(tmp_path))
        monkeypatch.setenv("HOSTILE_LOG", str(tmp_path / "hostile.jsonl"))
        types = ["hostile_reward:hostile"]  # the tests reward, the hostile set beside
    cfg = load_config(
        root / "params" / "embedded.yaml",
        {
            "reward.types": types,
            "reward.weights": weights,
            "grpo.max_steps": 2,
            "grpo.environment": "",
            "grpo.max_completion_length": 48,
            "data.max_seq_len": 256,
            "data.min_samples": 1,
            "data.holdout_fraction": 0.0,
            "round.runs_dir": str(root / "runs"),
        },
    )
    try:
        res = prep.run_prep([FIXTURES / name], tmp_path / "prep", cfg, make_plots=False)
    except prep.GateRefused as e:
        res = e.result
    ds = load_from_disk(str(res.output_dir / "grpo_dataset"))
    assert len(ds) == 6 and all(TestSpec.from_json(t).kind == kind for t in ds["tests"])
    # the logged answers against their own tests: the right ones pass, the wrong ones do not
    logged = [json.loads(x) for x in (FIXTURES / name).read_text().splitlines()]
    spec_of = dict(zip(ds["prompt"], ds["tests"]))
    reward = make_tests_reward(cfg)
    got = reward(
        prompts=[r["prompt"] for r in logged],
        completions=[r["response"] for r in logged],
        tests=[spec_of[r["prompt"]] for r in logged],
    )
    assert [g == 5.0 for g in got] == [r["reward"] == 5.0 for r in logged], got

    out = train(cfg, res.output_dir, tmp_path / "train", evaluate_heldout=False)
    health = json.loads((tmp_path / "train" / "health.json").read_text())
    assert out.steps == 2 and health["status"] == "completed"
    sandbox, policy_completions = health["sandbox"], 2 * cfg.grpo.per_device_batch_size * cfg.grpo.group_size
    assert sum(sandbox["by_kind"].values()) == sandbox["completions"] and sandbox["sandbox_errors"] == 0
    if kind == "check":
        assert sandbox["completions"] == policy_completions
        return
    # the hostile set ran inside both steps: contained, zero, counted by kind, and training went on
    calls = [json.loads(x) for x in (tmp_path / "hostile.jsonl").read_text().splitlines()]
    assert len(calls) == 2 and all(set(c.values()) == {0.0} for c in calls), calls
    assert sandbox["completions"] == policy_completions + 2 * len(calls[0])
    kinds = sandbox["by_kind"]
    assert kinds["timeout"] >= 4 and kinds["memory"] >= 2 and kinds["output_limit"] >= 2, kinds  # 2 steps each
    assert kinds["crash"] >= 2, kinds  # os.kill of its parent: the harness's judge dies, the run scores 0
    client = mlflow_store.MlflowClient()
    for k, v in kinds.items():
        hist = sorted(client.get_metric_history(out.mlflow_run_id, f"train/tests_{k}"), key=lambda m: m.step)
        assert hist and hist[-1].value == v, (k, hist)
    sys.modules["hostile_reward"].TESTS.sandbox.runner.executor.close()
