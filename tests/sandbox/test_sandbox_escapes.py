"""The local sandbox against an escape set written for it, in both modes: with namespaces (bubblewrap's root) and
the fallback without them (Landlock), each with the audit hook off so the kernel's layers hold alone.

Every program goes through the tests reward as a completion of an MBPP task (``add``). A program defines a
correct ``add`` only when its attack visibly worked from the inside (a connection made, a host token read, more
processes than allowed): contained, it raises or defines nothing and scores 0; escaped, it would score 5.
Attacks whose success cannot be seen from inside (a process that outlives the run, a full disk) define nothing;
for all of them the side effect is checked on the host: the listeners (TCP, UDP, a pathname and an abstract unix
socket), host files and dirs (/tmp, /var/tmp, /dev/shm, a file's content, mode, times, xattrs), the process
table (a marked daemon, a host process's signal handler), Shmem and SysV segments, disk and inodes, the key
counts and a canary key, the host's domain name. Nothing escapes, every score is 0, the reward never raises.
"""

from __future__ import annotations

import ctypes
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from hermes_lab.config.schema import load_config
from hermes_lab.rewards.tests import make_tests_reward
from hermes_lab.sandbox.local import LocalExecutor

from repo_paths import REPO

KEY = "sk-escape-SANDBOX-5c1e9a0b7d"
MBPP = json.dumps({"kind": "assert", "tests": ["assert add(1, 2) == 3", "assert add(2, 2) == 4"]})
MAX_PROCESSES = 8
LIMITS = {
    "reward.types": ["tests"],
    "sandbox.timeout_s": 3.0,
    "sandbox.cpu_s": 3.0,
    "sandbox.memory_mb": 256,
    "sandbox.file_mb": 16,
    "sandbox.max_processes": MAX_PROCESSES,
    "sandbox.max_output_kb": 64,
}
PRE = "import ctypes, os, signal, socket, sys, time\nlibc = ctypes.CDLL(None, use_errno=True)\nescaped = False\n"
END = "\nif escaped:\n    def add(a, b):\n        return a + b\n"


@dataclass
class Host:
    """What the host sets up for the attacks to aim at, and reads back after them."""

    tmp: Path  # a dir under /tmp anyone may write (0777): nothing may appear in it
    shm: Path  # the same under /dev/shm
    vartmp: Path  # and under /var/tmp
    file: Path  # a host file (0644): its content, mode, times and xattrs must not change
    token: str
    runs_file: Path  # runs/round-99/trajectories.jsonl of a project, holding the token
    home_file: Path  # a file under $HOME holding the token
    checkout_file: str
    port: int
    udp_port: int
    unix_path: str
    abstract: str
    victim: int  # a host process whose SIGURG handler writes victim_mark
    victim_mark: Path
    daemon_name: str
    canary: int  # a user key (readable by anyone) holding the token
    trainer: int


