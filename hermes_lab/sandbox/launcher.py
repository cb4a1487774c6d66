"""The child side of the local sandbox: one process per run, started by ``hermes_lab.sandbox.local``.

Stage: train (the tests reward) and every stage that scores the embedded code family. Reads one job (a
marshalled dict) on its stdin; writes nothing but the run's own stdout / stderr. It runs as a plain script
under ``python -S -s -B`` (no site-packages, no hermes_lab import), in a private temp dir the parent made, with
an environment the parent cleaned (no secrets, no proxy variables; PYTHONHASHSEED=0) and in a process group of
its own that the parent kills whole at the wall-clock limit.

    python -S -s -B hermes_lab/sandbox/launcher.py < job.marshal   # what LocalExecutor runs

What it sets up before the untrusted program runs, in this order (each layer is named in the report a probe run prints):

1. namespaces (``unshare``): network (only a loopback that is down: no connection reaches anything), pid (the
   program is pid 1 of its own tree: when it exits every process it started dies, and no process outside is
   visible or signalable), mount, IPC, UTS; as a non-root user inside a user namespace of its own. Where the
   kernel refuses (no unprivileged user namespaces), the run goes on without them and the report says so.
2. mounts, in the new mount namespace: the whole tree read-only (``mount_setattr``, or a remount per mount on
   older kernels), private size-capped tmpfs on /tmp, /var/tmp and /dev/shm, the work dir the only writable
   place on disk, a fresh /proc that shows only the sandbox's own processes (no other process's environ).
3. privileges: as root, the program runs as ``nobody`` (65534) with no groups and no capabilities; as a user in
   its own user namespace, with every capability dropped and no way to regain one on exec; ``no_new_privs``
   either way (a setuid binary gains nothing).
4. rlimits: CPU seconds, address space, file size, open files, processes (counted for the user the program
   runs as: the limit is that user's current count plus ``max_processes``, so a fork bomb stops there), no
   core dumps. The parent death signal kills the program when this launcher dies.
5. the guard: a Python audit hook (it cannot be removed) that refuses sockets, starting other programs,
   ctypes, signals to processes outside the run's process group, writing outside the work dir and the private
   tmp dirs, and reading another process's /proc entries. It is the only layer left where the kernel allows
   no namespaces, and it is a Python-level barrier: the report says so plainly.

The program runs in this interpreter as ``__main__`` (no second interpreter start: about half the cost of a
run). Exit status (the launcher's own codes lie above any program's): the program's, capped at 100; 124 when
it used up its CPU seconds; 125 when the launcher failed before the program started; 128 + N when the program
died of signal N.
"""

import marshal
import os
import resource
import signal
import sys

NOBODY = 65534
CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_SET_SECUREBITS, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 1, 28, 24, 38
PR_SET_CHILD_SUBREAPER = 36
SYS_MOUNT_SETATTR = 442  # x86_64 and aarch64 alike (the generic syscall table)
AT_RECURSIVE, MOUNT_ATTR_RDONLY = 0x8000, 0x1
MAX_PROGRAM_CODE, CPU_EXCEEDED, LAUNCHER_FAILED = 100, 124, 125
PRIVATE_TMP = ("/tmp", "/var/tmp", "/dev/shm")


