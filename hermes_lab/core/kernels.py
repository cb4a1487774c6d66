"""Stage kernels forked from a warm zygote: a papermill kernel starts with its common imports already done.

Foundation, used by the round runner (``hermes_lab.round.runner.run_notebook``) for every stage notebook.
Reads and writes nothing under runs/.

A stage kernel used to be a new interpreter (``python -m ipykernel_launcher``) that spent ~2.5 s of CPU on the
same imports before its first cell did any work: IPython and ipykernel, MLflow (every stage logs to it),
matplotlib and pandas. A round starts one kernel per stage; the test suite starts ~70. Here the process that
runs notebooks starts one *zygote* the first time it needs a kernel: ``python -m hermes_lab.core.kernels
--serve FD`` imports ``PRELOAD`` once, then forks one child per kernel, and the child becomes the kernel
(``ipykernel_launcher`` run as ``__main__`` with the command line, environment and working directory that
jupyter_client would have given the new interpreter). The kernel is still a real ipykernel over ZeroMQ
(CurveZMQ included); only its interpreter start is shared.

What a forked kernel sees is what a new one would: its cwd, ``sys.path[0]`` (the cwd, as ``python -m`` puts
it), its environment, matplotlib's inline backend, hermes_lab imported afresh from the kernel's own path (the
zygote forgets hermes_lab before the kernel starts). Where that cannot be promised, the kernel is started the
usual way instead, with nothing said above --debug:
- the kernelspec's command is not this interpreter's ``-m ipykernel_launcher`` (another Python, another kernel);
- the environment differs from the zygote's in a variable that an import may read (``PYTHONPATH``, ``HF_*``,
  ``HOME``, ...) while another of its kernels still runs. Only variables read when used, never at import, may
  differ: ``LATE_ENV`` (hermes_lab's own, the API keys, MLflow's tracking URI, proxies, pytest's and Jupyter's
  bookkeeping). With no kernel running, a new zygote is started in the new environment instead;
- ``HERMES_LAB_FORK_KERNELS=0``, a system other than Linux, or a zygote that could not start.

The heavy imports (torch, transformers, PEFT, TRL: 3-7 s of CPU) are not in ``PRELOAD``: many kernels never
need them (prep, review, compare, most notebooks of the test suite), and a zygote that imported them for nothing
would cost more than it saves. A kernel manager may name them instead (``manager(preload)``; the round runner
passes each stage's ``Stage.preload``): the zygote imports them before it forks that kernel, the kernel finds
them imported, and every later kernel of the zygote gets them for nothing. In a round, the zygote imports them
for the execute stage, and the train, validate and A/B kernels no longer import them each (a CI-scale round:
82 s -> 61 s of CPU). While the zygote imports them (~6 s, once), its other kernels' signals and exits wait.
Importing them starts no thread that a fork would lose: the only native threads then are OpenBLAS's idle
servers (numpy's and scipy's, one per core), which OpenBLAS stops and restarts around a fork itself, as it
does for PyTorch's DataLoader workers.

Lifetime: the zygote reaps its kernels and reports their exit status over a SOCK_SEQPACKET socket; signals
(interrupt, terminate, kill) go through it to the kernel's process group. When the process that started it
ends, killed or not, the socket closes: the zygote kills its kernels' groups and exits, and each kernel also
watches the zygote as its parent (ipykernel's parent poller), as a kernel watches the process that starts it.
In ``ps`` a forked kernel shows the zygote's command line (``-m hermes_lab.core.kernels --serve N``), and the
zygote as its parent.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import Sequence
from typing import Any

from jupyter_client.manager import AsyncKernelManager
from jupyter_client.provisioning import LocalProvisioner

log = logging.getLogger(__name__)

ENV_SWITCH = "HERMES_LAB_FORK_KERNELS"  # "0": every kernel is a new interpreter
# MLflow's SQLite store too: every stage opens it (tracking.setup), and importing it (its SQLAlchemy models and
# alembic) is ~1.5 s of CPU that each kernel would spend again
PRELOAD = (
    "ipykernel.kernelapp",
    "mlflow",
    "mlflow.store.tracking.sqlalchemy_store",
    "matplotlib.pyplot",
    "pandas",
    "yaml",
)
INLINE = "module://matplotlib_inline.backend_inline"  # what ipykernel gives a kernel with no MPLBACKEND
# read when used, never at import: these may differ between the zygote and a kernel it forks
LATE_ENV = ("HERMES_", "TAOTOKEN_", "JPY_", "PYDEVD_", "PYTEST_", "MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI")
LATE_ENV_KEYS = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY")  # and their lower-case spellings
MAX_MSG = 1 << 20  # a request carries the kernel's environment


def _late(key: str) -> bool:
    return key.upper() in LATE_ENV_KEYS or key.startswith(LATE_ENV)


def _import_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if not _late(k)}


# ------------------------------------------------------------------------------------- the runner's side
class _Kernel:
    """A forked kernel, as jupyter_client's LocalProvisioner sees a Popen: pid, poll, wait, signals."""

    stdin = stdout = stderr = None

    def __init__(self, zygote: Zygote, kid: int, sock: socket.socket):
        self.zygote, self.kid, self.sock = zygote, kid, sock  # sock: which zygote forked it
        self.started, self.done = threading.Event(), threading.Event()
        self.pid, self.returncode = 0, None  # type: int, int | None

    def poll(self) -> int | None:
        return self.returncode if self.done.is_set() else None

    def wait(self, timeout: float | None = None) -> int | None:
        if not self.done.wait(timeout):
            raise subprocess.TimeoutExpired("forked kernel", timeout or 0)
        self.zygote.forget(self.kid)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        self.zygote.send(("signal", self.kid, signum))

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


