"""The local executor: untrusted programs on this machine, each in a launcher process of its own.

Stage: train (the tests reward) and every stage that scores the embedded code family. Writes one private temp
dir per run (``$TMPDIR/hermes-sandbox-*/work``, the program's cwd, mode 0700), removed when the run ends;
nothing under runs/.

The parent side of ``hermes_lab.sandbox.launcher``. Per run it

- makes the temp dir (owned by ``nobody`` when we are root: the program runs as nobody);
- starts ``python -S -s -B launcher.py`` in a new session (one process group per run) with a clean
  environment: PATH, a UTF-8 locale, HOME and TMPDIR, PYTHONHASHSEED=0 (set and dict orders are the same on
  every run, so the same program gives the same output), nothing else (no API key, no proxy variable);
- hands it the job (program, stdin, limits) and reads stdout and stderr as they come, at most
  ``max_output_kb`` of each: past that the run is killed (``output_limit``), so a 100 MB print costs at most
  that much memory here;
- kills the whole process group at the wall-clock limit (``timeout``), and again when the launcher exits, so
  nothing the program started outlives it (inside a pid namespace they die with it anyway);
- removes the temp dir.

Parallel: ``run_many`` runs up to ``workers`` at once (threads, each waiting on its child).

What holds on a given machine (namespaces or not, the user the program runs as) comes from a probe run:
``LocalExecutor().describe()``, also printed by ``hermes-lab doctor``.
"""

from __future__ import annotations

import ast
import contextlib
import itertools
import marshal
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from hermes_lab.sandbox.executor import Executor, Limits, RunRequest, RunResult

LAUNCHER = Path(__file__).with_name("launcher.py")
NOBODY = 65534
MAX_PROGRAM_CODE, CPU_EXCEEDED, LAUNCHER_FAILED = 100, 124, 125  # launcher.py's exit codes
GRACE_S = 0.2  # after the launcher exits: how long output may still drain before the group is killed
KEEP_STDERR = 16 << 10  # stderr kept for diagnostics (the tail holds the traceback)


def clean_env(work: str) -> dict[str, str]:
    """The program's whole environment: nothing inherited, so no secret and no proxy variable."""
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "HOME": work,
        "TMPDIR": "/tmp",
        "PYTHONHASHSEED": "0",
        "PYTHONIOENCODING": "utf-8",
        "PYTHONDONTWRITEBYTECODE": "1",
    }


class _Handle:
    """A started run, whichever way it was started: its process group id, its output pipes, how to tell it
    has exited, kill it, and get its exit status (negative: killed by that signal)."""

    pid: int
    out_fd: int
    err_fd: int

    def exited(self) -> bool:
        raise NotImplementedError

    def kill(self) -> None:
        raise NotImplementedError

    def wait(self) -> int:
        raise NotImplementedError


