"""The sandbox's launcher: a stdlib-only script, run as root with ``python -I -S launcher.py``, that
sets up one call's isolation and runs the code in it. It is a separate script (not imported by the
rollout process) because everything here happens after a fork: namespaces, mounts, chroot, setuid.

It reads one job (JSON) on stdin and writes one status (JSON) to the pipe ``job["status_fd"]``. stdout and stderr are the
code's own, passed through to the caller. With ``isolated``:

outer launcher (host namespaces) --unshare(net, mount, pid, ipc)--> fork -> init (pid 1 of the new pid
namespace: builds the new root, forks the code, enforces the wall clock, then kills every process
left in the namespace) -> the code (an unprivileged uid, rlimits, chroot, empty environment, a fresh
session keyring). The IPC namespace dies with its last process, and every SysV shared-memory segment,
message queue and semaphore set the code made dies with it.

Without ``isolated`` (no namespaces on this kernel, or not root), the init step runs in the host
namespaces with the job's scratch directory as the working directory; the caller then kills the
uid's leftover processes (kill(-1) here would kill the host's processes).
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import platform
import resource
import signal
import sys
import time

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x08000000, 0x20000000, 0x40000000
NAMESPACES = CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWPID | CLONE_NEWNET
# keyctl(2) has no glibc wrapper: the syscall's number per architecture
SYS_KEYCTL = {"x86_64": 250, "aarch64": 219, "riscv64": 219, "ppc64le": 311, "s390x": 280, "i686": 288}
KEYCTL_JOIN_SESSION_KEYRING, KEYCTL_CLEAR = 1, 7
KEY_SPEC_USER_KEYRING, KEY_SPEC_USER_SESSION_KEYRING = -4, -5
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 1, 36
DEVICES = ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/random")
SYSTEM_PATHS = ("/usr", "/bin", "/lib", "/lib64", "/sbin", "/etc/ld.so.cache", "/etc/localtime")
CODE_FILE, STDIN_FILE = "main.py", ".stdin"

_libc = ctypes.CDLL(None, use_errno=True)
_status_fd = -1  # the caller's pipe for the status (job["status_fd"])


class _WallClock(Exception):
    pass


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _bytes(text: str | None) -> bytes | None:
    return text.encode() if text is not None else None


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = _bytes
    _check(_libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)), f"mount {target}")


def _bind_read_only(path: str, root: str) -> None:
    """``path`` appears at the same place under ``root``, read-only (a symlink stays a symlink)."""
    if not os.path.lexists(path):
        return
    target = root + path
    os.makedirs(os.path.dirname(target), exist_ok=True)
    if os.path.islink(path) and os.path.dirname(path) == "/":  # merged /usr: /bin -> usr/bin
        os.symlink(os.readlink(path), target)
        return
    real = os.path.realpath(path)
    if os.path.isdir(real):
        os.makedirs(target, exist_ok=True)
    elif not os.path.exists(target):
        open(target, "w").close()
    _mount(real, target, None, MS_BIND | MS_REC)
    # a bind mount only turns read-only on a remount
    _mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _submounts_read_only(root: str) -> None:
    """A recursive bind brings the mounts below a path along, writable as they were: remount each
    read-only too (the remount in _bind_read_only reaches only the top one)."""
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f]
    for point in points:
        point = point.replace("\\040", " ")
        if point.startswith(root + "/"):
            _mount(None, point, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _build_root(job: dict) -> str:
    """A tmpfs root holding read-only binds of the system and the interpreter, the devices the code
    may need, a fresh /proc, and a size-limited tmpfs /scratch owned by the code's uid; returns it."""
    root = job["root"]
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing here propagates back to the host
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    for path in SYSTEM_PATHS + tuple(job["readonly_paths"]):
        _bind_read_only(path, root)
    _submounts_read_only(root)
    os.makedirs(root + "/dev")
    for device in DEVICES:
        if os.path.exists(device):
            open(root + device, "w").close()
            _mount(device, root + device, None, MS_BIND)
    os.makedirs(root + "/proc")
    _mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.makedirs(root + "/scratch")
    uid = job["uid"]
    _mount("tmpfs", root + "/scratch", "tmpfs", MS_NOSUID | MS_NODEV,
           f"size={job['scratch_mb']}m,mode=700,uid={uid},gid={uid}")
    if not os.path.lexists(root + "/tmp"):  # a readonly path under /tmp made it a directory already
        os.symlink("scratch", root + "/tmp")
    _write_inputs(job, root + "/scratch")
    _mount(None, root, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)  # only /scratch stays writable
    os.chroot(root)
    return "/scratch"


def _write_inputs(job: dict, scratch: str) -> None:
    for name, text in ((CODE_FILE, job["code"]), (STDIN_FILE, job.get("stdin") or "")):
        with open(os.path.join(scratch, name), "w", encoding="utf-8") as f:
            f.write(text)
        os.chown(os.path.join(scratch, name), job["uid"], job["uid"])


def _fresh_keyrings() -> None:
    """Leave the caller's session keyring (root's secrets, reachable by possession after setuid) for a
    new anonymous one, and empty the uid's own user keyrings (they outlive a call: an earlier call of
    this uid could leave keys there). A kernel without keyrings (ENOSYS) has nothing to share."""
    number = SYS_KEYCTL.get(platform.machine())
    if number is None:
        raise OSError(errno.ENOSYS, f"keyctl: unknown syscall number on {platform.machine()}")
    for what, args in (("JOIN_SESSION_KEYRING", (KEYCTL_JOIN_SESSION_KEYRING, None)),
                       ("CLEAR user keyring", (KEYCTL_CLEAR, KEY_SPEC_USER_KEYRING)),
                       ("CLEAR user session keyring", (KEYCTL_CLEAR, KEY_SPEC_USER_SESSION_KEYRING))):
        if _libc.syscall(ctypes.c_long(number), *(ctypes.c_long(a) if a is not None else None for a in args)) < 0:
            err = ctypes.get_errno()
            if err == errno.ENOSYS:
                return
            raise OSError(err, f"keyctl({what}): {os.strerror(err)}")


