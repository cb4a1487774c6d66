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
import marshal
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
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


class LocalExecutor(Executor):
    """Runs each program through the launcher (see the module docstring). ``isolate=False`` skips the
    namespaces, ``guard=False`` the audit hook: for tests that check one layer alone, never for training."""

    name = "local"

    def __init__(
        self,
        workers: int | None = None,
        python: str | None = None,
        isolate: bool = True,
        guard: bool = True,
        tmp_root: str | None = None,
    ):
        super().__init__(workers)
        # the real binary: a venv's python is a symlink whose target nobody may reach (the launcher fixes
        # that for the stdlib), and -S skips the venv's site-packages anyway
        self.python = os.path.realpath(python or sys.executable)
        self.isolate, self.guard, self.tmp_root = isolate, guard, tmp_root
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
            proc = subprocess.Popen(
                [self.python, "-S", "-s", "-B", str(LAUNCHER)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=work,
                env=clean_env(work),
                start_new_session=True,  # its own process group: killed whole
                close_fds=True,
            )
        except OSError as e:
            return RunResult("sandbox_error", detail=f"cannot start the launcher: {e}", seconds=time.monotonic() - t0)
        try:
            assert proc.stdin is not None
            proc.stdin.write(marshal.dumps(job))  # the launcher reads it whole before anything else
            proc.stdin.close()
        except BrokenPipeError:
            pass
        deadline = t0 + float(limits.timeout_s)
        out, err, over, timed_out = self._read(proc, deadline, cap)
        if over or timed_out:
            _kill_group(proc.pid)
        # the group is killed once more before the launcher is reaped: until then its pid (the group's id)
        # cannot be reused, so the kill never reaches an unrelated process group
        os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
        _kill_group(proc.pid)  # whatever the program left behind in its group
        code = proc.wait()
        _wait_group_gone(proc.pid)  # killed processes die asynchronously: the run ends when they are gone
        seconds = round(time.monotonic() - t0, 4)
        stdout = out.decode("utf-8", "replace")
        stderr = err[-KEEP_STDERR:].decode("utf-8", "replace")
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

    @staticmethod
    def _read(proc: subprocess.Popen[bytes], deadline: float, cap: int) -> tuple[bytes, bytes, bool, bool]:
        """stdout and stderr until both close, the deadline passes or either passes ``cap`` bytes."""
        bufs: dict[Any, bytearray] = {proc.stdout: bytearray(), proc.stderr: bytearray()}
        sel = selectors.DefaultSelector()
        for f in bufs:
            sel.register(f, selectors.EVENT_READ)
        over = timed_out = False
        exited_at: float | None = None
        try:
            while sel.get_map():
                now = time.monotonic()
                if exited_at is None and _exited(proc.pid):
                    exited_at = now  # the launcher is gone: what is left in the pipes drains, briefly
                limit = deadline if exited_at is None else min(deadline, exited_at + GRACE_S)
                if now >= limit:
                    timed_out = exited_at is None
                    break
                for key, _ in sel.select(timeout=min(0.05, limit - now)):
                    chunk = os.read(key.fd, 65536)
                    if not chunk:
                        sel.unregister(key.fileobj)
                        continue
                    buf = bufs[key.fileobj]
                    buf += chunk
                    if len(buf) > cap:
                        del buf[cap:]
                        over = True
                if over:
                    break
        finally:
            sel.close()
            for f in bufs:
                f.close()  # type: ignore[union-attr]
        return bytes(bufs[proc.stdout]), bytes(bufs[proc.stderr]), over, timed_out

    # ------------------------------------------------------------------------------------------ describe
    def describe(self) -> dict[str, Any]:
        """What holds here: one probe run that reports its namespaces, user, filesystem and rlimits."""
        if self._report is None:
            r = self.run_one(RunRequest("pass"), Limits(timeout_s=30, cpu_s=10), report=True)
            rep: dict[str, Any] = {"executor": self.name, "workers": self.workers, "python": self.python}
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


def _exited(pid: int) -> bool:
    """Has the child exited? Without reaping it (WNOWAIT): its pid stays ours until Popen.wait."""
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


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