class Kernel:
    """The few libc calls Python's os module lacks (unshare, mount, prctl, capset), through ctypes."""

    def __init__(self):
        import ctypes

        self.ctypes = ctypes
        self.libc = ctypes.CDLL(None, use_errno=True)

    def _check(self, rc, what):
        if rc != 0:
            err = self.ctypes.get_errno()
            raise OSError(err, f"{what}: {os.strerror(err)}")

    def unshare(self, flags):
        self._check(self.libc.unshare(flags), "unshare")

    def mount(self, src, target, fstype, flags, data=None):
        enc = lambda s: s.encode() if s is not None else None  # noqa: E731
        rc = self.libc.mount(enc(src), enc(target), enc(fstype), self.ctypes.c_ulong(flags), enc(data))
        self._check(rc, f"mount {target}")

    def readonly_tree(self, root="/"):
        """Every mount under ``root`` read-only: one mount_setattr (Linux 5.12+), else one remount per mount."""
        c = self.ctypes

        class MountAttr(c.Structure):
            _fields_ = [("set", c.c_uint64), ("clr", c.c_uint64), ("prop", c.c_uint64), ("userns", c.c_uint64)]

        attr = MountAttr(MOUNT_ATTR_RDONLY, 0, 0, 0)
        rc = self.libc.syscall(SYS_MOUNT_SETATTR, -100, root.encode(), AT_RECURSIVE, c.byref(attr), c.sizeof(attr))
        if rc == 0:
            return
        with open("/proc/self/mountinfo") as f:  # older kernels: remount each mount, keeping its locked flags
            mounts = [line.split() for line in f]
        for parts in sorted(mounts, key=lambda p: len(p[4])):
            point, opts = parts[4].replace("\\040", " "), parts[5].split(",")
            keep = sum(
                bit for name, bit in (("nosuid", MS_NOSUID), ("nodev", MS_NODEV), ("noexec", MS_NOEXEC)) if name in opts
            )
            try:
                self.mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | keep)
            except OSError:
                pass  # a mount we may not touch (locked, gone): it keeps its flags

    def prctl(self, option, arg):
        self._check(self.libc.prctl(option, self.ctypes.c_ulong(arg), 0, 0, 0), f"prctl {option}")

    def drop_capabilities(self):
        """No capability, now or after an exec (root inside a user namespace would regain them on exec)."""
        c = self.ctypes
        for cap in range(64):
            if self.libc.prctl(PR_CAPBSET_DROP, c.c_ulong(cap), 0, 0, 0) != 0:
                break  # past the last capability this kernel knows
        noroot = 0x01 | 0x02 | 0x04 | 0x08  # SECBIT_NOROOT(+_LOCKED), SECBIT_NO_SETUID_FIXUP(+_LOCKED)
        self.libc.prctl(PR_SET_SECUREBITS, c.c_ulong(noroot), 0, 0, 0)

        class Header(c.Structure):
            _fields_ = [("version", c.c_uint32), ("pid", c.c_int)]

        class Data(c.Structure):
            _fields_ = [("effective", c.c_uint32), ("permitted", c.c_uint32), ("inheritable", c.c_uint32)]

        self._check(self.libc.capset(c.byref(Header(0x20080522, 0)), (Data * 2)()), "capset")


# ------------------------------------------------------------------------------------------------ setup
def _write(path, text):
    with open(path, "w") as f:
        f.write(text)


def isolate(kernel, job, report):
    """Step 1: new namespaces for the children of this process (pid) and for itself (the rest)."""
    root = job["host_root"]
    uid, gid = os.geteuid(), os.getegid()
    flags = CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWUTS
    try:
        kernel.unshare(flags if root else flags | CLONE_NEWUSER)
    except OSError as e:
        report["namespaces"] = f"none ({e.strerror})"
        return False
    if not root:  # be uid 0 of the new user namespace (the caller's own uid outside), so mounts are allowed
        _write("/proc/self/setgroups", "deny")
        _write("/proc/self/uid_map", f"0 {uid} 1")
        _write("/proc/self/gid_map", f"0 {gid} 1")
    report["namespaces"] = "user+net+pid+mount+ipc+uts" if not root else "net+pid+mount+ipc+uts"
    return True


def _expose(kernel, path):
    """As root the program runs as nobody: make the interpreter's prefix reachable when a parent dir (a 0700
    home such as /root) is not. A tmpfs covers that parent (its other contents stay hidden) and the prefix
    alone is bound back in, read-only."""
    parts = os.path.realpath(path).split(os.sep)
    for i in range(2, len(parts)):
        top = os.sep.join(parts[:i])
        if not os.stat(top).st_mode & 0o001:
            break
    else:
        return
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        kernel.mount("tmpfs", top, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=64k")
        os.makedirs(path, exist_ok=True)
        kernel.mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
        kernel.mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY)
    finally:
        os.close(fd)


