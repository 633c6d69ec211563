"""Launching SGLang servers: the command line, the health wait and its errors."""

from __future__ import annotations

import os
import time
import uuid

import pytest

from slime_rl.core.config import Config
from slime_rl.rollout_sglang.engine import SGLangEngine
from slime_rl.rollout_sglang.server import (
    ServerStartError,
    engine_args_to_flags,
    server_command,
    start_server,
    wait_healthy,
)


def test_engine_args_become_sglang_flags():
    flags = engine_args_to_flags({"mem_fraction_static": 0.6, "enable_memory_saver": True, "disable_radix_cache": False,
                                  "cuda-graph-bs": [1, 2, 4], "--attention-backend": "triton", "dtype": None})
    assert flags == ["--mem-fraction-static", "0.6", "--enable-memory-saver", "--cuda-graph-bs", "1", "2", "4",
                     "--attention-backend", "triton"]
    cmd = server_command("/env/bin/python", "/models/m", host="127.0.0.1", port=30001, tp_size=2,
                         engine_args={"skip_tokenizer_init": True})
    assert cmd == ["/env/bin/python", "-m", "sglang.launch_server", "--model-path", "/models/m", "--host",
                   "127.0.0.1", "--port", "30001", "--tp-size", "2", "--skip-tokenizer-init"]


def test_engine_args_may_not_override_what_slime_rl_sets():
    with pytest.raises(ValueError, match=r"rollout.sglang.server_args.port: slime-rl sets --port itself"):
        engine_args_to_flags({"port": 1234})


def test_a_server_that_never_becomes_healthy_fails_with_its_log_and_is_stopped(tiny_model, standin_python, tmp_path):
    server = start_server(0, str(tiny_model), log_dir=tmp_path, python=standin_python,
                          engine_args={"standin_never_healthy": True})
    with pytest.raises(ServerStartError) as err:
        wait_healthy(server, timeout=6)
    message = str(err.value)
    assert "sglang engine 0" in message and "did not answer /health within 6 s and was stopped" in message
    assert "[standin-sglang] starting:" in message  # the tail of the server's own log
    assert not server.process.alive()


def test_servers_start_with_a_health_endpoint_that_does_not_generate(tiny_model, standin_python, tmp_path):
    """SGLang's /health generates a token and answers 503 after 20 s without output, which a server busy with
    long generations does; the monitor then restarted healthy engines mid-rollout (issue 16, on the H200)."""
    environ = environ_of_a_server(tiny_model, standin_python, tmp_path)
    assert environ["SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"] == "false"
    assert "SGLANG_VLM_CACHE_SIZE_MB" not in environ  # a text model has no image cache to turn off


def test_a_vision_language_server_starts_without_the_image_embedding_cache(standin_python, tmp_path):
    """SGLang keeps each image's vision-tower output by its pixels and never clears it, not on a weight update:
    a seen image would keep the embedding of the weights it was first seen under (the tower trains)."""
    from slime_rl.core.testing import tiny_vl_model_folder

    model = tiny_vl_model_folder(tmp_path / "vl", "qwen2_5_vl")
    assert environ_of_a_server(model, standin_python, tmp_path)["SGLANG_VLM_CACHE_SIZE_MB"] == "0"


def environ_of_a_server(model, standin_python, tmp_path) -> dict[str, str]:
    """The environment a server process of ``model`` was started with (it never becomes healthy)."""
    server = start_server(0, str(model), log_dir=tmp_path, python=standin_python,
                          engine_args={"standin_never_healthy": True})
    try:
        # Between fork and exec /proc/PID/environ still shows this process's environment: wait for the exec
        # (the server's own command line; read too early, the variable was missing on a loaded machine)
        deadline = time.monotonic() + 60
        while str(model) not in open(f"/proc/{server.process.pid}/cmdline").read():
            assert time.monotonic() < deadline, "the server process did not exec within 60 s"
            time.sleep(0.05)
        return dict(item.split("=", 1) for item in
                    open(f"/proc/{server.process.pid}/environ").read().split("\0") if "=" in item)
    finally:
        server.process.stop()


def test_a_server_that_crashes_at_start_fails_fast_with_exit_code_and_log(tiny_model, standin_python, tmp_path):
    server = start_server(0, str(tiny_model), log_dir=tmp_path, python=standin_python,
                          engine_args={"standin_crash_on_start": True})
    with pytest.raises(ServerStartError, match=r"exited with code 1 before answering /health") as err:
        wait_healthy(server, timeout=120)
    assert "stand-in told to crash on start" in str(err.value)


def test_from_config_reports_a_crashing_server(tiny_model, standin_python, tmp_path):
    cfg = Config.model_validate({
        "model": {"path": str(tiny_model)},
        "rollout": {"engine": "sglang", "sglang": {"engine_python": standin_python,
                                                   "server_args": {"standin_crash_on_start": True}}},
        "cluster": {"device": "cpu", "actor_num_gpus_per_node": 2},
        "logging": {"dir": str(tmp_path)}})
    with pytest.raises(ServerStartError, match="sglang engine 0 .* exited with code 1"):
        SGLangEngine.from_config(cfg)


def test_a_failed_launch_leaves_no_server_running(tiny_model, standin_python, tmp_path):
    marker = f"marker-{uuid.uuid4().hex}"  # an extra flag, to find these processes in /proc
    with pytest.raises(ServerStartError, match="did not answer /health within 5 s"):
        SGLangEngine.launch(str(tiny_model), num_engines=2, python=standin_python, work_dir=tmp_path,
                            engine_args={"standin_never_healthy": True, "served_model_name": marker},
                            startup_timeout=5)
    assert _processes_with(marker) == []


def _processes_with(marker: str) -> list[int]:
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline:
            found.append(int(pid))
    return found


def test_engine_python_must_be_an_executable(tiny_model, tmp_path):
    with pytest.raises(ValueError, match=r"rollout.sglang.engine_python: .* is not an executable interpreter"):
        start_server(0, str(tiny_model), log_dir=tmp_path, python=str(tmp_path / "no-such-python"))
