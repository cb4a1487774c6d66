"""hermes_lab.cli.main: every command is wired, imports and answers --help; building the parser stays light
(no torch / transformers / trl / mlflow). Every `python -m hermes_lab.<module>`: tests/house/test_architecture.py."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from hermes_lab.cli import main as cli

from repo_paths import REPO

HEAVY = ("torch", "trl", "mlflow", "transformers")


def _help_exit(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as ei:
        cli.main(argv)
    assert ei.value.code == 0, f"{argv}: exit {ei.value.code}"
    return capsys.readouterr().out


def test_top_level_help_lists_every_command(capsys):
    out = _help_exit(["--help"], capsys)
    assert out.startswith("usage: hermes-lab")
    for name in cli.COMMANDS:
        assert name in out


@pytest.mark.parametrize("command", list(cli.COMMANDS))
def test_command_help(command, capsys):
    out = _help_exit([command, "--help"], capsys)
    assert f"hermes-lab {command}" in out
    assert cli.COMMANDS[command][1].split()[0] in out  # its one-line description


@pytest.mark.parametrize("command", list(cli.COMMANDS))
def test_command_module_imports_and_has_entry_points(command):
    modname = cli.COMMANDS[command][0]
    mod = importlib.import_module(modname)  # a missing stage fails here instead of vanishing from --help
    suffix = command.replace("-", "_")
    adder = getattr(mod, f"add_arguments_{suffix}", None) or getattr(mod, "add_arguments", None)
    runner = getattr(mod, f"run_cli_{suffix}", None) or getattr(mod, "run_cli", None)
    assert callable(adder), f"{modname}: no add_arguments for '{command}'"
    assert callable(runner), f"{modname}: no run_cli for '{command}'"


def test_parser_registers_every_command():
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert list(sub.choices) == list(cli.COMMANDS)  # none skipped silently


def test_missing_command_is_usage_error(capsys):
    with pytest.raises(SystemExit) as ei:
        cli.main([])
    assert ei.value.code == 2


def test_config_error_returns_2_in_process(tmp_path, capsys):
    p = tmp_path / "bad.yaml"
    p.write_text("grpo:\n  group_size: 1\n", encoding="utf-8")
    assert cli.main(["config", "--params", str(p)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "grpo.group_size" in err
    assert cli.main(["config", "--params", str(p), "--params", str(p)]) == 2  # several files: only with --check
    assert "one --params to print" in capsys.readouterr().err


def test_console_script_help():
    r = subprocess.run(
        [str(REPO / ".venv" / "bin" / "hermes-lab"), "--help"], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert r.returncode == 0, r.stderr
    assert "usage: hermes-lab" in r.stdout and "round" in r.stdout


def test_parser_does_not_import_heavy_packages():
    code = (
        "import hermes_lab.cli.main, sys; hermes_lab.cli.main.build_parser(); "
        f"print([m for m in {HEAVY!r} if m in sys.modules])"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]", f"building the parser imported {r.stdout.strip()}"
