"""hermes_lab.sandbox: the local executor against hostile code, each layer alone, and the HTTP executor against a
real stand-in of SandboxFusion's run_code API on 127.0.0.1.

The hostile set runs through the tests reward exactly as TRL calls it (prompts, completions, tests=[...]): every
case must score 0, be counted by kind, leave nothing behind (no file outside its temp dir, no connection, no
process, no temp dir) and let this process (the trainer's stand-in) go on. The fork bomb is gentle: 8 processes
at most, a 2 s wall clock, and the pid namespace (or the process group) ends it."""

from __future__ import annotations

import json
import os
import socket
import tempfile
import threading
import time
from pathlib import Path

import pytest

from hermes_lab.config.schema import load_config
from hermes_lab.rewards.tests import make_tests_reward
from hermes_lab.sandbox.executor import Limits, RunRequest
from hermes_lab.sandbox.fusion import FusionExecutor
from hermes_lab.sandbox.local import LocalExecutor
from hermes_lab.sandbox.server import serve

KEY = "sk-hostile-SANDBOX-9f3b2c7d1e"
MBPP = json.dumps(
    {"kind": "assert", "tests": ["assert add(1, 2) == 3", "assert add(2, 2) == 4", "assert add(0, 5) == 5"]}
)
GOOD = "def add(a, b):\n    return a + b\n"
FAST = Limits(timeout_s=2.0, cpu_s=2.0, memory_mb=256, max_processes=8, max_output_kb=256)


@pytest.fixture(scope="module")
def local():
    ex = LocalExecutor(workers=2)
    yield ex
    ex.close()


def namespaced(ex: LocalExecutor) -> bool:
    return str(ex.describe().get("namespaces", "none")).startswith(("user", "net"))


class Listener:
    """A TCP server on 127.0.0.1 that records every connection (none may arrive from the sandbox)."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        self._stop = False
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self):
        while not self._stop:
            try:
                c, _ = self.sock.accept()
            except (TimeoutError, OSError):
                continue
            self.connections += 1
            c.close()

    def close(self):
        self._stop = True
        self.thread.join(2)
        self.sock.close()


def _start_time(pid: int) -> str | None:
    """The process's start time (field 22 of /proc/PID/stat): tells a pid still running from a reused one; None
    once it is gone or a zombie (it runs nothing)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


def _left_over(uid: int, before: set[int], grace: float) -> set[int]:
    """Processes of ``uid`` not there ``before`` that are still the same processes ``grace`` seconds later. Under
    pytest-xdist another worker's sandboxed runs (the tests reward in a round) are nobody's processes too, but
    each ends within its own wall-clock limit (sandbox.timeout_s, 4 s by default); a fork bomb's escaped
    child would fork forever."""
    extra = {pid: _start_time(pid) for pid in _processes_of(uid) - before}
    deadline = time.monotonic() + grace
    while extra and time.monotonic() < deadline:
        time.sleep(0.2)
        extra = {pid: t for pid, t in extra.items() if t is not None and _start_time(pid) == t}
    return set(extra)


def _processes_of(uid: int) -> set[int]:
    out = set()
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if p.stat().st_uid == uid:
                    out.add(int(p.name))
            except OSError:
                pass
    return out


def hostile_set(outside: Path, port: int) -> dict[str, str]:
    """Each defines a correct add() after its attack: contained, the attack raises or is stopped and the
    completion scores 0; escaped, it would pass every test."""
    pid = os.getpid()
    return {
        "infinite_loop": "while True:\n    pass\n" + GOOD,
        "fork_bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n" + GOOD,
        "alloc_1gb": "blob = bytearray(1 << 30)\n" + GOOD,
        "print_100mb": "import sys\nfor _ in range(100):\n    sys.stdout.write('x' * (1 << 20))\n" + GOOD,
        "write_outside": f"open({str(outside / 'escaped.txt')!r}, 'w').write('escaped')\n" + GOOD,
        "read_api_key": f"import os\nkey = os.environ['TAOTOKEN_API_KEY']\nprint(key)\n{GOOD}",
        "read_parent_environ": f"print(open('/proc/{pid}/environ').read())\n" + GOOD,
        "open_socket": (
            f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2).sendall(b'leak')\n{GOOD}"
        ),
        "kill_parent": (
            f"import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nos.kill({pid}, signal.SIGKILL)\n{GOOD}"
        ),
    }


