"""Stage kernels forked from the zygote (hermes_lab.core.kernels): the same kernel a new interpreter would be,
started the usual way where it could not be, and gone with the process that started it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook

from hermes_lab.core import kernels
from hermes_lab.round.runner import run_notebook

from repo_paths import REPO

PROBE = """
import json, os, sys
print(json.dumps({
    "ppid": os.getppid(), "cwd": os.getcwd(), "path": sys.path, "argv0": sys.argv[0],
    "late": os.environ.get("HERMES_TEST_PROBE"), "extra": os.environ.get("PROBE_IMPORT_VAR"),
    "mlflow_preloaded": "mlflow" in sys.modules, "hermes_lab_preloaded": "hermes_lab" in sys.modules,
}))
"""
FIGURE = "import matplotlib, matplotlib.pyplot as plt\nprint(matplotlib.get_backend())\nplt.plot([1, 2])\nplt.show()"
IMPORT = "import hermes_lab.core.paths as p\nprint(p.__file__)"


def _notebook(path: Path, *cells: str) -> Path:
    nb = new_notebook(cells=[new_code_cell("# parameters\nx = 0", metadata={"tags": ["parameters"]})])
    nb.cells += [new_code_cell(c) for c in cells]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)
    return path


def _outputs(path: Path) -> list[list[dict]]:
    return [c.outputs for c in nbformat.read(path, 4).cells if c.cell_type == "code"][2:]  # after the parameters


def _run_probe(tmp_path: Path, name: str) -> tuple[dict, list[list[dict]]]:
    src = _notebook(tmp_path / "probe.ipynb", PROBE, FIGURE, IMPORT)
    out = tmp_path / f"{name}.ipynb"
    run_notebook(src, out, {"x": 1})
    outs = _outputs(out)
    return json.loads(outs[0][0]["text"]), outs


def _summary(outs: list[list[dict]]) -> list[list[tuple]]:
    """What a reader of the executed notebook sees: output types, text, and which data formats. Adjacent pieces of
    one stream are one text (how a loaded machine's flushes cut a print is not what the reader sees)."""
    seen = []
    for cell in outs:
        rows: list[tuple] = []
        for o in cell:
            row = (o["output_type"], o.get("text", ""), sorted(o.get("data", {})))
            if rows and row[0] == "stream" and rows[-1][0] == "stream" and o.get("name") == rows[-1][3]:
                rows[-1] = (row[0], rows[-1][1] + row[1], row[2], o.get("name"))
            else:
                rows.append((*row, o.get("name")))
        seen.append([r[:3] for r in rows])
    return seen


def test_a_forked_kernel_is_the_kernel_a_new_interpreter_would_be(tmp_path, monkeypatch):
    monkeypatch.setenv("HERMES_TEST_PROBE", "read when used")  # a variable a fork may take from the request
    monkeypatch.setenv(kernels.ENV_SWITCH, "0")
    new, new_outs = _run_probe(tmp_path, "new")
    monkeypatch.setenv(kernels.ENV_SWITCH, "1")
    forked, forked_outs = _run_probe(tmp_path, "forked")

    assert new["ppid"] == os.getpid()  # the usual launch: our child
    zygote = kernels.zygote()
    assert zygote.proc is not None and forked["ppid"] == zygote.proc.pid  # forked by the zygote
    assert forked["mlflow_preloaded"] and not new["mlflow_preloaded"]  # the imports it was spared
    for key in ("cwd", "path", "argv0", "late", "hermes_lab_preloaded"):
        assert forked[key] == new[key], key
    assert forked["cwd"] == str(REPO) and forked["late"] == "read when used"
    assert not forked["hermes_lab_preloaded"]  # hermes_lab comes from the kernel's own path, as in a new one
    assert _summary(forked_outs[1:]) == _summary(new_outs[1:])  # the inline figure, hermes_lab's file
    assert "image/png" in _summary(forked_outs)[1][-1][2]


def test_a_preload_is_imported_by_the_zygote_before_its_kernel_and_kept_for_the_next(tmp_path, monkeypatch):
    """run_notebook(preload=...) (a stage's Stage.preload): the zygote imports the modules before it forks that
    kernel, so the kernel's first cell finds them imported; the zygote keeps them for every later kernel. A
    module that does not import is left to the kernel, which starts all the same."""
    monkeypatch.setenv(kernels.ENV_SWITCH, "1")
    probe = "import sys\nprint(sorted(m for m in ('wave', 'tabnanny') if m in sys.modules))"
    src = _notebook(tmp_path / "probe.ipynb", probe)
    run_notebook(src, tmp_path / "plain.ipynb", {"x": 1})
    run_notebook(src, tmp_path / "preloaded.ipynb", {"x": 1}, preload=("wave", "no_such_module_hl"))
    run_notebook(src, tmp_path / "after.ipynb", {"x": 1})
    seen = [_outputs(tmp_path / f"{n}.ipynb")[0][0]["text"].strip() for n in ("plain", "preloaded", "after")]
    assert seen == ["[]", "['wave']", "['wave']"]
    assert "no_such_module_hl" not in sys.modules


def test_the_rounds_policy_imports_exist():
    """Stage.preload names modules by their dotted path: a name that no longer exists (a TRL or transformers
    release moved it) would cost every round its import time without a word."""
    import importlib.util

    from hermes_lab.round.stages import POLICY_IMPORTS, STAGES

    assert {s.name for s in STAGES if s.preload} == {"execute", "train", "validate", "ab"}
    for name in POLICY_IMPORTS:
        assert importlib.util.find_spec(name) is not None, name


def test_an_environment_an_import_may_read_gets_a_new_zygote(tmp_path, monkeypatch):
    monkeypatch.setenv(kernels.ENV_SWITCH, "1")
    first, _ = _run_probe(tmp_path, "first")
    monkeypatch.setenv("PROBE_IMPORT_VAR", "set before the imports")  # not in LATE_ENV: imports may read it
    second, _ = _run_probe(tmp_path, "second")
    assert second["extra"] == "set before the imports"
    assert second["ppid"] != first["ppid"] and second["ppid"] != os.getpid()  # a new zygote, in the new env
    assert kernels.zygote().env.get("PROBE_IMPORT_VAR") == "set before the imports"


def test_not_this_interpreters_ipykernel_is_started_the_usual_way():
    assert kernels._forkable_cmd([sys.executable, "-m", "ipykernel_launcher", "-f", "c.json"])
    assert not kernels._forkable_cmd(["/usr/bin/python3-other", "-m", "ipykernel_launcher", "-f", "c.json"])
    assert not kernels._forkable_cmd([sys.executable, "-m", "other_kernel", "-f", "c.json"])
    assert kernels._late("HERMES_LAB_DEBUG") and kernels._late("https_proxy") and kernels._late("PYTEST_CURRENT_TEST")
    assert not kernels._late("PYTHONPATH") and not kernels._late("HF_HOME") and not kernels._late("MLFLOW_ENABLE_X")


SLEEPER = """
import os, subprocess, time
child = subprocess.Popen(["sleep", "300"])
open(os.environ["HERMES_TEST_PIDS"], "w").write(f"{os.getpid()} {child.pid}")
time.sleep(300)
"""


def _gone(pids: list[int], within: float) -> bool:
    deadline = time.time() + within
    while time.time() < deadline:
        alive = []
        for pid in pids:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    if f.read().split(") ")[1][0] != "Z":  # a zombie is dead, only not reaped yet
                        alive.append(pid)
            except FileNotFoundError:
                pass
        if not alive:
            return True
        time.sleep(0.2)
    return False


def _wait_pids(path: Path, proc: subprocess.Popen | None = None) -> list[int]:
    deadline = time.time() + 120
    while not (path.exists() and len(path.read_text().split()) == 2):
        assert time.time() < deadline, "the kernel never ran its cell"
        assert proc is None or proc.poll() is None, proc.stdout.read() if proc and proc.stdout else ""
        time.sleep(0.2)
    return [int(p) for p in path.read_text().split()]


def test_a_timed_out_cell_takes_the_forked_kernel_and_its_children(tmp_path, monkeypatch):
    monkeypatch.setenv(kernels.ENV_SWITCH, "1")
    monkeypatch.setenv("HERMES_TEST_PIDS", str(tmp_path / "pids"))
    src = _notebook(tmp_path / "sleep.ipynb", SLEEPER)
    with pytest.raises(Exception, match="timed out"):  # nbclient's CellTimeoutError; papermill shuts the kernel
        run_notebook(src, tmp_path / "out.ipynb", {}, timeout_s=4)
    kernel, child = _wait_pids(tmp_path / "pids")
    assert kernel != os.getpid() and _gone([kernel, child], 30)  # its process group went with it


def test_the_zygote_and_its_kernels_end_with_the_runner_killed(tmp_path):
    pids = tmp_path / "pids"
    src = _notebook(tmp_path / "sleep.ipynb", SLEEPER)
    out = tmp_path / "out.ipynb"
    code = (
        "from pathlib import Path\nfrom hermes_lab.round.runner import run_notebook\n"
        f"run_notebook(Path({str(src)!r}), Path({str(out)!r}), {{}})"
    )
    env = {**os.environ, kernels.ENV_SWITCH: "1", "HERMES_TEST_PIDS": str(pids)}
    runner = subprocess.Popen([sys.executable, "-c", code], env=env, cwd=REPO, start_new_session=True)
    try:
        kernel, child = _wait_pids(pids, runner)
        zygote = int(Path(f"/proc/{kernel}/stat").read_text().split(") ")[1].split()[1])
        assert zygote != runner.pid  # forked, not started by the runner
    finally:
        os.kill(runner.pid, signal.SIGKILL)  # no shutdown, no atexit: only the socket's EOF tells the zygote
        runner.wait()
    assert _gone([zygote, kernel, child], 30)


def test_the_runner_process_skips_the_iri_grammars_and_still_validates_notebooks():
    code = (
        "import sys\nfrom hermes_lab.core import kernels\nkernels.skip_unused_imports()\n"
        "import nbformat, papermill\nnbformat.validate(nbformat.v4.new_notebook())\n"
        "print(sys.modules.get('rfc3987_syntax'))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "None", r.stdout + r.stderr
