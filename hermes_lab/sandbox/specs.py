"""Test shapes: what a task's tests look like, how a completion's code runs against them, what it scored.

Stage: prep (``parse_tests`` validates a record's tests), train (the tests reward), every stage that scores the
embedded code family. Reads and writes nothing; programs run through an ``Executor``.

Three shapes, the ones users hold:

- ``assert`` (MBPP): ``tests: ["assert f(1) == 2", ...]``, or MBPP's own ``test_list`` (+ ``test_setup_code``).
  One test is one statement; the program is the code and a harness, run once.
- ``check`` (HumanEval): ``tests: "def check(candidate): ..."`` + ``entry_point``, or HumanEval's own ``test`` +
  ``entry_point``. One test is each top-level statement of check's body holding an assert; code + harness.
- ``io`` (APPS, CodeContests): ``tests: [{"input": ..., "output": ...}]``, or APPS' ``input_output``
  (``{"inputs": [...], "outputs": [...]}``, also as JSON text). One test is one stdin -> stdout case; the
  program is the code itself, run once a case.

``tests`` may also be a normalised spec (``TestSpec.to_dict()``: ``{"kind": ..., ...}``), which is what prep
writes into the GRPO dataset's ``tests`` column (a JSON string) and what the embedded code family carries.

``prefix``: code the completion continues. HumanEval's prompt is a signature and docstring, a completion
model writes the body: with ``entry_point`` set and the completion defining no ``def <entry_point>``, the
program is prefix + completion; when it does define it, the prefix's imports still go first. The embedded
code family's prefix is ``def f(x):\\n    return `` (the policy writes an expression).

Scoring (``TestRunner.score``): a completion's code is checked for syntax here (a compile error costs no run),
then runs once (``assert``, ``check``: every test in one process, each test's pass or failure reported on a
line that carries a per-run random marker the program cannot know in advance, so printing a fake report
earns nothing) or once a case (``io``: stdout compared line by line, trailing whitespace ignored). Its kind
is the worst that happened: ``compile_error``, ``timeout``, ``memory``, ``output_limit``, ``crash`` (killed,
or it exited before its tests reported: ``os._exit`` passes nothing) and ``no_code`` score 0;
``runtime_error`` (the code raised before any test ran) passes nothing; ``failed`` is some tests passed;
``passed`` all; ``sandbox_error`` (the executor failed, not the completion) scores None. Results are cached
by (code, spec): a group's duplicate completions run once.
"""

from __future__ import annotations

import ast
import hashlib
import json
import re
import secrets
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Any

from hermes_lab.sandbox.executor import Executor, Limits, RunRequest, RunResult

KINDS = (
    "passed",
    "failed",
    "runtime_error",
    "compile_error",
    "timeout",
    "memory",
    "output_limit",
    "crash",
    "no_code",
    "sandbox_error",
)
ZERO_KINDS = frozenset({"compile_error", "timeout", "memory", "output_limit", "crash", "no_code", "runtime_error"})
MAX_TESTS = 256  # tests or cases of one task (a bigger list is refused at prep, by line)
_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.S)
_PY_LANGS = {"", "python", "py", "python3"}


class SpecError(ValueError):
    """A record's tests do not parse: the message names the field and why (prep rejects the line)."""


@dataclass(frozen=True)
class TestSpec:
    __test__ = False  # not a pytest class, whatever its name

    kind: str  # assert | check | io
    tests: tuple[str, ...] = ()  # assert: one statement each
    check: str = ""  # check: source defining check(candidate)
    entry_point: str = ""  # check (and assert, optionally): the function the completion must define
    cases: tuple[tuple[str, str], ...] = ()  # io: (stdin, expected stdout)
    setup: str = ""  # code run before the tests (MBPP's test_setup_code)
    prefix: str = ""  # code the completion continues (HumanEval's prompt)

    @property
    def n_tests(self) -> int:
        if self.kind == "io":
            return len(self.cases)
        if self.kind == "check":
            return sum(t for _, t in _check_parts(self.check)[1]) or 1
        return len(self.tests)

    def to_dict(self) -> dict[str, Any]:
        """JSON-native (lists, not tuples): what a trajectory record's ``tests`` field holds."""
        d = asdict(self)
        d["tests"], d["cases"] = list(self.tests), [list(c) for c in self.cases]
        return {k: v for k, v in d.items() if v or k == "kind"}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str | None) -> TestSpec | None:
        """The column value prep wrote (JSON text), or None for a row without tests."""
        if not text:
            return None
        return parse_tests({"tests": json.loads(text)})


