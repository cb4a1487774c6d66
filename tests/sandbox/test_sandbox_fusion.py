"""SandboxFusion's run_code API: the official client (``sandbox-fusion`` 0.3.7, a test dependency) drives the
stand-in server (``hermes_lab.sandbox.server``, uvicorn on 127.0.0.1, runs in the local sandbox), and the HTTP
executor (``FusionExecutor``) scores through it as the local one does."""

from __future__ import annotations

import base64
import json
import socket
import threading
import time

import httpx
import pytest
from sandbox_fusion import RunCodeRequest, RunStatus, SummaryMapping, run_code, run_concurrent, summary_run_code_result

from hermes_lab.config.schema import load_config
from hermes_lab.rewards.tests import make_tests_reward
from hermes_lab.sandbox.executor import Limits, RunRequest
from hermes_lab.sandbox.fusion import FusionExecutor
from hermes_lab.sandbox.local import LocalExecutor
from hermes_lab.sandbox.server import serve

MBPP = json.dumps(
    {"kind": "assert", "tests": ["assert add(1, 2) == 3", "assert add(2, 2) == 4", "assert add(0, 5) == 5"]}
)
GOOD = "def add(a, b):\n    return a + b\n"


@pytest.fixture(scope="module")
def executor():
    ex = LocalExecutor(workers=4)
    yield ex
    ex.close()


class StandIn:
    """The stand-in server on 127.0.0.1 in a thread, ``workers`` programs at once."""

    def __init__(self, executor: LocalExecutor, workers: int, **kw):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.server = serve(sock, executor, Limits(max_output_kb=64), workers=workers, **kw)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(5)


@pytest.fixture(scope="module")
def standin(executor):
    s = StandIn(executor, workers=4)
    yield s.url
    s.close()


def call(url: str, **kw) -> object:
    return run_code(RunCodeRequest(**kw), endpoint=url, max_attempts=1)


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def test_the_official_client_runs_python_and_bash_with_files_stdin_and_real_exit_codes(standin):
    assert httpx.get(f"{standin}/v1/ping").json() == "pong"
    program = (
        "import sys, helper\n"
        "data = open('data/in.txt').read()\n"
        "open('out.txt', 'w').write(helper.shout(data + sys.stdin.read()))\n"
        "print(__file__.endswith('.py'), open(__file__).read().startswith('import sys'))\n"
        "sys.exit(120)\n"
    )
    files = {"helper.py": b64("def shout(s):\n    return s.upper()\n"), "data/in.txt": b64("abc-")}
    r = call(standin, code=program, language="python", stdin="def", files=files, fetch_files=["out.txt", "nope.txt"])
    assert r.status == RunStatus.Failed and r.run_result.return_code == 120  # a real exit code, not capped
    assert r.run_result.stdout == "True True\n"
    assert {k: base64.b64decode(v) for k, v in r.files.items()} == {"out.txt": b"ABC-DEF"}  # nope.txt left out
    bash = call(
        standin,
        code='read x; echo "got $x"; cat in.txt; exit 7',
        language="bash",
        stdin="hi\n",
        files={"in.txt": b64("file\n")},
    )
    assert (bash.run_result.stdout, bash.run_result.return_code) == ("got hi\nfile\n", 7)
    ok = call(standin, code="print(6 * 7)", language="python")
    assert ok.status == RunStatus.Success and ok.run_result.stdout == "42\n" and ok.compile_result is None


def test_compile_and_runtime_errors_timeouts_and_signals_read_as_sandboxfusion_reports_them(standin):
    syntax = call(standin, code="def f(:\n    pass\n", language="python")
    assert syntax.run_result.return_code == 1 and "SyntaxError" in syntax.run_result.stderr
    runtime = call(standin, code="def g():\n    return 1 / 0\ng()\n", language="python")
    err = runtime.run_result.stderr
    assert runtime.run_result.return_code == 1 and "ZeroDivisionError" in err
    # the program's own frames only: its file and line, never the launcher's
    assert err.startswith('Traceback (most recent call last):\n  File "/work/') and "launcher" not in err
    mapping = SummaryMapping(RunFailed="run failed", RunTimeout="run timeout")
    assert summary_run_code_result(runtime, mapping) == "run failed"
    slow = call(standin, code="import time\ntime.sleep(30)", language="python", run_timeout=1)
    assert slow.run_result.status == "TimeLimitExceeded" and summary_run_code_result(slow, mapping) == "run timeout"
    # a program that signals itself dies of it (it is not pid 1 of its namespace)
    term = call(
        standin, code="import os, signal\nos.kill(os.getpid(), signal.SIGTERM)\nprint('alive')", language="python"
    )
    assert term.run_result.return_code == -15 and term.run_result.stdout == ""


def test_malformed_requests_are_422_and_what_the_standin_cannot_run_a_sandbox_error(standin):
    for body in (
        {"language": "python"},
        {"code": "x", "language": "cobol"},
        {"code": "x", "language": "python", "run_timeout": "soon"},
        [1, 2],
        {"code": "x", "language": "python", "files": {"a": 3}},
    ):
        r = httpx.post(f"{standin}/run_code", json=body)
        assert r.status_code == 422 and r.json()["detail"][0]["loc"][0] == "body", body
    with pytest.raises(Exception, match="Sandbox responded with error"):  # the client raises on SandboxError
        call(standin, code="int main() {}", language="cpp")
    with pytest.raises(Exception, match="Sandbox responded with error"):
        call(standin, code="print(1)", language="python", files={"../escape.txt": b64("x")})


