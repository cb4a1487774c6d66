"""hermes_lab.sandbox's local executor in both modes (with namespaces, and the fallback without them): what a
program sees (its environment, stdin, exit codes, signals, tracebacks, bash), what a grading harness needs (fork,
socketpair, prctl, pipes), that stdin never lies in the program's memory and nothing crosses runs, the limits,
files in and out, ``sandbox.python`` (a numpy task), ``sandbox.require_isolation``, and what describe() says.
The escape set is tests/sandbox/test_sandbox_escapes.py; SandboxFusion's client tests/sandbox/test_sandbox_fusion.py."""

from __future__ import annotations

import functools
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from hermes_lab.config.schema import load_config
from hermes_lab.core.paths import machine_cache
from hermes_lab.rewards import tests as tests_reward
from hermes_lab.sandbox.executor import Limits, RunRequest
from hermes_lab.sandbox.local import LocalExecutor

from repo_paths import REPO

KEY = "sk-hostile-SANDBOX-9f3b2c7d1e"
FAST = Limits(timeout_s=3.0, cpu_s=3.0, memory_mb=256, max_processes=8, max_output_kb=256)
MODES = ["namespaces", "fallback"]


@pytest.fixture(scope="module", params=MODES)
def ex(request):
    e = LocalExecutor(workers=2, isolate=request.param == "namespaces")
    if request.param == "namespaces" and e.describe()["mode"] != "namespaces":
        pytest.skip(f"no namespaces here: {e.describe().get('namespaces')}")
    yield e
    e.close()


def test_a_run_sees_a_clean_environment_its_stdin_its_exit_code_and_its_own_tracebacks(ex, monkeypatch):
    monkeypatch.setenv("TAOTOKEN_API_KEY", KEY)
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")
    env, up, err, code, term, bash, syntax = ex.run_many(
        [
            RunRequest(
                "import os, json\n"
                "print(json.dumps({'env': dict(os.environ), 'cwd': os.getcwd(), 'ls': os.listdir('.')}))"
            ),
            RunRequest("import sys\nprint(sys.stdin.read().upper(), __file__.endswith('program.py'))", stdin="hello"),
            RunRequest("def f():\n    raise ValueError('boom')\nf()\n"),
            RunRequest("exit(203)"),
            RunRequest("import os, signal\nos.kill(os.getpid(), signal.SIGTERM)\nprint('alive')"),
            RunRequest('read x; echo "bash $x"; exit 4', stdin="in\n", language="bash"),
            RunRequest("def f(:\n"),
        ],
        FAST,
    )
    seen = json.loads(env.stdout)
    assert KEY not in env.stdout and "PROXY" not in env.stdout.upper()
    assert set(seen["env"]) <= {
        "PATH",
        "LANG",
        "LC_ALL",
        "HOME",
        "TMPDIR",
        "PYTHONHASHSEED",
        "PYTHONIOENCODING",
        "PYTHONDONTWRITEBYTECODE",
        "OPENBLAS_NUM_THREADS",
        "OMP_NUM_THREADS",
        "MKL_NUM_THREADS",
    }
    assert seen["ls"] == ["program.py"] and seen["env"]["HOME"] == seen["cwd"]
    assert (up.status, up.stdout) == ("ok", "HELLO True\n")
    # the program's frames only (no launcher), the source lines shown as python shows them
    assert err.status == "error" and err.exit_code == 1
    assert (
        err.stderr.count("  File ") == 2 and "launcher" not in err.stderr and "raise ValueError('boom')" in err.stderr
    )
    assert (code.status, code.exit_code) == ("error", 203)  # as the program gave it
    assert term.status == "killed" and term.signal == 15 and term.stdout == ""  # not pid 1: it dies of its signal
    assert (bash.status, bash.exit_code, bash.stdout) == ("error", 4, "bash in\n")
    assert syntax.status == "error" and "SyntaxError" in syntax.stderr and "Traceback" not in syntax.stderr


def test_what_a_grading_harness_needs_is_allowed_with_every_layer_on(ex):
    """fork within max_processes, socketpair(AF_UNIX), prctl(PR_SET_DUMPABLE, 0), pipes: what the tests reward's
    harness does (a judge forks the candidate and talks to it), with the audit hook on as training has it."""
    prog = (
        "import ctypes, os, socket\n"
        "assert ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0) == 0\n"
        "a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)\n"
        "r, w = os.pipe()\n"
        "kids = []\n"
        "for i in range(6):\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        b.sendall(b'x')\n"
        "        os.write(w, b'y')\n"
        "        os._exit(0)\n"
        "    kids.append(pid)\n"
        "assert all(os.waitpid(k, 0)[1] == 0 for k in kids)\n"
        "print(a.recv(6, socket.MSG_WAITALL).decode(), os.read(r, 16).decode())\n"
    )
    r = ex.run_one(RunRequest(prog), FAST)
    assert (r.status, r.stdout) == ("ok", "xxxxxx yyyyyy\n"), r.stderr


