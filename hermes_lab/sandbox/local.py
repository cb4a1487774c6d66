"""The local executor: untrusted programs on this machine, each run confined by the kernel, forked from a warm
launcher.

Stage: train (the tests reward) and every stage that scores code. Writes one cgroup per run (removed after) and,
without namespaces, one work dir per run on /dev/shm (removed after); nothing under runs/.

    LocalExecutor(python=".venv-np/bin/python").run_one(RunRequest("import numpy; print(numpy.pi)"), Limits())

The trainer's side of ``hermes_lab.sandbox.launcher``. Once per executor it starts the fork server (inside
bubblewrap's root where namespaces work, see ``hermes_lab.sandbox.isolation``), builds the seccomp filter and
makes its cgroup directory. Per run it

- writes the job (program, language, files, limits) into one memfd and stdin into another: stdin reaches the
  program as its fd 0 and never passes through the memory of any process of the run (the tests' expected values
  may travel there), and the server never reads a job;
- makes the run's cgroup (memory for the whole run, pids) and hands its ``cgroup.procs`` files to the run;
- reads stdout and stderr as they come, at most ``max_output_kb`` of each (past that: ``output_limit``);
- at the wall-clock limit, the output limit or the end, kills the whole cgroup (frozen first: nothing forks
  away), so no process outlives its run; then removes the cgroup and the work dir, never raising;
- reads the status record the run's supervisor wrote: exit code as the program gave it, the signal that ended
  it, CPU seconds; an out-of-memory kill in the cgroup is said as such.

Environment of a run: PATH, a UTF-8 locale, HOME and TMPDIR, PYTHONHASHSEED=0 (the same program gives the same
output), one thread for BLAS libraries (the pids limit counts threads); nothing inherited (no API key, no proxy).
``LocalExecutor().describe()`` says what holds here, layer by layer (``hermes-lab doctor`` prints it).
"""

from __future__ import annotations

import ast
import contextlib
import itertools
import marshal
import os
import selectors
import signal
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from hermes_lab.sandbox import isolation as iso
from hermes_lab.sandbox import seccomp
from hermes_lab.sandbox.executor import Executor, Limits, RunRequest, RunResult

LAUNCHER = Path(__file__).with_name("launcher.py")
LAUNCHER_FAILED = 125  # launcher.py's exit code when it failed before the program started
GRACE_S = 0.2  # after the run's launcher exits: how long output may still drain before the cgroup is killed
KEEP_STDERR = 16 << 10  # stderr kept for diagnostics (the tail holds the traceback)
NS_WORK = "/work"


def clean_env(work: str, tmp: str = "/tmp") -> dict[str, str]:
    """The program's whole environment: nothing inherited, so no secret and no proxy variable."""
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "HOME": work,
        "TMPDIR": tmp,
        "PYTHONHASHSEED": "0",
        "PYTHONIOENCODING": "utf-8",
        "PYTHONDONTWRITEBYTECODE": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }


class _Waiter:
    def __init__(self) -> None:
        self.done = threading.Event()
        self.code, self.failed = 0, ""