class _ProcessHandle(_Handle):
    """One ``python launcher.py`` per run, a child of ours."""

    def __init__(self, python: str, job: dict[str, Any], work: str):
        self.proc = subprocess.Popen(
            [python, "-S", "-s", "-B", str(LAUNCHER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=work,
            env=job["env"],
            start_new_session=True,  # its own process group: killed whole
            close_fds=True,
        )
        self.pid = self.proc.pid
        assert self.proc.stdin and self.proc.stdout and self.proc.stderr
        self.out_fd, self.err_fd = self.proc.stdout.fileno(), self.proc.stderr.fileno()
        with contextlib.suppress(BrokenPipeError):
            self.proc.stdin.write(marshal.dumps(job))  # the launcher reads it whole before anything else
            self.proc.stdin.close()

    def exited(self) -> bool:  # without reaping it (WNOWAIT): its pid stays ours until wait()
        return os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None

    def kill(self) -> None:
        _kill_group(self.pid)

    def wait(self) -> int:
        # the group is killed once more before the launcher is reaped: until then its pid (the group's id)
        # cannot be reused, so the kill never reaches an unrelated process group
        os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOWAIT)
        _kill_group(self.pid)  # whatever the program left behind in its group
        code = self.proc.wait()
        self.proc.stdout.close()  # type: ignore[union-attr]
        self.proc.stderr.close()  # type: ignore[union-attr]
        return code


class _Waiter:
    def __init__(self) -> None:
        self.started, self.done = threading.Event(), threading.Event()
        self.pid, self.code, self.failed = 0, 0, ""


class ForkServer:
    """One launcher started once (``launcher.py --serve``), forking a run per request: no interpreter start
    per run, which is most of a run's cost. Runs come back as (pid, exit status) messages over a
    SOCK_SEQPACKET socket; their output goes straight into pipes we made. If the server dies, the runs in
    flight end as sandbox errors and the next run starts a new one; when this process ends, the socket closes
    and the server kills what still runs and exits."""

    def __init__(self, python: str):
        self.python = python
        self.lock = threading.Lock()
        self.sock: socket.socket | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.waiters: dict[int, _Waiter] = {}
        self.ids = itertools.count(1)

    def _start(self) -> None:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.proc = subprocess.Popen(
            [self.python, "-S", "-s", "-B", str(LAUNCHER), "--serve", str(child.fileno())],
            pass_fds=[child.fileno()],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            cwd="/",
            env=clean_env("/"),
            start_new_session=True,
        )
        child.close()
        self.sock = parent
        threading.Thread(target=self._listen, args=(parent,), daemon=True, name="sandbox-forkserver").start()

    def _listen(self, sock: socket.socket) -> None:
        while True:
            try:
                msg = sock.recv(4096)
            except OSError:
                msg = b""
            if not msg:
                break
            kind, run_id, value = marshal.loads(msg)
            w = self.waiters.get(run_id)
            if w is None:
                continue
            if kind == "started":
                w.pid = value
                w.started.set()
            else:
                w.code = value
                w.done.set()
        with self.lock:
            if self.sock is sock:
                self.sock = None
            lost = [w for w in self.waiters.values() if not w.done.is_set()]
        for w in lost:  # the server is gone: these runs end here, as the executor's failure
            w.failed = "the sandbox fork server exited"
            w.started.set()
            w.done.set()

    def submit(self, job: dict[str, Any], out_w: int, err_w: int) -> tuple[int, _Waiter]:
        data = marshal.dumps(job)
        job_fd = os.memfd_create("hermes-job")
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(job_fd, view) :]
            os.lseek(job_fd, 0, os.SEEK_SET)
            with self.lock:
                if self.sock is None:
                    self._start()
                run_id, w = next(self.ids), _Waiter()
                self.waiters[run_id] = w
                assert self.sock is not None
                socket.send_fds(self.sock, [marshal.dumps(("run", run_id))], [out_w, err_w, job_fd])
        finally:
            os.close(job_fd)
        return run_id, w

    def kill(self, run_id: int) -> None:
        with self.lock, contextlib.suppress(OSError):
            if self.sock is not None:
                self.sock.send(marshal.dumps(("kill", run_id)))

    def forget(self, run_id: int) -> None:
        with self.lock:
            self.waiters.pop(run_id, None)

    def close(self) -> None:
        with self.lock:
            sock, proc, self.sock = self.sock, self.proc, None
        if sock is not None:
            # shutdown, not close alone: the listener thread's recv holds the socket open until it returns, so
            # a bare close() would send the server no EOF (it would be killed after the timeout below)
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()  # EOF: the server kills what still runs and exits
        if proc is not None:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                _kill_group(proc.pid)
                proc.wait()


