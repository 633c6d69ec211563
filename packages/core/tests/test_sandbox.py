"""The code sandbox (issue 18, part 3): each escape or abuse is contained, the call returns a result
that says what happened, and the next call still works. These machines run as root, so every test
here also checks that root's powers do not reach the code."""

import asyncio
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from slime_rl.core.config import Config, ConfigError, load_config
from slime_rl.core.sandbox import (
    IsolationSupport,
    SandboxSettings,
    SandboxUnavailable,
    arun_python,
    isolation_support,
    make_python_tool,
    run_python,
)
from slime_rl.core.sandbox import isolation as isolation_module
from slime_rl.core.sandbox.isolation import processes_of

FAST = SandboxSettings(timeout_s=3.0, cpu_time_s=5)

pytestmark = pytest.mark.skipif(os.name != "posix", reason="the sandbox is Linux-only")


@pytest.fixture(params=["namespaces", "none"])
def level(request, monkeypatch):
    """Each containment test runs with the namespaces (this machine has them: as root, asserted
    here) and without them (a kernel that refuses unshare), where only the uid and rlimits hold."""
    if request.param == "namespaces":
        assert isolation_support().isolated, isolation_support().reason  # root on Linux: must have them
    else:
        monkeypatch.setattr(isolation_module, "isolation_support", lambda: IsolationSupport("none", "test"))
        import slime_rl.core.sandbox.run as run_module

        monkeypatch.setattr(run_module, "isolation_support", lambda: IsolationSupport("none", "test"))
    return request.param


def test_output_stdin_exit_code_and_environment(monkeypatch, level):
    monkeypatch.setenv("SLIME_TEST_SECRET_TOKEN", "hunter2")
    keep_open = open(__file__)  # noqa: SIM115 - an inheritable descriptor the code must not get
    os.set_inheritable(keep_open.fileno(), True)
    try:
        code = ("import os, sys\nprint(input()[::-1])\nprint(sorted(os.environ))\nprint(os.getuid())\n"
                "print(sorted(int(fd) for fd in os.listdir('/proc/self/fd')))\nsys.exit(3)")
        result = run_python(code, FAST, stdin="olleh\n")
    finally:
        keep_open.close()
    lines = result.stdout.splitlines()
    assert lines[0] == "hello" and result.exit_code == 3 and result.killed_reason is None
    assert "SLIME_TEST_SECRET_TOKEN" not in result.stdout and "hunter2" not in result.stdout
    assert int(lines[2]) >= FAST.uid_base  # not root
    assert set(eval(lines[3])) <= {0, 1, 2, 3}  # 3: listdir's own descriptor
    assert result.isolation == level


def test_infinite_loop_is_stopped_by_the_wall_clock(level):
    result = run_python("while True:\n    pass", SandboxSettings(timeout_s=1.0, cpu_time_s=30))
    assert result.timed_out and result.killed_reason == "timeout" and result.exit_code is None
    assert "[killed: timeout]" in result.observation()
    assert run_python("print(1 + 1)", FAST).stdout == "2\n"  # the next call runs


def test_cpu_time_limit(level):
    result = run_python("while True:\n    pass", SandboxSettings(timeout_s=60.0, cpu_time_s=1))  # 1 s of CPU ends it
    assert result.killed_reason == "cpu time limit" and not result.timed_out


def test_fork_bomb_is_contained_and_leaves_no_process(level):
    settings = SandboxSettings(timeout_s=3.0, cpu_time_s=5, max_processes=8, uid_base=310_000)
    code = ("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError as err:\n"
            "        print(type(err).__name__, flush=True)\n")
    result = run_python(code, settings)
    assert result.killed_reason in ("timeout", "output limit"), result
    assert "BlockingIOError" in result.stdout  # the process limit held, although the caller is root
    assert processes_of(310_000) == []  # the call's uid has nothing left running
    assert run_python("print('after')", FAST).stdout == "after\n"


def test_ten_gib_allocation_fails_inside(level):
    result = run_python("x = bytearray(10 * 2**30)\nprint('allocated')", FAST)
    assert "MemoryError" in result.stderr and "allocated" not in result.stdout and result.exit_code == 1


def test_file_size_limit(level):
    result = run_python("open('big', 'wb').write(b'x' * (3 * 2**20))", SandboxSettings(timeout_s=3, file_size_mb=1))
    assert "File too large" in result.stderr and result.exit_code == 1  # Python ignores SIGXFSZ: EFBIG