def test_deep_or_huge_json_is_a_400_or_413_never_a_500(standin, executor):
    """A 100,000-deep array (the parser's RecursionError, which is no ValueError) and bodies past the limit,
    declared or streamed (chunked: no Content-Length). The control: the same nesting does raise RecursionError
    in json.loads, and a body under the limit runs."""
    deep = "[" * 100_000 + "]" * 100_000
    with pytest.raises(RecursionError):
        json.loads(deep)
    r = httpx.post(f"{standin}/run_code", content=deep, headers={"content-type": "application/json"})
    assert r.status_code == 400 and "nested too deeply" in r.json()["detail"], r.text
    wrapped = '{"code": "print(1)", "language": "python", "x": ' + deep + "}"
    assert httpx.post(f"{standin}/run_code", content=wrapped).status_code == 400
    small = StandIn(executor, workers=1, max_body=1 << 20)
    try:
        ok = {"code": "print(len('" + "x" * (600 << 10) + "'))", "language": "python"}
        assert httpx.post(f"{small.url}/run_code", json=ok).json()["run_result"]["stdout"] == f"{600 << 10}\n"
        big = json.dumps({"code": "#" + "x" * (2 << 20), "language": "python"}).encode()
        assert httpx.post(f"{small.url}/run_code", content=big).status_code == 413
        chunks = (big[i : i + 65536] for i in range(0, len(big), 65536))  # no Content-Length: counted as it comes
        assert httpx.post(f"{small.url}/run_code", content=chunks).status_code == 413
    finally:
        small.close()


def test_fetch_reads_regular_files_only_and_its_names_are_checked_like_files(standin):
    """A FIFO the run leaves (the fetch once blocked on it until the run's timeout) and a link to a device are
    not fetched, a regular file beside them is, at once; a fetch_files name that leaves the work dir is refused
    as a files name is."""
    code = (
        "import ctypes, os\nos.mkfifo('pipe')\nctypes.CDLL(None).symlink(b'/dev/zero', b'zeros')\n"
        "open('out.txt', 'w').write('done')\nprint(os.path.exists('zeros') and 'left')"
    )
    t0 = time.monotonic()
    r = call(standin, code=code, language="python", run_timeout=10, fetch_files=["pipe", "zeros", "out.txt"])
    took = time.monotonic() - t0
    assert r.run_result.stdout == "left\n" and r.files == {"out.txt": b64("done")}, r
    assert took < 5, took  # a blocked fetch would end at the run's 10 s
    for name in ("../escape.txt", "/etc/passwd", "a/../../b", "", "nul\0byte"):
        with pytest.raises(Exception, match="Sandbox responded with error"):
            call(standin, code="print(1)", language="python", fetch_files=[name])
    with pytest.raises(Exception, match="Sandbox responded with error"):
        call(standin, code="print(1)", language="python", files={"nul\0byte": b64("x")})


def test_workers_bound_every_request(executor):
    """Six concurrent 0.5 s sleeps: one at a time on --workers 1 (>= 3 s), three at a time on --workers 3."""
    took = {}
    for workers in (1, 3):
        s = StandIn(executor, workers)
        try:
            t0 = time.monotonic()
            out = run_concurrent(
                call,
                args=[[s.url]] * 6,
                kwargs=[{"code": "import time\ntime.sleep(0.5)", "language": "python"}] * 6,
                concurrency=6,
            )
            took[workers] = time.monotonic() - t0
            assert all(r.status == RunStatus.Success for r in out)
        finally:
            s.close()
    assert took[1] >= 3.0 and took[3] < 2.6, took


def test_the_http_executor_reports_a_cut_output_and_scores_as_the_local_one(standin, executor):
    with FusionExecutor(standin, workers=4) as ex:
        big, files = ex.run_many(
            [
                RunRequest("print('x' * (1 << 20))"),
                RunRequest("open('o.txt', 'w').write(input())", "fetched", fetch=("o.txt",)),
            ],
            Limits(timeout_s=5, max_output_kb=1024),
        )
    assert big.status == "output_limit"  # the stand-in cut it at its 64 KiB: the executor says so
    assert files.status == "ok" and files.files == {"o.txt": b"fetched"}
    # the loop ends at 1 s of CPU locally and at 3 s of wall clock through the stand-in; a passing completion gets 3 s
    # of wall clock (1 s failed it once on a fresh clone's CI, the cores busy with the other test files)
    quick = {"reward.types": ["tests"], "sandbox.timeout_s": 3.0, "sandbox.cpu_s": 1.0}
    cfg = load_config(None, {**quick, "sandbox.executor": "fusion", "sandbox.url": standin})
    codes = [GOOD, "def add(a, b):\n    return a * b\n", "def add(a, b) return", "while True: pass\n"]
    kw = dict(prompts=["p"] * 4, completions=codes, tests=[MBPP] * 4)
    via_http = make_tests_reward(cfg)
    # a * b passes add(2, 2) == 4 only: a third of the tests
    local = make_tests_reward(load_config(None, quick), executor=executor)
    assert via_http(**kw) == local(**kw) == [5.0, round(5 / 3, 4), 0.0, 0.0]
    assert via_http.sandbox.to_dict()["isolation"]["executor"] == "fusion"


def test_a_dead_sandbox_service_is_a_sandbox_error_not_a_zero():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there
    cfg = load_config(
        None, {"reward.types": ["tests"], "sandbox.executor": "fusion", "sandbox.url": f"http://127.0.0.1:{port}"}
    )
    reward = make_tests_reward(cfg, executor=FusionExecutor(f"http://127.0.0.1:{port}", retries=0))
    assert reward(prompts=["p"], completions=[GOOD], tests=[MBPP]) == [None]
    assert reward.sandbox.to_dict()["sandbox_errors"] == 1