def mounts(kernel, job, report):
    """Step 2 (in the new pid namespace, still privileged): read-only tree, private tmp, work dir, /proc."""
    work, tmp_size = job["work"], max(1, job["file_mb"])
    work_fd = os.open(work, os.O_RDONLY | os.O_DIRECTORY)  # the work dir may lie under a /tmp about to be covered
    kernel.mount(None, "/", None, MS_REC | MS_PRIVATE)
    kernel.readonly_tree("/")
    for d in PRIVATE_TMP:
        if os.path.isdir(d) and not os.path.islink(d):
            kernel.mount("tmpfs", d, "tmpfs", MS_NOSUID | MS_NODEV, f"mode=1777,size={tmp_size}m,nr_inodes=4096")
    os.makedirs(work, exist_ok=True)  # inside a private tmp: the same path again, then the real dir bound onto it
    kernel.mount(f"/proc/self/fd/{work_fd}", work, None, MS_BIND)
    os.close(work_fd)
    kernel.mount(None, work, None, MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NODEV)  # rw again: the one place
    kernel.mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    if job["drop"]:
        _expose(kernel, sys.base_prefix)
    report["filesystem"] = "read-only except the work dir and private /tmp, /var/tmp, /dev/shm"
    report["proc"] = "private"


def count_processes(uid):
    n = 0
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                n += os.stat(f"/proc/{name}").st_uid == uid
            except OSError:
                pass
    return n


def drop_privileges(kernel, job, nproc_base, report):
    """Steps 3 and 4: who the program runs as, and its rlimits (``nproc_base``: that user's processes now)."""
    if job["drop"]:
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)  # from root to a plain uid: every capability goes with it
        report["user"] = "nobody"
    elif job["namespaced"]:
        kernel.drop_capabilities()
        report["user"] = "own uid, no capabilities"
    else:
        report["user"] = "own uid"
    kernel.prctl(PR_SET_NO_NEW_PRIVS, 1)
    kernel.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # after setuid, which clears it
    cpu = max(1, int(job["cpu_s"] + 0.999))
    nproc = nproc_base + job["max_processes"]
    limits = [
        (resource.RLIMIT_CPU, cpu, cpu + 1),  # SIGXCPU at the soft limit, SIGKILL at the hard one
        (resource.RLIMIT_AS, job["memory_mb"] << 20, job["memory_mb"] << 20),
        (resource.RLIMIT_FSIZE, job["file_mb"] << 20, job["file_mb"] << 20),
        (resource.RLIMIT_NOFILE, job["max_files"], job["max_files"]),
        (resource.RLIMIT_NPROC, nproc, nproc),
        (resource.RLIMIT_CORE, 0, 0),
    ]
    for what, soft, hard in limits:
        resource.setrlimit(what, (soft, hard))
    report["rlimits"] = {"cpu_s": cpu, "memory_mb": job["memory_mb"], "file_mb": job["file_mb"], "nproc": nproc}


# ------------------------------------------------------------------------------------------------ guard
def install_guard(work):
    """Step 5: the audit hook. A denied event raises PermissionError inside the program, which may catch it:
    what it tried did not happen either way."""
    allowed = tuple(os.path.join(d, "") for d in (work, *PRIVATE_TMP))
    pgrp, me = os.getpgrp(), str(os.getpid())
    deny = ("socket.", "ctypes.", "subprocess.", "os.exec", "os.posix_spawn", "os.spawn", "os.system", "pty.")
    deny_import = {"_ctypes", "ctypes", "_posixsubprocess"}  # fork_exec raises no audit event of its own
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
    changes = ("os.rename", "os.remove", "os.rmdir", "os.mkdir", "os.symlink", "os.link", "os.truncate", "os.chmod")

    def inside(path):
        return (os.path.abspath(os.fsdecode(path)) + os.sep).startswith(allowed)

    def same_group(pid):
        try:
            return pid in (0, os.getpid()) or (pid > 0 and os.getpgid(pid) == pgrp) or pid == -pgrp
        except OSError:
            return False

    def hook(event, args):
        if event.startswith(deny):
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "import" and args[0].partition(".")[0] in deny_import:
            raise PermissionError(f"sandbox: import {args[0]} is not allowed")
        if (event == "os.kill" and not same_group(args[0])) or (event == "os.killpg" and args[0] != pgrp):
            raise PermissionError(f"sandbox: {event} outside the run is not allowed")
        if event == "open" and isinstance(args[0], (str, bytes)):
            path, mode, flags = args[0], args[1], args[2] or 0
            writing = (isinstance(mode, str) and any(ch in mode for ch in "wax+")) or flags & write_flags
            if writing and not inside(path) and os.fsdecode(path) != "/dev/null":
                raise PermissionError(f"sandbox: writing {os.fsdecode(path)} is not allowed")
            parts = os.path.abspath(os.fsdecode(path)).split(os.sep)
            if len(parts) > 2 and parts[1] == "proc" and parts[2].isdigit() and parts[2] != me:
                raise PermissionError("sandbox: another process's /proc entries are not readable")
        elif event in changes and any(isinstance(p, (str, bytes)) and not inside(p) for p in args):
            raise PermissionError(f"sandbox: {event} outside the work dir is not allowed")

    sys.addaudithook(hook)


