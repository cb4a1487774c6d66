"""What the local sandbox gets from this machine, layer by layer, and the trainer's side of each layer.

Stage: train (the tests reward) and every stage that scores code; ``hermes-lab doctor``. Reads /proc/self/cgroup,
the cgroup files under /sys/fs/cgroup and the sandbox interpreter's paths; writes one cgroup per run (removed when
the run ends) under a directory of this process's own, nothing under runs/.

    hermes-lab doctor --params params/embedded.yaml     # the layers that hold here, and what is missing

The layers, each enforced by the kernel (the audit hook inside the run is a second, Python-level layer):

- **a root of its own** (namespaces): the fork server runs inside bubblewrap (Debian's ``bubblewrap``, the
  sandbox Flatpak uses) in a root built of read-only binds of /usr, the interpreter and the libraries the run
  may import, and nothing else of the host (no checkout, no runs/, no $HOME, no /root); its own pid, network,
  IPC, UTS and cgroup namespaces. Each run adds a mount, pid and network namespace of its own with private tmpfs
  work dir, /tmp and /dev/shm (size- and inode-capped) and a devpts instance: no address, file, pty or process
  of one run is in another's reach. Without namespaces (or bubblewrap), the fallback:
- **Landlock** (``landlock_abi() >= 6``): each run in a Landlock domain of its own that reads only the
  interpreter, the system libraries and a few /etc files and writes only its work dir (on /dev/shm, a tmpfs
  whose pages the run's memory cgroup counts), and sends no signal outside itself; the seccomp filter refuses
  every unix socket address (Landlock scopes abstract ones, not paths): the probe run checks it, and without it
  the fallback is missing its "pathname unix socket barrier".
- **seccomp** (``hermes_lab.sandbox.seccomp``), in both modes; the fallback's filter also refuses changing a
  file's mode, owner, times, extended attributes or flags by path (Landlock does not govern those).
- **a cgroup per run** (v1's memory, pids and freezer hierarchies, or v2): memory for the whole run (every
  process, its tmpfs pages, shared memory), a pids limit, and the whole group frozen and killed at the end.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import json
import os
import shutil
import signal
import stat
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CGROUP_ROOT = Path("/sys/fs/cgroup")
V1_CONTROLLERS = ("memory", "pids", "freezer")
SANDBOX_LAUNCHER_DIR = "/sandbox"  # where the launcher's two files appear inside bubblewrap's root
SYSTEM_RO = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
ETC_RO = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime", "/etc/alternatives")
DEV_RW = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")
_seq = itertools.count(1)


# ----------------------------------------------------------------------------------------- interpreter
@dataclass(frozen=True)
class Interpreter:
    """The sandbox's Python: the default (this one's real binary, ``-S``: the standard library only) or
    ``sandbox.python`` (a virtualenv's, its site-packages importable). ``read_only``: what a run must read."""

    executable: str
    args: tuple[str, ...]
    read_only: tuple[str, ...]
    version: str

    @classmethod
    def of(cls, python: str | None) -> Interpreter:
        import sys

        exe = python or os.path.realpath(sys.executable)
        if python and not os.access(python, os.X_OK):
            raise ValueError(f"sandbox.python {python!r} is not an executable interpreter")
        # -I: no PYTHON* variable, no user site; -S for the default: no site-packages (the standard library)
        args = ("-I", "-B") if python else ("-I", "-S", "-B")
        return _probe(exe, args)


_probed: dict[tuple[str, tuple[str, ...]], Interpreter] = {}


def _probe(exe: str, args: tuple[str, ...]) -> Interpreter:
    key = (exe, args)
    if key not in _probed:
        code = (
            "import sys, json; print(json.dumps([sys.prefix, sys.base_prefix, sys.executable, sys.path, sys.version]))"
        )
        out = subprocess.run([exe, *args, "-c", code], capture_output=True, text=True, timeout=60, check=False)
        if out.returncode != 0:
            raise ValueError(f"sandbox.python {exe!r} does not run: {out.stderr.strip()[-300:]}")
        prefix, base, real, path, version = json.loads(out.stdout)
        roots = [os.path.realpath(p) for p in (prefix, base, os.path.dirname(os.path.realpath(real)), *path) if p]
        _probed[key] = Interpreter(exe, args, _minimal([p for p in roots if os.path.exists(p)]), version.split()[0])
    return _probed[key]


def _minimal(paths: list[str]) -> tuple[str, ...]:
    """The paths no other one of them contains (a bind or a Landlock rule covers what lies beneath)."""
    out: list[str] = []
    for p in sorted(set(paths), key=len):
        if not any(p == q or p.startswith(q.rstrip("/") + "/") for q in out):
            out.append(p)
    return tuple(out)


# -------------------------------------------------------------------------------------------- bubblewrap
def bwrap_command(interp: Interpreter, launcher_dir: Path) -> list[str]:
    """The command that starts the fork server inside bubblewrap's root (see the module docstring)."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise FileNotFoundError("bubblewrap is not installed (Debian: apt-get install bubblewrap)")
    cmd = [bwrap, "--die-with-parent", "--new-session", "--hostname", "sandbox", "--chdir", "/"]
    cmd += ["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
    if os.geteuid() == 0:  # root: no user namespace; the server keeps what it needs to mount and to become nobody
        cmd += ["--cap-drop", "ALL"]
        for cap in ("CAP_SYS_ADMIN", "CAP_SETUID", "CAP_SETGID", "CAP_SETPCAP", "CAP_KILL"):
            cmd += ["--cap-add", cap]
    else:  # a user: uid 0 of a user namespace of its own, its capabilities good there only
        cmd += ["--unshare-user", "--uid", "0", "--gid", "0", "--cap-add", "ALL"]
    bound: list[str] = []
    for p in SYSTEM_RO:
        if os.path.islink(p):
            cmd += ["--symlink", os.readlink(p), p]
        elif os.path.isdir(p):
            cmd += ["--ro-bind", p, p]
            bound.append(p)
    made: set[str] = set()
    for p in interp.read_only:
        if not any(p == b or p.startswith(b + "/") for b in bound):
            for parent in [str(q) for q in reversed(Path(p).parents)][1:]:
                if parent not in made:  # bwrap would copy a 0700 parent's mode (/root): nobody could not pass
                    cmd += ["--perms", "0755", "--dir", parent]
                    made.add(parent)
            cmd += ["--ro-bind", p, p]
            bound.append(p)
    for p in ETC_RO:
        cmd += ["--ro-bind-try", p, p]
    cmd += ["--proc", "/proc", "--dev", "/dev", "--dir", "/tmp", "--dir", "/work"]
    for name in ("launcher.py", "confine.py"):
        cmd += ["--ro-bind", str(launcher_dir / name), f"{SANDBOX_LAUNCHER_DIR}/{name}"]
    return cmd


_bwrap_ok: dict[str, str] = {}


def bwrap_works(interp: Interpreter) -> str:
    """'' when bubblewrap starts the interpreter in its root here, else why not (cached per interpreter)."""
    if interp.executable not in _bwrap_ok:
        try:
            cmd = bwrap_command(interp, Path(__file__).parent)
            r = subprocess.run([*cmd, interp.executable, *interp.args, "-c", "pass"], capture_output=True, timeout=30)
            why = "" if r.returncode == 0 else f"bubblewrap failed: {r.stderr.decode(errors='replace').strip()[-200:]}"
        except (OSError, subprocess.SubprocessError) as e:
            why = str(e)
        _bwrap_ok[interp.executable] = why
    return _bwrap_ok[interp.executable]


# ---------------------------------------------------------------------------------------------- Landlock
def landlock_abi() -> int:
    """The kernel's Landlock ABI version (0: none)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return max(0, int(libc.syscall(444, None, 0, 1)))
    except (OSError, AttributeError):
        return 0


def nobody_can_read(paths: tuple[str, ...]) -> bool:
    """Whether a process of another uid (nobody) could reach and read every one of ``paths``."""
    for p in paths:
        parts = Path(p).parts
        for i in range(1, len(parts) + 1):
            try:
                mode = os.stat(os.path.join(*parts[:i])).st_mode
            except OSError:
                return False
            if stat.S_ISDIR(mode) and not mode & stat.S_IXOTH:
                return False
    return True


# ----------------------------------------------------------------------------------------------- cgroups
class Cgroups:
    """This executor's cgroup directory (one per controller under cgroup v1) and a cgroup per run beneath.
    ``reason``: why there are none ('' when there are)."""

    def __init__(self) -> None:
        self.version, self.reason, self.bases = 0, "", {}
        self._lock = threading.Lock()
        name = f"hermes-sandbox-{os.getpid()}-{next(_seq)}"
        try:
            mine = _own_cgroups()
            if (CGROUP_ROOT / "memory" / "memory.limit_in_bytes").exists():
                self.version = 1
                for c in V1_CONTROLLERS:
                    parent = CGROUP_ROOT / c / mine.get(c, "/").lstrip("/")
                    _sweep(parent, 1)
                    self.bases[c] = parent / name
                    self.bases[c].mkdir()
            elif (CGROUP_ROOT / "cgroup.controllers").exists():
                self.version = 2
                parent = CGROUP_ROOT / mine.get("", "/").lstrip("/")
                _sweep(parent, 2)
                base = parent / name
                base.mkdir()
                self.bases[""] = base
                (base / "cgroup.subtree_control").write_text("+memory +pids")
            else:
                self.reason = "no cgroup hierarchy with memory and pids controllers is mounted at /sys/fs/cgroup"
        except OSError as e:
            self.reason = (
                f"cannot make cgroups under /sys/fs/cgroup ({e.strerror or e}): needs root or a delegated subtree"
            )
            self.close()
            self.version = 0

    @property
    def available(self) -> bool:
        return self.version > 0 and not self.reason

    def describe(self) -> str:
        if not self.available:
            return f"none ({self.reason})"
        where = ", ".join(str(b.parent) for b in self.bases.values())
        return f"v{self.version} ({'+'.join(self.bases) if self.version == 1 else 'memory+pids'}) under {where}"

    def run(self, memory_mb: int, max_processes: int) -> RunCgroup:
        return RunCgroup(self, f"run-{next(_seq)}", memory_mb, max_processes)

    def close(self) -> None:
        for base in self.bases.values():
            for d in sorted(base.glob("run-*"), reverse=True) if base.exists() else []:
                _remove_cgroup(d, self.version)
            _rmdir(base)
        self.bases = {}


class RunCgroup:
    """One run's cgroup: memory (the whole run), pids, kill at the end. Never raises on the way out."""

    def __init__(self, groups: Cgroups, name: str, memory_mb: int, max_processes: int):
        self.version = groups.version
        self.dirs = {c: base / name for c, base in groups.bases.items()}
        mem = str(int(memory_mb) << 20)
        pids = str(int(max_processes) + 1)  # the run's supervisor is one of its processes
        for d in self.dirs.values():
            d.mkdir()
        if self.version == 1:
            _write(self.dirs["memory"] / "memory.limit_in_bytes", mem)
            with contextlib.suppress(OSError):  # absent without swap accounting: then there is no swap to use
                _write(self.dirs["memory"] / "memory.memsw.limit_in_bytes", mem)
            _write(self.dirs["pids"] / "pids.max", pids)
        else:
            d = self.dirs[""]
            _write(d / "memory.max", mem)
            with contextlib.suppress(OSError):
                _write(d / "memory.swap.max", "0")
            _write(d / "pids.max", pids)

    def procs_fds(self) -> list[int]:
        """cgroup.procs of each controller, open for writing: the run's supervisor writes "0" to join."""
        return [os.open(d / "cgroup.procs", os.O_WRONLY | os.O_CLOEXEC) for d in self.dirs.values()]

    def pids(self) -> list[int]:
        d = next(iter(self.dirs.values()))
        try:
            return [int(x) for x in (d / "cgroup.procs").read_text().split()]
        except OSError:
            return []

    def oom_kills(self) -> int:
        name = "memory.oom_control" if self.version == 1 else "memory.events"
        d = self.dirs["memory" if self.version == 1 else ""]
        try:
            for line in (d / name).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            pass
        return 0

    def kill(self) -> None:
        """Every process of the run, however it was started (setsid, double fork): frozen, then killed."""
        _kill_cgroup(self.dirs, self.version)

    def remove(self) -> None:
        for d in self.dirs.values():
            _remove_cgroup(d, self.version, dirs=self.dirs)


def _kill_cgroup(dirs: dict[str, Path], version: int) -> None:
    try:
        if version == 2:
            _write(dirs[""] / "cgroup.kill", "1")
        else:
            first = next(iter(dirs.values()))
            if not (first / "cgroup.procs").read_text().strip():
                return
            freezer = dirs.get("freezer")
            if freezer is not None:  # frozen, nothing forks while the kills go out
                _write(freezer / "freezer.state", "FROZEN")
                deadline = time.monotonic() + 1.0
                while (freezer / "freezer.state").read_text().strip() != "FROZEN" and time.monotonic() < deadline:
                    time.sleep(0.001)
            for _ in range(50):
                pids = [int(x) for x in (first / "cgroup.procs").read_text().split()]
                if not pids:
                    break
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(pid, signal.SIGKILL)
                if freezer is not None:
                    _write(freezer / "freezer.state", "THAWED")  # the killed die once thawed
                time.sleep(0.002)
        deadline = time.monotonic() + 5.0
        first = next(iter(dirs.values()))
        while (first / "cgroup.procs").read_text().strip() and time.monotonic() < deadline:
            time.sleep(0.002)
    except (OSError, ValueError):
        pass  # gone already, or a controller we may not write: the rmdir below says so by failing


def _remove_cgroup(d: Path, version: int, dirs: dict[str, Path] | None = None) -> None:
    if not d.exists():
        return
    dirs = dirs or {"": d}
    for _ in range(200):  # a killed process leaves the cgroup once reaped: a few ms
        try:
            d.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            _kill_cgroup(dirs, version)
            time.sleep(0.005)


def _own_cgroups() -> dict[str, str]:
    """This process's cgroup path per v1 controller ('' for v2's unified one)."""
    out: dict[str, str] = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for c in controllers.split(",") if controllers else [""]:
            out[c] = path
    return out


def _sweep(parent: Path, version: int) -> None:
    """Executors' cgroup dirs left by a process that is gone (killed before its close): emptied and removed."""
    for base in parent.glob("hermes-sandbox-*"):
        try:
            pid = int(base.name.split("-")[2])
        except (IndexError, ValueError):
            continue
        if pid != os.getpid() and not Path(f"/proc/{pid}").exists():
            for d in base.glob("run-*"):
                _remove_cgroup(d, version)
            _rmdir(base)


def _rmdir(d: Path) -> None:
    with contextlib.suppress(OSError):
        d.rmdir()


def _write(path: Path, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


# ---------------------------------------------------------------------------------------- the layers
def missing(report: dict[str, Any]) -> list[str]:
    """The barriers a probe run's report says are not enforced here (what sandbox.require_isolation refuses)."""
    if "error" in report:
        return [f"the sandbox itself: {report['error']}"]
    out = []
    if report.get("seccomp_loaded") != 2:
        out.append(f"seccomp filter ({report.get('seccomp', 'not loaded')})")
    if not str(report.get("cgroup", "none")).startswith("v"):
        out.append(f"cgroup per run ({report.get('cgroup')})")
    if report.get("mode") != "namespaces":
        abi = int(report.get("landlock_abi", 0))
        if abi < 1:
            out.append(f"filesystem barrier (no namespaces: {report.get('namespaces')}; no Landlock in this kernel)")
        if abi < 6:
            out.append(f"signal barrier (no pid namespace, and Landlock ABI {abi} < 6 has no signal scoping)")
        # Landlock scopes abstract sockets, not a path's: without the filter's refusal, a run reaches a host's
        # listener (/dev/log, journald, docker.sock) and another run's socket by path
        if report.get("unix_sockets") != "refused":
            out.append(
                "pathname unix socket barrier (no namespaces, and a run's unix socket reaches addresses: "
                f"{report.get('unix_sockets', 'not probed')})"
            )
    return out


def remove_tree(path: str | os.PathLike[str]) -> None:
    """rm -rf that never raises and never recurses (a 2,500-deep tree is a loop here, not RecursionError): one
    directory descriptor at a time, down by name and back up by "..", so no path grows past PATH_MAX and no
    descriptor piles up."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(path)
        return
    names: list[str] = []  # the way down from path
    stays: list[set[str]] = [set()]  # per level: what could not be removed (skipped, not retried)
    try:
        while True:
            try:
                entries = [n for n in os.listdir(fd) if n not in stays[-1]]
            except OSError:
                entries = []
            sub = None
            for name in entries:
                try:
                    os.unlink(name, dir_fd=fd)
                    continue
                except IsADirectoryError:
                    pass
                except OSError:
                    stays[-1].add(name)
                    continue
                with contextlib.suppress(OSError):  # a dir the program made unreadable (fchmod 0)
                    os.chmod(name, 0o700, dir_fd=fd)
                try:
                    sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
                except OSError:
                    stays[-1].add(name)
                    continue
                names.append(name)
                stays.append(set())
                break
            if sub is not None:
                os.close(fd)
                fd = sub
                continue
            if not names:
                break
            parent = os.open("..", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = parent
            name = names.pop()
            stays.pop()
            try:
                os.rmdir(name, dir_fd=fd)
            except OSError:
                stays[-1].add(name)
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)
    with contextlib.suppress(OSError):
        os.rmdir(path)
