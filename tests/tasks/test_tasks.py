"""hermes_lab.tasks.suite: seeded task generation, stable ids, the train/heldout split, verifiers, corrupt()."""

from __future__ import annotations

import json
import random
import re
import string
import subprocess
import sys
from collections import Counter

import pytest

from hermes_lab.tasks import suite as tasks
from hermes_lab.tasks.suite import (
    DIFFICULTY,
    FAMILIES,
    HELDOUT_SHARE,
    LEVELS,
    SCALE,
    check_families,
    corrupt,
    family_of,
    generate_tasks,
    level_of,
    make_task,
    parse_prompt,
    score,
    split_of,
    verify,
)

from repo_paths import REPO

SUCCESS = 3.0


def test_scale_is_the_users():
    assert SCALE == 5


# -------------------------------------------------------------------------------------------- generation
def test_same_args_same_tasks():
    a = generate_tasks(200, split="train", seed=3)
    b = generate_tasks(200, split="train", seed=3)
    assert a == b
    assert generate_tasks(200, split="train", seed=4) != a
    assert generate_tasks(200, split="heldout", seed=3) != a


def test_deterministic_across_processes():
    code = (
        "import json; from hermes_lab.tasks.suite import generate_tasks; "
        "print(json.dumps([t.to_dict() for t in generate_tasks(60, split='any', seed=7)]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
        env={"PYTHONHASHSEED": "123", "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [t.to_dict() for t in generate_tasks(60, split="any", seed=7)]


def test_task_ids_stable_and_well_formed():
    ts = generate_tasks(300, split="any", seed=0)
    for t in ts:
        assert re.fullmatch(rf"{t.family}-[0-9a-f]{{8}}", t.task_id), t.task_id
        x = t.prompt.split(" ", 1)[1][:-1]  # the input behind "<prefix> <x>="
        assert make_task(t.family, x).task_id == t.task_id
    # a known prompt always gets the same id, whatever the process or seed
    assert make_task("upper", "cat").task_id == "upper-" + tasks.prompt_hash("up cat=")[:8]


def test_ids_unique_per_prompt():
    ts = generate_tasks(2000, split="any", seed=1)
    by_prompt = {}
    for t in ts:
        by_prompt.setdefault(t.prompt, set()).add(t.task_id)
    assert all(len(ids) == 1 for ids in by_prompt.values())
    ids = [next(iter(v)) for v in by_prompt.values()]
    assert len(set(ids)) == len(ids)  # different prompts, different ids


def test_split_share_is_about_15_percent():
    ts = generate_tasks(4000, split="any", seed=0)
    prompts = {t.prompt for t in ts}
    share = sum(split_of(p) == "heldout" for p in prompts) / len(prompts)
    assert HELDOUT_SHARE == 15
    assert 0.11 <= share <= 0.19, share


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_train_never_holds_a_heldout_prompt(seed):
    train = generate_tasks(600, split="train", seed=seed)
    heldout = generate_tasks(300, split="heldout", seed=seed)
    assert all(split_of(t.prompt) == "train" for t in train)
    assert all(split_of(t.prompt) == "heldout" for t in heldout)
    assert not {t.prompt for t in train} & {t.prompt for t in heldout}
    # also against heldout prompts drawn with other seeds
    other = generate_tasks(300, split="heldout", seed=seed + 100)
    assert not {t.prompt for t in train} & {t.prompt for t in other}


def test_bad_split_rejected():
    with pytest.raises(ValueError, match="train, heldout or any"):
        generate_tasks(3, split="test")


def test_every_family_present_round_robin_and_difficulty():
    ts = generate_tasks(50, split="train", seed=0)
    assert [t.family for t in ts[: len(FAMILIES)]] == list(FAMILIES)
    assert {t.family for t in ts} == set(FAMILIES)
    assert set(DIFFICULTY) == set(FAMILIES)
    # easiest first: difficulty never decreases along FAMILIES
    levels = [DIFFICULTY[f] for f in FAMILIES]
    assert levels == sorted(levels) and levels[0] < levels[-1]
    assert all(t.difficulty == DIFFICULTY[t.family] for t in ts)


def test_families_subset():
    ts = generate_tasks(20, split="train", seed=0, families=["add", "upper"])
    assert [t.family for t in ts[:4]] == ["add", "upper", "add", "upper"]


def test_check_families_error_lists_valid_names():
    assert check_families(None) == FAMILIES
    assert check_families([]) == FAMILIES
    assert check_families(["sort"]) == ("sort",)
    with pytest.raises(ValueError) as ei:
        check_families(["upper", "bogus"])
    msg = str(ei.value)
    assert "bogus" in msg and all(f in msg for f in FAMILIES)
    with pytest.raises(ValueError, match="bogus"):
        generate_tasks(5, families=["bogus"])


def test_answers_are_right():
    assert make_task("upper", "cat").answer == "CAT"
    assert make_task("reverse", "abcd").answer == "dcba"
    assert make_task("sort", "3142").answer == "1234"
    assert make_task("tool", "time rome").answer == "time(rome)"
    assert make_task("add", "12+7").answer == "19"
    assert make_task("tool", "time rome").prompt == "tool time rome="


def test_levels_grade_each_family_and_every_set_spans_them_equally():
    assert set(LEVELS) == set(FAMILIES) and all(n >= 2 for n in LEVELS.values())
    ts = generate_tasks(60 * len(FAMILIES), split="heldout", seed=1)  # the train stage's eval set
    for fam in FAMILIES:
        counts = Counter(t.level for t in ts if t.family == fam)
        assert sorted(counts) == list(range(1, LEVELS[fam] + 1)), (fam, counts)
        assert max(counts.values()) - min(counts.values()) <= 1, (fam, counts)  # equal shares
    # the level is the input's: a parsed prompt has the same one, and it grows with length / operand size
    assert all(parse_prompt(t.prompt).level == t.level for t in ts)
    assert [level_of("sort", x) for x in ("12", "1234", "1234567")] == [1, 2, 3]
    assert [level_of("add", x) for x in ("3+4", "12+4", "4+12", "12+34")] == [1, 2, 2, 3]
    assert [level_of("tool", x) for x in ("time rome", "map rome oslo")] == [1, 2]
    # harder levels have longer answers, and every answer fits the 16-token completion
    for fam in ("upper", "reverse", "sort"):
        lengths = {lv: {len(t.answer) for t in ts if t.family == fam and t.level == lv} for lv in (1, 2, 3)}
        assert max(lengths[1]) < min(lengths[2]) and max(lengths[2]) < min(lengths[3]), lengths
    assert max(len(t.answer) for t in generate_tasks(3000, split="any", seed=3)) <= 16


def test_two_argument_tool_calls():
    t = make_task("tool", "map rome oslo")
    assert (t.answer, t.level) == ("map(rome,oslo)", 2)
    assert parse_prompt("tool map rome oslo=") == t
    with pytest.raises(ValueError, match="levels 1-2"):
        tasks._make_input("tool", random.Random(0), level=3)


# ----------------------------------------------------------------------------------------------- parsing
def test_parse_prompt_round_trip_every_family():
    ts = generate_tasks(250, split="any", seed=5)
    for fam in FAMILIES:
        assert any(t.family == fam for t in ts)
    for t in ts:
        assert parse_prompt(t.prompt) == t
        assert parse_prompt(f"  {t.prompt}\n") == t
        assert family_of(t.prompt) == t.family


@pytest.mark.parametrize("prompt", ["", "hello", "up =", "mul 2*3=", "add 1+x=", "tool rome=", "up cat"])
def test_parse_prompt_rejects_foreign(prompt):
    assert parse_prompt(prompt) is None
    assert family_of(prompt) is None
    assert verify(prompt, "anything") == 0.0


# ---------------------------------------------------------------------------------------------- verifier
def test_verifier_exact_padded_near_garbage_empty():
    for t in generate_tasks(50, split="any", seed=2, families=[f for f in FAMILIES if f != "code"]):
        assert verify(t.prompt, t.answer) == 5.0
        assert verify(t.prompt, f"  {t.answer}\n\t") == 5.0
        near = t.answer + "."
        garbage = "#" * 12
        assert 0 <= verify(t.prompt, near) < SUCCESS
        assert verify(t.prompt, near) > verify(t.prompt, garbage)
        assert verify(t.prompt, "") == 0.0
        assert verify(t.prompt, "   ") == 0.0
        assert verify(t.prompt, None) == 0.0


def test_score_respects_scale():
    assert score("abc", "abc", scale=10) == 10.0
    assert 0 < score("abc", "abd", scale=10) < 5.0


def test_partial_credit_never_reaches_success():
    rng = random.Random(0)
    alphabet = string.ascii_letters + string.digits + "()+. '"
    ts = generate_tasks(100, split="any", seed=9, families=[f for f in FAMILIES if f != "code"])
    for i in range(3000):
        t = ts[i % len(ts)]
        k = rng.randint(1, 12)
        resp = "".join(rng.choice(alphabet) for _ in range(k))
        if rng.random() < 0.5:  # near misses too: mutate the answer
            resp = corrupt(t.answer, rng)
        s = verify(t.prompt, resp)
        if resp.strip() == t.answer:
            assert s == 5.0
        else:
            assert 0.0 <= s < SUCCESS, (t.prompt, resp, s)


# ----------------------------------------------------------------------------------------------- corrupt
def test_corrupt_always_differs():
    # every branch (format slips, swap, drop, duplicate, replace), including the swap of equal
    # neighbours ("11", "aa"), which falls through to the replace branch
    rng = random.Random(123)
    answers = [t.answer for t in generate_tasks(400, split="any", seed=3)]
    answers += ["11", "aa", "AA", "0", "7", "X", "2222", "time(rome)", "100"]
    for answer in answers:
        for _ in range(40):
            wrong = corrupt(answer, rng)
            assert wrong != answer, answer
            assert wrong.strip() != answer, answer
            assert score(answer, wrong) < SUCCESS


def test_corrupt_reaches_every_kind():
    rng = random.Random(0)
    outs = [corrupt("abcd", rng) for _ in range(400)]
    assert "abcd." in outs and "'abcd'" in outs and "abcd ok" in outs
    assert any(len(o) == 3 for o in outs)  # drop
    assert any(len(o) == 5 and sorted(o) != sorted("abcd") for o in outs)  # duplicate
    assert any(len(o) == 4 and sorted(o) == sorted("abcd") for o in outs)  # swap
    assert any(len(o) == 4 and sorted(o) != sorted("abcd") for o in outs)  # replace


# -------------------------------------------------------------------------------------------- code family
def _stepwise(x: int, ops: str) -> int:
    """What the spec says, one operation at a time (no operator precedence involved)."""
    for op in ops.split():
        sym, k = ("**", 2) if op == "^2" else (("//", int(op[2:])) if op.startswith("//") else (op[0], int(op[1:])))
        x = {"+": x + k, "-": x - k, "*": x * k, "%": x % k, "//": x // k, "**": x**k}[sym]
    return x


def test_code_answers_respect_python_precedence_and_variants_are_the_same_function():
    from hermes_lab.tasks import code

    assert [make_task("code", x).answer for x in ("+3", "+3 *2", "*2 +3", "*2 +3 ^2", "-1 %4 //2")] == [
        "x+3",
        "(x+3)*2",
        "x*2+3",
        "(x*2+3)**2",
        "(x-1)%4//2",
    ]
    rng = random.Random(0)
    variants = 0
    for t in generate_tasks(600, split="any", seed=4, families=["code"]):
        x = tasks.input_of(t)
        v = code.variant(x, rng)
        variants += v != t.answer
        for i in range(-9, 21):
            assert code.value(t.answer, i) == code.value(v, i) == _stepwise(i, x), (t.prompt, v, i)
    assert variants > 100  # the teacher writes other correct forms: only tests can grade them


@pytest.mark.parametrize("prompt", ["py +0=", "py ^3=", "py +1 +2 +3 +4=", "py x=", "py //1=", "py *1="])
def test_code_prompts_outside_the_family_are_foreign(prompt):
    assert parse_prompt(prompt) is None


def test_code_family_is_verified_by_its_hidden_tests_in_the_sandbox():
    from hermes_lab.tasks import code

    t = make_task("code", "+3 *2")
    spec = tasks.tests_of(t)
    assert spec["kind"] == "assert" and spec["prefix"] == "def f(x):\n    return " and len(spec["tests"]) == 3
    responses = [
        "(x+3)*2",  # the canonical answer
        "2*(x+3)",  # another correct form: a string comparison would call it wrong
        " x*2+6 ",
        "(x+3)*2.",  # a float equal to the int: the tests pass, so it passes
        "x+3*2",  # precedence slip: wrong everywhere but by chance
        "(x+3)*2 ok",  # syntax error
        "'(x+3)*2'",  # a string, not a number
        "",
    ]
    scores = tasks.score_tasks([t] * len(responses), responses)
    assert scores[:4] == [5.0, 5.0, 5.0, 5.0]
    assert all(0 <= s < SUCCESS for s in scores[4:]) and scores[5] == scores[6] == scores[7] == 0.0
    assert [verify(t.prompt, r) for r in responses[:2]] == scores[:2]
    assert code.runner().stats.cache_hits >= 2  # verify ran the same (code, tests) again: cached