def programs(h: Host) -> dict[str, str]:
    """At least 25 attacks, by class; each a completion (see the module docstring)."""
    families = "[2, 10, 1, 16, 17, 40, 38, 31, 29, 30, 15, 44]"  # inet, inet6, unix, netlink, packet, vsock, alg, ...
    p = {
        # sockets of every family, and ways round the socket() call
        "tcp_127": f"s = socket.create_connection(('127.0.0.1', {h.port}), timeout=1)\ns.sendall(b'leak')\n"
        "escaped = True",
        "udp_127": f"u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
        f"u.sendto(b'leak', ('127.0.0.1', {h.udp_port}))\n"
        "escaped = True",
        "unix_host_path": f"c = socket.socket(socket.AF_UNIX)\nc.connect({h.unix_path!r})\nc.sendall(b'leak')\n"
        "escaped = True",
        "unix_abstract": f"c = socket.socket(socket.AF_UNIX)\nc.connect('\\0{h.abstract}')\nc.sendall(b'leak')\n"
        "escaped = True",
        "every_family": f"opened = [(f, t) for f in {families} for t in (1, 2, 3) if libc.socket(f, t, 0) >= 0]\n"
        "print(opened)\nescaped = bool(opened)",
        "socketpair_inet": "fds = (ctypes.c_int * 2)()\nescaped = libc.socketpair(2, 1, 0, fds) == 0",
        "io_uring": "params = (ctypes.c_ubyte * 120)()\nescaped = libc.syscall(425, 8, params) >= 0",
        "x32_abi_socket": "escaped = libc.syscall(0x40000000 | 41, 2, 1, 0) >= 0",
        # writes by every path kind
        "write_host_tmp": f"open({str(h.tmp / 'w.txt')!r}, 'w').write('x')\nescaped = True",
        "write_var_tmp": f"open({str(h.vartmp / 'w.txt')!r}, 'w').write('x')\nescaped = True",
        "write_dev_shm": f"open({str(h.shm / 'w.txt')!r}, 'w').write('x')\nescaped = True",
        "write_dir_fd": f"d = os.open({str(h.tmp)!r}, os.O_RDONLY | os.O_DIRECTORY)\n"
        "w = os.open('dirfd.txt', os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=d)\nos.write(w, b'x')\nescaped = True",
        "write_relative_symlink": f"os.symlink('../' * 24 + {str(h.tmp / 'symlink.txt')[1:]!r}, 'lnk')\n"
        "open('lnk', 'w').write('x')\nescaped = True",
        "hard_link_host_file": f"os.link({str(h.file)!r}, 'hl')\nopen('hl', 'w').write('changed')\nescaped = True",
        "chmod_host_file": f"os.chmod({str(h.file)!r}, 0o777)\nescaped = True",
        "utime_host_file": f"os.utime({str(h.file)!r}, (0, 0))\nescaped = True",
        "xattr_host_file": f"os.setxattr({str(h.file)!r}, 'user.escape', b'1')\nescaped = True",
        "rename_host_file": f"os.rename({str(h.file)!r}, {str(h.file) + '.moved'!r})\nescaped = True",
        "mount_over_tmp": "escaped = libc.mount(b'none', b'/tmp', b'tmpfs', 0, None) == 0",
        "new_user_namespace": "escaped = libc.unshare(0x10000000) == 0",
        # processes that outlive the run or reach the host's
        "daemon_outlives": "if os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
        f"        libc.prctl(15, {h.daemon_name.encode()!r}, 0, 0, 0)\n        time.sleep(60)\n    os._exit(0)\n"
        "time.sleep(0.2)",
        "fork_count": "n = 0\nfor _ in range(48):\n    try:\n        if os.fork() == 0:\n            time.sleep(1)\n"
        "            os._exit(0)\n        n += 1\n    except OSError:\n        break\n"
        f"print(n)\nescaped = n >= {MAX_PROCESSES}",
        "thread_count": "import threading\nok = 0\nfor _ in range(48):\n    try:\n"
        "        threading.Thread(target=time.sleep, args=(1,), daemon=True).start()\n        ok += 1\n"
        f"    except RuntimeError:\n        break\nprint(ok)\nescaped = ok >= {MAX_PROCESSES}",
        "signal_host_process": f"os.kill({h.victim}, signal.SIGURG)\nescaped = True",
        "signal_every_process": "os.kill(-1, signal.SIGURG)",  # SIGURG: ignored by default, harmless if it got out
        "ptrace_parent": "escaped = libc.ptrace(16, os.getppid(), 0, 0) == 0",
        "proc_mem_of_parent": f"open(f'/proc/{{os.getppid()}}/mem', 'rb')\nescaped = True\n"
        f"open('/proc/{h.trainer}/mem', 'rb')",
        # memory by every allocation kind
        "heap_1gb": "blob = bytearray(1 << 30)\nescaped = True",
        "processes_x_memory": "kids = []\nfor _ in range(6):\n    pid = os.fork()\n    if pid == 0:\n"
        "        b = bytearray(150 << 20)\n        time.sleep(1)\n        os._exit(0)\n    kids.append(pid)\n"
        "ok = sum(os.waitpid(k, 0)[1] == 0 for k in kids)\nprint(ok)\nescaped = ok == 6",
        "memfd_960mb": "fd = os.memfd_create('hold')\nos.ftruncate(fd, 960 << 20)\n"
        "for i in range(0, 960, 8):\n    os.pwrite(fd, b'x' * (8 << 20), i << 20)\nescaped = True",
        "dev_shm_600mb": "f = open('/dev/shm/big', 'wb')\nfor _ in range(75):\n    f.write(b'x' * (8 << 20))\n"
        "f.flush()\nescaped = True",
        "mmap_shared_600mb": "import mmap\nm = mmap.mmap(-1, 600 << 20, mmap.MAP_SHARED)\n"
        "for i in range(0, 600 << 20, 4096):\n    m[i] = 1\nescaped = True",
        "sysv_shm": "escaped = libc.shmget(0, 512 << 20, 0o1000 | 0o600) >= 0",
        # disk
        "disk_fill": "n = 0\ntry:\n    while n < 128:\n        open(f'f{n}', 'wb').write(b'x' * (8 << 20))\n"
        "        n += 1\n"
        "except OSError:\n    pass\nprint(n)",
        "inode_fill": "n = 0\ntry:\n    while n < 20000:\n        open(f'i{n}', 'w').close()\n        n += 1\n"
        "except OSError:\n    pass\nprint(n)",
        "deep_tree": "for _ in range(2500):\n    os.mkdir('d')\n    os.chdir('d')",
        # keyrings
        "keyring_leave_token": "escaped = libc.syscall(248, b'user', b'hermes-escape', b'token', 5, -4) >= 0",
        "keyring_read_canary": f"buf = ctypes.create_string_buffer(256)\n"
        f"n = libc.syscall(250, 11, {h.canary}, buf, 256)\n"
        f"escaped = n > 0 and {h.token!r}.encode() in buf.raw",
        # secrets, /proc, the checkout, runs/, $HOME
        "env_secret": f"print(dict(os.environ))\nescaped = any({KEY!r} in v for v in os.environ.values())",
        "proc_trainer_environ": f"escaped = {KEY!r}.encode() in open('/proc/{h.trainer}/environ', 'rb').read()",
        "proc_scan_environ": "found = []\nfor p in os.listdir('/proc'):\n    try:\n"
        "        found.append(open(f'/proc/{p}/environ', 'rb').read())\n    except OSError:\n        pass\n"
        f"escaped = any({KEY!r}.encode() in e for e in found)",
        "proc_sys_domainname": "open('/proc/sys/kernel/domainname', 'w').write('hermes-escape')\nescaped = True",
        "read_checkout": f"print(open({h.checkout_file!r}).read()[:100])\nescaped = True",
        "read_runs": f"escaped = {h.token!r} in open({str(h.runs_file)!r}).read()",
        "read_home": f"escaped = {h.token!r} in open({str(h.home_file)!r}).read()",
        "list_root": "escaped = any(n != '.pyenv' for n in os.listdir('/root'))",
    }
    return {name: PRE + body + END for name, body in p.items()}