class _ServerHandle(_Handle):
    def __init__(self, server: ForkServer, job: dict[str, Any]):
        self.server = server
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            self.run_id, self.w = server.submit(job, out_w, err_w)
        finally:
            os.close(out_w)  # the run holds its own copies: EOF comes when it (and what it started) is gone
            os.close(err_w)
        self.out_fd, self.err_fd = out_r, err_r
        self.w.started.wait(30)
        self.pid = self.w.pid

    def exited(self) -> bool:
        return self.w.done.is_set()

    def kill(self) -> None:
        self.server.kill(self.run_id)

    def wait(self) -> int:
        if not self.w.done.wait(30):
            self.w.failed = "the sandbox fork server did not report the run's end"
        self.server.forget(self.run_id)
        os.close(self.out_fd)
        os.close(self.err_fd)
        return self.w.code


class LocalExecutor(Executor):
    """Runs each program through the launcher (see the module docstring): by default forked from one
    pre-started launcher (``ForkServer``), else (``forkserver=False``) one launcher process per run.
    ``isolate=False`` skips the namespaces, ``guard=False`` the audit hook: for tests and benchmarks that
    look at one layer alone, never for training."""

    name = "local"

    def __init__(
        self,
        workers: int | None = None,
        python: str | None = None,
        isolate: bool = True,
        guard: bool = True,
        tmp_root: str | None = None,
        forkserver: bool = True,
    ):
        super().__init__(workers)
        # the real binary: a venv's python is a symlink whose target nobody may reach (the launcher fixes
        # that for the stdlib), and -S skips the venv's site-packages anyway
        self.python = os.path.realpath(python or sys.executable)
        self.isolate, self.guard, self.tmp_root = isolate, guard, tmp_root
        self.server = ForkServer(self.python) if forkserver else None
        self._report: dict[str, Any] | None = None

    # ----------------------------------------------------------------------------------------------- run
    def run_one(self, req: RunRequest, limits: Limits, report: bool = False) -> RunResult:
        t0 = time.monotonic()
        root = tempfile.mkdtemp(prefix="hermes-sandbox-", dir=self.tmp_root)
        try:
            work = os.path.join(root, "work")
            os.mkdir(work, 0o700)
            if os.geteuid() == 0:
                os.chown(work, NOBODY, NOBODY)
            job = {
                "program": req.program,
                "stdin": req.stdin,
                "work": work,
                "env": clean_env(work),
                "cpu_s": float(limits.cpu_s),
                "memory_mb": int(limits.memory_mb),
                "file_mb": int(limits.file_mb),
                "max_files": int(limits.max_files),
                "max_processes": int(limits.max_processes),
                "isolate": self.isolate,
                "guard": self.guard,
                "report": report,
            }
            return self._supervise(job, limits, work, t0)
        finally:
            shutil.rmtree(root, ignore_errors=True)

    def _supervise(self, job: dict[str, Any], limits: Limits, work: str, t0: float) -> RunResult:
        cap = int(limits.max_output_kb) << 10
        try:
            h: _Handle = _ServerHandle(self.server, job) if self.server else _ProcessHandle(self.python, job, work)
        except OSError as e:
            return RunResult("sandbox_error", detail=f"cannot start the launcher: {e}", seconds=time.monotonic() - t0)
        out, err, over, timed_out = _read(h, t0 + float(limits.timeout_s), cap)
        if over or timed_out:
            h.kill()
        code = h.wait()
        failed = getattr(getattr(h, "w", None), "failed", "")
        if h.pid:
            _wait_group_gone(h.pid)  # killed processes die asynchronously: the run ends when they are gone
        seconds = round(time.monotonic() - t0, 4)
        stdout = out.decode("utf-8", "replace")
        stderr = err[-KEEP_STDERR:].decode("utf-8", "replace")
        if failed:
            return RunResult("sandbox_error", None, stdout, stderr, seconds, detail=failed)
        if over:
            return RunResult(
                "output_limit", None, stdout, stderr, seconds, detail=f"more than {cap >> 10} KiB of output"
            )
        if timed_out:
            return RunResult("timeout", None, stdout, stderr, seconds, detail=f"wall clock > {limits.timeout_s:g} s")
        if code < 0:  # the launcher itself was killed: the program signalled its own process group
            return RunResult(
                "killed", None, stdout, stderr, seconds, signal=-code, detail="the run's process group was killed"
            )
        if code == LAUNCHER_FAILED:
            return RunResult("sandbox_error", None, stdout, stderr, seconds, detail=_last_line(stderr))
        if code == CPU_EXCEEDED:
            return RunResult("timeout", None, stdout, stderr, seconds, detail=f"CPU time > {limits.cpu_s:g} s")
        if code > 128:
            sig = code - 128
            return RunResult("killed", None, stdout, stderr, seconds, signal=sig, detail=_signame(sig))
        return RunResult("ok" if code == 0 else "error", code, stdout, stderr, seconds)

    def close(self) -> None:
        super().close()
        if self.server is not None:
            self.server.close()

    # ------------------------------------------------------------------------------------------ describe
    def describe(self) -> dict[str, Any]:
        """What holds here: one probe run that reports its namespaces, user, filesystem and rlimits."""
        if self._report is None:
            r = self.run_one(RunRequest("pass"), Limits(timeout_s=30, cpu_s=10), report=True)
            rep: dict[str, Any] = {"executor": self.name, "workers": self.workers, "python": self.python}
            rep["spawn"] = "fork server" if self.server else "one launcher process per run"
            line = next((s for s in r.stderr.splitlines() if s.startswith("HERMES_SANDBOX ")), None)
            if r.status != "ok" or line is None:
                rep["error"] = f"the probe run failed ({r.status}): {r.detail or _last_line(r.stderr)}"
            else:
                probe = ast.literal_eval(line.split(" ", 1)[1])
                probe.pop("rlimits", None)  # the probe's own limits, not a run's
                rep.update(probe)
            ns = str(rep.get("namespaces", "none"))
            rep["network"] = (
                "cut off (own network namespace)"
                if "net" in ns
                else ("NOT cut off by the kernel (no namespaces here): only the audit hook refuses sockets")
            )
            self._report = rep
        return dict(self._report)