class ForkServer:
    """One launcher started once (``command`` + ``--serve FD``), forking a run per request. Runs' ends come
    back as ("exited", id, status) over a SOCK_SEQPACKET socket; their output goes straight into pipes we
    made. If the server dies, the runs in flight end as sandbox errors and the next run starts a new one; when
    this process ends, the socket closes and the server kills what still runs and exits."""

    def __init__(self, command: list[str]):
        self.command = command
        self.lock = threading.Lock()
        self.sock: socket.socket | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.waiters: dict[int, _Waiter] = {}
        self.ids = itertools.count(1)

    def _start(self) -> None:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.proc = subprocess.Popen(
            [*self.command, "--serve", str(child.fileno())],
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
            _, run_id, value = marshal.loads(msg)
            w = self.waiters.get(run_id)
            if w is not None:
                w.code = value
                w.done.set()
        with self.lock:
            if self.sock is sock:
                self.sock = None
            lost = [w for w in self.waiters.values() if not w.done.is_set()]
        for w in lost:  # the server is gone: these runs end here, as the executor's failure
            w.failed = "the sandbox fork server exited"
            w.done.set()

    def submit(self, fds: list[int]) -> tuple[int, _Waiter]:
        with self.lock:
            if self.sock is None:
                self._start()
            run_id, w = next(self.ids), _Waiter()
            self.waiters[run_id] = w
            assert self.sock is not None
            socket.send_fds(self.sock, [marshal.dumps(("run", run_id))], fds)
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
            # shutdown, not close alone: the listener thread's recv holds the socket open until it returns
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()  # EOF: the server kills what still runs and exits
        if proc is not None:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


class LocalExecutor(Executor):
    """Runs each program forked from one pre-started launcher (see the module docstring). ``python``: the
    sandbox interpreter (``sandbox.python``; default this one's, standard library only). The switches turn one
    layer off, for tests and the benchmark that look at a layer alone, never for training: ``isolate=False``
    the namespaces and bubblewrap's root (the fallback: Landlock), ``seccomp``, ``cgroup``, ``landlock``,
    ``guard`` (the audit hook). ``tmp_root``: where the fallback's work dirs go (default /dev/shm)."""

    name = "local"

    def __init__(
        self,
        workers: int | None = None,
        python: str | None = None,
        isolate: bool = True,
        seccomp: bool = True,
        cgroup: bool = True,
        landlock: bool = True,
        guard: bool = True,
        tmp_root: str | None = None,
    ):
        super().__init__(workers)
        self.interp = iso.Interpreter.of(python)
        self.python = self.interp.executable
        self.switches = {"isolate": isolate, "seccomp": seccomp, "cgroup": cgroup, "landlock": landlock}
        self.guard, self.tmp_root = guard, tmp_root
        self._setup_lock = threading.Lock()
        self._ready = False
        self._report: dict[str, Any] | None = None

    # ----------------------------------------------------------------------------------------------- setup
    def _setup(self) -> None:
        """What this machine gives, decided once: the mode, the filter, the cgroups, the server's command."""
        with self._setup_lock:
            if self._ready:
                return
            why_not = iso.bwrap_works(self.interp) if self.switches["isolate"] else "turned off (isolate=False)"
            self.namespaced = not why_not
            self.why_not = why_not
            self.seccomp_why = ""
            self.bpf: bytes | None = None
            if self.switches["seccomp"]:
                try:
                    self.bpf = seccomp.filter_bpf(landlocked=not self.namespaced)
                except seccomp.SeccompUnavailable as e:
                    self.seccomp_why = str(e)
            else:
                self.seccomp_why = "turned off"
            self.cgroups = iso.Cgroups() if self.switches["cgroup"] else None
            self.landlock_abi = iso.landlock_abi() if not self.namespaced and self.switches["landlock"] else 0
            run = [self.interp.executable, *self.interp.args]
            if self.namespaced:
                cmd = iso.bwrap_command(self.interp, LAUNCHER.parent) + [
                    *run,
                    f"{iso.SANDBOX_LAUNCHER_DIR}/launcher.py",
                ]
            else:
                cmd = [*run, str(LAUNCHER)]
            self.server = ForkServer(cmd)
            self.work_root = self.tmp_root or ("/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir())
            self._ready = True

    # ----------------------------------------------------------------------------------------------- run
    def run_one(self, req: RunRequest, limits: Limits, report: bool = False) -> RunResult:
        self._setup()
        t0 = time.monotonic()
        root = None
        cg = None
        fds: list[int] = []
        try:
            if self.namespaced:
                work = NS_WORK
                env = clean_env(work)
            else:
                root = tempfile.mkdtemp(prefix="hermes-sandbox-", dir=self.work_root)
                work = os.path.join(root, "work")
                os.mkdir(work, 0o700)
                env = clean_env(work, tmp=work)
            if self.cgroups is not None and self.cgroups.available:
                cg = self.cgroups.run(limits.memory_mb, limits.max_processes)
            job = self._job(req, limits, work, env, cg is not None, report)
            out_r, out_w = os.pipe()
            err_r, err_w = os.pipe()
            status_r, status_w = os.pipe()
            fetch_fd = _memfd("hermes-fetch", b"") if req.fetch else None
            fds = [_memfd("hermes-job", marshal.dumps(job)), out_w, err_w, status_w]
            fds.append(_memfd("hermes-stdin", req.stdin.encode("utf-8", "surrogateescape")))
            if fetch_fd is not None:
                fds.append(fetch_fd)
            fds += cg.procs_fds() if cg is not None else []
            try:
                run_id, w = self.server.submit(fds)
            finally:
                for fd in fds:
                    if fd != fetch_fd:
                        os.close(fd)
            return self._supervise(run_id, w, (out_r, err_r, status_r, fetch_fd), cg, limits, t0)
        except OSError as e:
            return RunResult("sandbox_error", detail=f"cannot start the run: {e}", seconds=time.monotonic() - t0)
        finally:
            if cg is not None:
                cg.remove()
            if root is not None:
                iso.remove_tree(root)

    def _job(self, req: RunRequest, limits: Limits, work: str, env: dict, cgroup: bool, report: bool) -> dict:
        landlock = None
        if not self.namespaced and self.landlock_abi:
            # /proc/self: opened in the program's process, so its own /proc/<pid> only (its maps, status)
            ro = [*iso.SYSTEM_RO, *iso.ETC_RO, *self.interp.read_only, "/proc/self"]
            landlock = {"abi": self.landlock_abi, "read_only": ro, "writable": list(iso.DEV_RW)}
        uid = os.geteuid()
        return {
            "program": req.program,
            "language": req.language,
            "files": dict(req.files),
            "fetch": list(req.fetch),
            "work": work,
            "env": env,
            "namespaced": self.namespaced,
            "to_nobody": self.namespaced and uid == 0,
            "cpu_s": float(limits.cpu_s),
            "memory_mb": int(limits.memory_mb),
            "file_mb": int(limits.file_mb),
            "max_files": int(limits.max_files),
            "max_processes": int(limits.max_processes),
            "nproc_base": 0 if cgroup else _processes_of(uid),
            "cgroup": cgroup,
            "landlock": landlock,
            "seccomp": self.bpf,
            "guard": self.guard and req.language == "python",
            "report": report,
            "probe_paths": _probe_paths() if report else [],
            "keep_fd": 0,
        }

    def _supervise(self, run_id, w, pipes, cg, limits: Limits, t0: float) -> RunResult:
        out_r, err_r, status_r, fetch_fd = pipes
        cap = int(limits.max_output_kb) << 10
        try:
            out, err, over, timed_out = _read(out_r, err_r, w, t0 + float(limits.timeout_s), cap)
            if over or timed_out:
                self._kill(run_id, cg)
            if not w.done.wait(30):
                w.failed = w.failed or "the sandbox fork server did not report the run's end"
            if cg is not None:
                cg.kill()  # what the program left behind (without namespaces nothing else ends it)
            record = _read_record(status_r)
            oom = cg.oom_kills() if cg is not None else 0
            fetched = _read_fetched(fetch_fd) if fetch_fd is not None else {}
        finally:
            self.server.forget(run_id)
            for fd in (out_r, err_r, status_r, fetch_fd):
                if fd is not None:
                    os.close(fd)
        seconds = round(time.monotonic() - t0, 4)
        stdout = out.decode("utf-8", "replace")
        stderr = err[-KEEP_STDERR:].decode("utf-8", "replace")

        def result(status: str, code: int | None = None, sig: int | None = None, detail: str = "") -> RunResult:
            return RunResult(status, code, stdout, stderr, seconds, sig, detail, fetched)

        if w.failed:
            return result("sandbox_error", detail=w.failed)
        if over:
            return result("output_limit", detail=f"more than {cap >> 10} KiB of output")
        if timed_out:
            return result("timeout", detail=f"wall clock > {limits.timeout_s:g} s")
        memory = f"out of memory: the run's {limits.memory_mb} MiB (its cgroup) ran out"
        if record is None:  # the supervisor never wrote one: killed (the OOM killer may pick it) or failed
            if oom:
                return result("killed", sig=signal.SIGKILL, detail=memory)
            return result("sandbox_error", detail=_last_line(stderr) or f"the run's launcher ended ({w.code})")
        if not record["started"]:
            return result("sandbox_error", detail=_last_line(stderr) or "the program did not start")
        sig = record["signal"]
        if sig is not None:
            # SIGXCPU is RLIMIT_CPU's soft limit; SIGKILL past it its hard one (or the OOM killer: CPU tells)
            if sig == signal.SIGXCPU or (sig == signal.SIGKILL and record["cpu"] >= limits.cpu_s - 0.05):
                return result("timeout", detail=f"CPU time > {limits.cpu_s:g} s")
            if oom:
                return result("killed", sig=sig, detail=memory)
            return result("killed", sig=sig, detail=_signame(sig))
        code = record["exit"]
        return result("ok" if code == 0 else "error", code=code, detail=self._hint(stderr) if code else "")

    def _hint(self, stderr: str) -> str:
        """A module the standard-library interpreter lacks: say so, and how to give runs a virtualenv's."""
        last = _last_line(stderr)
        if last.startswith("ModuleNotFoundError") and "-S" in self.interp.args:
            return f"{last}: the sandbox runs the standard library only; set sandbox.python to a virtualenv's python"
        return ""

    def _kill(self, run_id: int, cg: iso.RunCgroup | None) -> None:
        if cg is not None:
            cg.kill()
        else:
            self.server.kill(run_id)

    def close(self) -> None:
        super().close()
        if self._ready:
            self.server.close()
            if self.cgroups is not None:
                self.cgroups.close()

    # ------------------------------------------------------------------------------------------ describe
    def describe(self) -> dict[str, Any]:
        """What holds here, layer by layer: one probe run reports from inside (its user, what of the host it
        reaches, the filter loaded), the rest is what this side set up."""
        if self._report is None:
            self._setup()
            r = self.run_one(RunRequest("pass"), Limits(timeout_s=30, cpu_s=10), report=True)
            rep: dict[str, Any] = {"executor": self.name, "workers": self.workers, "python": self.python}
            rep["python_version"] = self.interp.version
            rep["spawn"] = "fork server"
            rep["mode"] = "namespaces" if self.namespaced else "fallback"
            rep.update(self._layers())
            line = next((s for s in r.stderr.splitlines() if s.startswith("HERMES_SANDBOX ")), None)
            if r.status != "ok" or line is None:
                rep["error"] = f"the probe run failed ({r.status}): {r.detail or _last_line(r.stderr)}"
            else:
                probe = ast.literal_eval(line.split(" ", 1)[1])
                rep["seccomp_loaded"] = probe["seccomp"]
                rep["user"] = "nobody" if probe["uid"] == 65534 else f"uid {probe['uid']}, no capabilities"
                rep["root_entries"] = probe["root"]
                rep["host_paths"] = probe["host_paths"]
                rep["unix_sockets"] = probe.get("unix_sockets", "not probed")
            rep["missing"] = iso.missing(rep)
            self._report = rep
        return dict(self._report)

    def _layers(self) -> dict[str, Any]:
        cg = self.cgroups.describe() if self.cgroups is not None else "none (turned off)"
        out: dict[str, Any] = {
            "seccomp": seccomp.describe() if self.bpf else f"none ({self.seccomp_why})",
            "cgroup": cg,
            "guard": self.guard,
        }
        if self.namespaced:
            user = "user+" if os.geteuid() != 0 else ""
            out["namespaces"] = f"{user}net+pid+mount+ipc+uts (bubblewrap; a mount, pid and network namespace per run)"
            out["filesystem"] = (
                "a root of its own: /usr and the interpreter read-only, nothing else of the host; "
                f"tmpfs {NS_WORK}, /tmp, /dev/shm and a devpts per run (file_mb each, {4096} inodes)"
            )
            out["network"] = (
                "cut off (a network namespace per run; no socket but a socketpair, and no address for it: seccomp)"
            )
            out["processes"] = "own pid namespace per run"
        else:
            abi = self.landlock_abi
            out["namespaces"] = f"none ({self.why_not})"
            out["landlock_abi"] = abi
            out["filesystem"] = (
                f"Landlock ABI {abi}: reads the interpreter and system libraries, writes its work dir on "
                f"{self.work_root} (a host dir; its pages count against the run's memory cgroup)"
                if abi
                else "NOT confined (no namespaces, no Landlock): only the audit hook"
            )
            out["network"] = "no socket but a socketpair, and no unix address for it (seccomp)" + (
                ", no TCP (Landlock)" if abi >= 4 else ""
            )
            out["processes"] = "Landlock signal scope" if abi >= 6 else "NOT confined: signals reach the host"
        return out


def _read(out_fd: int, err_fd: int, w: _Waiter, deadline: float, cap: int) -> tuple[bytes, bytes, bool, bool]:
    """stdout and stderr until both close, the deadline passes or either passes ``cap`` bytes."""
    bufs = {out_fd: bytearray(), err_fd: bytearray()}
    sel = selectors.DefaultSelector()
    for fd in bufs:
        sel.register(fd, selectors.EVENT_READ)
    over = timed_out = False
    exited_at: float | None = None
    try:
        while sel.get_map():
            now = time.monotonic()
            if exited_at is None and w.done.is_set():
                exited_at = now  # the run's launcher is gone: what is left in the pipes drains, briefly
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
    return bytes(bufs[out_fd]), bytes(bufs[err_fd]), over, timed_out


def _read_record(fd: int) -> dict[str, Any] | None:
    """The supervisor's status record (all of its writers are gone by now: the pipe is at EOF or holds it)."""
    os.set_blocking(fd, False)
    try:
        data = os.read(fd, 4096)
        rec = marshal.loads(data) if data else None
    except (OSError, ValueError, EOFError):
        return None
    return rec if isinstance(rec, dict) and "started" in rec else None


def _read_fetched(fd: int) -> dict[str, bytes]:
    os.lseek(fd, 0, os.SEEK_SET)
    with os.fdopen(os.dup(fd), "rb") as f:
        data = f.read()
    try:
        got = marshal.loads(data) if data else {}
    except (ValueError, EOFError):
        return {}
    return {k: v for k, v in got.items() if isinstance(k, str) and isinstance(v, bytes)}


def _processes_of(uid: int) -> int:
    n = 0
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            with contextlib.suppress(OSError):
                n += p.stat().st_uid == uid
    return n


def _probe_paths() -> list[str]:
    """Host paths a run must not reach: the checkout, the trainer's cwd (runs/ lies there), $HOME, /root."""
    checkout = Path(__file__).resolve().parents[2]
    return sorted({str(checkout / "pyproject.toml"), str(checkout), os.getcwd(), os.path.expanduser("~"), "/root"})


def _signame(sig: int) -> str:
    try:
        return f"killed by {signal.Signals(sig).name}"
    except ValueError:
        return f"killed by signal {sig}"


def _last_line(text: str) -> str:
    lines = [s for s in text.strip().splitlines() if s.strip()]
    return lines[-1][:300] if lines else ""