# ----------------------------------------------------------------------------------------- parsing
def _strings(v: Any, where: str) -> list[str]:
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise SpecError(f"{where} must be a list of strings")
    return v


def _parses(src: str, where: str) -> None:
    try:
        ast.parse(src)
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        msg = getattr(e, "msg", None) or type(e).__name__
        raise SpecError(f"{where} does not parse: {msg} (line {getattr(e, 'lineno', '?')})") from None


def _ident(v: Any, where: str) -> str:
    if not isinstance(v, str) or not v.isidentifier():
        raise SpecError(f"{where} must be a Python identifier, got {json.dumps(v)[:40]}")
    return v


def _cases(inputs: Any, outputs: Any, where: str) -> tuple[tuple[str, str], ...]:
    if not isinstance(inputs, list) or not isinstance(outputs, list) or len(inputs) != len(outputs):
        raise SpecError(f"{where}: inputs and outputs must be lists of the same length")

    def text(v: Any) -> str:  # APPS stores some outputs as lists of lines
        if isinstance(v, list) and all(isinstance(x, str) for x in v):
            return "\n".join(v)
        if not isinstance(v, str):
            raise SpecError(f"{where}: every input and output must be a string (or a list of lines)")
        return v

    return tuple((text(i), text(o)) for i, o in zip(inputs, outputs))


def parse_tests(rec: dict[str, Any], prompt: str | None = None) -> TestSpec | None:
    """The tests a record carries, as a ``TestSpec``; None when it carries none; ``SpecError`` naming the
    field when they do not parse. ``prompt``: the record's prompt, HumanEval's code prefix for ``check``."""
    t = rec.get("tests")
    entry = rec.get("entry_point")
    setup = rec.get("test_setup_code") or ""
    if t is None and rec.get("test_list") is not None:  # MBPP
        t = rec["test_list"]
    if t is None and isinstance(rec.get("test"), str):  # HumanEval
        t = rec["test"]
    if t is None and rec.get("input_output") is not None:  # APPS
        t = rec["input_output"]
        if isinstance(t, str):
            try:
                t = json.loads(t)
            except ValueError as e:
                raise SpecError(f"input_output is not JSON: {e}") from None
    if t is None:
        if entry is not None:
            raise SpecError("entry_point is set but there are no tests (tests, test, test_list or input_output)")
        return None
    if not isinstance(setup, str):
        raise SpecError("test_setup_code must be a string")
    if isinstance(t, dict) and "kind" in t:
        spec = _from_dict(t)
    elif isinstance(t, dict) and ("inputs" in t or "outputs" in t):
        if t.get("fn_name"):
            raise SpecError("input_output with fn_name (call-based APPS tests): give them as assert lines")
        spec = TestSpec("io", cases=_cases(t.get("inputs"), t.get("outputs"), "input_output"), setup=setup)
    elif isinstance(t, str):
        if entry is None:
            raise SpecError("tests is a check function (HumanEval): entry_point names the function it checks")
        spec = TestSpec("check", check=t, entry_point=_ident(entry, "entry_point"), prefix=prompt or "")
    elif isinstance(t, list) and t and all(isinstance(x, dict) for x in t):
        if not all(set(x) >= {"input", "output"} for x in t):
            raise SpecError("tests: stdin/stdout cases need an 'input' and an 'output' each")
        spec = TestSpec("io", cases=_cases([x["input"] for x in t], [x["output"] for x in t], "tests"))
    elif isinstance(t, list):
        spec = TestSpec(
            "assert",
            tests=tuple(_strings(t, "tests")),
            setup=setup,
            entry_point=_ident(entry, "entry_point") if entry else "",
        )
    else:
        raise SpecError("tests must be a list of assert lines, a check function, or stdin/stdout cases")
    return validate(spec)


