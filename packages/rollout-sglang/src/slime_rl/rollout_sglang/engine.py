"""`SGLangEngine`: N SGLang servers behind one sglang-router, as one `RolloutEngine`.

Generation goes through the router; control calls (abort, weight sync, memory) go to
every server directly (the router does not forward ``/abort_request``). A monitor task
watches the servers: one that dies is taken out of the router, restarted (or, when
attached, waited for), given the current weights and registered again. Its in-flight
requests are retried elsewhere by the router or by the client, and each ``generate``
call returns exactly once.

A weight sync (engine_sync.py) holds new requests; requests already out are paused (SGLang aborts
them and they come back with the tokens made so far) and continue from where they stopped once the new
weights are in, so a sync loses no work and never surfaces as an abort to the caller.

With LoRA adapters (``trainer.lora``, ``rollout.lora_sync: adapter``) a sync pauses nothing: each
version is loaded as a new adapter beside the current one, requests from then on name it, and the
old one leaves the servers after its last request (adapter_roster.py, docs/lora-sglang.md).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import tempfile
import uuid
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import httpx
import torch

from slime_rl.core.algorithms.lora import LoraSpec, lora_spec, syncs_adapters
from slime_rl.core.config.placement import plan_placement
from slime_rl.core.contracts import GenerateOutput, RolloutEngine, SamplingParams
from slime_rl.core.infra.net import LOOPBACK
from slime_rl.rollout_sglang import adapters
from slime_rl.rollout_sglang import launch as fleet
from slime_rl.rollout_sglang import weight_sync as ws
from slime_rl.rollout_sglang.adapter_roster import AdapterRoster
from slime_rl.rollout_sglang.client import GenerateClient, GenerateError, served_routing_shape
from slime_rl.rollout_sglang.engine_sync import EngineWeightSync
from slime_rl.rollout_sglang.keys import EngineKeys
from slime_rl.rollout_sglang.recovery import EngineRecovery, server_target
from slime_rl.rollout_sglang.router import Router
from slime_rl.rollout_sglang.server import SGLangServer
from slime_rl.rollout_sglang.transport import BucketPusher

if TYPE_CHECKING:
    from slime_rl.core.config import Config

logger = logging.getLogger(__name__)

T = TypeVar("T")
Transport = Literal["auto", "tensor", "nccl", "disk"]
ALL_MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")


@dataclass
class _Request:
    rid: str
    wire_rid: str | None = None  # the rid of the attempt on the wire; None while queued here
    aborted: bool = False  # the caller asked for it to stop
    done: bool = False


class SGLangEngine(EngineWeightSync, EngineRecovery, RolloutEngine):
    """N SGLang servers behind one sglang-router. Build with `from_config`, `launch` or `attach`.
    Tunables beyond the config are attributes: ``verify_weights``, ``sync_timeout``,
    ``health_interval`` (0: no monitor), ``keep_weights_for_recovery``."""

    # The training loop has trainer rank 0 push weights straight to the servers (CUDA IPC, NCCL).
    weight_sender = "slime_rl.rollout_sglang.trainer_sync:SGLangWeightSender"
    # No "pause": a weight sync holds requests itself (SGLang's pause_generation, then they continue), but
    # pause_generation/continue_generation are not offered to the loop. routed_experts needs a MoE model and
    # the server flag --enable-return-routed-experts (rollout.engine_args.enable_return_routed_experts).
    capabilities = frozenset({"release_memory", "routed_experts"})

    def __init__(self, servers: list[SGLangServer], router: Router, *, model_path: str, work_dir: str | Path,
                 max_concurrency: int = 512, transport: Transport = "auto", colocated: bool = True,
                 request_timeout: float = 3600.0, sync_timeout: float = 600.0, startup_timeout: float = 900.0,
                 health_interval: float = 5.0, keep_weights_for_recovery: bool | None = None,
                 verify_weights: bool = False, weights_cpu_backup: bool = False, keys: EngineKeys | None = None,
                 lora: LoraSpec | None = None):
        self.servers = servers
        self.router = router
        self.model_path = model_path
        self.work_dir = Path(work_dir)
        self.transport = transport
        self.colocated = colocated
        self._pusher = BucketPusher(weights_dir=self.work_dir / "weights", model_path=model_path, timeout=sync_timeout)
        # trainer.lora with rollout.lora_sync=adapter: syncs load adapters (adapter_roster.py), the base stays
        self.roster = AdapterRoster(lora, self.work_dir) if lora is not None else None
        self._unloads: set[asyncio.Task] = set()  # retired adapters leaving the servers
        self.startup_timeout = startup_timeout  # a restarted server until /health
        self.health_interval = health_interval
        # A host copy of each synced version, to restore a restarted engine. None: only when the buckets are
        # already on the CPU; copying CUDA buckets to the host cost ~10 s per 7B sync (issue 16), so it is opt-in.
        self.keep_weights_for_recovery = keep_weights_for_recovery
        self.verify_weights = verify_weights  # compare engine and trainer weights after each sync
        self.weights_cpu_backup = weights_cpu_backup  # the servers keep weights over a memory release
        self.keys = keys or EngineKeys()  # the run's keys (keys.py); the servers and the router refuse others
        self.client = GenerateClient(router.url, max_concurrency=max_concurrency, request_timeout=request_timeout,
                                     retry_timeout=startup_timeout, api_key=router.key, recovering=self._restarting)
        self._engine_clients: dict[str, GenerateClient] = {}  # url -> a client straight to that engine
        self._version = 0
        self._inflight: dict[str, _Request] = {}
        self._closed_by: set[str] = set()  # why generation is held: "sync", "memory"
        self._pause_epoch = 0  # grows with every pause; a request aborted by one continues
        self._servers_paused = False  # a pause went out and no continue since: opening again sends one
        self._syncing: int | None = None  # the version whose buckets are arriving
        self._bucket_index = 0
        self._sync_transport: str | None = None
        self._sync_lock: asyncio.Lock | None = None
        self._lock_loop: asyncio.AbstractEventLoop | None = None
        self._weights_cpu: dict[str, torch.Tensor] = {}
        self._verify_sample: dict[str, str] = {}  # name -> checksum
        self._disk_folder: Path | None = None  # the HF folder of the current version (disk transport)
        self._restore_folder: tuple[int, Path] | None = None
        self._pushed_by_trainer = False  # the last sync came from the trainer's sender (begin/end_weight_sync)
        self._released: set[str] = set()
        self._weights_stale = False  # weights were released without a backup; restore before generating
        self._recovering: set[int] = set()
        self._failures: dict[int, int] = {}  # consecutive failed health checks per engine
        self._recovery_failures: dict[int, int] = {}
        self.max_recovery_attempts = 3  # rollout.max_engine_restarts
        # cluster.async_mode=fully: running requests wait in place through a sync (not verified on a GPU yet)
        self.pause_mode = "abort"
        self._monitor_task: asyncio.Task | None = None
        self._shut = False
        self.restarts = 0  # engines restarted after a failure (a metric)
        # Control calls (weight sync, memory, recovery) block in threads of their own: asyncio's
        # default executor is shared with whatever else runs in this process, and when it is full
        # a weight sync would wait forever. One per server for recoveries (each may wait minutes), plus the sync's.
        self._control_threads = ThreadPoolExecutor(len(servers) + 4, thread_name_prefix="sglang-control")

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_config(cls, cfg: Config) -> SGLangEngine:
        """Launch one server per engine of the placement plan (`plan_placement`, what ``slime-cli plan``
        prints), each on the GPUs the plan gives it, or attach to ``rollout.engine_urls``; start the
        router and register them."""
        r, c = cfg.rollout, cfg.cluster
        common = dict(work_dir=fleet.work_dir(cfg), policy=r.router_policy, max_concurrency=r.max_concurrency,
                      transport=r.update_weight_transport, colocated=c.colocate,
                      startup_timeout=r.engine_startup_timeout, sync_timeout=r.weight_sync_timeout,
                      lora=lora_spec(cfg) if syncs_adapters(cfg) else None)
        if r.engine_urls:
            engine = cls.attach(r.engine_urls, **common)
        else:
            plan = plan_placement(cfg)
            engine = cls.launch(cfg.model.path, num_engines=len(plan.engines), tp_size=c.rollout_num_gpus_per_engine,
                                engine_args=fleet.engine_args(cfg), python=r.engine_python,
                                gpu_ids=fleet.engine_gpu_ids(plan), host=fleet.server_host(plan), **common)
        engine.max_recovery_attempts = r.max_engine_restarts
        engine.client.max_retries = r.generate_max_retries
        engine.pause_mode = "in_place" if c.async_mode == "fully" else "abort"
        return engine

    def stats(self) -> dict[str, float]:
        """Counters since launch, for the step metrics."""
        return {"engine/restarts": float(self.restarts), "engine/request_retries": float(self.client.retries)}

    @classmethod
    def launch(cls, model_path: str, *, num_engines: int = 1, tp_size: int = 1, engine_args: dict | None = None,
               python: str | None = None, gpu_ids: list[list[int]] | None = None, work_dir: str | Path | None = None,
               policy: str = "round_robin", startup_timeout: float = 900.0, host: str = LOOPBACK,
               **kwargs) -> SGLangEngine:
        """Start the servers (all at once), wait until each is healthy, then the router. The servers
        listen on ``host`` (loopback, or the node's private address when trainer ranks on other nodes
        push weights to them), the router on loopback; all refuse requests without this run's fresh
        keys (``/health`` excepted)."""
        work_dir = Path(work_dir or tempfile.mkdtemp(prefix="slime-rl-sglang-"))
        engine_args = dict(engine_args or {})
        servers, router, keys = fleet.start_servers(
            model_path, num_engines=num_engines, tp_size=tp_size, engine_args=engine_args, python=python,
            gpu_ids=gpu_ids, work_dir=work_dir, policy=policy, startup_timeout=startup_timeout, host=host,
            request_timeout=kwargs.get("request_timeout", 3600.0))
        weights_cpu_backup = bool(engine_args.get("enable_weights_cpu_backup"))
        return cls(servers, router, model_path=model_path, work_dir=work_dir, startup_timeout=startup_timeout,
                   weights_cpu_backup=weights_cpu_backup, keys=keys, **kwargs)

    @classmethod
    def attach(cls, urls: list[str], *, work_dir: str | Path | None = None, policy: str = "round_robin",
               **kwargs) -> SGLangEngine:
        """Front servers someone else runs; a failed one is waited for (not restarted) and then
        given the current weights again. Their keys come from the environment (keys.py:
        ``SLIME_RL_ENGINE_API_KEY``, ``SLIME_RL_ENGINE_ADMIN_API_KEY``)."""
        work_dir = Path(work_dir or tempfile.mkdtemp(prefix="slime-rl-sglang-"))
        servers, router, keys, model_path = fleet.attach_servers(
            urls, work_dir=work_dir, policy=policy, request_timeout=kwargs.get("request_timeout", 3600.0))
        try:
            for server in servers if kwargs.get("lora") is not None else []:  # started without our LoRA flags?
                info = httpx.get(f"{server.url}/server_info", headers=server.headers, timeout=30).json()
                adapters.check_attached_server(server.name, info, kwargs["lora"])
        except BaseException:
            router.stop()
            raise
        return cls(servers, router, model_path=model_path, work_dir=work_dir, keys=keys, **kwargs)

    # ------------------------------------------------------------------ plumbing

    @property
    def weight_version(self) -> int:
        return self._version

    @property
    def sync_timeout(self) -> float:
        """One transfer step (one bucket into one engine, a pause, a flush)."""
        return self._pusher.timeout

    @sync_timeout.setter
    def sync_timeout(self, seconds: float) -> None:
        self._pusher.timeout = seconds

    @property
    def engine_urls(self) -> list[str]:
        return [s.url for s in self.servers]

    def targets(self) -> list[ws.Target]:
        """The servers that take part in control calls now: not those being restarted, nor a launched
        one whose process has died (the monitor restarts it and gives it the current weights)."""
        return [server_target(s) for s in self.servers
                if s.index not in self._recovering and (s.process is None or s.process.alive())]

    async def _control_live(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(targets, *args, **kwargs)`` on the live servers; when one dies during the call (its
        process gone), again on those left: the dead one's recovery restores it."""
        while True:
            targets = self.targets()
            try:
                return await self._control(fn, targets, *args, **kwargs)
            except ws.WeightSyncError as err:
                if not await self._control(self._died, targets):
                    raise
                logger.warning("%s: a server died during the call (%s); going on with the others",
                               kwargs.get("step", getattr(fn, "__name__", fn)), err)

    def _lock(self) -> asyncio.Lock:
        loop = asyncio.get_running_loop()
        if self._sync_lock is None or self._lock_loop is not loop:
            self._sync_lock, self._lock_loop = asyncio.Lock(), loop
        return self._sync_lock

    async def _control(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` on the engine's own control threads."""
        return await asyncio.get_running_loop().run_in_executor(self._control_threads,
                                                                functools.partial(fn, *args, **kwargs))

    def _start_monitor(self) -> None:
        loop = asyncio.get_running_loop()
        task = self._monitor_task
        if self.health_interval > 0 and (task is None or task.done() or task.get_loop() is not loop):
            self._monitor_task = loop.create_task(self._monitor())

    async def _gate(self, req: _Request) -> None:
        """Wait while a sync or a memory release holds generation (unless the request is aborted);
        restore stale weights first."""
        while (self._closed_by or self._weights_stale) and not req.aborted:
            if self._shut:
                raise RuntimeError("SGLangEngine is shut down")
            if not self._closed_by and self._weights_stale:
                await self._restore_stale_weights()
                continue
            await asyncio.sleep(0.02)
        if self._shut:
            raise RuntimeError("SGLangEngine is shut down")

    # ------------------------------------------------------------------ generation

    async def generate(self, input_ids: list[int], params: SamplingParams,
                       request_id: str | None = None) -> GenerateOutput:
        self._start_monitor()
        rid = request_id or uuid.uuid4().hex
        if rid in self._inflight:
            raise ValueError(f"request id {rid!r} is already in flight")
        req = self._inflight[rid] = _Request(rid)
        tokens: list[int] = []
        log_probs: list[float] = []
        # SGLang answers with one version (the one at the finish); a part that spanned an in-place update
        # holds tokens of both, and which are which is not reported: its tokens count as the older
        # version (staleness over-counted, never under-counted).
        versions: list[int] = []
        # "<session>/<turn>": every turn of one episode to the same server, whose prefix cache holds it
        routing_key = rid.split("/", 1)[0] if "/" in rid else None
        cached: int | None = None  # the first part's: its input is the caller's
        try:
            while True:
                await self._gate(req)
                epoch = self._pause_epoch
                if req.aborted:
                    return GenerateOutput(tokens, log_probs, "abort", self._version, token_versions=versions)
                part_params = replace(params, max_new_tokens=params.max_new_tokens - len(tokens))
                wire_prefix = f"{rid}#{uuid.uuid4().hex[:12]}"  # a rid SGLang has not seen, for every part
                client, routed_shape, part_version = self.client, None, self._version
                if params.return_routed_experts:
                    client, routed_shape = self._engine_client(rid), served_routing_shape(self.model_path)
                lora, version = self.roster.acquire() if self.roster else (None, self._version)
                try:
                    out = await client.generate(list(input_ids) + tokens, part_params, wire_prefix,
                                                default_version=version, should_stop=lambda: req.aborted,
                                                routed_shape=routed_shape, routing_key=routing_key, lora_path=lora,
                                                on_attempt=lambda wire_rid: setattr(req, "wire_rid", wire_rid))
                except GenerateError as err:
                    raise GenerateError(f"{err}; the engines: {self._describe_servers()}") from None
                finally:
                    self._release_adapter(lora)
                if lora is not None:  # the server's own version is the base's; the adapter is the policy
                    out = replace(out, weight_version=version)
                req.wire_rid = None  # back from the server: nothing there to abort
                cached = out.cached_tokens if not tokens and cached is None else cached
                tokens += out.token_ids
                log_probs += out.log_probs
                versions += [min(part_version, out.weight_version)] * len(out.token_ids)
                paused_meanwhile = epoch != self._pause_epoch or bool(self._closed_by)
                if out.finish_reason == "abort" and not req.aborted and paused_meanwhile:
                    if len(tokens) < params.max_new_tokens:
                        continue  # cut short by a sync or a memory release: go on where it stopped
                    return GenerateOutput(tokens, log_probs, "length", out.weight_version, token_versions=versions,
                                          routed_experts=out.routed_experts, cached_tokens=cached)
                # the last part's routed experts cover the whole sequence (its input held the earlier parts)
                return GenerateOutput(tokens, log_probs, out.finish_reason, out.weight_version, token_versions=versions,
                                      routed_experts=out.routed_experts, cached_tokens=cached)
        finally:
            req.done = True
            self._inflight.pop(rid, None)

    def _engine_client(self, rid: str) -> GenerateClient:
        """A client straight to one engine (chosen by the request id, so a request's continuations
        meet its prefix cache): sglang-router 0.3.2 drops ``return_routed_experts``. Unverified on a
        GPU; a dead engine's requests retry on it until the restart (no router failover)."""
        server = self.servers[zlib.crc32(rid.encode()) % len(self.servers)]
        clients = self._engine_clients
        if server.url not in clients:
            clients[server.url] = GenerateClient(server.url, max_concurrency=self.client._max_concurrency,
                                                 request_timeout=self.client.request_timeout,
                                                 retry_timeout=self.client.retry_timeout,
                                                 max_retries=self.client.max_retries, api_key=self.keys.api_key,
                                                 recovering=self._restarting)
        return clients[server.url]

    async def abort(self, request_id: str | None = None) -> None:
        """Abort one request or all in flight; they return what they have with ``finish_reason="abort"``.
        Returns once the aborted requests that reached a server have come back (or after 30 s)."""
        if request_id is None:
            reqs = list(self._inflight.values())
        else:
            reqs = [self._inflight[request_id]] if request_id in self._inflight else []
        for req in reqs:
            req.aborted = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30.0
        async with httpx.AsyncClient(timeout=10.0) as http:
            while True:
                sent = [r for r in reqs if not r.done and r.wire_rid is not None]
                if not sent:
                    return
                # Re-sent until they return: an abort can reach a server before its request does.
                posts = [http.post(f"{t.url}/abort_request", json={"rid": r.wire_rid}, headers=t.headers)
                         for r in sent for t in self.targets()]
                await asyncio.gather(*posts, return_exceptions=True)
                if loop.time() >= deadline:
                    logger.warning("%d aborted requests still running after 30 s", len(sent))
                    return
                await asyncio.sleep(0.2)

    # ------------------------------------------------------------------ memory

    async def release_memory(self, tags: list[str] | None = None) -> None:
        """Free GPU memory for a colocated trainer (default: weights, KV cache and CUDA graphs).
        Generation is held until `resume_memory`."""
        self._closed_by.add("memory")
        self._pause_epoch += 1
        self._servers_paused = True
        targets = self.targets()
        await self._control(ws.pause_generation, targets, timeout=self.sync_timeout, step="release: pause")
        await self._control(ws.flush_cache, targets, timeout=self.sync_timeout, step="release: flush cache")
        await self._control(ws.release_memory, targets, tags, timeout=self.sync_timeout)
        self._released |= set(tags or ALL_MEMORY_TAGS)

    async def resume_memory(self, tags: list[str] | None = None) -> None:
        """Take the memory back (default: all that was released; SGLang refuses a tag it did not
        release). Weights released without a CPU backup hold garbage until the next sync; if
        generation is asked for first, the current version is restored from its copy."""
        tags = sorted(self._released) if tags is None else [t for t in tags if t in self._released]
        if not tags:
            return
        await self._control(ws.resume_memory, self.targets(), tags, timeout=self.sync_timeout)
        if "weights" in tags and "weights" in self._released and not self.weights_cpu_backup:
            self._weights_stale = True
        self._released -= set(tags)
        if not self._released:
            if "sync" not in self._closed_by:
                await self._control(ws.continue_generation, self.targets(), timeout=self.sync_timeout,
                                        step="resume: continue generation")
                self._servers_paused = False
            self._closed_by.discard("memory")

    async def shutdown(self) -> None:
        if self._shut:
            return
        self._shut = True
        if self._monitor_task is not None and not self._monitor_task.done():
            self._monitor_task.cancel()
        for client in (self.client, *self._engine_clients.values()):
            await client.aclose()
        self._pusher.close()
        self.router.stop()
        for server in self.servers:
            if server.process is not None:
                server.process.stop()
        self._control_threads.shutdown(wait=False, cancel_futures=True)

