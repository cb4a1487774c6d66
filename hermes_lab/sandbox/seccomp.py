"""The local sandbox's seccomp filter: which system calls a run may not make, built with libseccomp.

Stage: train (the tests reward) and every stage that scores code. Reads and writes nothing; the trainer builds
the filter once per executor (``filter_bpf``) and the launcher loads it, as classic BPF, into each run's program
process last, before the program starts (``hermes_lab.sandbox.confine.Kernel.seccomp``), in every mode, with
namespaces or without them.

    python -c "from hermes_lab.sandbox import seccomp; print(seccomp.describe(), len(seccomp.filter_bpf()))"

The filter allows by default and refuses (EPERM) what a program that computes an answer never needs and an
attacker does: every socket but an AF_UNIX socketpair, and any address for that one (bind, connect, sendto with
an address, sendmsg: no message or descriptor to another run or a host's listener), memory the
run's cgroup would not see or that outlives it (memfd, SysV shared memory), state shared across runs (keyrings,
SysV IPC, POSIX message queues), other processes (ptrace, process_vm_*, pidfd_getfd), new namespaces and
mounts, what one run could see of another through a file both read (flock, F_GETLK, inotify, fanotify, dnotify,
leases), and the kernel's larger attack surfaces (io_uring, which can open sockets past seccomp; bpf,
perf_event_open, userfaultfd; modules, kexec, reboot, clocks). ``clone3`` answers ENOSYS, so the C library
falls back to ``clone``, whose flags a filter can see (a clone asking for a namespace is refused). Syscalls of
another ABI (x32, i386 on x86_64) kill the process: libseccomp's architecture check.
"""

from __future__ import annotations

import contextlib
import errno
import socket
import tempfile

# why each group is refused (doctor and docs/sandbox.md say it in these words)
REFUSED: dict[str, tuple[str, ...]] = {
    "network (every socket but socketpair(AF_UNIX))": ("socket",),
    "memory outside the run's cgroup or outliving it": ("memfd_create", "memfd_secret", "shmget", "shmat", "shmctl"),
    "state shared across runs": (
        "add_key",
        "request_key",
        "keyctl",
        "msgget",
        "msgsnd",
        "msgrcv",
        "msgctl",
        "semget",
        "semop",
        "semtimedop",
        "semctl",
        "mq_open",
        "mq_unlink",
        "mq_timedsend",
        "mq_timedreceive",
        "mq_notify",
        "mq_getsetattr",
    ),
    # a socketpair talks to its peer only; an address (abstract or a path) reaches another run or a host's
    # listener, a descriptor sent reaches whoever receives it: the harness needs none of these (pipes)
    "unix socket addresses and descriptors passed": (
        "bind",
        "connect",
        "listen",
        "accept",
        "accept4",
        "sendmsg",
        "sendmmsg",
    ),
    # what one run can see of another through a file both may read (the interpreter's): a lock held, a watch
    "channels through shared files": ("flock", "inotify_add_watch", "fanotify_mark"),
    "other processes": ("ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "kcmp", "process_madvise"),
    "namespaces and mounts": (
        "unshare",
        "setns",
        "mount",
        "umount2",
        "pivot_root",
        "chroot",
        "move_mount",
        "open_tree",
        "fsopen",
        "fsconfig",
        "fsmount",
        "fspick",
        "mount_setattr",
    ),
    "the kernel's larger surfaces": (
        "io_uring_setup",
        "io_uring_enter",
        "io_uring_register",
        "bpf",
        "perf_event_open",
        "userfaultfd",
        "kexec_load",
        "kexec_file_load",
        "init_module",
        "finit_module",
        "delete_module",
        "reboot",
        "swapon",
        "swapoff",
        "syslog",
        "acct",
        "quotactl",
        "quotactl_fd",
        "lookup_dcookie",
        "open_by_handle_at",
        "name_to_handle_at",
        "iopl",
        "ioperm",
        "settimeofday",
        "clock_settime",
        "clock_adjtime",
        "adjtimex",
        "sethostname",
        "setdomainname",
        "vhangup",
        "uselib",
        "fanotify_init",
    ),
}
# without namespaces the run sees the host's tree through Landlock, which does not govern a file's mode, owner,
# times, extended attributes or inode flags: those changes by path are refused too (by descriptor they stay:
# a descriptor is only had through an open Landlock allowed)
BY_PATH_ATTRIBUTES = (
    "chmod",
    "fchmodat",
    "fchmodat2",
    "chown",
    "lchown",
    "fchownat",
    "utime",
    "utimes",
    "futimesat",
    "setxattr",
    "lsetxattr",
    "removexattr",
    "lremovexattr",
    "setxattrat",
    "removexattrat",
)
FS_IOC_SETFLAGS, FS_IOC_FSSETXATTR = 0x40086602, 0x401C5820
NAMESPACE_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000, 0x80)
TIOCSTI, TIOCLINUX = 0x5412, 0x541C  # push input into a terminal; the console's own ioctl
# fcntl commands that reach past the run's own files: another's lock on a file both read (F_GETLK, F_OFD_GETLK),
# leases and directory notifications (F_SETLEASE, F_NOTIFY), SIGIO sent to a process of one's choosing
F_GETLK, F_SETOWN, F_SETOWN_EX, F_OFD_GETLK, F_SETLEASE, F_NOTIFY = 5, 8, 15, 36, 1024, 1026
FCNTL_REFUSED = (F_GETLK, F_SETOWN, F_SETOWN_EX, F_OFD_GETLK, F_SETLEASE, F_NOTIFY)


