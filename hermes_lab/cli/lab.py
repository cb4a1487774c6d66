"""`hermes-lab lab` (``make lab``): JupyterLab on the project, opening notebooks/README.md first.

Front door for interactive work: the stage notebooks, the review widget (notebooks/review.ipynb), the
project's files. Writes ``runs/.jupyterlab/overrides.json`` (JupyterLab application settings: Markdown
files open as a rendered preview) and nothing else.

How it is served, and why:
- root = the project root (hermes_lab.core.paths), so params/, runs/ and notebooks/ are all in the file
  browser; a notebook's kernel still starts in notebooks/, which is why every notebook resolves its path
  parameters against the project root (``paths.resolve_params``), not against the kernel's cwd;
- ``$HERMES_LAB_ROOT`` is set for the kernels, so they find the same root whatever is opened;
- the first page is notebooks/README.md (what to open first);
- kernels get an encrypted channel (hermes_lab.core.quiet): no "running over TCP without encryption" warning.

    hermes-lab lab                                  # what `make lab` runs
    hermes-lab lab --port 8899 --no-browser -- --ServerApp.token=secret   # after --: jupyter lab's own options
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

START_PAGE = "notebooks/README.md"
# JupyterLab opens Markdown in the text editor by default: the start page reads better rendered. An offline
# workbench does not fetch Jupyter news or check for updates (and no toast asks about it)
OVERRIDES = {
    "@jupyterlab/docmanager-extension:plugin": {"defaultViewers": {"markdown": "Markdown Preview"}},
    "@jupyterlab/apputils-extension:notification": {"fetchNews": "false", "checkForUpdates": False},
}


def lab_command(root: Path, port: int | None = None, ip: str | None = None, no_browser: bool = False) -> list[str]:
    """The jupyter lab command line for a project root (the browser test starts exactly this)."""
    from hermes_lab.core import quiet

    settings = root / "runs" / ".jupyterlab"
    settings.mkdir(parents=True, exist_ok=True)
    (settings / "overrides.json").write_text(json.dumps(OVERRIDES, indent=2), encoding="utf-8")
    cmd = [
        sys.executable,
        "-m",
        "jupyterlab",
        f"--ServerApp.root_dir={root}",
        f"--LabApp.default_url=/lab/tree/{START_PAGE}",
        f"--LabApp.app_settings_dir={settings}",
        *quiet.kernel_args(),
    ]
    if port:
        cmd.append(f"--ServerApp.port={port}")
    if ip:
        cmd.append(f"--ServerApp.ip={ip}")
    if no_browser:
        cmd.append("--no-browser")
    if hasattr(os, "geteuid") and os.geteuid() == 0:  # containers and CI run as root; jupyter refuses without it
        cmd.append("--allow-root")
    return cmd


def lab_env(root: Path) -> dict[str, str]:
    from hermes_lab.core.paths import ENV_ROOT

    return {**os.environ, ENV_ROOT: str(root)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--port", type=int, default=None, help="port (default: jupyter's, 8888 or the next free one)")
    p.add_argument("--ip", default=None, help="address to listen on (default: jupyter's, localhost)")
    p.add_argument("--no-browser", action="store_true", help="do not open a browser")
    p.add_argument("jupyter_args", nargs=argparse.REMAINDER, help="after --: options passed on to jupyter lab")


def run_cli(args: argparse.Namespace) -> int:
    from hermes_lab.core.paths import project_root

    root = project_root()
    extra = [a for a in args.jupyter_args if a != "--"]
    cmd = lab_command(root, args.port, args.ip, args.no_browser) + extra
    print(f"JupyterLab on {root} (start page {START_PAGE}); stop with Ctrl-C", flush=True)
    os.execve(sys.executable, cmd, lab_env(root))  # replaces this process: Ctrl-C and signals reach jupyter
    return 0  # pragma: no cover


def main(argv: list[str] | None = None) -> int:
    from hermes_lab.core.command import run_module

    return run_module("hermes_lab.cli.lab", add_arguments, run_cli, argv, description=__doc__.split("\n")[0])


if __name__ == "__main__":
    sys.exit(main())
