"""The docs point at what exists: README.md stays a newcomer's page (at most MAX_README_LINES lines) whose layout
tree names every package and notebook, and every relative link and every backticked repo path or ``hermes_lab``
module name in README.md and docs/*.md resolves.

A backticked path is checked when its first part is a top-level entry of the checkout (``hermes_lab/``,
``tests/``, ``params/``, ``Makefile``...), ``runs/`` excepted (a round's outputs, git-ignored); a dotted name
``hermes_lab.x.y`` (or ``hermes_lab.x.y:attr``) when it names a module, a package, or a name a module defines.
Placeholders (``round-NN``, ``<experiment>``, ``*``, ``...``) and fenced code blocks are left alone. Reads the
files only; fast.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

from repo_paths import REPO

MAX_README_LINES = 200
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
TOP = {p.name for p in REPO.iterdir() if not p.name.startswith(".") or p.name == ".ci"} - {"runs", ".venv"}
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE = re.compile(r"`([^`\n]+)`")
PLACEHOLDER = re.compile(r"NN|<|>|\*|\.\.\.|\{|\$")


def _prose(path: Path) -> str:
    """The file without its fenced code blocks (a fence's lines kept as blanks: line numbers stay right)."""
    return FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), path.read_text(encoding="utf-8"))


def _spans(path: Path, pattern: re.Pattern[str]) -> list[tuple[int, str]]:
    text = _prose(path)
    return [(text.count("\n", 0, m.start()) + 1, m.group(1)) for m in pattern.finditer(text)]


@cache
def _defined(module: Path) -> frozenset[str]:
    """The names a module's top level defines (functions, classes, assignments, imports)."""
    names: set[str] = set()
    for node in ast.parse(module.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return frozenset(names)


def _module_name_resolves(name: str) -> bool:
    """``hermes_lab.a.b[.attr][:attr]``: the longest prefix that is a module or package, the rest one name it
    defines (or, after a class, an attribute of it: not checked further)."""
    dotted, _, attr = name.partition(":")
    parts = dotted.split(".")
    for k in range(len(parts), 0, -1):
        base = REPO.joinpath(*parts[:k])
        module = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
        if not module.is_file():
            continue
        rest = parts[k:] + ([attr] if attr else [])
        return not rest or rest[0] in _defined(module)
    return False


def _repo_path(span: str) -> Path | None:
    """Where a backticked span points in the checkout, if it is a path: from the top (``tests/x.py``), or a
    module named from inside the package (``live/arms.py``, as ARCHITECTURE.md names them)."""
    if " " in span or PLACEHOLDER.search(span):
        return None
    first = span.split("/")[0]
    if first in TOP and ("/" in span or "." in span):
        return REPO / span
    if span.endswith(".py") and "/" in span and (REPO / "hermes_lab" / first).is_dir():
        return REPO / "hermes_lab" / span
    return None


def test_readme_is_a_page_a_newcomer_reads():
    n = len((REPO / "README.md").read_text(encoding="utf-8").splitlines())
    assert n <= MAX_README_LINES, f"README.md has {n} lines (at most {MAX_README_LINES}): move a topic to docs/"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_link_and_backticked_path_resolves(doc):
    missing = []
    for line, target in _spans(doc, LINK):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # a URL or an anchor of the same page
        if not (doc.parent / target.split("#", 1)[0]).exists():
            missing.append(f"{doc.name}:{line}: link ({target})")
    for line, span in _spans(doc, CODE):
        span = span.strip().rstrip("/") or span
        path = _repo_path(span)
        if path is not None and not path.exists():
            missing.append(f"{doc.name}:{line}: `{span}` (no such file or folder)")
        elif re.fullmatch(r"hermes_lab(\.\w+)+(:\w+)?", span) and not _module_name_resolves(span):
            missing.append(f"{doc.name}:{line}: `{span}` (no such module or name)")
    assert not missing, "pointers that lead nowhere:\n" + "\n".join(missing)


def test_the_readme_layout_names_every_package_and_nothing_else():
    """The README's layout tree: each folder and notebook it lists exists, and it lists every package of
    hermes_lab/ and every notebook (a package or notebook renamed or added shows here)."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    tree = re.search(r"^## Layout\n+```text\n(.*?)^```", text, re.S | re.M)
    assert tree, "README.md has no ```text layout block under '## Layout'"
    top, listed, missing = None, set(), []
    for line in tree.group(1).splitlines():
        if line and not line[0].isspace():
            top = line.split()[0]
            if not (REPO / top).exists():
                missing.append(top)
        elif top and line.startswith("  ") and not line.startswith("   "):
            for name in line.split():
                if not name.endswith(("/", ".ipynb")):
                    break
                listed.add((top, name.rstrip("/")))
                if not (REPO / top / name).exists():
                    missing.append(top + name)
    assert not missing, f"the README's layout lists what does not exist: {missing}"
    packages = {p.parent.name for p in (REPO / "hermes_lab").glob("*/__init__.py")}
    in_tree = {name for t, name in listed if t == "hermes_lab/"}
    assert in_tree == packages, f"not in the layout: {sorted(packages - in_tree)}; gone: {sorted(in_tree - packages)}"
    notebooks = {p.name for p in (REPO / "notebooks").glob("*.ipynb")}
    assert {name for t, name in listed if t == "notebooks/"} == notebooks, "the layout's notebooks are not notebooks/'s"


def test_the_checks_catch_what_they_are_for(tmp_path):
    """The checks themselves: a stale path, a stale module name and a dead link are found; placeholders not."""
    doc = tmp_path / "x.md"
    doc.write_text(
        "`hermes_lab/nowhere.py` `hermes_lab.live.nowhere` [a](gone.md) `runs/round-NN/train/` `train/eval.json`\n"
        "`live/nowhere.py` `live/arms.py`\n"
        "```bash\n`hermes_lab/inside_a_fence.py`\n```\n"
        "`hermes_lab.live.log.open_conversations` `tests/house/test_docs.py`\n"
    )
    spans = [s for _, s in _spans(doc, CODE)]
    assert "hermes_lab/inside_a_fence.py" not in spans
    paths = [s for s in spans if _repo_path(s)]
    assert paths == ["hermes_lab/nowhere.py", "live/nowhere.py", "live/arms.py", "tests/house/test_docs.py"]
    assert [s for s in paths if not _repo_path(s).exists()] == ["hermes_lab/nowhere.py", "live/nowhere.py"]
    assert not _module_name_resolves("hermes_lab.live.nowhere")
    assert _module_name_resolves("hermes_lab.live.log.open_conversations")
    assert _module_name_resolves("hermes_lab.tasks.hermes:WorkspaceEnv")  # the round's agent environment
    assert _module_name_resolves("hermes_lab.tasks.agent:TimeEnv")
    assert [t for _, t in _spans(doc, LINK)] == ["gone.md"]