# -------------------------------------------------------------------------------------------------- run
def run_program(job, stdin_fd, report, ready_fd):
    """In the program's process (pid 1 of its namespace when there is one): steps 2-5, then the program as
    __main__. Never returns."""
    try:
        kernel = Kernel()
        if job["namespaced"] and not job["host_root"]:
            nproc_base = 2  # a new user namespace counts its own processes: this one and the launcher
        else:  # the kernel counts the user's processes machine-wide
            nproc_base = count_processes(NOBODY if job["drop"] else os.geteuid())
        if job["namespaced"]:
            mounts(kernel, job, report)
        os.chdir(job["work"])
        os.dup2(stdin_fd, 0)
        os.close(stdin_fd)
        drop_privileges(kernel, job, nproc_base, report)
        report["guard"] = bool(job.get("guard", True))
        if job.get("report"):
            sys.stderr.write(f"HERMES_SANDBOX {report!r}\n")  # a Python literal: no json import, ~10 ms a run
            sys.stderr.flush()
        program, work, guard = job["program"], job["work"], job.get("guard", True)
        del job, kernel  # nothing of the launcher's state is left for the program to reach
        sys.modules.pop("ctypes", None)
        sys.argv = ["program.py"]
        import builtins

        builtins.exit = builtins.quit = sys.exit  # what site would have added (-S): programs call exit()
        main_mod = type(sys)("__main__")
        main_mod.__dict__["__builtins__"] = __builtins__
        sys.modules["__main__"] = main_mod
        if guard:
            install_guard(work)
        os.write(ready_fd, b"1")
        os.close(ready_fd)
    except BaseException as e:
        sys.stderr.write(f"sandbox launcher failed: {type(e).__name__}: {e}\n")
        os._exit(LAUNCHER_FAILED)
    code = 0
    try:
        exec(compile(program, "program.py", "exec"), main_mod.__dict__)
    except SystemExit as e:
        code = e.code
        if code is None:
            code = 0
        elif not isinstance(code, int):
            sys.stderr.write(f"{code}\n")
            code = 1
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    _flush()
    os._exit(code & 0xFF)


