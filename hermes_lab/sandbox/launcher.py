"""The sandbox side of the local executor: a fork server that starts each run, confined, from a warm interpreter.

Stage: train (the tests reward) and every stage that scores code. Started once per executor by
``hermes_lab.sandbox.local`` (with namespaces inside bubblewrap's root, see ``hermes_lab.sandbox.isolation``);
reads runs' jobs from file descriptors it is sent, writes nothing but each run's own stdout, stderr and status.
It runs under ``python -I -S`` (no hermes_lab import; ``-S`` dropped when ``sandbox.python`` names a virtualenv,
whose packages the programs may then import) and imports only the stdlib and its sibling ``confine.py``.

    python -I -S -B launcher.py --serve FD        # what the executor starts (inside bwrap, or not)

A run, process by process:

- **R**, forked by the server for each ``("run", id)`` message, with the run's descriptors attached (job,
  stdout, stderr, status, stdin, then optional fetch and cgroup ones). It reads the job (the program, its
  language, files, limits: never stdin, which stays in the memfd the trainer wrote), starts a session of its own,
  and with namespaces makes a mount, pid and network namespace for the run and mounts its private tmpfs (work
  dir, /tmp, /dev/shm) and devpts. The server never reads a job: nothing of one run lingers in the memory the
  next is forked from.
- **the supervisor** (pid 1 of the run's pid namespace, forked by R; without namespaces, R itself) joins the
  run's cgroups through the ``cgroup.procs`` descriptors the trainer opened (every process it starts is then
  counted and killed with the run), mounts the run's /proc, starts the program's process and waits for it;
  then kills whatever the program left (with namespaces) and writes the status record: started or not, exit
  code or signal, CPU seconds. With ``fetch``, a process confined as the program reads the files asked for.
- **the program's process**: chdir to the work dir, stdin dup'ed from the memfd (never read here), every other
  descriptor closed, privileges dropped, the files and the program written, rlimits, Landlock (without
  namespaces), the seccomp filter, the audit hook (Python), then the program: Python ``exec``'d as
  ``__main__`` with ``__file__`` set, its tracebacks its own (no launcher frame), ``exit()`` codes as they are,
  threads joined and atexit run as the interpreter would; bash ``exec``'d.
"""

import marshal
import os
import signal
import stat
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import confine  # the sibling module, inside the sandbox's root as here

del sys.path[0]  # nothing of the launcher's dir is the program's to import
# what programs and harnesses import most: imported once here, each run finds them loaded
PRELOAD = ("json", "math", "re", "collections", "itertools", "functools", "string", "traceback", "random", "typing")
LAUNCHER_FAILED = 125
FETCH_CAP = 64 << 20


# ------------------------------------------------------------------------------------------- the program
def start_program(job, kernel, ready_w):
    """In the program's process: confine it, then run the program. Never returns."""
    try:
        confine_like_program(job, kernel, seccomp=False)
        for name, data in job["files"].items():
            _write_file(os.path.join(job["work"], name), data)
        path = os.path.join(job["work"], "program.sh" if job["language"] == "bash" else "program.py")
        _write_file(path, job["program"].encode("utf-8", "surrogateescape"))
        if job["report"]:
            report = probe(job, kernel)
        if job["seccomp"]:
            kernel.seccomp(job["seccomp"])
        if job["report"]:
            report["seccomp"] = _prctl_get(kernel, 21)  # PR_GET_SECCOMP: 2 once the filter is loaded
            report["unix_sockets"] = probe_unix_addresses()
            sys.stderr.write(f"HERMES_SANDBOX {report!r}\n")  # a Python literal: no json import
            sys.stderr.flush()
        if job["language"] == "bash":
            os.write(ready_w, b"1")
            os.execve("/bin/bash", ["/bin/bash", path], os.environ)
        main = _main_module(path)
        if job["guard"]:
            confine.install_guard(job["work"])
        os.write(ready_w, b"1")
        os.close(ready_w)
    except BaseException as e:
        sys.stderr.write(f"sandbox launcher failed: {type(e).__name__}: {e}\n")
        _flush()
        os._exit(LAUNCHER_FAILED)
    del job, kernel  # nothing of the launcher's state is left for the program to reach
    os._exit(run_python(path, main))