def _exec_code(job: dict, scratch: str) -> None:
    """In the forked child: limits, drop to the job's uid, exec the interpreter. Never returns."""
    try:
        os.chdir(scratch)
        limits = job["limits"]
        for name, value in (("RLIMIT_CPU", limits["cpu_s"]), ("RLIMIT_AS", limits["memory_bytes"]),
                            ("RLIMIT_FSIZE", limits["file_size_bytes"]), ("RLIMIT_NPROC", limits["processes"]),
                            ("RLIMIT_NOFILE", limits["open_files"]), ("RLIMIT_CORE", 0)):
            # CPU: SIGXCPU at the soft limit, SIGKILL a second later if it is caught
            hard = value + 1 if name == "RLIMIT_CPU" else value
            resource.setrlimit(getattr(resource, name), (value, hard))
        stdin_fd = os.open(STDIN_FILE, os.O_RDONLY)
        os.dup2(stdin_fd, 0)
        os.closerange(3, 65536)  # the status pipe and anything else inherited: the code gets 0, 1, 2
        if os.getuid() == 0:
            os.setgroups([])
            os.setgid(job["uid"])
            os.setuid(job["uid"])
        _fresh_keyrings()  # after setuid: the new keyring belongs to the code's uid, the cleared ones are its own
        for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGXCPU):
            signal.signal(sig, signal.SIG_DFL)
        # -S: no site-packages (the base interpreter's .pth files can import half a package index at
        # startup); -s: no user site. The environment is the job's alone, so PYTHONPATH there is honoured.
        os.execve(job["python"], [job["python"], "-S", "-s", "-u", CODE_FILE], job["env"])
    except BaseException as err:  # noqa: B036 - whatever happens, the child must not return into the launcher
        os.write(2, f"sandbox: cannot start the code: {err}\n".encode())
    os._exit(127)


def _run_init(job: dict) -> dict:
    """Start the code, wait for it (at most the wall clock), reap; returns the status."""
    if job["isolated"]:
        _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl")
        scratch = _build_root(job)
    else:  # the code's orphans come to us, so that _kill_uid can reap them
        _check(_libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "prctl")
        scratch = job["scratch"]
        _write_inputs(job, scratch)
    child = os.fork()
    if child == 0:
        _exec_code(job, scratch)

    def on_alarm(signum, frame):
        raise _WallClock

    signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, job["timeout_s"])
    status: dict = {"timed_out": False}
    start = time.monotonic()
    try:
        while True:  # as pid 1 we also reap the code's orphans
            pid, wait_status = os.waitpid(-1, 0)
            if pid == child:
                break
    except _WallClock:
        status["timed_out"] = True
        wait_status = None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    try:
        if os.getpid() == 1:  # pid 1 of our own namespace: kill(-1) reaches only the code's processes
            os.kill(-1, signal.SIGKILL)
        elif wait_status is None:
            os.kill(child, signal.SIGKILL)
    except ProcessLookupError:
        pass  # nothing left to kill
    if wait_status is None:
        _, wait_status = os.waitpid(child, 0)
    if os.getpid() != 1 and os.getuid() == 0:
        _kill_uid(job["uid"])
    _reap_all()
    status["duration_s"] = time.monotonic() - start
    if os.WIFSIGNALED(wait_status):
        status["signal"] = os.WTERMSIG(wait_status)
    else:
        status["exit_code"] = os.WEXITSTATUS(wait_status)
    return status


def _kill_uid(uid: int) -> None:
    """Without a pid namespace: SIGKILL the call's uid until none of its processes is left, reaping
    them as their subreaper (a fork bomb forks while we kill)."""
    for _ in range(100):
        pids = []
        for name in os.listdir("/proc"):
            try:
                with open(f"/proc/{name}/status", "rb") as f:
                    fields = dict(line.split(b":", 1) for line in f if b":" in line)
            except (OSError, ValueError):
                continue
            if int(fields[b"Uid"].split()[0]) == uid and not fields[b"State"].strip().startswith(b"Z"):
                pids.append(int(name))
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _reap_all(block=False)
        if not pids:
            return


def _reap_all(block: bool = True) -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, 0 if block else os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _report(status: dict) -> None:
    os.write(_status_fd, json.dumps(status).encode())


def main() -> None:
    global _status_fd
    # The run's processes keep umask 077 (core/infra/private_files.py); the new root's folders and
    # binds must stay traversable by the call's unprivileged uid, as before.
    os.umask(0o022)
    job = json.loads(sys.stdin.buffer.read())
    _status_fd = job["status_fd"]
    try:
        if job["isolated"]:
            _check(_libc.unshare(NAMESPACES), "unshare")
            init = os.fork()  # only children enter the new pid namespace
            if init != 0:
                _, wait_status = os.waitpid(init, 0)
                os._exit(os.WEXITSTATUS(wait_status) if os.WIFEXITED(wait_status) else 125)
        _report(_run_init(job))
    except Exception as err:  # setup failed: say why, in the status
        _report({"setup_error": f"{type(err).__name__}: {err}"})
        os._exit(125)
    os._exit(0)


if __name__ == "__main__":
    main()
