"""Install the project into the virtualenv this interpreter runs in: torch's CPU wheel first, then the package with
its dev extra (``make setup``, which every make target runs first).

uv installs what pip would (the same versions: its best match across every index, pip's own find-links, extra
indexes and constraints passed on from ``pip config``), several times faster: a fresh clone's venv in ~25 s instead
of ~3.5 minutes on 2 cores. Where uv is missing or fails, pip does the same install.

    .venv/bin/python requirements/install.py        # (the Makefile's setup target)
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# constraints.txt: every package at the version the tests passed with (a fresh clone gets what CI ran, not the
# registry's newest); torch is not in it, its build comes from torch-cpu.txt (or docs/gpu.md)
PINS = ["-c", str(ROOT / "requirements/constraints.txt")]
STEPS = (["-r", str(ROOT / "requirements/torch-cpu.txt"), *PINS], ["-e", f"{ROOT}[dev]", *PINS])
FLAGS = {"find-links", "extra-index-url", "index-url", "constraint"}  # pip's settings that say where packages come from


def pip_settings() -> list[str]:
    """pip's configured sources (its files and PIP_* variables, as ``pip config list`` shows them) as uv flags."""
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    seen: dict[tuple[str, str], None] = {}
    for line in out.splitlines():
        key, _, value = line.partition("=")
        name = key.rpartition(".")[2]
        if name in FLAGS:
            seen.update(((f"--{name}", v), None) for v in shlex.split(value.strip().strip("'\"")))
    return [x for pair in seen for x in pair]


def main() -> int:
    uv = shutil.which("uv", path=str(Path(sys.executable).parent))
    if uv:
        # --compile-bytecode: what pip does by default. Without it every test process compiled torch's and
        # transformers' modules on first import (with PYTHONDONTWRITEBYTECODE set, on every import)
        base = [uv, "pip", "install", "-q", "--python", sys.executable, "--index-strategy", "unsafe-best-match"]
        base.append("--compile-bytecode")
        flags = pip_settings()
        if all(subprocess.run([*base, *flags, *step]).returncode == 0 for step in STEPS):
            return 0
        print("requirements/install.py: uv failed; installing with pip", file=sys.stderr)
    for step in STEPS:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", *step], check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
