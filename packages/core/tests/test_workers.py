"""The worker pool that runs user code: a hung call is killed and its worker replaced; failures are reported."""

import asyncio
import os
import textwrap
import time

import pytest

from slime_rl.core.infra.workers import (
    UserCodeError,
    UserCodeLoadError,
    UserCodeTimeout,
    WorkerPool,
    WorkerStartError,
)

USER_CODE = textwrap.dedent('''
    import asyncio, os, sys, threading, time

    def pid():
        return os.getpid()

    def add(a, b):
        return a + b

    def hang(seconds=3600):
        time.sleep(seconds)
        return "woke"

    async def async_blocking():  # blocks its event loop: only the worker's
        time.sleep(3600)

    async def async_ok(x):
        await asyncio.sleep(0.01)
        return x * 2

    def boom():
        raise ValueError("no scorer for\\nthis")

    def garbage():
        return (lambda: 1)  # cannot be pickled back

    def chatty():
        print("printed to stdout", flush=True)
        os.write(1, b"written to fd 1\\n")
        return "still a clean reply"

    def die():
        os._exit(3)

    def spawn_and_hang(path):
        import subprocess
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
        open(path, "w").write(str(child.pid))
        time.sleep(3600)

    NOT_CALLABLE = 3
''')


@pytest.fixture
def pool(tmp_path):
    (tmp_path / "pool_user_code.py").write_text(USER_CODE)
    (tmp_path / "pool_broken.py").write_text("def f(:\n")
    pool = WorkerPool(1, path=[str(tmp_path)])
    yield pool
    pool.close()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead too
        return open(f"/proc/{pid}/stat").read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_calls_run_in_a_long_lived_worker_process(pool):
    first = pool.call("pool_user_code:pid", (), 10)
    assert first != os.getpid() and pool.call("pool_user_code:pid", (), 10) == first  # reused, not one per call
    assert pool.call("pool_user_code:add", (2, 3), 10) == 5
    assert asyncio.run(pool.acall("pool_user_code:async_ok", (21,), 10)) == 42


@pytest.mark.parametrize("fn", ["hang", "async_blocking"])
def test_a_hung_call_is_killed_at_its_timeout_and_the_worker_replaced(pool, fn):
    old = pool.call("pool_user_code:pid", (), 10)
    start = time.monotonic()
    with pytest.raises(UserCodeTimeout, match="timed out after 0.5 s; its worker process was killed"):
        pool.call(f"pool_user_code:{fn}", (), 0.5)
    assert time.monotonic() - start < 5
    assert not alive(old)
    new = pool.call("pool_user_code:pid", (), 10)
    assert new != old and alive(new)


def test_killing_a_worker_takes_what_it_started(pool, tmp_path):
    child_file = tmp_path / "child.pid"
    with pytest.raises(UserCodeTimeout):
        pool.call("pool_user_code:spawn_and_hang", (str(child_file),), 3)
    child = int(child_file.read_text())
    deadline = time.monotonic() + 5
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(child)


def test_exceptions_and_garbage_come_back_as_errors_and_keep_the_worker(pool):
    worker = pool.call("pool_user_code:pid", (), 10)
    with pytest.raises(UserCodeError, match=r"^raised ValueError: no scorer for this$"):
        pool.call("pool_user_code:boom", (), 10)
    with pytest.raises(UserCodeError, match="returned a function, which cannot be sent back"):
        pool.call("pool_user_code:garbage", (), 10)
    assert pool.call("pool_user_code:chatty", (), 10) == "still a clean reply"  # prints do not break the pipe
    assert pool.call("pool_user_code:pid", (), 10) == worker


def test_a_dying_worker_is_reported_and_replaced(pool):
    worker = pool.call("pool_user_code:pid", (), 10)
    with pytest.raises(UserCodeError, match=r"^died with its worker process \(the worker process exited \(code 3\)\)$"):
        pool.call("pool_user_code:die", (), 10)
    assert pool.call("pool_user_code:pid", (), 10) != worker


def test_what_does_not_load_is_a_load_error(pool):
    with pytest.raises(UserCodeLoadError, match="No module named 'nowhere'"):
        pool.call("nowhere:f", (), 10)
    with pytest.raises(UserCodeLoadError, match="has no attribute 'nope'"):
        pool.call("pool_user_code:nope", (), 10)
    with pytest.raises(UserCodeLoadError, match="is a int, not a callable"):
        pool.call("pool_user_code:NOT_CALLABLE", (), 10)
    with pytest.raises(UserCodeLoadError, match="SyntaxError"):
        pool.call("pool_broken:f", (), 10)
    with pytest.raises(UserCodeError, match="^got arguments that cannot be sent to a worker process"):
        pool.call("pool_user_code:add", (lambda: 1, 2), 10)
    assert pool.call("pool_user_code:add", (1, 2), 10) == 3


def test_calls_run_side_by_side_up_to_the_pool_size(tmp_path):
    (tmp_path / "pool_user_code.py").write_text(USER_CODE)
    pool = WorkerPool(3, path=[str(tmp_path)])
    try:
        async def run():
            return await asyncio.gather(*(pool.acall("pool_user_code:hang", (1.0,), 30) for _ in range(3)),
                                        pool.acall("pool_user_code:pid", (), 30))
        asyncio.run(run())  # start the three workers
        start = time.monotonic()
        assert asyncio.run(run())[:3] == ["woke"] * 3
        assert time.monotonic() - start < 2.5  # three one-second calls at once, not one after another
        assert len(pool.pids()) == 3
    finally:
        pool.close()


def test_a_worker_hung_in_user_code_goes_when_its_parent_dies(tmp_path):
    """A killed rollout process leaves no worker behind, even one stuck in the user's code."""
    import subprocess
    import sys

    (tmp_path / "pool_user_code.py").write_text(USER_CODE)
    script = textwrap.dedent(f"""
        import sys
        from slime_rl.core.infra.workers import WorkerPool
        pool = WorkerPool(1, path=[{str(tmp_path)!r}])
        print(pool.call("pool_user_code:pid", (), 30), flush=True)
        pool.call("pool_user_code:hang", (), 3600)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    worker = int(parent.stdout.readline())
    time.sleep(0.5)  # the worker is in hang() now
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while alive(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(worker)


def test_a_worker_that_cannot_start_says_so():
    pool = WorkerPool(1, preload=["no_such_module_to_preload"], quiet=True)
    try:
        with pytest.raises(WorkerStartError, match="could not start a worker process .*preloading "
                                                   "no_such_module_to_preload"):
            pool.call("os:getpid", (), 10)
    finally:
        pool.close()
