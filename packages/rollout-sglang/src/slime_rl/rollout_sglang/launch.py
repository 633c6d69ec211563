"""Where and how an engine's servers start: the GPUs the placement plan gives each engine, the
address they listen on, the SGLang flags a config implies; launching them (or attaching to
servers someone else runs) with the router in front."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from slime_rl.core.algorithms.lora import lora_spec, syncs_adapters
from slime_rl.core.config import ConfigError
from slime_rl.core.config.device import resolve_device
from slime_rl.core.config.dtype import model_dtype
from slime_rl.core.config.positions import ModelPositions, asked_length
from slime_rl.core.infra.net import LOOPBACK, node_address
from slime_rl.rollout_sglang import fp8, vision
from slime_rl.rollout_sglang.keys import EngineKeys
from slime_rl.rollout_sglang.router import Router, launch_router
from slime_rl.rollout_sglang.server import SGLangServer, attach_server, start_server, wait_healthy
from slime_rl.rollout_sglang.settings import sglang_settings
from slime_rl.rollout_sglang.weights.adapters import lora_engine_args
from slime_rl.rollout_sglang.weights.delta_loader import LOADER as DELTA_LOADER

if TYPE_CHECKING:
    from slime_rl.core.config import Config
    from slime_rl.core.config.placement import Placement


def work_dir(cfg: Config) -> Path:
    """The engine's folder in the run: server logs, and ``weights/v{N}`` of disk syncs (both sides of a
    sync write there: the engine and the trainer's sender, `weights.pusher.BucketPusher`)."""
    return Path(cfg.logging.dir) / "sglang"


def engine_gpu_ids(plan: Placement, visible: str | None = None) -> list[list[int]] | None:
    """Each engine's GPUs as this process's CUDA numbers them: the plan's ``(node, gpu)`` per engine
    rank, the GPU index read through ``visible`` (CUDA_VISIBLE_DEVICES) when it lists as many GPUs as
    the plan uses, else taken as the physical index. None on the CPU (no GPUs to give).

    The servers start in the rollout process, which Ray places on engine 0's node
    (`Reservation.rollout_options`): every engine must sit on that node."""
    if plan.device != "cuda":
        return None
    nodes = sorted({node for engine in plan.engines for node, _ in engine.gpus})
    if len(nodes) > 1:
        raise ConfigError("cluster.rollout_num_gpus", f"the plan puts the SGLang engines on nodes {nodes}, but"
                          " slime-rl starts the servers on one node (the rollout process's): give the engines"
                          " GPUs that fit on one node (cluster.num_gpus_per_node), or start servers on each node"
                          " yourself and list them in rollout.sglang.engine_urls")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "") if visible is None else visible
    devices = [int(d) for d in visible.split(",") if d.strip().isdigit()]
    used = 1 + max(gpu for engine in plan.engines for _, gpu in engine.gpus)
    if len(devices) < used:  # not restricted (or restricted to fewer GPUs than the plan uses): physical ids
        devices = list(range(used))
    return [[devices[gpu] for _, gpu in engine.gpus] for engine in plan.engines]


def server_host(plan: Placement) -> str:
    """Trainer ranks on other nodes push weights to the servers themselves: then the servers listen on
    this node's private address (keys on, as always), else on loopback."""
    return LOOPBACK if plan.num_nodes == 1 else node_address()


def engine_args(cfg: Config) -> dict[str, Any]:
    """``rollout.sglang``'s server flags (``server_args`` and the typed ones) with the flags the rest of the
    config implies (the user's win)."""
    r, c, settings = cfg.rollout, cfg.cluster, sglang_settings(cfg)
    args = {**settings.server_args, **settings.server_flags()}
    if cfg.model.tokenizer_path:
        args.setdefault("tokenizer_path", cfg.model.tokenizer_path)
    if (context := context_length(cfg)) is not None:
        args.setdefault("context_length", context)
    # Always a concrete dtype: SGLang's own auto (fp16 for an fp32 checkpoint) is not the trainer's.
    dtype = model_dtype(cfg.model.dtype, resolve_device(cfg.cluster.device))
    if args.setdefault("dtype", dtype) != dtype:
        raise ConfigError("rollout.sglang.server_args.dtype", f"{args['dtype']!r} is not the run's model.dtype ({dtype}):"
                          " the trainer and the engines build in one dtype; set model.dtype instead")
    if c.colocate:  # release/resume memory needs SGLang's memory saver
        args.setdefault("enable_memory_saver", True)
    for key, value in vision.launch_flags(cfg.model.path).items():  # images: SGLang's tokenizer kept (vision.py)
        args.setdefault(key, value)
    if not r.stop:  # token ids in and out; stop strings need SGLang's detokenizer
        args.setdefault("skip_tokenizer_init", True)
    if r.update_weight_mode == "delta":  # delta syncs load through our custom loader (weights/delta_loader.py)
        args.setdefault("custom_weight_loader", [DELTA_LOADER])
    for key, value in fp8.server_flags(cfg).items():  # rollout.precision / kv_cache_dtype (fp8.py)
        args.setdefault(key, value)
    if cfg.algorithm.routing_replay == "rollout":  # MoE: the experts each token went to, per request
        args.setdefault("enable_return_routed_experts", True)
    if syncs_adapters(cfg):  # weight syncs load LoRA adapters at run time (adapters.py)
        # in flight at once: the current version and, by the staleness bound (fully async), older ones
        versions = 1 + max(1, r.max_staleness or 1)
        for key, value in lora_engine_args(lora_spec(cfg), versions).items():
            args.setdefault(key, value)
    return args