class Zygote:
    """The client of one zygote process, shared by every kernel this process starts."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sock: socket.socket | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.env: dict[str, str] = {}
        self.kernels: dict[int, _Kernel] = {}
        self.ids = itertools.count(1)

    def _start(self, env: dict[str, str]) -> None:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.env = dict(env)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "hermes_lab.core.kernels", "--serve", str(child.fileno())],
            pass_fds=[child.fileno()],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            env=self.env,
            start_new_session=True,
        )
        child.close()
        self.sock = parent
        threading.Thread(target=self._listen, args=(parent,), daemon=True, name="kernel-zygote").start()

    def _listen(self, sock: socket.socket) -> None:
        while True:
            try:
                msg = sock.recv(MAX_MSG)
            except OSError:
                msg = b""
            if not msg:
                break
            kind, kid, value = json.loads(msg)
            k = self.kernels.get(kid)
            if k is None:
                continue
            if kind == "started":
                k.pid = value
                k.started.set()
            else:
                k.returncode = value
                k.done.set()
        with self.lock:
            if self.sock is sock:
                self.sock = None
            lost = [k for k in self.kernels.values() if k.sock is sock and not k.done.is_set()]
        for k in lost:  # the zygote is gone, and it took its kernels with it
            k.returncode = -signal.SIGKILL
            k.started.set()
            k.done.set()

    def fork(
        self, argv: list[str], env: dict[str, str], cwd: str, preload: Sequence[str] = (), timeout: float = 180
    ) -> _Kernel | None:
        """A kernel forked with this command line, environment and cwd, from a zygote that has imported
        ``preload`` as well; None where it would not be the kernel a new interpreter gives (the module
        docstring's list) or the zygote failed to start it."""
        with self.lock:
            wanted, have = _import_env(env), _import_env(self.env)
            if self.sock is not None and wanted != have:
                changed = sorted({k for k, _ in set(wanted.items()) ^ set(have.items())})
                if any(not k.done.is_set() for k in self.kernels.values()):
                    log.debug("kernel not forked: the environment differs in %s, and kernels still run", changed)
                    return None
                log.debug("a new zygote: the environment differs in %s", changed)
                self._close_locked()
            if self.sock is None:
                self._start(env)
            assert self.sock is not None
            kid = next(self.ids)
            k = self.kernels[kid] = _Kernel(self, kid, self.sock)
            req = {"argv": argv, "env": env, "cwd": cwd, "preload": list(preload)}
            request = json.dumps(["start", kid, req]).encode()
            try:
                socket.send_fds(self.sock, [request], [1, 2])  # the kernel's stdio is ours, as if inherited
            except OSError:
                self.kernels.pop(kid)
                return None
        # a request waits for the zygote's imports (~3 s, and its preload's the first time: up to ~10 s on a busy
        # machine); a stuck zygote leaves the usual launch
        if not k.started.wait(timeout) or (k.done.is_set() and not k.pid):
            self.send(("signal", kid, signal.SIGKILL))  # should it start after all, nobody would connect to it
            self.forget(kid)
            return None
        return k

    def send(self, msg: tuple[Any, ...]) -> None:
        with self.lock, contextlib.suppress(OSError):
            if self.sock is not None:
                self.sock.send(json.dumps(msg).encode())

    def forget(self, kid: int) -> None:
        with self.lock:
            self.kernels.pop(kid, None)

    def close(self, owner: int | None = None) -> None:
        """End the zygote (and so any kernel it still runs); with ``owner``, only in that process (not in a fork
        of it, whose shutdown of the shared socket would end the parent's zygote)."""
        if owner is not None and owner != os.getpid():
            return
        with self.lock:
            proc = self._close_locked()
        if proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)

    def _close_locked(self) -> subprocess.Popen[bytes] | None:
        sock, proc, self.sock, self.proc = self.sock, self.proc, None, None
        if sock is not None:
            with contextlib.suppress(OSError):
                # shutdown, not close alone: the listener's recv holds the socket open until it returns
                sock.shutdown(socket.SHUT_RDWR)  # EOF: the zygote kills its kernels and exits
            sock.close()
        return proc  # reaped by close(), or by subprocess's own cleanup at the next Popen