def confine_like_program(job, kernel, seccomp=True):
    """The program's confinement (the fetcher gets the same): its cwd, stdin, descriptors, user, rlimits,
    Landlock; the seccomp filter too unless the caller loads it later."""
    keep = job["keep_fd"]  # stdin, stdout, stderr and this one: nothing else of the launcher's
    os.closerange(3, keep)
    os.closerange(keep + 1, 1 << 16)
    kernel.drop_privileges(job["to_nobody"])
    os.chdir(job["work"])  # as the program's user: the work dir is its own (0700)
    confine.rlimits(job, count_processes=not job["cgroup"])
    ll = job["landlock"]
    if ll:
        kernel.landlock(ll["read_only"], [job["work"], *ll["writable"]], ll["abi"])
    if seccomp and job["seccomp"]:
        kernel.seccomp(job["seccomp"])


def _write_file(path, data):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def _main_module(path):
    import builtins

    builtins.exit = builtins.quit = sys.exit  # what site adds (-S): programs call exit()
    main = type(sys)("__main__")
    main.__dict__.update(__file__=path, __builtins__=builtins, __cached__=None)
    sys.modules["__main__"] = main
    sys.argv = [path]
    sys.path.insert(0, os.path.dirname(path))  # as `python program.py`: the files it was given import
    return main


def run_python(path, main):
    """The program as ``python path`` runs it; the exit status the interpreter would give."""
    code = 0
    try:
        with open(path, "rb") as f:
            source = f.read()
        exec(compile(source, path, "exec"), main.__dict__)
    except SystemExit as e:
        code = _exit_code(e)
    except BaseException as e:
        tb = e.__traceback__.tb_next if e.__traceback__ is not None else None  # the program's frames only
        try:
            sys.excepthook(type(e), e.with_traceback(tb), tb)
        except BaseException:
            pass
        code = 1
    try:
        if "threading" in sys.modules:
            sys.modules["threading"]._shutdown()  # non-daemon threads end first, as at interpreter exit
        import atexit

        atexit._run_exitfuncs()
    except SystemExit as e:
        code = _exit_code(e)
    except BaseException:
        pass
    _flush()
    return code & 0xFF


def _exit_code(e):
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    sys.stderr.write(f"{e.code}\n")
    return 1


def probe(job, kernel):
    """What holds inside a run, for ``describe()``: the user, the root, what of the host is in reach."""
    reach = {}
    for p in job["probe_paths"]:
        try:
            if os.path.isdir(p):
                reach[p] = sorted(os.listdir(p))[:6]  # bubblewrap makes the parents of what it binds
            else:
                open(p, "rb").close()
                reach[p] = "readable"
        except FileNotFoundError:
            reach[p] = "absent"
        except OSError as e:
            reach[p] = f"refused ({e.strerror})"
    try:
        root = sorted(os.listdir("/"))
    except OSError as e:
        root = [f"refused ({e.strerror})"]
    return {
        "uid": os.getuid(),
        "no_new_privs": _prctl_get(kernel, 39),
        "root": root,
        "host_paths": reach,
        "python": sys.executable,
    }


def probe_unix_addresses():
    """Whether a unix socket of this run can reach an address (a host's listener, another run's): 'refused' when
    every way is (bind, connect, sendto, sendmsg), else the first way that got through to the kernel's lookup.
    Probed at an absent path and an unused abstract name: an error other than EPERM means the call was made."""
    import errno
    import socket

    try:
        a, peer = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    except OSError as e:
        return f"refused (socketpair: {e.strerror})"
    where = ("/nonexistent-hermes-probe/sock", f"\0hermes-probe-{os.getpid()}")  # a path no bind can create
    ways = [
        ("sendto", lambda addr: a.sendto(b"x", addr)),
        ("sendmsg", lambda addr: a.sendmsg([b"x"], [], 0, addr)),
        ("connect", a.connect),
        ("bind", a.bind),
    ]
    try:
        for what, call in ways:
            for addr in where:
                try:
                    call(addr)
                except OSError as e:
                    if e.errno == errno.EPERM:
                        continue
                    return f"open ({what} {addr!r}: {e.strerror})"
                return f"open ({what} {addr!r} succeeded)"
    finally:
        a.close()
        peer.close()
    return "refused"


