"""Runs isolated from each other as from the host (issue 57): pairs of runs, at the same time in one executor, try
every channel between two runs, in both modes (namespaces; the fallback without them, Landlock), the audit hook
off so the kernel's layers hold alone.

Each channel is a holder and a prober that share a per-test token and nothing else. The pair prints ``CROSSED``
when the channel carried something from one run to the other: a datagram over an abstract or a pathname unix
address (sendto, sendmsg, connect), a descriptor of the prober's work dir passed with SCM_RIGHTS and written
through, a pty's bytes, a file in /tmp, /dev/shm or /var/tmp, a lock held on a file both read (flock, a POSIX
lock seen with F_GETLK or in /proc/locks), an inotify or dnotify watch on one. Every channel is first shown to
work between two runs of the same executor with every layer off (the control: the test can fail), then shown
to carry nothing in either mode. Then signals and /proc of a sibling run (given its host pid), a run's datagram
to a host listener by path, the fallback without the filter refused by name, and the collusion the issue found:
samples of code that computes nothing, scored in one reward call beside one that computes, are paid nothing.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import threading
import time
from pathlib import Path

import pytest

from hermes_lab.config.schema import load_config
from hermes_lab.rewards import tests as tests_reward
from hermes_lab.rewards.tests import make_tests_reward
from hermes_lab.sandbox.executor import Limits, RunRequest
from hermes_lab.sandbox.local import LocalExecutor

WAIT = 2.5  # how long each side of a pair tries
LIMITS = Limits(timeout_s=WAIT + 5, cpu_s=4, memory_mb=256, max_processes=8)
MODES = ("open", "namespaces", "fallback")
HEAD = (
    "import ctypes, fcntl, glob, os, select, signal, socket, string, struct, sys, termios, time\n"
    "T = {token!r}\nROOT = {root!r}\nWAIT = {wait!r}\nend = time.monotonic() + WAIT\n"
    "STDLIB = os.path.dirname(string.__file__)\n"
    "def crossed():\n    print('CROSSED', flush=True)\n"
    "def unpaired():  # a socketpair's datagram socket, dissociated from its peer (connect AF_UNSPEC): any may send\n"
    "    a, _ = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)\n"
    "    ctypes.CDLL(None).connect(a.fileno(), bytes(16), 16)\n"
    "    return a\n"
)
# a prober that sends its token to ADDR until it gets through or the time is up, by one way of sending
SEND = (
    "s, _ = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)\n"
    "while time.monotonic() < end:\n"
    "    try:\n"
    "        {how}\n"
    "        break\n"
    "    except OSError:\n"
    "        time.sleep(0.05)\n"
)
RECV = "a = unpaired()\na.bind(ADDR)\na.settimeout(WAIT)\nif a.recv(64) == T.encode():\n    crossed()\n"


def channels() -> dict[str, tuple[str, str]]:
    """name -> (holder, prober): programs after HEAD. Either prints CROSSED when the channel carried."""
    c: dict[str, tuple[str, str]] = {}
    for how, send in (
        ("sendto", "s.sendto(T.encode(), ADDR)"),
        ("sendmsg", "s.sendmsg([T.encode()], [], 0, ADDR)"),
        ("connect", "s.connect(ADDR)\n        s.send(T.encode())"),
    ):
        addr = f"ADDR = '\\0hx-{how}-' + T\n"
        c[f"abstract_{how}"] = (addr + RECV, addr + SEND.format(how=send))
    # a pathname socket in the holder's own work dir, found by the prober under the fallback's work root
    c["pathname_between_runs"] = (
        "ADDR = os.path.join(os.getcwd(), 'hx-' + T + '.sock')\n" + RECV,
        "s, _ = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)\n"
        "while time.monotonic() < end:\n"
        "    for p in glob.glob(ROOT + '/*/work/hx-' + T + '.sock'):\n"
        "        try:\n"
        "            s.sendto(T.encode(), p)\n"
        "        except OSError:\n"
        "            pass\n"
        "    time.sleep(0.05)\n",
    )
    # the prober's work dir, passed to the holder, which writes into it
    c["scm_rights_work_dir"] = (
        "ADDR = '\\0hx-fd-' + T\n"
        "a = unpaired()\n"
        "a.bind(ADDR)\n"
        "a.settimeout(WAIT)\n"
        "_, fds, _, _ = socket.recv_fds(a, 64, 4)\n"
        "w = os.open('planted', os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fds[0])\n"
        "os.write(w, T.encode())\n"
        "crossed()\n",
        "ADDR = '\\0hx-fd-' + T\n"
        "d = os.open('.', os.O_RDONLY | os.O_DIRECTORY)\n"
        + SEND.format(how="s.sendmsg([b'd'], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack('i', d))], 0, ADDR)")
        + "while time.monotonic() < end + 1:\n"
        "    if os.path.exists('planted'):\n"
        "        crossed()\n"
        "        break\n"
        "    time.sleep(0.05)\n",
    )
    # a pty: the holder's window size marks it, the prober reads only a pty so marked (no other terminal's bytes)
    c["pty"] = (
        "m, sl = os.openpty()\n"
        "fcntl.ioctl(sl, termios.TIOCSWINSZ, struct.pack('HHHH', 4242, int(T[:4], 16), 0, 0))\n"
        "while time.monotonic() < end:\n"
        "    os.write(m, T.encode() + b'\\n')\n"
        "    time.sleep(0.2)\n",
        "while time.monotonic() < end:\n"
        "    for p in glob.glob('/dev/pts/[0-9]*'):\n"
        "        try:\n"
        "            fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)\n"
        "        except OSError:\n"
        "            continue\n"
        "        try:\n"
        "            size = struct.unpack('HHHH', fcntl.ioctl(fd, termios.TIOCGWINSZ, bytes(8)))[:2]\n"
        "            if size == (4242, int(T[:4], 16)):\n"
        "                time.sleep(0.3)\n"
        "                if T.encode() in os.read(fd, 4096):\n"
        "                    crossed()\n"
        "                    sys.exit(0)\n"
        "        except OSError:\n"
        "            pass\n"
        "        finally:\n"
        "            os.close(fd)\n"
        "    time.sleep(0.1)\n",
    )
    c["shared_tmp"] = (
        "for d in ('/tmp', '/dev/shm', '/var/tmp'):\n"
        "    try:\n"
        "        open(d + '/hx-' + T, 'w').write(T)\n"
        "    except OSError:\n"
        "        pass\n"
        "time.sleep(WAIT)\n",
        "while time.monotonic() < end:\n"
        "    for d in ('/tmp', '/dev/shm', '/var/tmp'):\n"
        "        try:\n"
        "            if open(d + '/hx-' + T).read() == T:\n"
        "                crossed()\n"
        "                sys.exit(0)\n"
        "        except OSError:\n"
        "            pass\n"
        "    time.sleep(0.05)\n",
    )
    # a lock held on a file every run may read: one bit a poll, as often as the two like
    c["flock"] = (
        "f = os.open(os.path.join(STDLIB, 'string.py'), os.O_RDONLY)\n"
        "fcntl.flock(f, fcntl.LOCK_EX)\n"
        "time.sleep(WAIT)\n",
        "while time.monotonic() < end:\n"
        "    g = os.open(os.path.join(STDLIB, 'string.py'), os.O_RDONLY)\n"
        "    try:\n"
        "        fcntl.flock(g, fcntl.LOCK_EX | fcntl.LOCK_NB)\n"
        "        fcntl.flock(g, fcntl.LOCK_UN)\n"
        "    except BlockingIOError:\n"
        "        crossed()\n"
        "        break\n"
        "    finally:\n"
        "        os.close(g)\n"
        "    time.sleep(0.05)\n",
    )
    c["posix_lock_seen"] = (
        "f = os.open(os.path.join(STDLIB, 'colorsys.py'), os.O_RDONLY)\n"
        "fcntl.lockf(f, fcntl.LOCK_SH)\ntime.sleep(WAIT)\n",
        "path = os.path.join(STDLIB, 'colorsys.py')\nino = ':%d ' % os.stat(path).st_ino\n"
        "while time.monotonic() < end:\n"
        "    g = os.open(path, os.O_RDONLY)\n"
        "    try:\n"
        "        got = fcntl.fcntl(g, fcntl.F_GETLK, struct.pack('hhqqi4x', fcntl.F_WRLCK, 0, 0, 0, 0))\n"
        "        if struct.unpack('hhqqi4x', got)[0] != fcntl.F_UNLCK:\n"
        "            crossed()\n"
        "            break\n"
        "    except OSError:\n"
        "        pass\n"
        "    finally:\n"
        "        os.close(g)\n"
        "    try:\n"
        "        if ino in open('/proc/locks').read():\n"
        "            crossed()\n"
        "            break\n"
        "    except OSError:\n"
        "        pass\n"
        "    time.sleep(0.05)\n",
    )
    c["inotify"] = (
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "fd = libc.inotify_init1(os.O_NONBLOCK)\n"
        "if libc.inotify_add_watch(fd, os.path.join(STDLIB, 'wsgiref', 'headers.py').encode(), 0x21) < 0:\n"
        "    raise OSError(ctypes.get_errno(), 'inotify_add_watch')\n"
        "while time.monotonic() < end:\n"
        "    if select.select([fd], [], [], 0.1)[0]:\n"
        "        crossed()\n"
        "        break\n",
        "while time.monotonic() < end:\n"
        "    open(os.path.join(STDLIB, 'wsgiref', 'headers.py'), 'rb').read(1)\n"
        "    time.sleep(0.05)\n",
    )
    c["dnotify"] = (
        "hit = []\n"
        "signal.signal(signal.SIGIO, lambda *a: hit.append(1))\n"
        "d = os.open(os.path.join(STDLIB, 'xmlrpc'), os.O_RDONLY)\n"
        "fcntl.fcntl(d, fcntl.F_NOTIFY, fcntl.DN_ACCESS | fcntl.DN_MULTISHOT)\n"
        "while time.monotonic() < end and not hit:\n"
        "    time.sleep(0.05)\n"
        "if hit:\n"
        "    crossed()\n",
        "while time.monotonic() < end:\n"
        "    open(os.path.join(STDLIB, 'xmlrpc', '__init__.py'), 'rb').read(1)\n"
        "    time.sleep(0.05)\n",
    )
    return c


def executor(mode: str, root: Path, workers: int) -> LocalExecutor:
    """``open``: every layer off (the control); ``namespaces`` / ``fallback``: every layer but the audit hook."""
    if mode == "open":
        return LocalExecutor(
            workers=workers, isolate=False, seccomp=False, cgroup=False, landlock=False, guard=False, tmp_root=str(root)
        )
    return LocalExecutor(workers=workers, isolate=mode == "namespaces", guard=False, tmp_root=str(root))


def _cleanup(token: str) -> None:
    for d in ("/tmp", "/dev/shm", "/var/tmp"):
        Path(f"{d}/hx-{token}").unlink(missing_ok=True)


@pytest.fixture(scope="module")
def crossed(tmp_path_factory):
    """mode -> {channel: whether it carried}, every pair of a mode run at once in one executor."""
    out: dict[str, dict[str, bool]] = {}
    chans = channels()
    for mode in MODES:
        root = tmp_path_factory.mktemp(f"xrun-{mode}")
        root.chmod(0o755)
        token = secrets.token_hex(8)
        head = HEAD.format(token=token, root=str(root), wait=WAIT)
        ex = executor(mode, root, workers=2 * len(chans))
        try:
            if mode == "namespaces" and ex.describe()["mode"] != "namespaces":
                pytest.skip("no namespaces here")
            reqs = [RunRequest(head + prog) for holder, prober in chans.values() for prog in (holder, prober)]
            results = ex.run_many(reqs, LIMITS)
        finally:
            ex.close()
            _cleanup(token)
        out[mode] = {
            name: any("CROSSED" in r.stdout for r in results[2 * i : 2 * i + 2]) for i, name in enumerate(chans)
        }
        assert not list(root.iterdir()), "every run's work dir is removed"
    return out


def test_every_channel_between_two_runs_works_with_the_layers_off(crossed):
    """The control: each pair's mechanism is real, so the zeros below are the sandbox's."""
    assert crossed["open"] == dict.fromkeys(channels(), True)


@pytest.mark.parametrize("mode", ["namespaces", "fallback"])
def test_no_channel_between_two_runs_carries_anything_in_either_mode(crossed, mode):
    assert crossed[mode] == dict.fromkeys(channels(), False)


def test_within_one_run_its_own_socketpair_pty_and_locks_still_work():
    """What the filter leaves: a socketpair talks to its peer (send, recv), a run's pty works (namespaces: its
    own devpts), a POSIX lock on its own file is taken; what it refuses answers EPERM, not a hang."""
    prog = (
        "import fcntl, os, socket\n"
        "a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)\n"
        "a.send(b'ping')\n"
        "print(b.recv(8).decode())\n"
        "f = os.open('own.lock', os.O_RDWR | os.O_CREAT)\n"
        "fcntl.lockf(f, fcntl.LOCK_EX)\n"
        "print('locked')\n"
        "refused = (lambda: a.sendto(b'x', '\\0elsewhere'), lambda: a.connect('/dev/log'), lambda: fcntl.flock(f, 2))\n"
        "for call in refused:\n"
        "    try:\n"
        "        call()\n"
        "    except OSError as e:\n"
        "        print(e.errno)\n"
        "try:\n"
        "    m, s = os.openpty()\n"
        "    os.write(m, b'pty\\n')\n"
        "    print(os.read(s, 8).decode().strip(), os.ttyname(s))\n"
        "except OSError as e:\n"
        "    print('no pty', e.errno)\n"
        "if os.path.isdir('/sandbox'):  # namespaces: bubblewrap's root (a user's runs own it: uid 0 of a userns)\n"
        "    for d in ('/hx-shared', '/dev/hx-shared'):\n"
        "        try:\n"
        "            os.mkfifo(d)\n"
        "        except OSError as e:\n"
        "            print(e.errno)\n"
    )
    for mode in ("namespaces", "fallback"):
        ex = LocalExecutor(workers=1, isolate=mode == "namespaces", guard=False)
        try:
            if mode == "namespaces" and ex.describe()["mode"] != "namespaces":
                continue
            r = ex.run_one(RunRequest(prog), LIMITS)
        finally:
            ex.close()
        lines = r.stdout.splitlines()
        assert r.status == "ok" and lines[:5] == ["ping", "locked", "1", "1", "1"], (mode, r.stdout, r.stderr)
        # namespaces: the run's own devpts, its first pty is pts/0 whatever other runs hold; fallback: none
        assert lines[5] == ("pty /dev/pts/0" if mode == "namespaces" else "no pty 13"), r.stdout
        if mode == "namespaces":  # bubblewrap's root and /dev, shared by every run: read-only in each (EROFS)
            assert lines[6:] == ["30", "30"], r.stdout


# ------------------------------------------------------------------------------ signals and /proc of a sibling
def _host_pid_of(comm: str, deadline: float) -> int | None:
    while time.monotonic() < deadline:
        for p in Path("/proc").iterdir():
            if p.name.isdigit():
                try:
                    if (p / "comm").read_text().strip() == comm:
                        return int(p.name)
                except OSError:
                    pass
        time.sleep(0.05)
    return None


SIGNALLED = (
    "import ctypes, os, signal, sys, time\n"
    "hit = []\n"
    "signal.signal(signal.SIGUSR1, lambda *a: hit.append(1))\n"
    "ctypes.CDLL(None).prctl(15, {comm!r}.encode(), 0, 0, 0)\n"
    "end = time.monotonic() + {wait}\n"
    "while time.monotonic() < end:  # alive until the prober is done, signalled or not\n"
    "    time.sleep(0.05)\n"
    "print('SIGNALLED' if hit else 'quiet', flush=True)\n"
)
SIGNALLER = (
    "import ctypes, os, signal\n"
    "PID = {pid}\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "for way in ('kill', 'pidfd', 'comm', 'status', 'cmdline', 'fds'):\n"
    "    try:\n"
    "        if way == 'kill':\n"
    "            os.kill(PID, signal.SIGUSR1)\n"
    "        elif way == 'pidfd':\n"
    "            fd = os.pidfd_open(PID)\n"
    "            signal.pidfd_send_signal(fd, signal.SIGUSR1)\n"
    "        elif way == 'comm':\n"
    "            assert open(f'/proc/{{PID}}/comm').read().strip() == {comm!r}\n"
    "        elif way == 'status':\n"
    "            assert {comm!r} in open(f'/proc/{{PID}}/status').read()\n"
    "        elif way == 'cmdline':\n"
    "            assert b'python' in open(f'/proc/{{PID}}/cmdline', 'rb').read()\n"
    "        else:\n"
    "            os.listdir(f'/proc/{{PID}}/fd')\n"
    "        print('REACHED', way, flush=True)\n"
    "    except (OSError, AssertionError) as e:\n"
    "        print('refused', way, type(e).__name__)\n"
)


@pytest.mark.parametrize("mode", MODES)
def test_a_run_neither_signals_nor_reads_the_proc_of_a_sibling_run(mode, tmp_path):
    """The signaller is given the sibling's real pid (the host finds it by its name): only the control reaches it."""
    comm = f"hs{secrets.token_hex(5)}"
    ex = executor(mode, tmp_path, workers=2)
    try:
        if mode == "namespaces" and ex.describe()["mode"] != "namespaces":
            pytest.skip("no namespaces here")
        got: dict[str, object] = {}
        t = threading.Thread(
            target=lambda: got.update(r=ex.run_one(RunRequest(SIGNALLED.format(comm=comm, wait=WAIT + 1)), LIMITS))
        )
        t.start()
        pid = _host_pid_of(comm, time.monotonic() + 5)
        assert pid is not None, "the sibling run started"
        prober = ex.run_one(RunRequest(SIGNALLER.format(pid=pid, comm=comm)), LIMITS)
        t.join(15)
    finally:
        ex.close()
    sibling = got["r"]
    reached = [line.split()[1] for line in prober.stdout.splitlines() if line.startswith("REACHED")]
    if mode == "open":  # the control: every way works between two runs with the layers off
        assert reached == ["kill", "pidfd", "comm", "status", "cmdline", "fds"], prober.stdout + prober.stderr
        assert "SIGNALLED" in sibling.stdout
    else:
        assert reached == [], prober.stdout
        assert sibling.stdout.strip() == "quiet", sibling.stdout + sibling.stderr


