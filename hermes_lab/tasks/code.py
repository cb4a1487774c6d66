"""The embedded code family: a one-line Python function from a short spec, checked by hidden tests.

Reads and writes nothing; ``hermes_lab.tasks.suite`` draws, parses and scores these tasks beside the others, and
runs their tests through the local sandbox (``hermes_lab.sandbox``), the same machinery the tests reward uses.

A prompt lists operations applied to ``x`` in order; the policy writes the body of ``def f(x): return ...``::

    py +3=           ->  x+3
    py +3 *2=        ->  (x+3)*2          (or 2*(x+3), or x*2+6: any expression the tests accept)
    py *2 +3 ^2=     ->  (x*2+3)**2

Operations: ``+k`` ``-k`` (k 1-9), ``*k`` ``%k`` ``//k`` (k 2-9), ``^2`` (square). The level is the number of
operations (1-3): each new one must respect Python's precedence, parenthesising what came before when the new
operation binds tighter, which is what makes level 3 harder than level 1.

The hidden tests are three MBPP-style asserts on ``f`` at inputs drawn from the prompt's hash (so a logged
prompt always has the same tests), with the prefix ``def f(x):\\n    return `` that the completion continues: a
``TestSpec("assert", ..., prefix=PREFIX, entry_point="f")``. A completion passes when every test passes;
different correct expressions pass alike, which a string comparison with the canonical answer would not see.
"""

from __future__ import annotations

import hashlib
import random
import re

from hermes_lab.sandbox.executor import Limits
from hermes_lab.sandbox.specs import Outcome, TestRunner, TestSpec

PREFIX = "def f(x):\n    return "
ENTRY = "f"
N_TESTS = 3
LEVELS = 3
_OP = r"(?:[-+][1-9]|[*%][2-9]|//[2-9]|\^2)"
PARSE = re.compile(rf"^{_OP}(?: {_OP}){{0,{LEVELS - 1}}}$")
# Python precedence of an expression's outermost operator: + - lowest, then * // %, then **, then an atom
_PREC = {"+": 1, "-": 1, "*": 2, "%": 2, "//": 2, "**": 3}
ATOM = 4


def _split(op: str) -> tuple[str, int]:
    """'+3' -> ('+', 3), '//2' -> ('//', 2), '^2' -> ('**', 2)."""
    if op == "^2":
        return "**", 2
    sym = "//" if op.startswith("//") else op[0]
    return sym, int(op[len(sym) :])


def _apply(expr: str, prec: int, op: str, commute: bool = False) -> tuple[str, int]:
    """``expr`` (whose outermost operator has precedence ``prec``) with one more operation applied to it."""
    sym, k = _split(op)
    p = _PREC[sym]
    # left operand: parenthesised when it binds looser than the new operator, or as tightly for ** (right-assoc.)
    left = f"({expr})" if prec < p or (sym == "**" and prec == p) else expr
    if commute and sym == "*":  # k*(...): the same function, another string; a right operand of equal
        right = f"({expr})" if prec <= p else expr  # precedence needs its parentheses (k*(a%b) != k*a%b)
        return f"{k}*{right}", p
    return f"{left}{sym}{k}", p


def solve(x: str) -> str:
    """The canonical answer for an input (its operations, space-separated)."""
    expr, prec = "x", ATOM
    for op in x.split():
        expr, prec = _apply(expr, prec, op)
    return expr


def variant(x: str, rng: random.Random) -> str:
    """A correct answer in another form than the canonical one (k*(...), x*x for x**2), when one exists."""
    expr, prec = "x", ATOM
    for op in x.split():
        if op == "^2" and prec == ATOM and rng.random() < 0.5:
            expr, prec = f"{expr}*{expr}", _PREC["*"]
            continue
        expr, prec = _apply(expr, prec, op, commute=rng.random() < 0.5)
    return expr


def make_input(rng: random.Random, level: int) -> str:
    ops = []
    for _ in range(level):
        kind = rng.choice(("+", "-", "*", "%", "//", "^"))
        if kind == "^":
            ops.append("^2")
        else:
            ops.append(f"{kind}{rng.randint(1 if kind in '+-' else 2, 9)}")
    return " ".join(ops)


def level_of(x: str) -> int:
    return max(1, min(len(x.split()), LEVELS))


def valid(x: str) -> bool:
    return PARSE.match(x) is not None


def inputs(x: str) -> list[int]:
    """The hidden tests' inputs: three distinct integers in -9..20 from the spec's hash."""
    rng = random.Random(int(hashlib.sha1(f"code-tests:{x}".encode()).hexdigest()[:12], 16))
    return rng.sample(range(-9, 21), N_TESTS)


def value(expr: str, x: int) -> int:
    """What an expression built by ``solve`` gives at ``x``: only the operators above, on ints (trusted input)."""
    return int(eval(expr, {"__builtins__": {}}, {"x": x}))


def spec(x: str) -> TestSpec:
    """The hidden tests of an input, as the sandbox runs them."""
    answer = solve(x)
    tests = tuple(f"assert f({a}) == {value(answer, a)}" for a in inputs(x))
    return TestSpec("assert", tests=tests, entry_point=ENTRY, prefix=PREFIX)


# ------------------------------------------------------------------------------------------ scoring
_RUNNER: TestRunner | None = None
LIMITS = Limits(timeout_s=2.0, cpu_s=2.0, memory_mb=256, max_output_kb=64)  # an expression needs no more


def runner() -> TestRunner:
    """The family's test runner: the local sandbox, one run a core, a cache shared by the whole process."""
    global _RUNNER
    if _RUNNER is None:
        from hermes_lab.sandbox.local import LocalExecutor

        _RUNNER = TestRunner(LocalExecutor(), LIMITS, cache_size=200_000)
    return _RUNNER


def run_tests(responses: list[str], xs: list[str]) -> list[Outcome]:
    """Each response (the whole completion is the expression) against its input's hidden tests."""
    out = runner().score([r.strip() for r in responses], [spec(x) for x in xs])
    return [o if o is not None else Outcome("no_code") for o in out]
