"""Each stage's inputs are declared once (hermes_lab.core.inputs): every notebook's parameters cell, read by
papermill's own inspection, is its declaration (names in order, types, defaults, help comments); each stage
command's arguments are the declaration's; what the round passes is declared; path parameters resolve."""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

import nbformat
import papermill
import pytest

from hermes_lab.cli import main as cli
from hermes_lab.core import inputs as declared
from hermes_lab.core.inputs import KINDS, PATH, PATHS, ROUND_PARAMS, SPEC, Input, Inputs
from hermes_lab.round.stages import STAGES, RoundContext

from repo_paths import REPO

NOTEBOOKS = REPO / "notebooks"
# notebook -> its declaration: the stages' from their rows, the reviewer's notebook (not a stage) by name
DECLARED = {s.notebook: s.inputs for s in STAGES} | {"review.ipynb": declared.REVIEW_APP}


def mismatches(path: Path, inputs: Inputs) -> list[str]:
    """How a notebook's parameters cell differs from its declaration, as papermill reads the cell."""
    cell = papermill.inspect_notebook(str(path))
    rows = inputs.notebook_rows()
    if list(cell) != [r.name for r in rows]:
        return [f"{path.name}: parameters {list(cell)}, declared {[r.name for r in rows]}"]
    out = []
    for r in rows:
        p = cell[r.name]
        default = ast.literal_eval(p["default"])
        if p["inferred_type_name"] != r.type.__name__:
            out.append(f"{path.name}: {r.name} is typed {p['inferred_type_name']}, declared {r.type.__name__}")
        if default != r.default or type(default) is not type(r.default):
            out.append(f"{path.name}: {r.name} = {p['default']}, declared {r.default!r}")
        if p["help"] != r.help:
            out.append(f"{path.name}: {r.name}'s help is {p['help']!r}, declared {r.help!r}")
    return out


def test_every_notebook_is_declared_and_every_declaration_has_its_notebook():
    on_disk = sorted(p.name for p in NOTEBOOKS.glob("*.ipynb"))
    assert sorted(DECLARED) == on_disk
    assert sorted(map(id, declared.NOTEBOOKS)) == sorted(map(id, DECLARED.values()))  # KINDS reads them all


@pytest.mark.parametrize("name", sorted(DECLARED))
def test_the_parameters_cell_is_its_declaration(name):
    assert mismatches(NOTEBOOKS / name, DECLARED[name]) == []


def _edited(tmp_path: Path, name: str, edit) -> Path:
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    cell = next(c for c in nb.cells if c.cell_type == "code")
    cell.source = edit(cell.source)
    out = tmp_path / name
    nbformat.write(nb, out)
    return out


def test_a_parameter_gained_lost_retyped_or_reworded_is_a_mismatch(tmp_path):
    name, inputs = "20_grpo_train.ipynb", declared.TRAIN
    gained = _edited(tmp_path, name, lambda s: s + '\nextra: str = ""  # not declared')
    assert "extra" in mismatches(gained, inputs)[0]
    lost = _edited(tmp_path, name, lambda s: "\n".join(s.splitlines()[:-1]))
    assert "resume" in mismatches(lost, inputs)[0]
    retyped = _edited(tmp_path, name, lambda s: s.replace("max_steps: int = 0", "max_steps: float = 0.0"))
    assert [m.split(" is ")[0] for m in mismatches(retyped, inputs)][:1] == [f"{name}: max_steps"]
    redefault = _edited(tmp_path, name, lambda s: s.replace("resume: bool = True", "resume: bool = False"))
    assert mismatches(redefault, inputs) == [f"{name}: resume = False, declared True"]
    reworded = _edited(tmp_path, name, lambda s: s.replace("# override grpo.max_steps", "# set grpo.max_steps"))
    assert "max_steps's help" in mismatches(reworded, inputs)[0]


@pytest.mark.parametrize("stage", STAGES, ids=lambda s: s.name)
def test_a_stage_takes_the_round_params_first_and_the_round_passes_only_declared_ones(stage, tmp_path):
    from hermes_lab.config.schema import load_config
    from hermes_lab.core.state import FlywheelState

    assert stage.inputs.notebook_names()[:3] == ROUND_PARAMS
    cfg = load_config(None, {"round.runs_dir": str(tmp_path)})
    ctx = RoundContext(cfg, "params/embedded.yaml", tmp_path / "round-02", 2, "run-id", FlywheelState(last_round=1))
    if stage.name == "ab":  # its builder resolves the embedded policy's dir: give it a champion instead
        ctx.state.champion_adapter = str(tmp_path / "round-01" / "train" / "adapter")
    passed = {"config_path": "params/embedded.yaml", "round_dir": str(ctx.round_dir), "parent_run_id": "x"}
    passed |= stage.params(ctx)
    assert list(stage.inputs.papermill(passed)) == [n for n in stage.inputs.notebook_names() if n in passed]


def test_what_a_run_passes_is_checked_against_the_declaration():
    with pytest.raises(ValueError, match=r"unknown parameter\(s\) \['sead'\]"):
        declared.EXECUTE.papermill({"sead": 3})
    with pytest.raises(ValueError, match="seed='3' is not int"):
        declared.EXECUTE.papermill({"seed": "3"})
    with pytest.raises(ValueError, match="seed=True is not int"):
        declared.EXECUTE.papermill({"seed": True})
    assert declared.EXECUTE.papermill({"seed": 3, "config_path": "c.yaml"}) == {"config_path": "c.yaml", "seed": 3}
    with pytest.raises(ValueError, match="declared twice"):
        Inputs("x", (Input("a", str, "", "a"), Input("a", int, 0, "a")))


@pytest.mark.parametrize("stage", [s for s in STAGES if s.command], ids=lambda s: s.name)
def test_a_stage_command_has_exactly_its_declared_arguments_and_helps(stage):
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[stage.command]
    got = {tuple(a.option_strings): a.help for a in sub._actions if a.option_strings and a.dest != "help"}
    rows = [r for r in stage.inputs.rows if r.flag]
    want = {(r.flag,) if isinstance(r.flag, str) else r.flag: r.help for r in rows}
    assert got == want


def test_path_parameters_are_declared_as_paths():
    """Whatever is named like a path is resolved against the project root in a notebook (core.paths)."""
    for inputs in declared.NOTEBOOKS:
        for r in inputs.notebook_rows():
            if r.name.endswith(("_path", "_dir")) or r.name in ("trajectories", "adapter"):
                assert r.kind in (PATH, PATHS, SPEC), f"{inputs.name}: {r.name} is declared a {r.kind}"
    assert KINDS["compare_rounds"] == PATHS and KINDS["candidate"] == SPEC and KINDS["seed"] == "value"
    with pytest.raises(ValueError, match="'round_dir' is a value here, a path elsewhere"):
        declared.kinds((declared.EXECUTE, Inputs("odd", (Input("round_dir", str, "", "a folder"),))))