def test_writes_outside_scratch_fail(tmp_path, level):
    target = tmp_path / "open_to_all"
    target.mkdir()
    target.chmod(0o777)  # only the sandbox can stop this write, not the permissions
    code = (f"import os\nfor path in ['{target}/escaped', '/usr/escaped', '/escaped']:\n"
            "    try:\n        open(path, 'w').write('x')\n        print('WROTE', path)\n"
            "    except OSError as err:\n        print('refused', path, type(err).__name__)\n"
            "open('scratch_file', 'w').write('kept')\nprint(open('scratch_file').read())")
    result = run_python(code, FAST)
    assert "kept" in result.stdout and result.exit_code == 0
    assert not Path("/usr/escaped").exists() and not Path("/escaped").exists()
    if level == "namespaces":
        assert "WROTE" not in result.stdout and not (target / "escaped").exists()
    else:  # without a mount namespace a world-writable host directory stays writable (docs/sandbox.md)
        (target / "escaped").unlink(missing_ok=True)


def test_home_directory_is_unreadable(level):
    secret = Path.home() / f".slime-sandbox-test-secret-{os.getpid()}"
    secret.write_text("the-secret-value")
    secret.chmod(0o600)  # a root-owned credential file
    try:
        code = (f"try:\n    print(open('{secret}').read())\nexcept OSError as err:\n"
                "    print('refused', type(err).__name__)")
        result = run_python(code, FAST)
    finally:
        secret.unlink()
    assert "the-secret-value" not in result.stdout and "refused" in result.stdout


def _listener() -> tuple[socket.socket, list]:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.2)
    accepted: list = []

    def accept() -> None:
        while server.fileno() != -1:
            try:
                accepted.append(server.accept())
            except OSError:
                continue

    threading.Thread(target=accept, daemon=True).start()
    return server, accepted


def test_no_network_not_even_loopback():
    assert isolation_support().isolated
    server, accepted = _listener()
    port = server.getsockname()[1]
    try:
        code = (f"import socket\nfor host, port in [('127.0.0.1', {port}), ('1.1.1.1', 53), ('8.8.8.8', 443)]:\n"
                "    s = socket.socket()\n    s.settimeout(2)\n    try:\n        s.connect((host, port))\n"
                "        print('CONNECTED', host)\n    except OSError as err:\n        print(host, err)\n")
        result = run_python(code, FAST)
    finally:
        server.close()
    assert "CONNECTED" not in result.stdout and accepted == []
    assert result.stdout.count("Network is unreachable") == 3, result.stdout


def test_a_gigabyte_print_is_truncated(level):
    settings = SandboxSettings(timeout_s=10.0, max_output_bytes=4096)
    result = run_python("import sys\nfor _ in range(1024):\n    sys.stdout.write('x' * 2**20)", settings)
    assert result.stdout_truncated and result.killed_reason == "output limit"
    assert len(result.stdout) == 4096 and not result.stderr_truncated


def test_killing_the_parent_process_group_kills_only_the_code(level):
    code = ("import os, signal\nfor kill in (lambda: os.killpg(os.getpgid(os.getppid()), signal.SIGKILL),\n"
            "             lambda: os.kill(os.getppid(), signal.SIGKILL), lambda: os.killpg(0, signal.SIGKILL),\n"
            "             lambda: os.kill(-1, signal.SIGKILL)):\n"
            "    try:\n        kill()\n    except OSError as err:\n        print(type(err).__name__, flush=True)\n")
    result = run_python(code, FAST)
    assert result.killed_reason == "signal SIGKILL"  # the code killed itself, and nothing above it
    assert run_python("print('still here')", FAST).stdout == "still here\n"


def test_calls_run_concurrently_up_to_the_bound():
    settings = SandboxSettings(timeout_s=10.0, max_concurrency=2)
    code = "import time\nprint(time.time())\ntime.sleep(1.2)\nprint(time.time())"  # overlaps even on a loaded machine

    async def main():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.05)
                ticks += 1

        tick = asyncio.ensure_future(ticker())
        results = await asyncio.gather(*(arun_python(code, settings) for _ in range(4)))
        tick.cancel()
        return results, ticks

    results, ticks = asyncio.run(main())
    spans = [tuple(map(float, r.stdout.split())) for r in results]
    most_at_once = max(sum(start <= t < end for start, end in spans) for t, _ in spans)
    assert most_at_once == 2
    assert ticks > 10  # the event loop kept running while four calls waited and ran