def _from_dict(d: dict[str, Any]) -> TestSpec:
    known = {f for f in TestSpec.__dataclass_fields__}
    extra = set(d) - known
    if extra:
        raise SpecError(f"tests: unknown key {sorted(extra)[0]!r} (known: {', '.join(sorted(known))})")
    if d["kind"] not in ("assert", "check", "io"):
        raise SpecError(f"tests.kind must be assert, check or io, got {json.dumps(d['kind'])[:40]}")
    for k in ("check", "entry_point", "setup", "prefix"):
        if not isinstance(d.get(k, ""), str):
            raise SpecError(f"tests.{k} must be a string")
    cases = d.get("cases", [])
    if not isinstance(cases, list) or not all(isinstance(c, list) and len(c) == 2 for c in cases):
        raise SpecError("tests.cases must be a list of [stdin, stdout] pairs")
    return TestSpec(
        d["kind"],
        tests=tuple(_strings(d.get("tests", []), "tests.tests")),
        check=d.get("check", ""),
        entry_point=d.get("entry_point", ""),
        cases=_cases([c[0] for c in cases], [c[1] for c in cases], "tests.cases"),
        setup=d.get("setup", ""),
        prefix=d.get("prefix", ""),
    )


def validate(spec: TestSpec) -> TestSpec:
    """Every test parses, there is at least one and at most MAX_TESTS; a check function is defined."""
    n = {"assert": len(spec.tests), "io": len(spec.cases), "check": 1}[spec.kind]
    if n == 0:
        raise SpecError("tests is empty: a task with tests needs at least one")
    if n > MAX_TESTS:
        raise SpecError(f"{n} tests: at most {MAX_TESTS} a task")
    for i, t in enumerate(spec.tests):
        _parses(t, f"tests[{i}]")
    if spec.setup:
        _parses(spec.setup, "test_setup_code")
    if spec.kind == "check":
        _parses(spec.check, "the check function")
        if _check_parts(spec.check)[2] is None:
            raise SpecError("the check function: no 'def check(candidate)' at its top level")
        if spec.entry_point and not spec.entry_point.isidentifier():
            raise SpecError("entry_point must be a Python identifier")
    return spec


def _check_parts(src: str) -> tuple[str, list[tuple[str, bool]], str | None]:
    """HumanEval's test source split into (module-level code other than check, check's body statements as
    (source, is a test), the name of check's argument). A top-level statement of check's body that contains an
    assert is one test; the others are setup, run in order. A body with no assert or a return at its top level
    cannot be split: then check(candidate) as a whole is the one test (an empty list)."""
    try:
        tree = ast.parse(src)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return src, [], None
    fn = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "check"), None)
    if fn is None or len(fn.args.args) != 1:
        return src, [], None
    arg = fn.args.args[0].arg
    body = [(ast.unparse(s), any(isinstance(n, ast.Assert) for n in ast.walk(s))) for s in fn.body]
    if any(isinstance(s, ast.Return) for s in fn.body) or not any(t for _, t in body):
        return src, [], arg
    return ast.unparse(ast.Module([n for n in tree.body if n is not fn], [])), body, arg


# ------------------------------------------------------------------------------------------ code
def extract_code(completion: str, mode: str = "auto") -> str | None:
    """The code of a completion. ``fenced``: the last ```python (or unlabelled) block, None without one;
    ``whole``: the completion as it is; ``auto``: the fenced block when there is one, else the whole."""
    if mode == "whole":
        return completion
    blocks = [body for lang, body in _FENCE.findall(completion or "") if lang.lower() in _PY_LANGS]
    if blocks:
        return blocks[-1]
    return None if mode == "fenced" else completion


def _defines(code: str, name: str) -> bool:
    return bool(name) and re.search(rf"^\s*(async\s+)?def\s+{re.escape(name)}\s*\(", code, re.M) is not None


def _imports(src: str) -> str:
    try:
        tree = ast.parse(src)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return ""
    return "\n".join(ast.unparse(n) for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom)))


def solution_source(code: str, spec: TestSpec) -> str:
    """The completion's code as it runs: continued from the prefix, or with the prefix's imports first."""
    if not spec.prefix:
        return code
    if _defines(code, spec.entry_point):
        imports = _imports(spec.prefix)
        return f"{imports}\n{code}" if imports else code
    return spec.prefix + code


