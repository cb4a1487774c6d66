"""Hermes's own agent loop on many tasks in one process: the driver ``agents.hermes_loop`` starts in its sandbox.

Runs inside bubblewrap, in the pinned hermes-agent virtualenv's interpreter (stdlib and ``run_agent`` only, no
hermes_lab import: that virtualenv does not have it). Reads task lines on stdin, writes one result line per task
on stdout; writes nothing but under each task's own folders (its workspace, its HERMES_HOME, its tmp)::

    python hermes_driver.py [--parallel N] < tasks.jsonl > results.jsonl
    in:  {"id", "prompt", "workspace", "home", "tmp", "timeout", "toolsets", "max_turns", "base_url", "model"}
    out: {"id", "conversation_id", "messages", "final_response", "completed", "error", "seconds", "timed_out", "exit"}

``run_agent`` is imported once (~1.2 s), with what Hermes would otherwise do lazily in every task (``warm``); each
task then runs in a child forked from the warm process (copy on write), up to ``--parallel`` children at once, each
result line written as its task ends. The child, before Hermes sees the task:

- moves into the task's workspace, with ``HERMES_HOME`` and ``HOME`` its own folder (its config.yaml names the
  model server and the conversation id header the gateway files it under) and ``TMPDIR`` its own tmp;
- confines itself and every process it starts with a Landlock domain of its own: the system, the interpreter and
  the virtualenv read-only, its three folders the only places it may read or write among the tasks' (another
  task's workspace is out of reach, as is every host path the sandbox shows), TCP connect to the model's port only
  and no TCP bind, no abstract unix socket or signal outside the domain;
- is killed with its process group at the task's timeout (``timed_out``, exit "timeout").

The sandbox has no network but the model's address: bubblewrap gives it an empty network namespace, and the
driver listens on ``127.0.0.1:<the model's port>`` in there, passing each connection to the unix socket named by
``HERMES_LAB_MODEL_SOCKET`` (the host end forwards it to the model server).
"""

import contextlib
import ctypes
import json
import os
import select
import signal
import socket
import sys
import threading
import time

SYS_CREATE, SYS_ADD_RULE, SYS_RESTRICT = 444, 445, 446
RULE_PATH, RULE_PORT = 1, 2
NET_BIND, NET_CONNECT = 1, 2
SCOPES = 1 | 2  # abstract unix sockets, signals (ABI 6)
READ = 1 | 4 | 8  # execute, read file, read dir
FS_ALL = {1: (1 << 13) - 1, 2: (1 << 14) - 1, 3: (1 << 15) - 1, 5: (1 << 16) - 1}
FILE_RIGHTS = 1 | 2 | 4 | (1 << 14) | (1 << 15)
DEVICES = ("/dev/null", "/dev/zero", "/dev/full")  # written to by every shell: writable, and they keep nothing


# ------------------------------------------------------------------------------------------ the network
def _pump(a, b):
    with contextlib.suppress(OSError):
        while True:
            data = a.recv(65536)
            if not data:
                break
            b.sendall(data)
    for s in (a, b):
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_RDWR)