# ------------------------------------------------------------------------------------- the host's unix sockets
@pytest.mark.parametrize("mode", MODES)
def test_a_run_sends_nothing_to_a_host_unix_socket_by_path(mode, tmp_path):
    """A datagram listener on a host path (as /dev/log, journald's socket): sendto, sendmsg, connect + send from
    a socketpair's socket. The control's datagrams arrive; in either mode none does."""
    base = tmp_path / "host"
    base.mkdir()
    base.chmod(0o755)
    path = str(base / "log.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(path)
    os.chmod(path, 0o777)
    listener.settimeout(0.2)
    prog = (
        "import socket\n"
        "s, _ = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)\n"
        f"P = {path!r}\n"
        "for way, call in (('sendto', lambda: s.sendto(b'sendto', P)), ('sendmsg', lambda: s.sendmsg([b'sendmsg'], "
        "[], 0, P)), ('connect', lambda: (s.connect(P), s.send(b'connect')))):\n"
        "    try:\n"
        "        call()\n"
        "        print('sent', way)\n"
        "    except OSError as e:\n"
        "        print('refused', way, e.errno)\n"
    )
    ex = executor(mode, tmp_path, workers=1)
    try:
        if mode == "namespaces" and ex.describe()["mode"] != "namespaces":
            pytest.skip("no namespaces here")
        r = ex.run_one(RunRequest(prog), LIMITS)
    finally:
        ex.close()
    got = []
    try:
        while True:
            got.append(listener.recv(64).decode())
    except OSError:
        pass
    finally:
        listener.close()
    if mode == "open":
        assert sorted(got) == ["connect", "sendmsg", "sendto"], (got, r.stdout, r.stderr)
    else:
        assert got == [] and r.status == "ok", (got, r.stdout, r.stderr)
        assert r.stdout.split("\n").count("sent sendto") == 0


def test_the_fallback_without_the_filter_is_not_isolated_and_require_isolation_refuses_it_by_name(monkeypatch):
    """The fallback counts as isolated only with unix socket addresses refused (the probe run checks it); without
    the filter it is missing its "pathname unix socket barrier", and require_isolation refuses it by that name."""
    whole = LocalExecutor(isolate=False)
    try:
        rep = whole.describe()
        assert rep["missing"] == [] and rep["unix_sockets"] == "refused", rep
    finally:
        whole.close()
    weak = LocalExecutor(isolate=False, seccomp=False)
    try:
        rep = weak.describe()
    finally:
        weak.close()
    assert rep["unix_sockets"].startswith("open (sendto"), rep["unix_sockets"]
    assert any(m.startswith("pathname unix socket barrier") for m in rep["missing"]), rep["missing"]
    monkeypatch.setattr(tests_reward, "LocalExecutor", lambda **kw: LocalExecutor(**kw, isolate=False, seccomp=False))
    with pytest.raises(tests_reward.SandboxUnavailable, match="pathname unix socket barrier"):
        tests_reward.executor_of(load_config(None, {"reward.types": ["tests"]}))


# ---------------------------------------------------------------------------------- collusion in one reward call
ORACLE = (
    "import os, socket, time\n"
    "def _tell(key, value):\n"
    "    for how in ('abstract', 'tmp'):\n"
    "        try:\n"
    "            if how == 'abstract':\n"
    "                s, _ = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)\n"
    "                s.sendto(repr(value).encode(), '\\0hx-oracle-{tag}-' + key)\n"
    "            else:\n"
    "                open('/tmp/hx-oracle-{tag}-' + key, 'w').write(repr(value))\n"
    "        except OSError:\n"
    "            pass\n"
)
COPYCAT = (
    "import ast, ctypes, os, socket, time\n"
    "def _ask(key):\n"
    "    a, _ = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)\n"
    "    ctypes.CDLL(None).connect(a.fileno(), bytes(16), 16)  # its peer's no more: anyone may send to it\n"
    "    try:\n"
    "        a.bind('\\0hx-oracle-{tag}-' + key)\n"
    "        a.settimeout(0.05)\n"
    "    except OSError:\n"
    "        a = None\n"
    "    end = time.monotonic() + 1.0\n"
    "    while time.monotonic() < end:\n"
    "        try:\n"
    "            return ast.literal_eval(open('/tmp/hx-oracle-{tag}-' + key).read())\n"
    "        except (OSError, ValueError, SyntaxError):\n"
    "            pass\n"
    "        try:\n"
    "            if a is not None:\n"
    "                return ast.literal_eval(a.recv(64).decode())\n"
    "        except OSError:\n"
    "            pass\n"
    "        time.sleep(0.02)\n"
    "    return None\n"
)


@pytest.mark.parametrize("mode", MODES)
def test_samples_of_one_reward_call_cannot_pool_what_they_learn(mode, tmp_path):
    """Eight samples in one call: one computes and publishes each answer (an abstract address per call, a /tmp
    file), seven compute nothing and ask for it. With the layers off the seven are paid (the control); in
    either mode they earn 0 and the one that computes its 5."""
    tag = secrets.token_hex(4)
    tests = ["assert mul(3, 4) == 12", "assert mul(5, 6) == 30", "assert mul(7, 0) == 0"]
    spec = json.dumps({"kind": "assert", "tests": tests, "entry_point": "mul"})
    oracle = ORACLE.format(tag=tag) + (
        "def mul(a, b):\n    time.sleep(0.3)\n    _tell(f'{a}-{b}', a * b)\n    return a * b\n"
    )
    copycats = [
        COPYCAT.format(tag=tag) + f"# sample {i}\ndef mul(a, b):\n    return _ask(f'{{a}}-{{b}}')\n" for i in range(7)
    ]
    cfg = load_config(None, {"reward.types": ["tests"], "sandbox.timeout_s": 8.0, "sandbox.cpu_s": 4.0})
    ex = executor(mode, tmp_path, workers=8)
    try:
        if mode == "namespaces" and ex.describe()["mode"] != "namespaces":
            pytest.skip("no namespaces here")
        reward = make_tests_reward(cfg, executor=ex)
        scores = reward(prompts=["mul"] * 8, completions=[oracle, *copycats], tests=[spec] * 8)
    finally:
        ex.close()
        for key in ("3-4", "5-6", "7-0"):
            Path(f"/tmp/hx-oracle-{tag}-{key}").unlink(missing_ok=True)
    assert scores[0] == 5.0
    if mode == "open":
        assert scores[1:] == [5.0] * 7, scores
    else:
        assert scores[1:] == [0.0] * 7, scores
