"""Every notebooks/*.ipynb follows the notebook rules of docs/CONVENTIONS.md, and the round's stage
notebooks accept the parameters the round runner passes."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import nbformat
import papermill
import pytest

from hermes_lab.core.inputs import KINDS, ROUND_PARAMS
from hermes_lab.round.stages import STAGES

from repo_paths import REPO

NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
SECRET_WORDS = {"key", "apikey", "token", "secret", "password", "passwd", "credential", "credentials", "bearer"}


def _read(path: Path) -> nbformat.NotebookNode:
    return nbformat.read(path, as_version=4)


def _code_cells(nb) -> list:
    return [c for c in nb.cells if c.cell_type == "code"]


def _parameters_cell(nb):
    cells = [c for c in nb.cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(cells) == 1, f"{len(cells)} cells tagged 'parameters' (need exactly one)"
    return cells[0]


def _assignments(source: str) -> list[tuple[str, int, ast.expr]]:
    """(name, line, value) of every top-level assignment in a parameters cell."""
    out = []
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign):
            for target in node.targets:
                assert isinstance(target, ast.Name), f"line {node.lineno}: assign plain names only"
                out.append((target.id, node.lineno, node.value))
        elif isinstance(node, ast.AnnAssign):
            out.append((node.target.id, node.lineno, node.value))
    return out


def _comments_by_line(source: str) -> dict[int, str]:
    """line -> comment text (without '#'), found with tokenize so a '#' inside a string is not a comment."""
    out = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out[tok.start[0]] = tok.string.lstrip("#").strip()
    return out


def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 2


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_valid_nbformat_and_clean(path):
    nb = _read(path)
    nbformat.validate(nb)
    assert nb.metadata.get("kernelspec", {}).get("name") == "python3", nb.metadata.get("kernelspec")
    for i, cell in enumerate(_code_cells(nb)):
        assert cell.get("outputs") == [], f"{path.name}: code cell {i} has outputs"
        assert cell.get("execution_count") is None, f"{path.name}: code cell {i} has an execution count"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_parameters_cell_first_code_cell(path):
    nb = _read(path)
    params = _parameters_cell(nb)
    assert _code_cells(nb)[0] is params, f"{path.name}: the 'parameters' cell is not the first code cell"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_parameters_are_flat_scalars_with_help(path):
    src = _parameters_cell(_read(path)).source
    assigns = _assignments(src)
    assert assigns, f"{path.name}: no parameters"
    comments = _comments_by_line(src)
    for name, line, value in assigns:
        assert comments.get(line), f"{path.name}: parameter '{name}' (line {line}) has no '# help' comment"
        assert isinstance(value, ast.Constant) and isinstance(value.value, (str, int, float, bool)), (
            f"{path.name}: parameter '{name}' is not a flat scalar"
        )
    names = [n for n, _, _ in assigns]
    assert len(names) == len(set(names)), f"{path.name}: a parameter is assigned twice"
    for required in ROUND_PARAMS:
        assert required in names, f"{path.name}: missing parameter '{required}'"
    defaults = {n: v.value for n, _, v in assigns}
    assert defaults["config_path"] == "params/embedded.yaml"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_no_secret_parameters(path):
    for name, _, _ in _assignments(_parameters_cell(_read(path)).source):
        parts = set(name.lower().split("_"))
        assert not parts & SECRET_WORDS, f"{path.name}: parameter '{name}' looks like a secret"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_no_def_or_class_in_cells(path):
    pattern = re.compile(r"^\s*(async\s+def|def|class)\s+\w", re.M)
    for i, cell in enumerate(_code_cells(_read(path))):
        m = pattern.search(cell.source)
        assert not m, f"{path.name}: code cell {i} defines '{m.group(0).strip()}' (logic lives in hermes_lab)"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_papermill_sees_parameters_with_help(path):
    info = papermill.inspect_notebook(str(path))
    names = [n for n, _, _ in _assignments(_parameters_cell(_read(path)).source)]
    assert list(info) == names
    for name, p in info.items():
        assert p["help"].strip(), f"{path.name}: papermill sees no help for '{name}'"
    for required in ROUND_PARAMS:
        assert required in info


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_parameters_are_typed_for_papermill_help(path):
    """`papermill --help-notebook` shows type, default and help for every parameter (not "Unknown type"):
    papermill reads the type from an annotation, `max_steps: int = 0  # help`."""
    for name, p in papermill.inspect_notebook(str(path)).items():
        default = ast.literal_eval(p["default"])
        assert p["inferred_type_name"] == type(default).__name__, f"{path.name}: '{name}' is typed {p}"
        assert not p["help"].startswith("help:"), f"{path.name}: '{name}': the help repeats 'help:'"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_config_cell_resolves_paths_against_the_project_root(path):
    """The second code cell makes path parameters absolute against the project root before anything reads
    them (the kernel's cwd is notebooks/ under JupyterLab): hermes_lab.core.paths.resolve_params."""
    second = _code_cells(_read(path))[1].source
    assert "paths.resolve_params(globals())" in second and "quiet.configure()" in second
    assert second.index("paths.resolve_params") < second.index("load_config(")
    names = [n for n, _, _ in _assignments(_parameters_cell(_read(path)).source)]
    pathlike = [n for n in names if n.endswith(("_path", "_dir")) or n in ("trajectories", "adapter")]
    missing = [n for n in pathlike if KINDS.get(n, "value") == "value"]
    assert not missing, f"{path.name}: path parameters {missing} are not resolved (declare them in core.inputs)"


def test_round_stage_notebooks_exist_and_accept_round_params():
    from hermes_lab.round.runner import notebook_path

    assert STAGES, "no stages"
    assert len({s.notebook for s in STAGES}) == len(STAGES) and len({s.name for s in STAGES}) == len(STAGES)
    for stage in STAGES:
        path = notebook_path(stage)
        assert path.is_file(), f"stage '{stage.name}': {stage.notebook} is missing"
        info = papermill.inspect_notebook(str(path))
        missing = [p for p in ROUND_PARAMS if p not in info]
        assert not missing, f"stage '{stage.name}' ({stage.notebook}) lacks parameters {missing}"
