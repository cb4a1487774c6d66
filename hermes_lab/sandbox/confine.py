"""The kernel calls that confine one run, for ``hermes_lab.sandbox.launcher`` (inside the sandbox, stdlib only).

Stage: train (the tests reward) and every stage that scores code. Reads and writes nothing but the run's own
private mounts; imported by the launcher under ``python -I -S`` (no hermes_lab import: it runs in the sandbox
interpreter, which may be another virtualenv's).

    Kernel().seccomp(bpf)         # what the launcher calls, in this order, in the program's process

What each layer does, and what it is for:

- ``private_mounts``: a size- and inode-capped tmpfs on the work dir, /tmp and /dev/shm of the run's own mount
  namespace (a fresh one per run, so nothing written survives it), a devpts instance of its own (no pty of one
  run is another's), bubblewrap's shared root and /dev read-only, and a /proc of its own pid namespace.
- ``drop_privileges``: as root, the program runs as ``nobody`` with no groups; otherwise with every capability
  gone from every set, the bounding set and ambient ones included, and ``SECBIT_NOROOT`` locked (an exec never
  gives them back); ``no_new_privs`` either way.
- ``rlimits``: CPU seconds, address space, file size, open files, no core dumps; processes only where no pids
  cgroup counts them (RLIMIT_NPROC counts a user's processes machine-wide, so it is no per-run limit).
- ``landlock`` (the mode without namespaces): a Landlock domain of the run's own: the interpreter, the system
  libraries and a few /etc files read-only, the work dir the one place it may write; no TCP bind or connect,
  no abstract unix socket or signal outside its own domain (another run, the trainer, any host process).
- ``seccomp``: a BPF program built by ``hermes_lab.sandbox.seccomp`` (libseccomp) in the trainer, loaded last:
  no socket but socketpair(AF_UNIX), no memfd, keyring, ptrace, namespace, mount, io_uring, bpf, SysV IPC.
- ``install_guard``: the Python audit hook, a second layer above the kernel's: it refuses sockets, starting
  programs, signals outside the run and writes outside its dirs before the kernel is even asked.
"""

import contextlib
import ctypes
import os
import resource
import stat
import sys

NOBODY = 65534
CLONE_NEWNS, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x20000000, 0x40000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_PRIVATE = 2, 4, 8, 16384, 1 << 18
MS_RDONLY, MS_REMOUNT, MS_BIND, MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1, 32, 4096, 1024, 2048, 1 << 21
ST_RELATIME = 4096  # statvfs's f_flag for relatime (the other flags it shares share MS_*'s values)
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 1, 4, 38
PR_CAPBSET_DROP, PR_SET_SECUREBITS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 24, 28, 47, 4
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446
LANDLOCK_RULE_PATH_BENEATH, LANDLOCK_CREATE_RULESET_VERSION = 1, 1
PRIVATE_TMP = ("/tmp", "/dev/shm")
TMPFS_INODES = 4096

# Landlock's filesystem rights by the ABI that brought them (1: 13 rights; 2 REFER, 3 TRUNCATE, 5 IOCTL_DEV)
FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR = 1, 2, 4, 8
FS_ALL_BY_ABI = {1: (1 << 13) - 1, 2: (1 << 14) - 1, 3: (1 << 15) - 1, 5: (1 << 16) - 1}
FS_FILE_RIGHTS = FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | (1 << 14) | (1 << 15)  # those a file rule may hold
FS_TRUNCATE = 1 << 14
NET_BIND_TCP, NET_CONNECT_TCP = 1, 2
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1, 2


