"""tests/ itself (issue 59): it mirrors the packages (tests/<package>/ for a package of hermes_lab/, house/ for the
checks of the whole project, e2e/ for the slow end-to-end tests), only the shared helpers sit at its root, and a test
file's name is unique in all of it: pytest imports a test module by that name, one test imports another's helpers by
it, and tests/conftest.py's LONGEST_FIRST and POLICY_FREE name files by it (those names must be files). Fast."""

from __future__ import annotations

from conftest import LONGEST_FIRST, POLICY_FREE
from repo_paths import REPO, TESTS

SHARED = {"conftest.py", "repo_paths.py", "fake_openai.py", "gateway_process.py", "families.py", "forced_lm.py"}


def test_tests_mirror_the_packages_with_unique_file_names():
    flat = sorted(p.name for p in TESTS.glob("*.py") if p.name not in SHARED)
    assert not flat, f"test files at tests/'s root: {flat} (tests/<package>/, tests/house/ or tests/e2e/)"
    files = sorted(TESTS.glob("**/test_*.py"))
    deep = [p.relative_to(TESTS).as_posix() for p in files if len(p.relative_to(TESTS).parts) != 2]
    assert not deep, f"test files not one folder down (tests/<folder>/test_*.py): {deep}"
    packages = {p.parent.name for p in (REPO / "hermes_lab").glob("*/__init__.py")}
    folders = {p.parent.name for p in files}
    other = sorted(folders - packages - {"house", "e2e"})
    assert not other, f"test folders named for no package of hermes_lab/: {other}"
    names = [p.name for p in files]
    twice = sorted({n for n in names if names.count(n) > 1})
    assert not twice, f"test file names used twice: {twice}"
    unknown = sorted((set(LONGEST_FIRST) | set(POLICY_FREE)) - set(names))
    assert not unknown, f"tests/conftest.py's LONGEST_FIRST / POLICY_FREE name no test file: {unknown}"