def test_python_tool_returns_the_observation():
    tool = make_python_tool(FAST)
    assert asyncio.run(tool("print(6 * 7)")) == "42\n"
    text = asyncio.run(tool("raise ValueError('nope')"))
    assert "ValueError: nope" in text and "[exit code 1]" in text


def test_require_isolation_is_refused_without_namespaces(monkeypatch, tmp_path):
    monkeypatch.setattr(isolation_module, "isolation_support", lambda: IsolationSupport("none", "no unshare"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"input": "x", "label": "y"}\n')
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"data.prompt_data={prompts}", "rollout.sandbox.require_isolation=true"])
    assert info.value.field == "rollout.sandbox.require_isolation" and "no unshare" in str(info.value)
    with pytest.raises(SandboxUnavailable, match="require_isolation"):
        run_python("pass", SandboxSettings(require_isolation=True))


def test_settings_follow_the_config(tmp_path):
    assert SandboxSettings() == SandboxSettings.from_config(Config())  # the same defaults in both places
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"input": "x", "label": "y"}\n')
    cfg = load_config(None, [f"data.prompt_data={prompts}", "rollout.sandbox.timeout_s=2.5",
                             "rollout.sandbox.max_concurrency=3", "rollout.sandbox.require_isolation=true"])
    settings = SandboxSettings.from_config(cfg)
    assert settings.timeout_s == 2.5 and settings.concurrency == 3 and settings.require_isolation
    with pytest.raises(ConfigError, match="rollout.sandbox.python"):
        load_config(None, [f"data.prompt_data={prompts}", "rollout.sandbox.python=/no/such/python"])


def test_doctor_report_says_where_isolation_is_missing(monkeypatch):
    from slime_rl.core.sandbox import report

    lines = {name: (status, ok) for name, status, ok in report.sandbox_report(FAST)}
    assert lines["isolation"][0].startswith("namespaces") and lines["trial_call"] == (lines["trial_call"][0], True)
    none = IsolationSupport("none", "the kernel refused the namespaces: EPERM")
    monkeypatch.setattr(report, "isolation_support", lambda: none)
    lines = {name: (status, ok) for name, status, ok in report.sandbox_report(FAST)}
    assert "EPERM" in lines["isolation"][0] and lines["require_isolation"][0].startswith("refused here")


def test_packages_come_from_readonly_paths_and_pythonpath(tmp_path):
    assert isolation_support().isolated
    (tmp_path / "helper_pkg_for_sandbox.py").write_text("ANSWER = 42\n")
    tmp_path.chmod(0o755)  # a bind mount keeps the permissions: the code's uid must be let in
    (tmp_path / "helper_pkg_for_sandbox.py").chmod(0o666)  # writable to all: only the read-only mount stops it
    settings = SandboxSettings(timeout_s=3.0, readonly_paths=(str(tmp_path),), env={"PYTHONPATH": str(tmp_path)})
    code = "import helper_pkg_for_sandbox as h\nprint(h.ANSWER)\nopen(h.__file__, 'a').write('x')"
    result = run_python(code, settings)
    assert result.stdout == "42\n" and "Read-only file system" in result.stderr
    assert "ModuleNotFoundError" in run_python("import helper_pkg_for_sandbox", FAST).stderr  # not without them


def test_mounts_below_a_readonly_path_are_read_only_too(tmp_path):
    """A writable tmpfs mounted inside a readonly_paths folder stays read-only for the code. The tmpfs
    lives in a mount namespace of this test's own (unshare), so the host never sees it."""
    assert isolation_support().isolated
    shared = tmp_path / "shared"
    (shared / "sub").mkdir(parents=True)
    tmp_path.chmod(0o755)
    shared.chmod(0o755)
    script = tmp_path / "probe.py"
    script.write_text(
        "import sys\nfrom slime_rl.core.sandbox import SandboxSettings, run_python\n"
        f"r = run_python(\"open('{shared}/sub/x', 'w')\", SandboxSettings(timeout_s=5, readonly_paths=('{shared}',)))\n"
        "print(r.stderr)\n")
    out = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c",
         f"mount -t tmpfs -o mode=777 tmpfs {shared}/sub && {sys.executable} {script}"],
        capture_output=True, text=True, timeout=60)
    assert "Read-only file system" in out.stdout, out.stdout + out.stderr
    assert not (shared / "sub" / "x").exists()