class Kernel:
    """The libc calls Python's os module lacks (unshare, mount, prctl, capset, Landlock, seccomp), via ctypes."""

    def __init__(self):
        self.libc = ctypes.CDLL(None, use_errno=True)

    def _check(self, rc, what):
        if rc != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{what}: {os.strerror(err)}")

    def unshare(self, flags):
        self._check(self.libc.unshare(flags), "unshare")

    def mount(self, src, target, fstype, flags, data=None):
        enc = lambda s: s.encode() if s is not None else None  # noqa: E731
        rc = self.libc.mount(enc(src), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data))
        self._check(rc, f"mount {target}")

    def prctl(self, option, arg, arg2=0):
        rc = self.libc.prctl(option, ctypes.c_ulong(arg), ctypes.c_ulong(arg2), 0, 0)
        self._check(rc, f"prctl {option}")

    # ------------------------------------------------------------------------------------------- mounts
    def private_mounts(self, work, size_mb, uid):
        """In a fresh mount namespace: the work dir, /tmp and /dev/shm as tmpfs of ``size_mb`` each and
        TMPFS_INODES files at most, owned by the user the program runs as; a devpts instance of the run's own on
        /dev/pts (bubblewrap's one served every run: a pty one run opened, another could open and read)."""
        self.mount(None, "/", None, MS_REC | MS_PRIVATE)
        opts = f"size={max(1, size_mb)}m,nr_inodes={TMPFS_INODES},uid={uid},gid={uid}"
        self.mount("tmpfs", work, "tmpfs", MS_NOSUID | MS_NODEV, f"mode=0700,{opts}")
        for d in PRIVATE_TMP:
            self.mount("tmpfs", d, "tmpfs", MS_NOSUID | MS_NODEV, f"mode=1777,{opts}")
        # /dev/ptmx is bubblewrap's link to pts/ptmx: it opens this instance's
        self.mount("devpts", "/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666,mode=0600")
        # bubblewrap's root and /dev are tmpfs every run shares, and uid 0 of a user namespace (a user's runs) owns
        # them: read-only in this run's mount namespace, nothing one run makes there (a file, a FIFO) another sees
        for d in ("/", "/dev"):
            self.remount_read_only(d)

    def remount_read_only(self, path):
        """This mount namespace's mount at ``path`` read-only, its other flags kept (a user namespace locks
        nosuid, nodev, noexec and the atime ones: a remount that dropped one would be refused)."""
        f = os.statvfs(path).f_flag
        keep = f & (MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_NOATIME | MS_NODIRATIME)
        keep |= MS_RELATIME if f & ST_RELATIME else 0
        self.mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | keep)

    def mount_proc(self):
        """A /proc of this pid namespace (the caller is its pid 1): only the run's own processes in it."""
        self.mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)

    # --------------------------------------------------------------------------------------- privileges
    def drop_privileges(self, to_nobody):
        """As root: nobody, no groups (every capability goes with the uid). Otherwise: the same uid, no
        capability in any set. ``no_new_privs`` either way, and the parent-death signal (setuid clears it)."""
        if to_nobody:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
        else:
            self.drop_capabilities()
        self.prctl(PR_SET_NO_NEW_PRIVS, 1)
        self.prctl(PR_SET_PDEATHSIG, 9)

    def drop_capabilities(self):
        """No capability, now or after an exec (uid 0 keeps its files' ownership, never a capability)."""
        for cap in range(64):
            if self.libc.prctl(PR_CAPBSET_DROP, ctypes.c_ulong(cap), 0, 0, 0) != 0:
                break  # past the last capability this kernel knows
        self.libc.prctl(PR_CAP_AMBIENT, ctypes.c_ulong(PR_CAP_AMBIENT_CLEAR_ALL), 0, 0, 0)
        noroot = 0x01 | 0x02 | 0x04 | 0x08  # SECBIT_NOROOT(+_LOCKED), SECBIT_NO_SETUID_FIXUP(+_LOCKED)
        self.libc.prctl(PR_SET_SECUREBITS, ctypes.c_ulong(noroot), 0, 0, 0)

        class Header(ctypes.Structure):
            _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

        class Data(ctypes.Structure):
            _fields_ = [
                ("effective", ctypes.c_uint32),
                ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32),
            ]

        self._check(self.libc.capset(ctypes.byref(Header(0x20080522, 0)), (Data * 2)()), "capset")

    # ------------------------------------------------------------------------------------------ Landlock
    def landlock_abi(self):
        """The kernel's Landlock ABI version; 0 when it has none (not built in, or not an active LSM)."""
        rc = self.libc.syscall(SYS_LANDLOCK_CREATE_RULESET, None, 0, LANDLOCK_CREATE_RULESET_VERSION)
        return max(0, rc)

    def landlock(self, read_only, writable, abi):
        """Restrict this process and its children to ``read_only`` (read, list, execute) and ``writable``
        (everything) paths; every other path is out of reach. ABI 4+: no TCP bind or connect. ABI 6+: no
        abstract unix socket and no signal outside this domain. Needs no_new_privs (set before)."""
        fs_all = FS_ALL_BY_ABI[max(k for k in FS_ALL_BY_ABI if k <= abi)]
        net = NET_BIND_TCP | NET_CONNECT_TCP if abi >= 4 else 0
        scoped = SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL if abi >= 6 else 0
        attr = (ctypes.c_uint64 * 3)(fs_all, net, scoped)
        size = 8 if abi < 4 else (16 if abi < 6 else 24)
        ruleset = self.libc.syscall(SYS_LANDLOCK_CREATE_RULESET, ctypes.byref(attr), size, 0)
        if ruleset < 0:
            self._check(-1, "landlock_create_ruleset")
        try:
            read = FS_EXECUTE | FS_READ_FILE | FS_READ_DIR
            for paths, rights in ((read_only, read), (writable, fs_all)):
                for path in paths:
                    self._landlock_rule(ruleset, path, rights & fs_all)
            self._check(self.libc.syscall(SYS_LANDLOCK_RESTRICT_SELF, ruleset, 0), "landlock_restrict_self")
        finally:
            os.close(ruleset)

    def _landlock_rule(self, ruleset, path, rights):
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            return  # a path this machine lacks: nothing to allow
        try:
            if not stat.S_ISDIR(os.fstat(fd).st_mode):
                rights &= FS_FILE_RIGHTS
            rule = (ctypes.c_ubyte * 12)()  # struct landlock_path_beneath_attr: u64 allowed, s32 fd, packed
            ctypes.c_uint64.from_buffer(rule, 0).value = rights
            ctypes.c_int32.from_buffer(rule, 8).value = fd
            rc = self.libc.syscall(SYS_LANDLOCK_ADD_RULE, ruleset, LANDLOCK_RULE_PATH_BENEATH, rule, 0)
            self._check(0 if rc == 0 else -1, f"landlock_add_rule {path}")
        finally:
            os.close(fd)

    # ------------------------------------------------------------------------------------------- seccomp
    def seccomp(self, bpf):
        """Load a classic BPF program (libseccomp's export, 8 bytes an instruction) as this thread's filter.
        Every later child inherits it; it cannot be removed."""

        class SockFprog(ctypes.Structure):
            _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

        buf = ctypes.create_string_buffer(bytes(bpf), len(bpf))
        prog = SockFprog(len(bpf) // 8, ctypes.cast(buf, ctypes.c_void_p))
        rc = self.libc.prctl(PR_SET_SECCOMP, ctypes.c_ulong(SECCOMP_MODE_FILTER), ctypes.byref(prog), 0, 0)
        self._check(rc, "seccomp filter")


def rlimits(job, count_processes):
    """The run's rlimits; RLIMIT_NPROC only when ``count_processes`` (no pids cgroup): then it is the
    user's current count (``job["nproc_base"]``) plus max_processes, the best a per-user counter can do."""
    cpu = max(1, int(job["cpu_s"] + 0.999))
    mem = job["memory_mb"] << 20
    limits = [
        (resource.RLIMIT_CPU, cpu, cpu + 1),  # SIGXCPU at the soft limit, SIGKILL at the hard one
        (resource.RLIMIT_AS, mem, mem),
        (resource.RLIMIT_FSIZE, job["file_mb"] << 20, job["file_mb"] << 20),
        (resource.RLIMIT_NOFILE, job["max_files"], job["max_files"]),
        (resource.RLIMIT_CORE, 0, 0),
    ]
    if count_processes:
        n = job.get("nproc_base", 0) + job["max_processes"]
        limits.append((resource.RLIMIT_NPROC, n, n))
    for what, soft, hard in limits:
        resource.setrlimit(what, (soft, hard))
    return {"cpu_s": cpu, "memory_mb": job["memory_mb"], "file_mb": job["file_mb"]}


def count_processes(uid):
    """Processes of ``uid`` now, machine-wide (what RLIMIT_NPROC counts)."""
    n = 0
    for name in os.listdir("/proc"):
        if name.isdigit():
            with contextlib.suppress(OSError):
                n += os.stat(f"/proc/{name}").st_uid == uid
    return n


# ------------------------------------------------------------------------------------------------ guard
def install_guard(work):
    """The audit hook. A denied event raises PermissionError inside the program, which may catch it: what it
    tried did not happen either way. It is a Python-level layer (code in the run can reach it); the kernel's
    layers above hold without it."""
    allowed = tuple(os.path.join(d, "") for d in (work, *PRIVATE_TMP, "/var/tmp"))
    pgrp, me = os.getpgrp(), str(os.getpid())
    # ctypes stays importable: a harness sets PR_SET_DUMPABLE through it, and what ctypes could reach (raw
    # syscalls) the seccomp filter and the namespaces or Landlock refuse whatever the language
    deny = ("socket.", "subprocess.", "os.exec", "os.posix_spawn", "os.spawn", "os.system", "pty.")
    deny_import = {"_posixsubprocess"}  # fork_exec raises no audit event of its own
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
            if event == "socket.__new__" and args[1] == 1:  # AF_UNIX: socketpair() wraps its two this way
                return  # (socket(AF_UNIX) itself the seccomp filter refuses)
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