def test_stdin_never_lies_in_the_programs_memory_and_nothing_crosses_runs(ex):
    """Tests' expected values travel in stdin: a program that never reads it finds nothing of it in its own
    memory (/proc/self/mem, every readable mapping), nor of the stdin an earlier run read; files it left in the
    work dir, /tmp or /dev/shm are gone for the next run."""
    first, second = secrets.token_hex(24), secrets.token_hex(24)
    scan = (
        "import ctypes, os\n"
        "ctypes.CDLL(None).prctl(4, 1, 0, 0, 0)  # dumpable again: /proc/self/mem is then its own to read\n"
        "hay = []\n"
        "for line in open('/proc/self/maps'):\n"
        "    lo, hi = (int(x, 16) for x in line.split()[0].split('-'))\n"
        "    if line.split()[1].startswith('r') and hi - lo < 1 << 30:\n"
        "        try:\n"
        "            with open('/proc/self/mem', 'rb', 0) as m:\n"
        "                m.seek(lo)\n"
        "                hay.append(m.read(hi - lo))\n"
        "        except (OSError, ValueError, OverflowError):\n"
        "            pass\n"
        "blob = b''.join(hay).translate(bytes(b ^ 1 for b in range(256)))\n"
        "print(len(blob) > 1 << 20, {needles})\n"
    )
    leave = (
        "import sys\ndata = sys.stdin.read()\nfor p in ('left.txt', '/tmp/left.txt', '/dev/shm/left.txt'):\n"
        "    try:\n        open(p, 'w').write(data)\n    except OSError:\n        pass\nprint(len(data))"
    )
    reader = ex.run_one(RunRequest(leave, stdin=first), FAST)
    assert reader.stdout == "48\n"
    # searched for in the memory with every byte's low bit flipped, so the program's own text holds neither
    flip = lambda t: bytes(c ^ 1 for c in t.encode()).decode()  # noqa: E731
    needles = f"[n.encode() in blob for n in ({flip(first)!r}, {flip(second)!r})]"
    later = ex.run_one(
        RunRequest(
            scan.format(needles=needles)
            + "print([os.path.exists(p) for p in ('left.txt', '/tmp/left.txt', '/dev/shm/left.txt')])",
            stdin=second,
        ),
        FAST,
    )
    assert later.status == "ok", later.stderr
    # the scan reads megabytes of its own memory; neither the earlier run's stdin nor its own unread stdin is there
    assert later.stdout.splitlines() == ["True [False, False]", "[False, False, False]"]


def test_limits_hold_for_the_whole_run(ex):
    t0 = time.monotonic()
    spin, sleep, many, mem = ex.run_many(
        [
            RunRequest("while True:\n    pass"),
            RunRequest("import time\ntime.sleep(60)"),
            RunRequest(
                "import os, time\nn = 0\nfor _ in range(40):\n    try:\n        if os.fork() == 0:\n"
                "            time.sleep(3)\n            os._exit(0)\n        n += 1\n"
                "    except OSError:\n        break\nprint(n)"
            ),
            # four processes of 100 MB each under a 256 MB run: the run's cgroup stops them, not each one's rlimit
            RunRequest(
                "import os, time\nkids = []\nfor _ in range(4):\n    pid = os.fork()\n    if pid == 0:\n"
                "        b = bytearray(100 << 20)\n        time.sleep(0.5)\n        os._exit(0)\n    kids.append(pid)\n"
                "print(sum(os.waitpid(k, 0)[1] == 0 for k in kids))"
            ),
        ],
        # the wall clock well above the CPU limit: on loaded cores a spinning program gets a fraction of a core,
        # and must still run into its CPU limit first
        Limits(timeout_s=5.0, cpu_s=0.5, memory_mb=256, max_processes=8),
    )
    assert time.monotonic() - t0 < 12
    assert spin.status == "timeout" and "CPU" in spin.detail
    assert sleep.status == "timeout" and "wall clock" in sleep.detail
    assert many.status == "ok" and int(many.stdout) == 7  # 8 processes: the program and 7 children
    assert mem.status == "ok" and int(mem.stdout) < 4, mem  # the OOM killer took some: not 4 x 100 MB


