"""The house: hermes_lab's import graph has no cycle (function-level imports included), the package root stays
small, the layers hold (`lint-imports`, the contracts in pyproject.toml), and every module entry point, the
user's own commands first, answers --help.

The graph comes from grimp, which reads every import statement of every module, those inside functions and
under ``if TYPE_CHECKING`` too: an import a reader cannot see at the top of a file still counts.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

from repo_paths import REPO

PKG = REPO / "hermes_lab"
# the user's commands as docs/SPEC.md and the README write them: they must keep working as typed
USER_COMMANDS = ("hermes_lab.prep", "hermes_lab.train", "hermes_lab.ab_run", "hermes_lab")
MAX_FLAT = 10  # modules at the package root (issue 26: everything else lives in a stage or service package)


def _graph() -> grimp.ImportGraph:
    return grimp.build_graph("hermes_lab", include_external_packages=False)


def _cycle(graph: grimp.ImportGraph) -> list[str] | None:
    """One import cycle between modules, as a path a -> b -> ... -> a, or None (iterative DFS, colours)."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    for root in sorted(graph.modules):
        if state.get(root):
            continue
        stack = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        path = [root]
        state[root] = 1
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                state[node] = 2
                stack.pop()
                path.pop()
            elif state.get(child) == 1:
                return path[path.index(child) :] + [child]
            elif not state.get(child):
                state[child] = 1
                path.append(child)
                stack.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
    return None


def test_the_import_graph_has_no_cycle():
    graph = _graph()
    assert len(graph.modules) > 50  # the whole package was read, not an empty shell
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_cycle_finder_finds_a_cycle():
    """The check above could not fail if _cycle never found anything: feed it one."""
    g = grimp.ImportGraph()
    for m in ("x", "x.a", "x.b", "x.c"):
        g.add_module(m)
    g.add_import(importer="x.a", imported="x.b")
    g.add_import(importer="x.b", imported="x.c")
    assert _cycle(g) is None
    g.add_import(importer="x.c", imported="x.a")
    assert _cycle(g) == ["x.a", "x.b", "x.c", "x.a"]


def test_at_most_ten_flat_modules_at_the_package_root():
    flat = sorted(p.name for p in PKG.glob("*.py"))
    assert len(flat) <= MAX_FLAT, flat
    packages = sorted(p.name for p in PKG.iterdir() if (p / "__init__.py").is_file())
    for name in packages:  # modules inside a package carry no prefix the package already says
        for mod in (PKG / name).glob("*.py"):
            assert not mod.stem.startswith(f"{name}_"), f"{name}/{mod.name}: drop the '{name}_' prefix"


def test_lint_imports_contracts_hold():
    r = subprocess.run(
        [str(Path(sys.executable).parent / "lint-imports"), "--no-cache"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "0 broken" in r.stdout and "Contracts: " in r.stdout, r.stdout[-2000:]


def _entry_points() -> list[str]:
    """Every `python -m` target in the package: modules with a __main__ block, packages with __main__.py."""
    out = []
    for p in sorted(PKG.rglob("*.py")):
        mod = ".".join(p.relative_to(REPO).with_suffix("").parts)
        if p.name == "__main__.py":
            out.append(mod.rsplit(".", 1)[0])
            continue
        tree = ast.parse(p.read_text(encoding="utf-8"))
        for node in tree.body:
            if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
                out.append(mod)
    return out


ENTRY_POINTS = _entry_points()


def test_the_users_commands_are_entry_points():
    assert set(USER_COMMANDS) <= set(ENTRY_POINTS), sorted(set(USER_COMMANDS) - set(ENTRY_POINTS))
    assert len(ENTRY_POINTS) >= 15  # every stage module's own too


@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_every_entry_point_answers_help(module):
    r = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("usage:"), r.stdout[:200]
    if module in ("hermes_lab.prep", "hermes_lab.train", "hermes_lab.ab_run"):  # named as the user types it
        assert r.stdout.startswith(f"usage: python -m {module} "), r.stdout[:200]
