"""What sandboxed code must not share with the host (issue 34): SysV IPC objects (none of the host's is
visible, none of the code's outlives the call), the caller's session keyring, and the uid lock folder
(one planted by another user is refused). These machines run as root, as CI does."""

import ctypes
import os
import platform
import random

import pytest

from slime_rl.core.sandbox import (
    IsolationSupport,
    SandboxError,
    SandboxSettings,
    isolation_support,
    run_python,
)
from slime_rl.core.sandbox import isolation as isolation_module

FAST = SandboxSettings(timeout_s=5.0, cpu_time_s=5)
IPC_CREAT, IPC_EXCL, IPC_RMID = 0o1000, 0o2000, 0
KEY_SPEC_SESSION_KEYRING, KEY_SPEC_USER_KEYRING, KEYCTL_UNLINK, KEYCTL_SEARCH, KEYCTL_READ = -3, -4, 9, 10, 11
ADD_KEY_KEYCTL = {"x86_64": (248, 250), "aarch64": (217, 219)}  # syscall numbers: no glibc wrappers

pytestmark = [pytest.mark.skipif(os.name != "posix", reason="the sandbox is Linux-only"),
              pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox drops to its own uids only as root")]
libc = ctypes.CDLL(None, use_errno=True)
libc.shmget.argtypes = [ctypes.c_int, ctypes.c_size_t, ctypes.c_int]


@pytest.fixture(params=["namespaces", "none"])
def level(request, monkeypatch):
    """With namespaces (this machine has them as root) and without (a kernel that refuses unshare)."""
    if request.param == "namespaces":
        assert isolation_support().isolated, isolation_support().reason
    else:
        import slime_rl.core.sandbox.run as run_module

        monkeypatch.setattr(run_module, "isolation_support", lambda: IsolationSupport("none", "test"))
    return request.param


def _host_ipc_keys() -> dict[str, set[int]]:
    keys = {}
    for kind in ("shm", "msg", "sem"):
        with open(f"/proc/sysvipc/{kind}") as f:
            keys[kind] = {int(line.split()[0]) for line in list(f)[1:]}
    return keys


def _remove_by_key(shm_key: int, msg_key: int, sem_key: int) -> None:
    """Clean up whatever a failing run left on the host."""
    if (shm := libc.shmget(shm_key, 0, 0)) >= 0:
        libc.shmctl(shm, IPC_RMID, None)
    if (msg := libc.msgget(msg_key, 0)) >= 0:
        libc.msgctl(msg, IPC_RMID, None)
    if (sem := libc.semget(sem_key, 0, 0)) >= 0:
        libc.semctl(sem, 0, IPC_RMID)


def test_no_sysv_ipc_object_outlives_the_call_and_the_hosts_are_hidden(level):
    shm_key, msg_key, sem_key, host_key = random.sample(range(1 << 20, 1 << 30), 4)
    host_shm = libc.shmget(host_key, 4096, IPC_CREAT | IPC_EXCL | 0o644)  # world-readable, as the round found
    assert host_shm >= 0, os.strerror(ctypes.get_errno())
    code = (
        "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "libc.shmget.argtypes = [ctypes.c_int, ctypes.c_size_t, ctypes.c_int]\n"
        "libc.shmat.restype = ctypes.c_void_p\n"
        f"shm = libc.shmget({shm_key}, 1 << 20, 0o1000 | 0o600)\n"
        "ctypes.memset(libc.shmat(shm, None, 0), 1, 1 << 20)  # pinned pages, as a real abuse would\n"
        f"msg = libc.msgget({msg_key}, 0o1000 | 0o600)\n"
        f"sem = libc.semget({sem_key}, 1, 0o1000 | 0o600)\n"
        f"host = libc.shmget({host_key}, 0, 0)\n"
        "listed = [line.split()[0] for line in open('/proc/sysvipc/shm')]\n"
        f"print(shm, msg, sem, host, 'VISIBLE' if '{host_key}' in listed else 'hidden')\n")
    try:
        result = run_python(code, FAST)
        after = _host_ipc_keys()
    finally:
        libc.shmctl(host_shm, IPC_RMID, None)
        _remove_by_key(shm_key, msg_key, sem_key)
    shm, msg, sem, host, seen = result.stdout.split()
    assert result.exit_code == 0 and min(int(shm), int(msg), int(sem)) >= 0, result  # the code made all three
    assert shm_key not in after["shm"] and msg_key not in after["msg"] and sem_key not in after["sem"], after
    if level == "namespaces":  # without an IPC namespace the host's objects stay in view (docs/sandbox.md)
        assert host == "-1" and seen == "hidden"


def test_the_callers_session_keyring_is_not_inherited(level):
    numbers = ADD_KEY_KEYCTL.get(platform.machine())
    if numbers is None:
        pytest.skip(f"add_key's syscall number is not listed for {platform.machine()}")
    add_key, keyctl = numbers
    name, secret = f"slime-test-{os.getpid()}".encode(), b"the-keyring-secret"
    key = libc.syscall(ctypes.c_long(add_key), b"user", name, secret, ctypes.c_size_t(len(secret)),
                       ctypes.c_int(KEY_SPEC_SESSION_KEYRING))
    if key < 0:
        pytest.skip(f"this kernel refuses keyrings: {os.strerror(ctypes.get_errno())}")
    code = (
        "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nbuf = ctypes.create_string_buffer(256)\n"
        f"found = libc.syscall(ctypes.c_long({keyctl}), ctypes.c_long({KEYCTL_SEARCH}),"
        f" ctypes.c_long({KEY_SPEC_SESSION_KEYRING}), b'user', {name!r}, ctypes.c_long(0))\n"
        f"read = libc.syscall(ctypes.c_long({keyctl}), ctypes.c_long({KEYCTL_READ}), ctypes.c_long({key}), buf,"
        " ctypes.c_long(256))\n"
        "print(found, read, buf.value)\n")
    try:
        result = run_python(code, FAST)
    finally:
        libc.syscall(ctypes.c_long(keyctl), ctypes.c_long(KEYCTL_UNLINK), ctypes.c_long(key),
                     ctypes.c_long(KEY_SPEC_SESSION_KEYRING))
    assert result.exit_code == 0, result
    assert secret.decode() not in result.stdout
    found, read, _ = result.stdout.split(maxsplit=2)
    assert found == "-1" and read == "-1", result.stdout


def test_a_key_one_call_leaves_in_its_user_keyring_is_gone_for_the_next(level):
    numbers = ADD_KEY_KEYCTL.get(platform.machine())
    if numbers is None:
        pytest.skip(f"add_key's syscall number is not listed for {platform.machine()}")
    add_key, keyctl = numbers
    settings = SandboxSettings(timeout_s=5.0, uid_base=330_000)  # one call at a time: both get uid 330000
    prefix = "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
    leave = prefix + (f"key = libc.syscall(ctypes.c_long({add_key}), b'user', b'carried', b'from-call-1',"
                      f" ctypes.c_size_t(11), ctypes.c_int({KEY_SPEC_USER_KEYRING}))\n"
                      "print(os.getuid(), key, os.strerror(ctypes.get_errno()))\n")
    find = prefix + (f"print(os.getuid(), libc.syscall(ctypes.c_long({keyctl}), ctypes.c_long({KEYCTL_SEARCH}),"
                     f" ctypes.c_long({KEY_SPEC_USER_KEYRING}), b'user', b'carried', ctypes.c_long(0)))\n")
    left = run_python(leave, settings).stdout.split()
    if int(left[1]) < 0:
        pytest.skip(f"this kernel refuses keyrings: {' '.join(left[2:])}")
    found = run_python(find, settings).stdout.split()
    assert found[0] == left[0] == "330000" and found[1] == "-1", (left, found)


def test_a_lock_folder_of_another_user_is_refused(tmp_path, monkeypatch):
    planted = tmp_path / "locks"
    planted.mkdir()
    os.chown(planted, 12345, 12345)  # another local user made it first
    planted.chmod(0o777)
    monkeypatch.setattr(isolation_module, "LOCK_DIR", planted)
    with pytest.raises(SandboxError, match=f"{planted} is owned by uid 12345"):
        run_python("pass", FAST)
    assert list(planted.iterdir()) == []
    mine = tmp_path / "mine"
    monkeypatch.setattr(isolation_module, "LOCK_DIR", mine)
    assert run_python("print('ok')", FAST).stdout == "ok\n"  # a folder it creates itself is used
    assert mine.lstat().st_uid == os.geteuid() and mine.lstat().st_mode & 0o777 == 0o700


def test_a_symlinked_lock_folder_is_refused(tmp_path, monkeypatch):
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)  # ours and private: only the link is wrong
    link = tmp_path / "locks"
    link.symlink_to(target)
    monkeypatch.setattr(isolation_module, "LOCK_DIR", link)
    with pytest.raises(SandboxError, match=f"{link} is not a plain folder"):
        run_python("pass", FAST)
    assert list(target.iterdir()) == []  # nothing created through the link


def test_the_default_lock_folder_cannot_be_planted_by_another_user():
    folder = isolation_module.default_lock_dir()
    parent = folder.parent.lstat()
    # root's /run (writable by root alone), or a per-uid name that UidLease verifies before use
    assert (parent.st_uid == 0 and not parent.st_mode & 0o022) or folder.name.endswith(f"-{os.geteuid()}")