_zygote: tuple[int, Zygote] | None = None  # (the pid that started it, the client): a fork of ours needs its own


def zygote() -> Zygote:
    global _zygote
    if _zygote is None or _zygote[0] != os.getpid():
        z = Zygote()
        atexit.register(z.close, os.getpid())  # it ends before this process does (killed: the socket's EOF)
        _zygote = (os.getpid(), z)
    return _zygote[1]


def skip_unused_imports() -> None:
    """Called before papermill is imported. nbformat imports jsonschema, and jsonschema imports rfc3987_syntax
    where it is installed (JupyterLab's jupyter-events brings it), which compiles three Earley grammars at
    import: ~2 s of CPU in every process that runs notebooks, for the IRI formats that no notebook schema has.
    Only this process goes without it (jsonschema then checks no IRI format); kernels are untouched."""
    sys.modules.setdefault("rfc3987_syntax", None)  # None: ``import`` raises ImportError, which jsonschema expects


def forking_enabled() -> bool:
    """On Linux, unless switched off: macOS's system frameworks are not safe to fork without exec, Windows has
    no fork."""
    switched_off = os.environ.get(ENV_SWITCH, "1").strip().lower() in {"0", "false", "no", "off"}
    return sys.platform.startswith("linux") and not switched_off


def _forkable_cmd(cmd: list[str]) -> bool:
    return (
        len(cmd) >= 3
        and cmd[1:3] == ["-m", "ipykernel_launcher"]
        and os.path.realpath(cmd[0]) == os.path.realpath(sys.executable)
    )


class ForkProvisioner(LocalProvisioner):
    """LocalProvisioner, except that a python kernel of this interpreter is forked from the zygote (with the
    modules its kernel manager's ``preload`` names imported there first)."""

    async def launch_kernel(self, cmd: list[str], **kwargs: Any) -> Any:
        k = None
        if forking_enabled() and _forkable_cmd(cmd) and kwargs.get("stdout") is None and kwargs.get("stderr") is None:
            env = dict(kwargs.get("env") or os.environ)
            cwd = str(kwargs.get("cwd") or os.getcwd())
            k = zygote().fork(list(cmd), env, cwd, getattr(self.parent, "preload", ()))
        if k is None:
            return await super().launch_kernel(cmd, **kwargs)
        self.process, self.pid, self.pgid = k, k.pid, None  # signals go through the zygote to the group
        self.cwd = kwargs.get("cwd") or os.getcwd()
        return self.connection_info


class ForkingKernelManager(AsyncKernelManager):
    """The kernel manager papermill gets from the round runner (``kernel_manager_class``)."""

    preload: tuple[str, ...] = ()  # modules the zygote imports before it forks this manager's kernel

    async def _async_pre_start_kernel(self, **kw: Any) -> Any:
        if self.provisioner is None and not (self.kernel_spec.metadata or {}).get("kernel_provisioner"):
            self.kernel_id = self.kernel_id or kw.pop("kernel_id", None) or str(uuid.uuid4())
            self.provisioner = ForkProvisioner(kernel_id=self.kernel_id, kernel_spec=self.kernel_spec, parent=self)
        return await super()._async_pre_start_kernel(**kw)


_managers: dict[tuple[str, ...], type[ForkingKernelManager]] = {}