@pytest.mark.slow
def test_the_hostile_set_is_contained_scores_zero_and_is_counted(tmp_path, monkeypatch, local):
    monkeypatch.setenv("TAOTOKEN_API_KEY", KEY)
    cfg = load_config(
        None,
        {
            "reward.types": ["tests"],
            "sandbox.timeout_s": 2.0,
            "sandbox.cpu_s": 2.0,
            "sandbox.memory_mb": 256,
            "sandbox.max_processes": 8,
            "sandbox.max_output_kb": 256,
        },
    )
    outside = tmp_path / "outside"
    outside.mkdir()
    outside.chmod(0o777)  # even a directory anyone may write to stays out of reach
    listener = Listener()
    # the runs' temp dirs under a root of this test's: other test files' sandboxes run in parallel (make test)
    sandbox_root = Path(tempfile.mkdtemp(prefix="hermes-test-sandbox-root-"))
    sandbox_root.chmod(0o1777)  # as /tmp: each run's own dir is private (0700), its parent anyone's to traverse
    monkeypatch.setattr(local, "tmp_root", str(sandbox_root))
    nobody_before = _processes_of(65534) if os.geteuid() == 0 else None
    reward = make_tests_reward(cfg, executor=local)
    cases = hostile_set(outside, listener.port)
    t0 = time.monotonic()
    try:
        scores = reward(
            prompts=["add two numbers"] * (len(cases) + 1),
            completions=[*cases.values(), GOOD],
            tests=[MBPP] * (len(cases) + 1),
        )
    finally:
        time.sleep(0.3)
        listener.close()
    took = time.monotonic() - t0
    by_case = dict(zip([*cases, "good"], scores))
    assert by_case.pop("good") == 5.0  # the same tests pass for honest code: the zeros are the attacks'
    assert by_case == {name: 0.0 for name in cases}, by_case
    tally = reward.sandbox.to_dict()
    kinds = tally["by_kind"]
    assert kinds["timeout"] == 2  # the infinite loop and the fork bomb
    assert kinds["memory"] == 1 and kinds["output_limit"] == 1 and kinds["passed"] == 1
    assert kinds["runtime_error"] == 5  # write, key, environ, socket, kill: each raised before any test ran
    assert sum(kinds.values()) == len(cases) + 1
    assert took < 15, took  # bounded: the two 2 s timeouts ran in parallel with the rest
    # nothing escaped
    assert not (outside / "escaped.txt").exists()
    assert listener.connections == 0
    assert not list(sandbox_root.iterdir())  # every run's temp dir removed
    sandbox_root.rmdir()
    if nobody_before is not None:
        assert not _left_over(65534, nobody_before, grace=8.0)  # no process of the fork bomb is left
    # the API key never reached a run: no output of any run holds it
    assert KEY not in json.dumps(tally)


def test_a_run_gets_a_clean_environment_and_its_own_temp_dir(monkeypatch, local):
    monkeypatch.setenv("TAOTOKEN_API_KEY", KEY)
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")
    prog = "import os, json\nprint(json.dumps({'env': dict(os.environ), 'cwd': os.getcwd(), 'files': os.listdir('.')}))"
    first, second = local.run_many([RunRequest(prog), RunRequest(prog)], FAST)
    a, b = json.loads(first.stdout), json.loads(second.stdout)
    assert KEY not in first.stdout and "PROXY" not in first.stdout.upper()
    assert set(a["env"]) <= {
        "PATH",
        "LANG",
        "LC_ALL",
        "HOME",
        "TMPDIR",
        "PYTHONHASHSEED",
        "PYTHONIOENCODING",
        "PYTHONDONTWRITEBYTECODE",
    }
    assert a["cwd"] != b["cwd"] and a["files"] == [] and not Path(a["cwd"]).exists()


def test_stdin_exit_codes_and_signals(local):
    ok, err, code, sig = local.run_many(
        [
            RunRequest("import sys\nprint(sys.stdin.read().upper())", stdin="hello"),
            RunRequest("raise ValueError('boom')"),
            RunRequest("exit(3)"),
            RunRequest("import os\nos.abort()"),
        ],
        FAST,
    )
    assert (ok.status, ok.stdout) == ("ok", "HELLO\n")
    assert err.status == "error" and err.exit_code == 1 and "ValueError: boom" in err.stderr
    assert (code.status, code.exit_code) == ("error", 3)
    assert sig.status == "killed" and sig.signal in (6, 11), sig  # abort(): SIGABRT, or SIGSEGV as pid 1


def test_wall_and_cpu_limits_hold(local):
    t0 = time.monotonic()
    spin, sleep = local.run_many(
        [RunRequest("while True:\n    pass"), RunRequest("import time\ntime.sleep(60)")],
        Limits(timeout_s=1.5, cpu_s=1.0),
    )
    assert time.monotonic() - t0 < 6
    assert spin.status == "timeout" and sleep.status == "timeout"
    assert "wall clock" in sleep.detail