# The harness binds what it uses before the completion's code runs: rebinding builtins (exec, isinstance...)
# from the code changes nothing here. It does not hide itself from a program that goes looking (its report
# function is reachable through sys.modules): the marker stops blind forgery, such as printing a pass line.
HARNESS = """\
import os as _os
_out, _write, _exec, _compile, _isinstance = _os.dup(1), _os.write, exec, compile, isinstance
_BaseException, _MemoryError, _AssertionError, _SystemExit = BaseException, MemoryError, AssertionError, SystemExit
def _report(kind, marks, detail=""):
    _write(_out, ("\\n%s %s %s %s\\n" % ({marker!r}, kind, marks or "-", detail.replace("\\n", " ")[:300])).encode())
_g = {{"__name__": "__main__", "__builtins__": __builtins__}}
try:
    _exec(_compile({solution!r}, "solution.py", "exec"), _g)
    _exec(_compile({setup!r}, "setup.py", "exec"), _g)
except _BaseException as _e:
    _report("runtime_error", "", type(_e).__name__ + ": " + str(_e))
    raise _SystemExit(0)
{bind}
_marks = ""
for _i, (_t, _counted) in enumerate({tests!r}):
    try:
        _exec(_compile(_t, "test_%d.py" % _i, "exec"), _g)
        _m = "1"
    except _BaseException as _e:
        _m = "m" if _isinstance(_e, _MemoryError) else "0" if _isinstance(_e, _AssertionError) else "e"
    if _counted:
        _marks += _m
_report("done", _marks)
"""
_BIND_CHECK = """\
try:
    _g[{arg!r}] = _g[{entry!r}]
except KeyError:
    _report("runtime_error", "", "the code defines no function named " + {entry!r})
    raise _SystemExit(0)
"""


def build_program(code: str, spec: TestSpec, marker: str) -> str:
    """The harness program of an assert / check spec (io runs the solution itself)."""
    solution, setup, bind = solution_source(code, spec), spec.setup, ""
    tests: list[tuple[str, bool]] = [(t, True) for t in spec.tests]
    if spec.kind == "check":
        module, body, arg = _check_parts(spec.check)
        setup = f"{setup}\n{module}" if setup else module
        bind = _BIND_CHECK.format(arg=arg or "candidate", entry=spec.entry_point)
        tests = body or [(f"check({spec.entry_point})", True)]
    return HARNESS.format(marker=marker, solution=solution, setup=setup, tests=tests, bind=bind)


# ------------------------------------------------------------------------------------------ outcome
@dataclass
class Outcome:
    kind: str  # one of KINDS
    passed: int = 0
    total: int = 0
    detail: str = ""
    marks: str = ""  # per test: 1 pass, 0 assertion failed, e error, m MemoryError, t timeout, - not run

    @property
    def share(self) -> float:
        return self.passed / self.total if self.total and self.kind not in ZERO_KINDS else 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _compile_error(source: str) -> str | None:
    try:
        compile(source, "solution.py", "exec", dont_inherit=True)
    except (SyntaxError, ValueError) as e:
        return f"{type(e).__name__}: {getattr(e, 'msg', e)} (line {getattr(e, 'lineno', '?')})"
    except (RecursionError, MemoryError) as e:
        return f"{type(e).__name__} while compiling"
    return None


def _run_kind(r: RunResult) -> str | None:
    """The kind a run's status says by itself (None: look at what the program reported)."""
    if r.status == "timeout":
        return "timeout"
    if r.status == "output_limit":
        return "output_limit"
    if r.status == "sandbox_error":
        return "sandbox_error"
    if r.status == "killed":
        return "crash"
    if r.status == "error" and "MemoryError" in r.stderr[-300:]:
        return "memory"
    return None


def harness_outcome(r: RunResult, marker: str, total: int) -> Outcome:
    kind = _run_kind(r)
    if kind is not None:
        return Outcome(kind, 0, total, r.detail or _tail(r.stderr), "-" * total)
    line = next((s for s in reversed(r.stdout.splitlines()) if s.startswith(marker + " ")), None)
    if line is None:
        return Outcome(
            "crash", 0, total, "exited before its tests reported: " + (_tail(r.stderr) or f"exit {r.exit_code}")
        )
    _, what, marks, detail = (line.split(" ", 3) + ["", "", ""])[:4]
    marks = "" if marks == "-" else marks
    if what == "runtime_error":
        return Outcome("memory" if detail.startswith("MemoryError") else "runtime_error", 0, total, detail, "-" * total)
    passed = marks.count("1")
    if "m" in marks:
        return Outcome("memory", passed, total, "MemoryError in a test", marks)
    return Outcome("passed" if passed == total else "failed", passed, total, "", marks)