def _prctl_get(kernel, option):
    return kernel.libc.prctl(option, 0, 0, 0, 0)


# ------------------------------------------------------------------------------------------- the run
def supervise(job, kernel, fds, namespaced):
    """The run's supervisor: in its cgroups, starts the program and waits; the status record. Returns its
    exit code (the record is what counts)."""
    for fd in fds["cgroups"]:
        os.write(fd, b"0")  # cgroup.procs: "0" moves the writer; its children are born inside
        os.close(fd)
    if namespaced:
        kernel.mount_proc()
    kernel.prctl(confine.PR_SET_DUMPABLE, 0)  # the program may not read this process's memory
    ready_r, ready_w = os.pipe()
    job["keep_fd"] = ready_w
    pid = os.fork()
    if pid == 0:
        os.dup2(fds["stdin"], 0)
        start_program(job, kernel, ready_w)
    os.close(ready_w)
    os.close(fds["stdin"])
    started = os.read(ready_r, 1) == b"1"
    os.close(ready_r)
    status, usage = _wait_for(pid, reap_all=namespaced)
    if namespaced:  # the program's end is the run's: what it left dies now (pid 1 may signal every process)
        try:
            os.kill(-1, signal.SIGKILL)
        except OSError:
            pass
        _reap_all()
    record = {
        "started": started,
        "exit": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
        "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
        "cpu": usage.ru_utime + usage.ru_stime,
    }
    if started and job["fetch"] and fds.get("fetch") is not None:
        record["fetched"] = fetch(job, kernel, fds["fetch"])
    os.write(fds["status"], marshal.dumps(record))
    return 0


def _wait_for(pid, reap_all):
    """The program's wait status and rusage; as pid 1, also reaps the orphans that come meanwhile."""
    while True:
        try:
            got, status, usage = os.wait4(-1 if reap_all else pid, 0)
        except InterruptedError:
            continue
        if got == pid:
            return status, usage


def _reap_all():
    while True:
        try:
            os.wait()
        except ChildProcessError:
            return
        except InterruptedError:
            continue


def fetch(job, kernel, out_fd):
    """The files the caller asked for, read by a process confined as the program was (its user, its view of
    the file tree, its rlimits), so a link to somewhere else reads only what the program could have read."""
    pid = os.fork()
    if pid == 0:
        try:
            job["keep_fd"] = out_fd
            confine_like_program(job, kernel)
            got, total = {}, 0
            for name in job["fetch"]:
                try:
                    data = _read_regular(os.path.join(job["work"], name), FETCH_CAP - total + 1)
                except (OSError, ValueError):
                    continue  # not there, or not a regular file: not fetched (as SandboxFusion leaves it out)
                if total + len(data) > FETCH_CAP:
                    break
                got[name], total = data, total + len(data)
            os.write(out_fd, marshal.dumps(got))
            os._exit(0)
        except BaseException:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    return status == 0