def test_kernel_layers_alone_without_the_audit_hook(tmp_path):
    """The namespaces and mounts hold by themselves (the audit hook off): no network, read-only disk, a private
    /tmp, no other process visible. Skipped where the kernel allows no namespaces, which the report says."""
    ex = LocalExecutor(workers=1, guard=False)
    rep = ex.describe()
    if not namespaced(ex):
        pytest.skip(f"no namespaces on this kernel: {rep.get('namespaces')} (network: {rep.get('network')})")
    assert rep["network"].startswith("cut off") and rep["proc"] == "private"
    target = tmp_path / "kernel.txt"
    tmp_path.chmod(0o777)
    prog = (
        "import os, socket\n"
        "res = {}\n"
        "try:\n    socket.create_connection(('127.0.0.1', 22), timeout=1)\n    res['net'] = 'open'\n"
        "except OSError as e:\n    res['net'] = e.errno\n"
        f"try:\n    open({str(target)!r}, 'w').write('x')\n    res['disk'] = 'written'\n"
        "except OSError as e:\n    res['disk'] = e.errno\n"
        "open('/tmp/private.txt', 'w').write('mine')\n"
        "res['pids'] = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())\n"
        "print(res)\n"
    )
    r = ex.run_one(RunRequest(prog), FAST)
    ex.close()
    res = eval(r.stdout)  # our own dict literal
    assert res["net"] != "open" and res["disk"] != "written" and not target.exists()
    assert res["pids"] == [1]  # pid 1 of its own namespace: nothing else is visible
    assert not Path("/tmp/private.txt").exists()  # its /tmp was its own


# ---------------------------------------------------------------------------------- HTTP executor
@pytest.fixture
def standin():
    """The stand-in run_code server on 127.0.0.1 (uvicorn in a thread), running code through the local executor."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    ex = LocalExecutor(workers=2)
    server = serve(sock, ex)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(5)
    ex.close()


def test_the_http_executor_speaks_run_code_to_the_standin(standin):
    import httpx

    raw = httpx.post(f"{standin}/run_code", json={"code": "print(input()[::-1])", "language": "python", "stdin": "abc"})
    body = raw.json()  # SandboxFusion's RunCodeResponse, field for field
    assert body["status"] == "Success" and body["compile_result"] is None and body["files"] == {}
    assert body["run_result"]["status"] == "Finished" and body["run_result"]["stdout"] == "cba\n"
    assert httpx.post(f"{standin}/run_code", json={"code": "x", "language": "cpp"}).json()["status"] == "SandboxError"
    with FusionExecutor(standin, workers=4) as ex:
        ok, err, slow = ex.run_many(
            [
                RunRequest("print(sum(map(int, input().split())))", "2 3"),
                RunRequest("1/0"),
                RunRequest("while 1: pass"),
            ],
            Limits(timeout_s=1.5, cpu_s=1.5),
        )
    assert (ok.status, ok.stdout, ok.exit_code) == ("ok", "5\n", 0)
    assert err.status == "error" and "ZeroDivisionError" in err.stderr
    assert slow.status == "timeout"


def test_the_tests_reward_through_the_http_executor_matches_the_local_one(standin, local):
    quick = {"reward.types": ["tests"], "sandbox.timeout_s": 1.0, "sandbox.cpu_s": 1.0}  # the loop times out
    cfg = load_config(None, {**quick, "sandbox.executor": "fusion", "sandbox.url": standin})
    codes = [GOOD, "def add(a, b):\n    return a * b\n", "def add(a, b) return", "while True: pass\n"]
    kw = dict(prompts=["p"] * 4, completions=codes, tests=[MBPP] * 4)
    via_http = make_tests_reward(cfg)
    local_cfg = load_config(None, quick)
    # a * b passes add(2, 2) == 4 only: a third of the tests
    assert via_http(**kw) == make_tests_reward(local_cfg, executor=local)(**kw) == [5.0, round(5 / 3, 4), 0.0, 0.0]
    assert via_http.sandbox.to_dict()["isolation"]["executor"] == "fusion"


def test_a_dead_sandbox_service_is_a_sandbox_error_not_a_zero():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there
    cfg = load_config(
        None,
        {"reward.types": ["tests"], "sandbox.executor": "fusion", "sandbox.url": f"http://127.0.0.1:{port}"},
    )
    reward = make_tests_reward(cfg, executor=FusionExecutor(f"http://127.0.0.1:{port}", retries=0))
    assert reward(prompts=["p"], completions=[GOOD], tests=[MBPP]) == [None]
    assert reward.sandbox.to_dict()["sandbox_errors"] == 1