def serve_model_port(port, unix_path):
    """127.0.0.1:port in this (empty) network namespace, each connection passed on to ``unix_path``."""
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", port))
    srv.listen(64)

    def accept():
        while True:
            conn, _ = srv.accept()
            up = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                up.connect(unix_path)
            except OSError:
                conn.close()
                continue
            threading.Thread(target=_pump, args=(conn, up), daemon=True).start()
            threading.Thread(target=_pump, args=(up, conn), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()


# ------------------------------------------------------------------------------------------- Landlock
def landlock(read_only, writable, port):
    """This process and its children: ``read_only`` paths readable, ``writable`` ones all rights, nothing else;
    TCP connect to ``port`` only, no bind; no abstract unix socket or signal outside the domain."""
    libc = ctypes.CDLL(None, use_errno=True)
    abi = libc.syscall(SYS_CREATE, None, 0, 1)
    if abi < 1:
        raise OSError("Landlock is not available in this kernel")
    fs_all = FS_ALL[max(k for k in FS_ALL if k <= abi)]
    net = NET_BIND | NET_CONNECT if abi >= 4 else 0
    attr = (ctypes.c_uint64 * 3)(fs_all, net, SCOPES if abi >= 6 else 0)
    size = 8 if abi < 4 else (16 if abi < 6 else 24)
    rs = libc.syscall(SYS_CREATE, ctypes.byref(attr), size, 0)
    if rs < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset")
    try:
        for paths, rights in ((read_only, READ), (writable, fs_all)):
            for path in paths:
                try:
                    fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
                except OSError:
                    continue  # a path this machine lacks
                try:
                    r = rights & fs_all
                    if not os.path.isdir(path):
                        r &= FILE_RIGHTS
                    rule = (ctypes.c_ubyte * 12)()  # landlock_path_beneath_attr: u64 allowed, s32 fd (packed)
                    ctypes.c_uint64.from_buffer(rule, 0).value = r
                    ctypes.c_int32.from_buffer(rule, 8).value = fd
                    if libc.syscall(SYS_ADD_RULE, rs, RULE_PATH, rule, 0) != 0:
                        raise OSError(ctypes.get_errno(), f"landlock_add_rule {path}")
                finally:
                    os.close(fd)
        if net:
            rule = (ctypes.c_uint64 * 2)(NET_CONNECT, port)  # landlock_net_port_attr
            if libc.syscall(SYS_ADD_RULE, rs, RULE_PORT, rule, 0) != 0:
                raise OSError(ctypes.get_errno(), "landlock_add_rule port")
        if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS: Landlock's precondition
            raise OSError(ctypes.get_errno(), "no_new_privs")
        if libc.syscall(SYS_RESTRICT, rs, 0) != 0:
            raise OSError(ctypes.get_errno(), "landlock_restrict_self")
    finally:
        os.close(rs)


def system_paths():
    """What Hermes and the commands its terminal runs must read: the system, this interpreter and its packages."""
    paths = ["/usr", "/bin", "/sbin", "/lib", "/lib64", "/etc", "/proc", "/dev", "/sys", "/opt"]
    paths += [sys.prefix, sys.base_prefix, os.path.dirname(os.path.realpath(sys.executable))]
    return paths


# ------------------------------------------------------------------------------------------ one task
def forget_parent_logs():
    """Hermes's log files are the driver's (opened in its HERMES_HOME at import): the child closes them, so that
    its own AIAgent logs under the task's home, the only one it may write."""
    import logging

    import hermes_logging

    with contextlib.suppress(Exception):
        hermes_logging._reset_queued_handlers()
    root = logging.getLogger()
    for h in list(root.handlers):
        if isinstance(h, logging.FileHandler):
            root.removeHandler(h)
    hermes_logging._logging_initialized = False


def adopt_home(old, new):
    """Hermes's modules keep paths under the HERMES_HOME of their import (``run_agent._hermes_home``, the skills',
    checkpoints' and processes' folders...): every such module-level path now points under the task's home."""
    import pathlib

    if not old:
        return
    old = os.path.realpath(old)
    for mod in list(sys.modules.values()):
        names = getattr(mod, "__dict__", None)
        if not isinstance(names, dict):
            continue
        for k, v in list(names.items()):
            if isinstance(v, (pathlib.PurePath, str)) and not isinstance(v, bool):
                s = str(v)
                if s == old or s.startswith(old + os.sep):
                    names[k] = type(v)(new + s[len(old) :])
    with contextlib.suppress(Exception):
        import hermes_constants

        hermes_constants.set_hermes_home_override(new)


def child(task, w):
    """In the forked child: confine, run Hermes's loop on the task, write the result to ``w``."""
    out = {"error": None}
    before = set(sys.modules)
    try:
        os.setsid()
        log = os.open(os.path.join(task["home"], "driver.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.environ.update(
            HERMES_HOME=task["home"], HOME=task["home"], TMPDIR=task["tmp"], TERMINAL_CWD=task["workspace"]
        )
        os.chdir(task["workspace"])
        forget_parent_logs()
        adopt_home(os.environ.get("HERMES_LAB_DRIVER_HOME", ""), task["home"])
        landlock(system_paths(), [task["workspace"], task["home"], task["tmp"], *DEVICES], int(task["port"]))
        from run_agent import AIAgent

        agent = AIAgent(
            base_url=task["base_url"],
            model=task["model"],
            api_key=os.environ.get("OPENAI_API_KEY", "sk-unused"),
            max_iterations=int(task.get("max_turns") or 6),
            enabled_toolsets=task.get("toolsets"),
            quiet_mode=True,
            platform="cli",
        )
        try:
            res = agent.run_conversation(task["prompt"])
        finally:
            with contextlib.suppress(Exception):
                agent.close()
        out.update(
            messages=res.get("messages") or [],
            final_response=res.get("final_response"),
            completed=bool(res.get("completed")),
        )
    except BaseException as e:  # whatever Hermes raised is the task's result, not the driver's end
        import traceback

        out["error"] = f"{type(e).__name__}: {e}"[:2000]
        out["traceback"] = traceback.format_exc()[-4000:]
    out["imported"] = sorted(set(sys.modules) - before)
    data = json.dumps(out, default=str).encode()
    view = memoryview(data)
    while view:
        view = view[os.write(w, view[:65536]) :]
    os._exit(0)


def warm():
    """What Hermes does lazily on every task, done once here so that every child inherits it: the OpenAI SDK's
    import (AIAgent imports it when it makes its client: ~0.5 s of pydantic classes a task) and the toolchain probe
    of its system prompt (python3, pip and uv run as processes, cached per process: ~0.3 s a task). Neither depends
    on the task: the probe looks at the machine, not the workspace."""
    with contextlib.suppress(Exception):
        import openai  # noqa: F401
    with contextlib.suppress(Exception):
        from tools.env_probe import get_environment_probe_line

        get_environment_probe_line()


def warm_imports(names):
    """The modules a child imported that this process has not: imported here, so the next child starts with them
    (the tools' modules, on first use). A module that fails to import here is left to the children, as before."""
    import importlib

    for name in names:
        if name not in sys.modules:
            with contextlib.suppress(Exception):
                importlib.import_module(name)


FORK = threading.Lock()  # a fork never overlaps this process's own imports or prints: a child forked mid-import or
# mid-print would inherit a lock (the import lock, stdout's buffer) held by a thread it does not have


def run_one(task):
    """Fork the task's child, collect its result, kill its process group at the timeout."""
    with FORK:
        r, w = os.pipe()
        t0 = time.monotonic()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            child(task, w)
        os.close(w)
    deadline = t0 + float(task.get("timeout") or 120)
    chunks, timed_out = [], False
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            break
        ready, _, _ = select.select([r], [], [], left)
        if ready:
            data = os.read(r, 65536)
            if not data:
                break
            chunks.append(data)
    os.close(r)
    if timed_out:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    try:
        out = json.loads(b"".join(chunks) or b"{}")
    except json.JSONDecodeError:
        out = {}
    with FORK:
        warm_imports(out.pop("imported", ()))
    if timed_out:
        out = {"error": f"timed out after {task.get('timeout')} s"}
    elif not out:
        out = {"error": f"the task's process ended without a result (wait status {status})"}
    exit_ = "timeout" if timed_out else ("error" if out.get("error") else "ok")
    head = {"id": task["id"], "conversation_id": task.get("conversation_id")}
    return {**head, **out, "seconds": round(time.monotonic() - t0, 3), "timed_out": timed_out, "exit": exit_}


def main():
    import argparse

    p = argparse.ArgumentParser(
        prog="python hermes_driver.py",
        description="Hermes's own agent loop on the task lines read from stdin, one result line each on stdout "
        "(run by hermes_lab.agents.hermes_loop inside its sandbox, in the hermes-agent virtualenv's interpreter).",
    )
    p.add_argument("--parallel", type=int, default=1, help="tasks run at once, each in its own child")
    args = p.parse_args()
    sock, port = os.environ.get("HERMES_LAB_MODEL_SOCKET"), os.environ.get("HERMES_LAB_MODEL_PORT")
    if sock and port:
        serve_model_port(int(port), sock)
    # python put this file's folder first on sys.path (it runs as a script); hermes_lab/agents/ is no place to import
    # from here: a module of it named as one of hermes-agent's own (hermes_cli.py, once) would be imported instead
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    import run_agent  # noqa: F401 - imported once: every task's child starts warm

    warm()

    print(json.dumps({"ready": True}), flush=True)
    slots = threading.BoundedSemaphore(max(1, args.parallel))

    def one(task):
        try:
            res = json.dumps(run_one(task), default=str)
        except BaseException as e:  # the driver's own failure on this task: its result line says so
            res = {"id": task.get("id"), "conversation_id": task.get("conversation_id"), "exit": "error"}
            res = json.dumps({**res, "error": f"driver: {type(e).__name__}: {e}"})
        with FORK:  # never a fork mid-print: the child would inherit stdout's buffer lock held
            print(res, flush=True)
        slots.release()

    threads = []
    for line in sys.stdin:  # results come back as tasks end, each line carrying its task's id
        if line.strip():
            slots.acquire()
            threads.append(threading.Thread(target=one, args=(json.loads(line),), daemon=True))
            threads[-1].start()
    for t in threads:
        t.join()


if __name__ == "__main__":
    main()