def _read_regular(path, cap):
    """Up to ``cap`` bytes of a regular file. Opened without blocking and refused unless regular: a FIFO the run
    left would block the fetch until the run's timeout, a device could be read without end or with effects."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path}: not a regular file")
        os.set_blocking(fd, True)
        chunks, left = [], cap
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def run(job, kernel, fds):
    """R: a session of its own; with namespaces, the run's mount and pid namespace and its private mounts, then
    the supervisor as the pid namespace's first process; without, R supervises itself."""
    os.setsid()
    if not job["namespaced"]:
        return supervise(job, kernel, fds, namespaced=False)
    uid = confine.NOBODY if job["to_nobody"] else os.getuid()
    # a network namespace per run, not only bubblewrap's one for the server: abstract unix addresses live in a
    # network namespace, and runs that shared one could talk (and pass descriptors) over them (~1.8 ms a run)
    kernel.unshare(confine.CLONE_NEWNS | confine.CLONE_NEWPID | confine.CLONE_NEWNET)
    kernel.private_mounts(job["work"], job["file_mb"], uid)
    pid = os.fork()
    if pid == 0:
        try:
            code = supervise(job, kernel, fds, namespaced=True)
        except BaseException as e:
            os.write(2, f"sandbox launcher failed: {type(e).__name__}: {e}\n".encode())
            code = LAUNCHER_FAILED
        os._exit(code)
    for fd in (fds["stdin"], fds["status"], *fds["cgroups"], *([fds["fetch"]] if fds.get("fetch") else [])):
        os.close(fd)
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else LAUNCHER_FAILED
        except InterruptedError:
            continue


# ------------------------------------------------------------------------------------------ fork server
def serve(sock_fd):
    """One launcher, started once, forks a run per request (no interpreter start per run).

    Requests come on a SOCK_SEQPACKET socket as marshalled tuples with file descriptors attached:
    ("run", id) + fds -> a forked R (``_run_forked``), later ("exited", id, status) once it is reaped;
    ("kill", id) -> R's process group gets SIGKILL (the executor's way to stop a run where it has no cgroup).
    The server is a subreaper: what a run leaves behind is reparented here and reaped at once. EOF on the
    socket (the trainer is gone) kills every running group and ends the server."""
    import select
    import socket

    for name in PRELOAD:
        __import__(name)
    import gc

    gc.freeze()  # the warm heap is never scanned by a run's collections: its pages stay shared, not copied
    sock = socket.socket(fileno=sock_fd)
    kernel = confine.Kernel()  # ctypes and libc loaded once: every fork has them
    kernel.prctl(36, 1)  # PR_SET_CHILD_SUBREAPER
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so SIGCHLD writes to the wakeup fd
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the trainer's Ctrl-C is the trainer's
    running, ids = {}, {}  # pid -> id; id -> pid, until reaped
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
                msg, fds, _, _ = socket.recv_fds(sock, 4096, 64)
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
            pid = os.fork()
            if pid == 0:
                _run_forked(sock, (wake_r, wake_w), fds, kernel)
            for f in fds:
                os.close(f)
            running[pid], ids[run_id] = run_id, pid
        _reap(sock, running, ids)


def _run_forked(sock, wake, fds, kernel):
    """R, just forked: its own stdio and job, none of the server's descriptors."""
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        sock.close()
        for f in wake:
            os.close(f)
        job_fd, out_fd, err_fd, status_fd, stdin_fd, *rest = fds
        os.dup2(out_fd, 1)
        os.dup2(err_fd, 2)
        for f in (out_fd, err_fd):
            os.close(f)
        null = os.open("/dev/null", os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        with os.fdopen(job_fd, "rb") as f:
            job = marshal.load(f)
        fetch_fd = rest.pop(0) if job["fetch"] else None
        names = {"stdin": stdin_fd, "status": status_fd, "fetch": fetch_fd, "cgroups": rest}
        os.environ.clear()
        os.environ.update(job["env"])
        code = run(job, kernel, names)
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
            _send(sock, ("exited", run_id, os.waitstatus_to_exitcode(status)))


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


def _flush():
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed or broken stream: nothing left to say on it
            pass


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--serve":
        return serve(int(sys.argv[2]))
    print("usage: python -I -S -B launcher.py --serve FD  (started by hermes_lab.sandbox.local)")
    return 0 if sys.argv[1:] in (["--help"], ["-h"]) else 2


if __name__ == "__main__":
    sys.exit(main())