def context_length(cfg: Config) -> int | None:
    """SGLang's ``--context-length``: the longest sample the config allows when the prompt is bounded
    (SGLang refuses a request whose input plus max_new_tokens exceeds it, and sizes its per-request token
    table by it: a 128k-position model serving 16k-token samples holds 8x the table otherwise); the
    positions the model's RoPE scaling reaches when SGLang would not count them itself (a ``factor`` with
    an ``original_max_position_embeddings`` leaves SGLang at ``max_position_embeddings``); else SGLang's
    own (None). check_config has refused a config asking for more than the model's positions."""
    model = ModelPositions.of_folder(cfg.model.path)
    if cfg.rollout.max_prompt_len is not None:
        return asked_length(cfg)
    if model is not None and model.positions > model.max_position_embeddings:
        return model.positions
    return None


def router_args(request_timeout: float) -> list[str]:
    """The router must not cut a generation the client still waits for (its default is 1800 s)."""
    return ["--request-timeout-secs", str(int(request_timeout) + 60)]


def start_servers(model_path: str, *, num_engines: int, tp_size: int, engine_args: dict[str, Any],
                  python: str | None, gpu_ids: list[list[int]] | None, work_dir: Path, policy: str,
                  startup_timeout: float, host: str, request_timeout: float,
                  ) -> tuple[list[SGLangServer], Router, EngineKeys]:
    """Start the servers (all at once) with fresh keys, wait until each is healthy, then the router
    with all of them registered. On any failure, what was started is stopped."""
    log_dir = work_dir / "logs"
    keys = EngineKeys.generate()
    servers: list[SGLangServer] = []
    router = None
    try:
        for i in range(num_engines):
            servers.append(start_server(i, model_path, log_dir=log_dir, python=python, tp_size=tp_size,
                                        engine_args=engine_args, gpu_ids=gpu_ids[i] if gpu_ids else None,
                                        host=host, keys=keys))
        for server in servers:
            wait_healthy(server, startup_timeout)
        router = launch_router(log_dir, policy=policy, extra_args=router_args(request_timeout), key=keys.router_key)
        for server in servers:
            router.add_worker(server.url, api_key=keys.api_key)
        router.wait_ready(len(servers))
    except BaseException:
        for server in servers:
            if server.process is not None:
                server.process.stop()
        if router is not None:
            router.stop()
        raise
    return servers, router, keys


def attach_servers(urls: list[str], *, work_dir: Path, policy: str, request_timeout: float,
                   keys: EngineKeys | None = None) -> tuple[list[SGLangServer], Router, EngineKeys, str]:
    """Servers someone else runs, with ``keys`` (default: from the environment, `EngineKeys.for_attached`),
    behind a router of ours; and the model path they serve."""
    keys = keys or EngineKeys.for_attached()
    servers = [attach_server(i, url, keys=keys) for i, url in enumerate(urls)]
    model_path = httpx.get(f"{servers[0].url}/model_info", headers=servers[0].headers,
                           timeout=30).json()["model_path"]
    router = launch_router(work_dir / "logs", policy=policy, extra_args=router_args(request_timeout),
                           key=keys.router_key)
    try:
        for server in servers:
            router.add_worker(server.url, api_key=keys.api_key)
        router.wait_ready(len(servers))
    except BaseException:
        router.stop()
        raise
    return servers, router, keys, model_path
