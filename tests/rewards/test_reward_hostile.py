"""The tests reward against a reward-hunting policy: the hostile set (hermes_lab.rewards.adversarial.TESTS, 52
wrong completions, each with an attack on its grader, written for this project) on MBPP, HumanEval (its prompt
raw, chat-wrapped and as a system + user pair), stdin/stdout and the embedded code family, through the tests
reward with the default config and the real sandbox. None is paid; the right answers to the same tasks are, so
the zeros are the attacks'. Then exceptions against every judge-side protocol that catches one (each shown to
bend the same statement run in one process), the wire between the judge and the candidate (sandbox/harness.py)
against hostile bytes, and the harness's source fallback for another interpreter."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hermes_lab.config.schema import load_config
from hermes_lab.rewards import adversarial as A
from hermes_lab.rewards.tests import make_tests_reward
from hermes_lab.sandbox import harness
from hermes_lab.sandbox.local import LocalExecutor
from hermes_lab.sandbox.shapes import TestSpec, job_of
from hermes_lab.sandbox.specs import harness_outcome

RIGHT = {  # the honest answer to every probe of the set
    "mbpp": "def similar_elements(a, b):\n    return tuple(set(a) & set(b))\n",
    "humaneval": "    b = 0\n    for o in ops:\n        b += o\n        if b < 0:\n            return True\n"
    "    return False\n",
    "helper": "    return encode(s)\n",
    "stale": "    return x * x\n",
    "nested": "    return x * x\n",
    "longest": "    return max(words, key=len) if words else None\n",
    # chat forms: the whole function in a fence, relying on the prompt's helper (it stays defined)
    "helper_chat": "```python\ndef decode(s):\n    return encode(s)\n```\n",
    "helper_pair": "Sure.\n```python\ndef decode(s):\n    return encode(s)\n```\n",
    "protocol": "    return n % 2 == 0\n",
    "io": "a, b = map(int, input().split())\nprint(a + b)\n",
    "code": "(x+9)*7",
}


@pytest.fixture(scope="module")
def tests_reward():
    reward = make_tests_reward(load_config(None, {"reward.types": ["tests"]}))
    yield reward
    reward.sandbox.runner.executor.close()


def test_the_hostile_set_is_paid_nothing_and_the_right_answers_are(tests_reward):
    cases = A.TESTS
    assert len(cases) >= 30 and {c.probe for c in cases} >= {"mbpp", "humaneval", "io", "code"}
    probes = [*(A.PROBES[c.probe] for c in cases), *(A.PROBES[p] for p in RIGHT)]
    scores = tests_reward(
        prompts=[p.prompt for p in probes],
        completions=[*(c.completion for c in cases), *RIGHT.values()],
        tests=[p.column("tests") for p in probes],
    )
    hostile, right = dict(zip((c.name for c in cases), scores)), dict(zip(RIGHT, scores[len(cases) :]))
    assert right == {p: 5.0 for p in RIGHT}, right
    paid = {name: s for name, s in hostile.items() if s != 0.0}
    assert not paid, paid
    tally = tests_reward.sandbox.to_dict()
    assert tally["sandbox_errors"] == 0 and sum(tally["by_kind"].values()) == len(probes)
    kinds = tally["by_kind"]
    # contained in every way the set tries: the judge killed, stopped, the candidate gone, nonsense answered
    assert kinds["crash"] >= 8 and kinds["timeout"] == 1 and kinds["runtime_error"] >= 2, kinds
    assert tests_reward.sandbox.runner.stats.exposed == 0  # every judge's memory was out of the candidate's reach


# A test statement that reads the candidate through a protocol, and the exception the protocol takes for its
# signal: a candidate that raises it (and computes nothing) passes the statement in one process.
PROTOCOLS = {
    "StopIteration": "assert all(map(f, [1, 2, 3])) and not any(map(f, [4, 5]))",
    "StopIteration ": "assert list(iter(lambda: f(0), 1)) == []",  # iter(callable, sentinel)
    "IndexError": "class _S:\n    def __getitem__(self, i):\n        return f(i)\nassert list(_S()) == []",
    "AttributeError": "class _P:\n    v = property(lambda self: f(0))\nassert not hasattr(_P(), 'v')",
    "KeyError": "import collections\nclass _M(dict):\n    def __missing__(self, k):\n        return f(k)\n"
    "assert collections.ChainMap(_M(), {'k': 7})['k'] == 7",
    "TypeError": "import operator\nclass _L:\n    def __length_hint__(self):\n        return f(0)\n"
    "assert operator.length_hint(_L(), 7) == 7",
}


def _raiser(exc: str) -> str:
    return f"def f(x):\n    raise {exc.strip()}('computed nothing')\n"


def test_no_exception_of_the_candidate_steers_a_protocol_of_the_judge(tests_reward):
    """Each statement passes in one process with a candidate that raises the protocol's signal (the control:
    the bend is real); through the sandbox it fails: the exception arrives as CandidateRaised."""
    for exc, stmt in PROTOCOLS.items():
        ns: dict = {}
        exec(_raiser(exc), ns)
        exec(compile(stmt, "test.py", "exec"), ns)  # passes: the protocol swallowed the candidate's exception
    specs = [json.dumps({"kind": "assert", "tests": [stmt], "entry_point": "f"}) for stmt in PROTOCOLS.values()]
    scores = tests_reward(prompts=["f"] * len(specs), completions=[_raiser(e) for e in PROTOCOLS], tests=specs)
    assert scores == [0.0] * len(specs), dict(zip(PROTOCOLS, scores))


def test_an_exception_the_tests_catch_by_name_still_arrives_as_itself_but_a_protocol_signal_never(tests_reward):
    expects = "try:\n    f(-1)\n    assert False\nexcept {exc}:\n    pass"
    cases = [  # (the exception the test expects, what the candidate raises, paid)
        ("ValueError", "ValueError", 5.0),
        ("LookupError", "IndexError", 5.0),  # a base class named: IndexError is caught as in one process
        ("(KeyError, TypeError)", "TypeError", 5.0),
        ("ValueError", "TypeError", 0.0),
        ("StopIteration", "StopIteration", 0.0),  # a protocol's signal: never itself, even where it is expected
    ]
    specs = [
        json.dumps({"kind": "assert", "tests": [expects.format(exc=want), "assert f(2) == 2"], "entry_point": "f"})
        for want, _, _ in cases
    ]
    codes = [f"def f(x):\n    if x < 0:\n        raise {got}('no')\n    return x\n" for _, got, _ in cases]
    scores = tests_reward(prompts=["f"] * len(cases), completions=codes, tests=specs)
    assert scores == [paid for _, _, paid in cases], scores


def test_raised_maps_every_protocol_signal_to_a_distinct_error():
    every = frozenset(harness.PROTOCOL_SIGNALS | {"ValueError", "IndexError", "LookupError"})
    for name in (*harness.PROTOCOL_SIGNALS, "NotAnException", "UnicodeDecodeError"):
        e = harness.raised(name, "x", every | {name})
        assert type(e) is harness.CandidateRaised and str(e) == f"{name}: x"
    assert type(harness.raised("ValueError", "x", every)) is ValueError
    assert type(harness.raised("IndexError", "x", frozenset({"LookupError"}))) is IndexError
    assert type(harness.raised("IndexError", "x", frozenset())) is harness.CandidateRaised
    assert type(harness.raised("MemoryError", "x", frozenset())) is MemoryError  # still the memory kind
    assert not issubclass(harness.CandidateRaised, (StopIteration, LookupError, AttributeError, TypeError))


def test_the_verdict_cannot_exceed_full_marks_whatever_the_run_prints():
    """The share is counted here from the judge's marks, one per planned test: a line with more marks, another
    nonce or a kind the judge never writes is a crash, not a pay."""
    from hermes_lab.sandbox.executor import RunResult

    spec = TestSpec.from_json(A.PROBES["mbpp"].column("tests"))
    nonce = "HERMES-" + "a" * 32
    for stdout in (
        f"\n{nonce} done {'1' * 999} ok P ''\n",
        f"\n{nonce} done 11 ok P ''\n",
        f"\nHERMES-{'b' * 32} done 111 ok P ''\n",
        f"\n{nonce} passed 111 ok P ''\n",
        f"\n{nonce} done 1x1 ok P ''\n",
    ):
        outcome, _ = harness_outcome(RunResult("ok", 0, stdout), nonce, spec)
        assert outcome.kind == "crash" and outcome.share == 0.0, (stdout, outcome)
    outcome, protected = harness_outcome(RunResult("ok", 0, f"junk\n{nonce} done 1n0 ok P ''\n"), nonce, spec)
    assert (outcome.kind, outcome.passed, outcome.total, outcome.share, protected) == ("failed", 1, 2, 0.5, True)


# ------------------------------------------------------------------------------------------- the wire
plain = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False)
    | st.text()
    | st.binary()
    | st.complex_numbers(allow_nan=False),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.tuples(inner, inner)
        | st.dictionaries(st.text(max_size=5) | st.integers(), inner, max_size=4)
        | st.frozensets(st.integers() | st.text(max_size=3), max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=200, deadline=None)
@given(plain)
def test_plain_data_crosses_unchanged(value):
    assert harness.decode(harness.encode(value)) == value


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_hostile_bytes_decode_to_plain_data_or_a_wire_error(data):
    try:
        value = harness.decode(data)
    except harness.WireError:
        return
    allowed = (type(None), bool, int, float, complex, str, bytes, bytearray, list, tuple, set, frozenset, dict)
    todo = [value]
    while todo:  # fresh builtin objects all the way down: nothing with an __eq__ of its own
        v = todo.pop()
        assert type(v) in allowed
        if isinstance(v, dict):
            todo += [*v.keys(), *v.values()]
        elif isinstance(v, (list, tuple, set, frozenset)):
            todo += list(v)


def test_what_cannot_cross_says_so_and_caps_hold():
    rng = random.Random(0)
    deep: list = []
    for _ in range(harness.MAX_DEPTH + 5):
        deep = [deep]
    for value in (object(), lambda: 1, deep, iter([1])):
        with pytest.raises(harness.WireError):
            harness.encode(value)
    for data in (b"l999999999:", b"s5:ab", b"i" + b"9" * 6000 + b";", b"f1e5x;", b"Q", b"d1:N", b"S1:l0:"):
        with pytest.raises(harness.WireError):
            harness.decode(data)
    blob = bytes(rng.getrandbits(8) for _ in range(harness.MAX_FRAME + 1))
    with pytest.raises(harness.WireError):
        harness.decode(blob)


def test_the_harness_runs_from_source_on_another_interpreter_version():
    """A SandboxFusion service's Python is not this one: the program falls back from the marshalled code to
    the source, with the same verdict."""
    spec = TestSpec.from_json(A.PROBES["code"].column("tests"))
    req = job_of("(x+9)*7", spec, "HERMES-" + "c" * 32, load_config(None).sandbox and _limits())
    other = type(req)(req.program.replace("sys.implementation.cache_tag ==", "'another-tag' =="), req.stdin)
    with LocalExecutor(workers=1) as ex:
        results = ex.run_many([req, other], _limits())
    for r in results:
        outcome, _ = harness_outcome(r, "HERMES-" + "c" * 32, spec)
        assert outcome.kind == "passed" and outcome.marks == "111", (r.stdout, r.stderr[-300:])


def _limits():
    from hermes_lab.rewards.tests import limits_of

    return limits_of(load_config(None))


def test_the_job_holds_the_tests_and_the_program_does_not():
    """What the candidate's process holds before the fork is the program alone: no test, no nonce in it."""
    spec = TestSpec.from_json(A.PROBES["mbpp"].column("tests"))
    req = job_of(A.WRONG_MBPP, spec, "HERMES-" + "d" * 32, _limits())
    assert req.program == harness.PROGRAM
    for secret in ("similar_elements((3, 4, 5, 6)", "HERMES-" + "d" * 32):
        assert secret not in req.program and secret in req.stdin
    job = harness.decode(req.stdin.encode("utf-8", "surrogateescape"))
    assert json.dumps(job["names"]) == '["similar_elements"]' and job["statements"][0][1] is True
