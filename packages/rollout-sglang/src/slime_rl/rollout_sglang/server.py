"""SGLang servers: launched as subprocesses (from this interpreter or a user-given one, so
SGLang's pinned torch and transformers can live in their own environment) or attached
by URL, and waited on until ``/health`` answers."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from slime_rl.core.config.positions import ModelPositions
from slime_rl.core.infra.leftovers import KEYS_PREFIX, private_folder
from slime_rl.core.infra.net import port_to_bind_later
from slime_rl.rollout_sglang import model_fixes, vision
from slime_rl.rollout_sglang.keys import EngineKeys, bearer
from slime_rl.rollout_sglang.process import ChildProcess, start_process
from slime_rl.rollout_sglang.settings import OWN_FLAGS, flag_name

logger = logging.getLogger(__name__)



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
    keys: EngineKeys = field(default_factory=EngineKeys)
    key_file: Path | None = None  # the private --config file with the keys; removed once the server is up

    @property
    def headers(self) -> dict[str, str]:
        """For the server's normal endpoints (``/server_info``, ``/model_info``)."""
        return bearer(self.keys.api_key)

    @property
    def name(self) -> str:
        return f"sglang engine {self.index} ({self.url})"


def engine_args_to_flags(engine_args: dict[str, Any]) -> list[str]:
    """``{"mem_fraction_static": 0.6, "enable_memory_saver": True}`` -> ``--mem-fraction-static 0.6
    --enable-memory-saver``. False and None drop the flag; lists become several values."""
    flags: list[str] = []
    for key, value in engine_args.items():
        flag = flag_name(key)
        if flag in OWN_FLAGS:
            raise ValueError(f"rollout.sglang.server_args.{key}: slime-rl sets --{flag} itself; remove it from"
                             " server_args")
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


def write_key_config(keys: EngineKeys, engine_args: dict[str, Any]) -> tuple[Path, dict[str, Any]]:
    """SGLang's ``--config`` YAML holding the keys (and a user's own ``config`` file merged in), in a
    fresh private folder: keys on the command line would show in every user's process listing.
    Returns the file and the engine args without ``config``."""
    import yaml

    engine_args = dict(engine_args)
    merged: dict[str, Any] = {}
    user_config = engine_args.pop("config", None)
    if user_config:
        try:
            merged = yaml.safe_load(Path(user_config).read_text()) or {}
        except (OSError, yaml.YAMLError) as err:
            raise ValueError(f"rollout.sglang.server_args.config: cannot read {user_config}: {err}") from None
        if not isinstance(merged, dict) or {"api-key", "api_key", "admin-api-key", "admin_api_key"} & set(merged):
            raise ValueError(f"rollout.sglang.server_args.config: {user_config} must be a mapping without api-key or "
                             "admin-api-key (slime-rl sets the run's keys itself)")
    merged.update(keys.server_config())
    folder = private_folder(KEYS_PREFIX)  # 0700, owner-tagged: a killed run's is removed by the next (leftovers)
    path = folder / "server.yaml"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("".join(f"{key}: {json.dumps(value)}\n" for key, value in merged.items()))  # JSON is YAML
    return path, engine_args


def check_engine_args_with_keys(engine_args: dict[str, Any]) -> None:
    """SGLang options that switch its key check off or refuse keys (srt/entrypoints/http_server.py,
    server_args.py of 0.5.17): refused here, before a server starts."""
    flags = {str(k).lstrip("-").replace("_", "-"): v for k, v in engine_args.items()}
    if int(flags.get("tokenizer-worker-num") or 1) > 1:
        raise ValueError("rollout.sglang.server_args.tokenizer_worker_num: SGLang checks no API key with more than one "
                         "tokenizer worker, so the weight and memory endpoints would be open; remove it")
    if flags.get("grpc-port"):
        raise ValueError("rollout.sglang.server_args.grpc_port: SGLang's gRPC listener bypasses the API keys "
                         "(it refuses to start with them); remove it")