def _read(h: _Handle, deadline: float, cap: int) -> tuple[bytes, bytes, bool, bool]:
    """stdout and stderr until both close, the deadline passes or either passes ``cap`` bytes."""
    bufs = {h.out_fd: bytearray(), h.err_fd: bytearray()}
    sel = selectors.DefaultSelector()
    for fd in bufs:
        sel.register(fd, selectors.EVENT_READ)
    over = timed_out = False
    exited_at: float | None = None
    try:
        while sel.get_map():
            now = time.monotonic()
            if exited_at is None and h.exited():
                exited_at = now  # the launcher is gone: what is left in the pipes drains, briefly
            limit = deadline if exited_at is None else min(deadline, exited_at + GRACE_S)
            if now >= limit:
                timed_out = exited_at is None
                break
            for key, _ in sel.select(timeout=min(0.05, limit - now)):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fd)
                    continue
                buf = bufs[key.fd]
                buf += chunk
                if len(buf) > cap:
                    del buf[cap:]
                    over = True
            if over:
                break
    finally:
        sel.close()
    return bytes(bufs[h.out_fd]), bytes(bufs[h.err_fd]), over, timed_out


def _wait_group_gone(pgid: int, limit_s: float = 5.0) -> None:
    """Until no process is left in the group (signal 0 only: a pid that is no group's any more could be
    reused, and must not be signalled). The kernel keeps a group id in use while a member lives."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.005)


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _signame(sig: int) -> str:
    try:
        return f"killed by {signal.Signals(sig).name}"
    except ValueError:
        return f"killed by signal {sig}"


def _last_line(text: str) -> str:
    lines = [s for s in text.strip().splitlines() if s.strip()]
    return lines[-1][:300] if lines else ""