# ------------------------------------------------------------------------------------------- the host side
class Listeners:
    """A TCP and a UDP socket on 127.0.0.1, a pathname and an abstract unix socket; counts what reaches them."""

    def __init__(self, tmp: Path):
        self.tcp = socket.socket()
        self.tcp.bind(("127.0.0.1", 0))
        self.tcp.listen(16)
        self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.udp.bind(("127.0.0.1", 0))
        self.unix_path = str(tmp / "host.sock")
        self.unix = socket.socket(socket.AF_UNIX)
        self.unix.bind(self.unix_path)
        os.chmod(self.unix_path, 0o777)
        self.unix.listen(16)
        self.abstract_name = f"hermes-escape-{secrets.token_hex(4)}"
        self.abstract = socket.socket(socket.AF_UNIX)
        self.abstract.bind("\0" + self.abstract_name)
        self.abstract.listen(16)
        self.hits = 0
        self._stop = False
        self.threads = [threading.Thread(target=self._loop, args=(s,), daemon=True) for s in self.all]
        for t in self.threads:
            t.start()

    @property
    def all(self) -> list[socket.socket]:
        return [self.tcp, self.udp, self.unix, self.abstract]

    def _loop(self, s: socket.socket) -> None:
        s.settimeout(0.1)
        while not self._stop:
            try:
                if s.type == socket.SOCK_DGRAM:
                    s.recv(64)
                else:
                    s.accept()[0].close()
            except OSError:
                continue
            self.hits += 1

    def close(self) -> None:
        self._stop = True
        for t in self.threads:
            t.join(2)
        for s in self.all:
            s.close()


def _key_counts() -> dict[str, str]:
    """/proc/key-users: keys per uid (a key left by a run would add one)."""
    out = {}
    for line in Path("/proc/key-users").read_text().splitlines():
        uid, _, rest = line.strip().partition(":")
        out[uid] = rest.split()[1]
    return out


def _shmem_kb() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("Shmem:"):
            return int(line.split()[1])
    return 0


def _comm_pids(name: str) -> list[int]:
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if (p / "comm").read_text().strip() == name:
                    out.append(int(p.name))
            except OSError:
                pass
    return out


def _add_canary(token: str) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    serial = libc.syscall(248, b"user", b"hermes-canary", token.encode(), len(token), -4)  # add_key to @u
    assert serial > 0, os.strerror(ctypes.get_errno())
    libc.syscall(250, 5, serial, 0x3F3F3F3F)  # KEYCTL_SETPERM: anyone may read it, if a run could ask
    return serial


