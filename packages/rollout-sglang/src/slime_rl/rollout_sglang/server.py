"""SGLang servers: launched as subprocesses (from this interpreter or a user-given one, so
SGLang's pinned torch and transformers can live in their own environment) or attached
by URL, and waited on until ``/health`` answers."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from slime_rl.rollout_sglang.process import ChildProcess, free_port, start_process

# Flags slime-rl sets itself; giving them in rollout.engine_args would be silently overridden.
_OWN_FLAGS = {"model-path", "host", "port", "tp-size", "tp", "tensor-parallel-size"}


class ServerStartError(RuntimeError):
    """A server exited or never answered ``/health``; the message carries the tail of its log."""


@dataclass
class SGLangServer:
    """One SGLang HTTP server (one engine of ``tp_size`` GPUs)."""

    index: int  # position among the run's engines, for messages
    url: str
    tp_size: int = 1
    process: ChildProcess | None = None  # None when attached to a server someone else runs
    gpu_ids: list[int] | None = None
    launch: dict[str, Any] = field(default_factory=dict)  # what start_server was given, to restart it

    @property
    def name(self) -> str:
        return f"sglang engine {self.index} ({self.url})"


def engine_args_to_flags(engine_args: dict[str, Any]) -> list[str]:
    """``{"mem_fraction_static": 0.6, "enable_memory_saver": True}`` -> ``--mem-fraction-static 0.6
    --enable-memory-saver``. False and None drop the flag; lists become several values."""
    flags: list[str] = []
    for key, value in engine_args.items():
        flag = str(key).lstrip("-").replace("_", "-")
        if flag in _OWN_FLAGS:
            raise ValueError(f"rollout.engine_args.{key}: slime-rl sets --{flag} itself; remove it from engine_args")
        if value is None or value is False:
            continue
        if value is True:
            flags.append(f"--{flag}")
        elif isinstance(value, (list, tuple)):
            flags += [f"--{flag}", *[str(v) for v in value]]
        elif isinstance(value, dict):
            import json

            flags += [f"--{flag}", json.dumps(value)]
        else:
            flags += [f"--{flag}", str(value)]
    return flags


def server_command(python: str, model_path: str, *, host: str, port: int, tp_size: int,
                   engine_args: dict[str, Any]) -> list[str]:
    return [python, "-m", "sglang.launch_server", "--model-path", model_path, "--host", host, "--port", str(port),
            "--tp-size", str(tp_size), *engine_args_to_flags(engine_args)]


def start_server(index: int, model_path: str, *, log_dir: str | Path, python: str | None = None, tp_size: int = 1,
                 engine_args: dict[str, Any] | None = None, gpu_ids: list[int] | None = None,
                 host: str = "127.0.0.1", env: dict[str, str] | None = None) -> SGLangServer:
    """Start one server process (not yet healthy: see `wait_healthy`)."""
    python = python or sys.executable
    if os.sep in python and not os.access(python, os.X_OK):
        raise ValueError(f"rollout.engine_python: {python} is not an executable interpreter")
    engine_args = dict(engine_args or {})
    port = free_port(host)
    cmd = server_command(python, model_path, host=host, port=port, tp_size=tp_size, engine_args=engine_args)
    child_env = dict(os.environ if env is None else env)
    child_env.setdefault("PYTHONUNBUFFERED", "1")
    # The H200 machine's rules hold in every process we start (gpu/README.md).
    for key, value in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                       "NVSHMEM_DISABLE_NVLS": "1"}.items():
        child_env.setdefault(key, value)
    if gpu_ids is not None:
        child_env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpu_ids)
    log_path = Path(log_dir) / f"sglang-engine-{index}-port{port}.log"
    process = start_process(f"sglang engine {index}", cmd, log_path, env=child_env)
    launch = dict(model_path=model_path, log_dir=str(log_dir), python=python, tp_size=tp_size,
                  engine_args=engine_args, gpu_ids=gpu_ids, host=host, env=env)
    return SGLangServer(index=index, url=f"http://{host}:{port}", tp_size=tp_size, process=process,
                        gpu_ids=gpu_ids, launch=launch)


def restart_server(server: SGLangServer) -> SGLangServer:
    """Stop what is left of a launched server and start it again (same GPUs, a fresh port)."""
    if server.process is None:
        raise ValueError(f"{server.name} was attached, not launched; it cannot be restarted from here")
    server.process.stop()
    return start_server(server.index, **server.launch)


def is_healthy(url: str, timeout: float = 5.0) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return False


def wait_healthy(server: SGLangServer, timeout: float, interval: float = 0.5) -> None:
    """Block until ``GET /health`` answers 200. Raises `ServerStartError` (with the log tail)
    if the process exits first or ``timeout`` seconds pass; a launched server is then stopped."""
    deadline = time.monotonic() + timeout
    while True:
        if server.process is not None and not server.process.alive():
            code = server.process.popen.returncode
            raise ServerStartError(
                f"{server.name} exited with code {code} before answering /health. "
                f"Last lines of {server.process.log_path}:\n{server.process.log_tail()}")
        if is_healthy(server.url, timeout=min(5.0, max(0.5, deadline - time.monotonic()))):
            return
        if time.monotonic() >= deadline:
            if server.process is None:
                raise ServerStartError(f"{server.name}: no healthy SGLang server at this URL after {timeout:.0f} s "
                                       "(rollout.engine_urls); check that it runs and is reachable")
            tail = server.process.log_tail()
            server.process.stop()
            raise ServerStartError(
                f"{server.name} did not answer /health within {timeout:.0f} s and was stopped. "
                f"Last lines of {server.process.log_path}:\n{tail}")
        time.sleep(interval)


def attach_server(index: int, url: str, timeout: float = 30.0) -> SGLangServer:
    """A server someone else runs; its TP size comes from ``/server_info``."""
    server = SGLangServer(index=index, url=url.rstrip("/"))
    wait_healthy(server, timeout)
    info = httpx.get(f"{server.url}/server_info", timeout=30).json()
    server.tp_size = int(info.get("tp_size", 1))
    return server