def run_job(job, kernel):
    """One run: namespaces, then the program's process (``run_program``), waited for; the exit status."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an oversized write fails with EFBIG instead of killing
    report = {}
    job["host_root"] = os.geteuid() == 0
    job["drop"] = job["host_root"] and job.get("drop_to_nobody", True)
    try:
        job["namespaced"] = bool(job.get("isolate", True)) and isolate(kernel, job, report)
    except OSError as e:  # the id maps could not be written: no usable user namespace after all
        job["namespaced"] = False
        report["namespaces"] = f"none ({e})"
    stdin_fd = os.memfd_create("stdin")
    os.write(stdin_fd, job.get("stdin", "").encode("utf-8", "surrogateescape"))
    os.lseek(stdin_fd, 0, os.SEEK_SET)
    ready_r, ready_w = os.pipe()  # one byte when the program starts: a failure before it is the launcher's
    pid = os.fork()
    if pid == 0:
        os.close(ready_r)
        run_program(job, stdin_fd, report, ready_w)
    os.close(stdin_fd)
    os.close(ready_w)
    started = os.read(ready_r, 1) == b"1"
    os.close(ready_r)
    while True:
        try:
            _, status, usage = os.wait4(pid, 0)
            break
        except InterruptedError:
            continue
    if not started:
        return LAUNCHER_FAILED
    if usage.ru_utime + usage.ru_stime >= job["cpu_s"] - 0.01:
        return CPU_EXCEEDED
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return min(os.WEXITSTATUS(status), MAX_PROGRAM_CODE)


# ------------------------------------------------------------------------------------------ fork server
def serve(sock_fd):
    """Fork-server mode: one launcher, started once, forks a run per request (no interpreter start per run).

    Requests come on a SOCK_SEQPACKET socket as marshalled tuples with file descriptors attached:
    ("run", id) + [stdout, stderr, job memfd] -> ("started", id, pid), later ("exited", id, status);
    ("kill", id) -> the run's process group gets SIGKILL (a no-op once it is reaped). The run's process is
    a session and process group of its own, as in per-run mode; the server reaps it, killing its group
    first (a zombie's pid cannot be reused, so that kill never reaches another group). EOF on the socket
    (the trainer is gone) kills every running group and ends the server."""
    import socket

    sock = socket.socket(fileno=sock_fd)
    kernel = Kernel()  # ctypes and libc loaded once: every fork has them
    # a run's orphans (its program once the run's launcher is killed) are reparented here and reaped at once,
    # not by the machine's init whenever it gets to them: the trainer waits for a run's group to be empty
    kernel.prctl(PR_SET_CHILD_SUBREAPER, 1)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so SIGCHLD writes to the wakeup fd
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the trainer's Ctrl-C is the trainer's
    running = {}  # pid -> id
    ids = {}  # id -> pid, until reaped
    import select

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
                _reap(sock, running, ids)
                continue
            try:
                msg, fds, _, _ = socket.recv_fds(sock, 4096, 3)
            except InterruptedError:
                continue
            if not msg:  # the trainer is gone: so is every run
                for pid in running:
                    _killpg(pid)
                return 0
            kind, run_id = marshal.loads(msg)
            if kind == "kill":
                if run_id in ids:
                    _killpg(ids[run_id])
                continue
            out_fd, err_fd, job_fd = fds
            pid = os.fork()
            if pid == 0:
                _run_forked(sock, wake_r, wake_w, out_fd, err_fd, job_fd, kernel)
            for f in fds:
                os.close(f)
            running[pid], ids[run_id] = run_id, pid
            _send(sock, ("started", run_id, pid))
        _reap(sock, running, ids)


def _run_forked(sock, wake_r, wake_w, out_fd, err_fd, job_fd, kernel):
    """In a run's process forked by the server: its own session, its own stdio, the job, nothing else."""
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        sock.close()
        os.close(wake_r)
        os.close(wake_w)
        os.setsid()
        os.dup2(out_fd, 1)
        os.dup2(err_fd, 2)
        null = os.open("/dev/null", os.O_RDONLY)
        os.dup2(null, 0)
        with os.fdopen(job_fd, "rb") as f:
            job = marshal.load(f)
        os.closerange(3, 1 << 16)
        os.environ.clear()  # the server's environment was the clean one already; the job's HOME is per run
        os.environ.update(job.get("env", {}))
        code = run_job(job, kernel)
    except BaseException as e:
        os.write(2, f"sandbox launcher failed: {type(e).__name__}: {e}\n".encode())
        code = LAUNCHER_FAILED
    os._exit(code)


def _reap(sock, running, ids):
    while True:
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return
        if info is None:
            return
        pid = info.si_pid
        _killpg(pid)  # whatever the run left in its group, while the zombie still holds the group's id
        _, status = os.waitpid(pid, 0)
        run_id = running.pop(pid, None)
        if run_id is not None:
            ids.pop(run_id, None)
            code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            _send(sock, ("exited", run_id, code))


def _killpg(pgid):
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _send(sock, msg):
    try:
        sock.send(marshal.dumps(msg))
    except OSError:
        pass  # the trainer is gone: the next poll sees EOF


def main():
    del sys.path[0]  # the launcher's own dir: nothing there is the program's to import
    if len(sys.argv) == 3 and sys.argv[1] == "--serve":
        return serve(int(sys.argv[2]))
    if len(sys.argv) > 1:
        print("usage: python -S -s -B launcher.py [--serve FD] < job.marshal  (started by hermes_lab.sandbox.local)")
        return 0
    job = marshal.loads(sys.stdin.buffer.read())  # the same interpreter wrote it: no json import (~10 ms a run)
    return run_job(job, Kernel())


def _flush():
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed or broken stream: nothing left to say on it
            pass


if __name__ == "__main__":
    sys.exit(main())