def _drop_canary(serial: int) -> None:
    ctypes.CDLL(None).syscall(250, 21, serial)  # KEYCTL_INVALIDATE


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    base = tmp_path_factory.mktemp("escape")
    base.chmod(0o755)
    tag = secrets.token_hex(4)
    dirs = [base / "tmp", Path(f"/dev/shm/hermes-escape-{tag}"), Path(f"/var/tmp/hermes-escape-{tag}")]
    for d in dirs:
        d.mkdir()
        d.chmod(0o777)  # even a dir anyone may write to stays out of reach
    token = secrets.token_hex(16)
    hfile = base / "host_file.txt"
    hfile.write_text(token)
    hfile.chmod(0o644)
    runs = base / "project" / "runs" / "round-99" / "trajectories.jsonl"
    runs.parent.mkdir(parents=True)
    runs.write_text(json.dumps({"answer": token}) + "\n")
    home = Path.home() / ".cache" / "hermes-lab" / f"escape-token-{tag}"
    home.parent.mkdir(parents=True, exist_ok=True)
    home.write_text(token)
    mark = base / "victim-hit"
    victim = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import signal, sys, time\n"
            f"signal.signal(signal.SIGURG, lambda *a: open({str(mark)!r}, 'w').write('hit'))\ntime.sleep(300)",
        ]
    )
    listeners = Listeners(base)
    canary = _add_canary(token)
    h = Host(
        tmp=dirs[0],
        shm=dirs[1],
        vartmp=dirs[2],
        file=hfile,
        token=token,
        runs_file=runs,
        home_file=home,
        checkout_file=str(REPO / "pyproject.toml"),
        port=listeners.tcp.getsockname()[1],
        udp_port=listeners.udp.getsockname()[1],
        unix_path=listeners.unix_path,
        abstract=listeners.abstract_name,
        victim=victim.pid,
        victim_mark=mark,
        daemon_name=f"hx{tag}",
        canary=canary,
        trainer=os.getpid(),
    )
    yield h, listeners
    listeners.close()
    victim.kill()
    victim.wait()
    _drop_canary(canary)
    home.unlink()
    for d in dirs[1:]:
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("mode", ["namespaces", "fallback"])
def test_the_escape_set_is_contained_in_both_modes(mode, host, monkeypatch, tmp_path):
    h, listeners = host
    monkeypatch.setenv("TAOTOKEN_API_KEY", KEY)
    work_root = tmp_path / "runs-root"  # the fallback's work dirs: every one must be gone after
    work_root.mkdir()
    ex = LocalExecutor(workers=2, isolate=mode == "namespaces", guard=False, tmp_root=str(work_root))
    rep = ex.describe()
    if mode == "namespaces" and rep["mode"] != "namespaces":
        pytest.skip(f"no namespaces here: {rep.get('namespaces')}")
    assert rep["missing"] == [], rep["missing"]  # every layer holds here: the set tests them, not their absence
    cases = programs(h)
    assert len(cases) >= 25
    file_before = (h.file.read_text(), h.file.stat().st_mode, h.file.stat().st_mtime_ns, os.listxattr(h.file))
    keys_before, shm_before = _key_counts(), _shmem_kb()
    sysv_before = Path("/proc/sysvipc/shm").read_text()
    disk_before = {p: shutil.disk_usage(p).used for p in ("/", "/dev/shm")}
    domain_before = Path("/proc/sys/kernel/domainname").read_text()
    reward = make_tests_reward(load_config(None, LIMITS), executor=ex)
    t0 = time.monotonic()
    try:
        scores = reward(
            prompts=["add"] * (len(cases) + 1),
            completions=[*cases.values(), "def add(a, b):\n    return a + b\n"],
            tests=[MBPP] * (len(cases) + 1),
        )
    finally:
        ex.close()
    took = time.monotonic() - t0
    by_case = dict(zip([*cases, "honest"], scores))
    assert by_case.pop("honest") == 5.0  # the same tests pay honest code: the zeros are the attacks'
    assert by_case == dict.fromkeys(cases, 0.0), {k: v for k, v in by_case.items() if v}
    time.sleep(0.3)
    # on the host: nothing reached a listener, no file appeared or changed, no process is left or was signalled
    assert listeners.hits == 0
    assert [list(d.iterdir()) for d in (h.tmp, h.shm, h.vartmp)] == [[], [], []]
    assert (h.file.read_text(), h.file.stat().st_mode, h.file.stat().st_mtime_ns, os.listxattr(h.file)) == file_before
    assert not Path(str(h.file) + ".moved").exists()
    assert not h.victim_mark.exists() and _comm_pids(h.daemon_name) == []
    assert _key_counts() == keys_before  # no key left by a run, for any user
    assert Path("/proc/sysvipc/shm").read_text() == sysv_before
    assert _shmem_kb() - shm_before < 64 << 10  # no memfd, /dev/shm file or tmpfs of a run holds memory now
    for p, used in disk_before.items():  # nothing written stays (other work on the machine moves it a little)
        assert shutil.disk_usage(p).used - used < 200 << 20, p
    assert Path("/proc/sys/kernel/domainname").read_text() == domain_before
    assert list(work_root.iterdir()) == []  # every run's work dir removed (the 2,500-deep tree too)
    tally = reward.sandbox.to_dict()
    assert KEY not in json.dumps(tally) and h.token not in json.dumps(tally)
    assert took < 40, took