def test_files_in_and_out_and_a_link_out_of_the_work_dir_fetches_nothing(ex, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("host secret")
    prog = f"import os\nopen('out/r.txt', 'w').write(open('in/a.txt').read() * 2)\nos.symlink({str(secret)!r}, 'link')"
    fetch = ("out/r.txt", "link", "missing")
    r = ex.run_one(RunRequest("import os\nos.makedirs('out')\n" + prog, files={"in/a.txt": b"ab"}, fetch=fetch), FAST)
    assert r.status == "ok", r.stderr
    assert r.files == {"out/r.txt": b"abab"}  # the link led out of the run's view: nothing read through it


@functools.lru_cache(maxsize=1)
def numpy_python() -> str:
    """A small virtualenv with numpy, made once per machine in its cache (core.paths.machine_cache; with the
    cache off, once per test session in a temp dir)."""
    name = f"sandbox-numpy-py{sys.version_info.major}{sys.version_info.minor}"
    venv = machine_cache(name) or Path(tempfile.mkdtemp(prefix="hermes-test-")) / name
    py = venv / "bin" / "python"
    if not (venv / ".ready").exists():
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", "numpy"], check=True, timeout=600)
        (venv / ".ready").write_text("numpy\n")
    return str(py)


def test_a_numpy_task_is_graded_with_sandbox_python_and_refused_clearly_without(monkeypatch):
    task = json.dumps({"kind": "assert", "tests": ["assert norm([3, 4]) == 5.0", "assert norm([0, 0]) == 0.0"]})
    code = "import numpy as np\ndef norm(v):\n    return float(np.linalg.norm(np.array(v)))\n"
    kw = dict(prompts=["norm"], completions=[code], tests=[task])
    with_np = load_config(None, {"reward.types": ["tests"], "sandbox.python": numpy_python()})
    reward = tests_reward.make_tests_reward(with_np)
    try:
        assert reward(**kw) == [5.0]
        assert reward.sandbox.to_dict()["isolation"]["python"] == numpy_python()
    finally:
        reward.sandbox.runner.executor.close()
    plain = tests_reward.make_tests_reward(load_config(None, {"reward.types": ["tests"]}))
    try:
        assert plain(**kw) == [0.0]
        ex = plain.sandbox.runner.executor
        r = ex.run_one(RunRequest("import numpy"), FAST)
        assert r.status == "error" and "sandbox.python" in r.detail and "numpy" in r.detail
    finally:
        plain.sandbox.runner.executor.close()


def test_require_isolation_refuses_a_machine_without_the_layers_and_an_opt_out_says_what_is_missing(
    monkeypatch, capsys
):
    """A machine without cgroups or Landlock (their switches off: the real executor without those layers)."""
    weak = functools.partial(LocalExecutor, isolate=False, cgroup=False, landlock=False)
    monkeypatch.setattr(tests_reward, "LocalExecutor", weak)
    with pytest.raises(tests_reward.SandboxUnavailable, match="cgroup per run.*filesystem barrier.*signal barrier"):
        tests_reward.executor_of(load_config(None, {"reward.types": ["tests"]}))
    ex = tests_reward.executor_of(load_config(None, {"reward.types": ["tests"], "sandbox.require_isolation": False}))
    ex.close()
    assert "NOT enforced (sandbox.require_isolation is false): cgroup per run" in capsys.readouterr().err


def test_describe_says_what_holds_layer_by_layer(ex):
    rep = ex.describe()
    assert rep["missing"] == [] and rep["seccomp_loaded"] == 2 and rep["cgroup"].startswith("v")
    checkout = str(REPO)
    # seen from inside a run: the checkout, its pyproject and $HOME are absent (namespaces) or refused (Landlock)
    assert str(rep["host_paths"][checkout]).startswith(("absent", "refused"))
    assert str(rep["host_paths"][checkout + "/pyproject.toml"]).startswith(("absent", "refused"))
    if rep["mode"] == "namespaces":
        assert rep["user"] == "nobody" if os.geteuid() == 0 else rep["user"].endswith("no capabilities")
        assert rep["network"].startswith("cut off") and "sandbox" in rep["root_entries"]
    else:
        assert rep["landlock_abi"] >= 6 and rep["processes"] == "Landlock signal scope"