def io_outcome(results: list[RunResult], spec: TestSpec) -> Outcome:
    marks, worst = "", None
    for r, (_, expected) in zip(results, spec.cases):
        kind = _run_kind(r)
        if kind is not None:
            worst = worst or kind
            marks += "t" if kind == "timeout" else "-"
        elif r.status == "ok" and _lines(r.stdout) == _lines(expected):
            marks += "1"
        else:
            marks += "e" if r.status == "error" else "0"
    total = len(spec.cases)
    if worst is not None:
        return Outcome(worst, 0, total, next(r.detail for r in results if _run_kind(r) == worst), marks)
    passed = marks.count("1")
    return Outcome("passed" if passed == total else "failed", passed, total, "", marks)


def _lines(text: str) -> list[str]:
    out = [s.rstrip() for s in text.replace("\r\n", "\n").split("\n")]
    while out and not out[-1]:
        out.pop()
    return out


def _tail(text: str) -> str:
    lines = [s for s in (text or "").strip().splitlines() if s.strip()]
    return lines[-1][:300] if lines else ""


# ------------------------------------------------------------------------------------------- runner
@dataclass
class RunnerStats:
    completions: int = 0
    cache_hits: int = 0
    executions: int = 0  # programs the executor ran
    by_kind: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class TestRunner:
    """Scores completions' code against specs through an executor, with an LRU cache by (code, spec)."""

    __test__ = False  # not a pytest class, whatever its name

    def __init__(self, executor: Executor, limits: Limits | None = None, cache_size: int = 100_000):
        self.executor, self.limits = executor, limits or Limits()
        self.cache: OrderedDict[str, Outcome] = OrderedDict()
        self.cache_size = cache_size
        self.stats = RunnerStats()

    @staticmethod
    def key(code: str, spec: TestSpec) -> str:
        return hashlib.sha256(f"{len(code)}:{code}\0{spec.to_json()}".encode("utf-8", "surrogatepass")).hexdigest()

    def score(self, codes: list[str | None], specs: list[TestSpec | None]) -> list[Outcome | None]:
        """One Outcome per completion (None where the spec is None: no tests, not applicable)."""
        out: list[Outcome | None] = [None] * len(codes)
        todo: dict[str, tuple[str, TestSpec, list[int]]] = {}
        for i, (code, spec) in enumerate(zip(codes, specs)):
            if spec is None:
                continue
            self.stats.completions += 1
            if code is None or not code.strip():
                out[i] = Outcome("no_code", 0, spec.n_tests, "no code in the completion")
                continue
            k = self.key(code, spec)
            hit = self.cache.get(k)
            if hit is not None:
                self.cache.move_to_end(k)
                self.stats.cache_hits += 1
                out[i] = hit
            elif k in todo:
                self.stats.cache_hits += 1  # a duplicate within the batch: runs once
                todo[k][2].append(i)
            else:
                todo[k] = (code, spec, [i])
        for k, outcome in self._run(todo).items():
            for i in todo[k][2]:
                out[i] = outcome
            if outcome.kind != "sandbox_error":  # an executor fault is retried next time, not remembered
                self.cache[k] = outcome
                if len(self.cache) > self.cache_size:
                    self.cache.popitem(last=False)
        for o in out:
            if o is not None:
                self.stats.by_kind[o.kind] = self.stats.by_kind.get(o.kind, 0) + 1
        return out

    def _run(self, todo: dict[str, tuple[str, TestSpec, list[int]]]) -> dict[str, Outcome]:
        done: dict[str, Outcome] = {}
        requests: list[RunRequest] = []
        plan: list[tuple[str, TestSpec, str, int]] = []  # key, spec, marker, how many requests
        for k, (code, spec, _) in todo.items():
            source = solution_source(code, spec)
            err = _compile_error(source)
            if err is not None:
                done[k] = Outcome("compile_error", 0, spec.n_tests, err)
                continue
            if spec.kind == "io":
                program = f"{spec.setup}\n{source}" if spec.setup else source
                requests += [RunRequest(program, stdin) for stdin, _ in spec.cases]
                plan.append((k, spec, "", len(spec.cases)))
            else:
                marker = "HERMES-" + secrets.token_hex(8)  # per run: the program cannot print it in advance
                requests.append(RunRequest(build_program(code, spec, marker)))
                plan.append((k, spec, marker, 1))
        results = self.executor.run_many(requests, self.limits)
        self.stats.executions += len(requests)
        at = 0
        for k, spec, marker, n in plan:
            rs = results[at : at + n]
            at += n
            done[k] = io_outcome(rs, spec) if spec.kind == "io" else harness_outcome(rs[0], marker, spec.n_tests)
        return done