class SeccompUnavailable(RuntimeError):
    """libseccomp (Debian: libseccomp2) or its binding (pyseccomp) is missing: the filter cannot be built."""


def refused_count() -> int:
    # + clone with a namespace flag, clone3, socketpair other than AF_UNIX, sendto an address, fcntl's commands
    return sum(len(v) for v in REFUSED.values()) + 5


def filter_bpf(landlocked: bool = False) -> bytes:
    """The filter as classic BPF for this machine's architecture (``SeccompUnavailable`` when libseccomp or
    its binding is missing). ``landlocked``: the mode without namespaces, which also refuses
    ``BY_PATH_ATTRIBUTES`` and the inode-flag ioctls. Built once per executor: about a millisecond."""
    try:
        import pyseccomp as sc
    except (ImportError, RuntimeError, OSError) as e:  # pyseccomp raises RuntimeError without libseccomp.so
        raise SeccompUnavailable(f"libseccomp is not usable here ({e}); Debian: apt-get install libseccomp2") from e
    f = sc.SyscallFilter(defaction=sc.ALLOW)
    deny = sc.ERRNO(errno.EPERM)
    groups = [*REFUSED.values(), BY_PATH_ATTRIBUTES] if landlocked else list(REFUSED.values())
    for names in groups:
        for name in names:
            with contextlib.suppress(OSError, RuntimeError, ValueError):  # a syscall unknown here: none to refuse
                f.add_rule(deny, name)
    f.add_rule(deny, "socketpair", sc.Arg(0, sc.NE, socket.AF_UNIX))
    f.add_rule(deny, "sendto", sc.Arg(4, sc.NE, 0))  # an address: send() (no address) to the peer stays
    for cmd in FCNTL_REFUSED:
        f.add_rule(deny, "fcntl", sc.Arg(1, sc.EQ, cmd))
    for flag in NAMESPACE_FLAGS:
        f.add_rule(deny, "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")  # its flags live in memory no filter reads: use clone
    if landlocked:
        f.add_rule(deny, "utimensat", sc.Arg(1, sc.NE, 0))  # a path; futimens (no path) stays
    for req in (TIOCSTI, TIOCLINUX, *((FS_IOC_SETFLAGS, FS_IOC_FSSETXATTR) if landlocked else ())):
        f.add_rule(deny, "ioctl", sc.Arg(1, sc.MASKED_EQ, 0xFFFFFFFF, req))
    with tempfile.TemporaryFile() as out:
        f.export_bpf(out)
        out.seek(0)
        bpf = out.read()
    if not bpf or len(bpf) % 8:
        raise SeccompUnavailable(f"libseccomp exported {len(bpf)} bytes, not a BPF program")
    return bpf


def describe() -> str:
    groups = "; ".join(REFUSED)
    return f"{refused_count()} system calls refused ({groups})"