def manager(preload: Sequence[str] = ()) -> type[ForkingKernelManager]:
    """The kernel manager class (papermill takes a class) whose kernels find ``preload`` imported, e.g.
    ``("torch", "transformers")``: the zygote imports them once, before the first such kernel."""
    key = tuple(preload)
    if not key:
        return ForkingKernelManager
    if key not in _managers:
        _managers[key] = type("ForkingKernelManager", (ForkingKernelManager,), {"preload": key})
    return _managers[key]


# --------------------------------------------------------------------------------------- the zygote's side
def serve(sock_fd: int) -> int:
    """The zygote: import PRELOAD, then fork a kernel per request until the socket closes."""
    import select

    sock = socket.socket(fileno=sock_fd)
    os.environ.setdefault("MPLBACKEND", INLINE)  # matplotlib reads it at import, as in a kernel
    _import(PRELOAD)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so SIGCHLD writes to the wakeup fd
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the runner's: it interrupts its kernels through us
    running: dict[int, int] = {}  # pid -> kernel id, until reaped
    ids: dict[int, int] = {}  # kernel id -> pid
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN)
    poller.register(wake_r, select.POLLIN)
    while True:
        try:
            events = poller.poll()
        except InterruptedError:
            continue
        for fd, _ in events:
            if fd == wake_r:
                os.read(wake_r, 4096)
                _reap(sock, running)
                continue
            try:
                msg, fds, _, _ = socket.recv_fds(sock, MAX_MSG, 2)
            except InterruptedError:
                continue
            if not msg:  # the runner is gone: so are its kernels
                for pid in running:
                    _killpg(pid, signal.SIGKILL)
                return 0
            kind, kid, value = json.loads(msg)
            if kind == "signal":
                if kid in ids and ids[kid] in running:
                    _killpg(ids[kid], value)
                continue
            _import(value.get("preload", ()))
            pid = os.fork()
            if pid == 0:
                _become_kernel(sock, wake_r, wake_w, fds, value)
            for f in fds:
                os.close(f)
            running[pid], ids[kid] = kid, pid
            _send(sock, ("started", kid, pid))
        _reap(sock, running)


def _import(names: Sequence[str]) -> None:
    """Import what is not imported yet; a module that fails to import is left to the kernel (which then fails
    on it as a new interpreter would, with its own traceback)."""
    import importlib

    for name in names:
        if name not in sys.modules:
            with contextlib.suppress(Exception):
                importlib.import_module(name)


def _become_kernel(sock: socket.socket, wake_r: int, wake_w: int, fds: list[int], req: dict[str, Any]) -> None:
    """In the forked child: the session, stdio, cwd, environment and sys.path of ``python -m ipykernel_launcher``."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        sock.close()
        os.close(wake_r)
        os.close(wake_w)
        os.setsid()
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        for f in (null, *fds):
            os.close(f)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        os.environ["JPY_PARENT_PID"] = str(os.getppid())  # jupyter_client's launcher sets it to the kernel's parent
        for name in [m for m in sys.modules if m == "hermes_lab" or m.startswith("hermes_lab.")]:
            del sys.modules[name]  # the kernel imports hermes_lab from its own sys.path, as a new one would
        sys.path[0] = os.getcwd()
        if "matplotlib" in sys.modules:
            sys.modules["matplotlib"].rcParams["backend"] = os.environ.get("MPLBACKEND") or INLINE
        # the class default of parent_handle was read from the zygote's environment: say it here
        sys.argv = ["ipykernel_launcher", *req["argv"][3:], f"--IPKernelApp.parent_handle={os.getppid()}"]
        import runpy

        try:
            runpy.run_module("ipykernel_launcher", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # the child must never return into the zygote's loop
        import traceback

        traceback.print_exc()
    finally:
        with contextlib.suppress(BaseException):
            import atexit

            atexit._run_exitfuncs()  # the kernel's, as at a normal interpreter exit
        for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def _reap(sock: socket.socket, running: dict[int, int]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        kid = running.pop(pid, None)
        if kid is not None:
            code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            _send(sock, ("exited", kid, code))


def _killpg(pgid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)


def _send(sock: socket.socket, msg: tuple[Any, ...]) -> None:
    with contextlib.suppress(OSError):
        sock.send(json.dumps(msg).encode())


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--serve":
        sys.exit(serve(int(sys.argv[2])))
    print("usage: python -m hermes_lab.core.kernels --serve FD  (started by the round runner's kernel manager)")