def start_server(index: int, model_path: str, *, log_dir: str | Path, python: str | None = None, tp_size: int = 1,
                 engine_args: dict[str, Any] | None = None, gpu_ids: list[int] | None = None,
                 host: str = "127.0.0.1", env: dict[str, str] | None = None,
                 keys: EngineKeys | None = None) -> SGLangServer:
    """Start one server process (not yet healthy: see `wait_healthy`). With ``keys``, the server
    refuses every request but ``/health`` that lacks them."""
    python = python or sys.executable
    if os.sep in python and not os.access(python, os.X_OK):
        raise ValueError(f"rollout.sglang.engine_python: {python} is not an executable interpreter")
    keys = keys or EngineKeys()
    engine_args = dict(engine_args or {})
    cmd_args, key_file = engine_args, None
    engine_args_to_flags(engine_args)  # refuse bad engine_args before writing anything
    if keys.api_key or keys.admin_key:
        check_engine_args_with_keys(engine_args)
        key_file, cmd_args = write_key_config(keys, engine_args)
        cmd_args["config"] = str(key_file)
    # bound seconds (SGLang: a minute or more) later by the server: not a port-0 pick, which the next server's
    # pick or any outgoing connection could be handed meanwhile (two stand-ins of one engine got the same in CI)
    port = port_to_bind_later(host)
    cmd = server_command(python, model_path, host=host, port=port, tp_size=tp_size, engine_args=cmd_args)
    child_env = dict(os.environ if env is None else env)
    child_env.setdefault("PYTHONUNBUFFERED", "1")
    # The H200 machine's rules hold in every process we start (gpu/README.md).
    for key, value in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                       "NVSHMEM_DISABLE_NVLS": "1"}.items():
        child_env.setdefault(key, value)
    # SGLang's /health otherwise queues a one-token generation and answers 503 when no output came for 20 s,
    # which a busy server does during long generations: the health monitor then restarted healthy engines
    # in the middle of a rollout (docs/gpu-results.md, issue 16). A hung scheduler is SGLang's watchdog's to end.
    child_env.setdefault("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "false")
    for key, value in {**vision.launch_env(model_path), **model_fixes.launch_env(model_path)}.items():
        child_env.setdefault(key, value)
    model = ModelPositions.of_folder(model_path)
    if model is not None and int(engine_args.get("context_length") or 0) > model.max_position_embeddings:
        # positions reached by the model's RoPE scaling (launch.context_length): SGLang refuses a context
        # length above max_position_embeddings unless told the longer one is meant
        child_env.setdefault("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN", "1")
    if gpu_ids is not None:
        child_env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpu_ids)
    log_path = Path(log_dir) / f"sglang-engine-{index}-port{port}.log"
    try:
        process = start_process(f"sglang engine {index}", cmd, log_path, env=child_env)
    except BaseException:
        _remove_key_file(key_file)
        raise
    launch = dict(model_path=model_path, log_dir=str(log_dir), python=python, tp_size=tp_size,
                  engine_args=engine_args, gpu_ids=gpu_ids, host=host, env=env, keys=keys)
    return SGLangServer(index=index, url=f"http://{host}:{port}", tp_size=tp_size, process=process,
                        gpu_ids=gpu_ids, launch=launch, keys=keys, key_file=key_file)


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
    try:
        _wait_healthy(server, timeout, interval)
    finally:
        _remove_key_file(server.key_file)  # read at start; a restart writes a fresh one
        server.key_file = None


def _remove_key_file(path: Path | None) -> None:
    if path is not None:
        path.unlink(missing_ok=True)
        try:
            path.parent.rmdir()
        except OSError:
            pass


def _wait_healthy(server: SGLangServer, timeout: float, interval: float) -> None:
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
                                       "(rollout.sglang.engine_urls); check that it runs and is reachable")
            tail = server.process.log_tail()
            server.process.stop()
            raise ServerStartError(
                f"{server.name} did not answer /health within {timeout:.0f} s and was stopped. "
                f"Last lines of {server.process.log_path}:\n{tail}")
        time.sleep(interval)


def attach_server(index: int, url: str, timeout: float = 30.0, keys: EngineKeys | None = None) -> SGLangServer:
    """A server someone else runs; its TP size comes from ``/server_info``. Its keys come from the
    environment (`EngineKeys.for_attached`)."""
    from slime_rl.rollout_sglang.keys import ENV_ADMIN_KEY, ENV_API_KEY

    server = SGLangServer(index=index, url=url.rstrip("/"), keys=keys or EngineKeys())
    wait_healthy(server, timeout)
    resp = httpx.get(f"{server.url}/server_info", headers=server.headers, timeout=30)
    if resp.status_code in (401, 403):
        raise ServerStartError(f"{server.name} refused our key (HTTP {resp.status_code}): set {ENV_API_KEY} (and "
                               f"{ENV_ADMIN_KEY} if its --admin-api-key differs) to the keys it was started with")
    resp.raise_for_status()
    info = resp.json()
    if not server.keys.api_key and not server.keys.admin_key:
        logger.warning("%s runs without API keys: anyone who can reach it can replace its weights or free its "
                       "memory. Start it with --api-key/--admin-api-key and set %s (docs/multi-node.md)",
                       server.name, ENV_API_KEY)
    server.tp_size = int(info.get("tp_size", 1))
    return server
