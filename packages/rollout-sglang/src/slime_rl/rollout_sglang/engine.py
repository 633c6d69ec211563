"""`SGLangEngine`: N SGLang servers behind one sglang-router, as one `RolloutEngine`.

Generation goes through the router; control calls (abort, weight sync, memory) go to
every server directly (the router does not forward ``/abort_request``). A monitor task
watches the servers: one that dies is taken out of the router, restarted (or, when
attached, waited for), given the current weights and registered again. Its in-flight
requests are retried elsewhere by the router or by the client, and each ``generate``
call returns exactly once.

A weight sync (weights/engine_sync.py, `EngineWeightSync`) holds new requests; requests already out are paused (SGLang aborts
them and they come back with the tokens made so far) and continue from where they stopped once the new
weights are in, so a sync loses no work and never surfaces as an abort to the caller. A dead server's
restart is `EngineRecovery` (recovery.py); the engine holds both and delegates to them.

With LoRA adapters (``trainer.lora``, ``rollout.lora_sync: adapter``) a sync pauses nothing: each
version is loaded as a new adapter beside the current one, requests from then on name it, and the
old one leaves the servers after its last request (weights/adapter_roster.py, docs/lora-sglang.md).
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
import uuid
import zlib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import httpx

from slime_rl.core.algorithms.lora import LoraSpec, lora_spec, syncs_adapters
from slime_rl.core.config.placement import plan_placement
from slime_rl.core.contracts import GenerateOutput, NamedTensors, RolloutEngine, SamplingParams
from slime_rl.core.infra.net import LOOPBACK
from slime_rl.rollout_sglang import fp8, vision
from slime_rl.rollout_sglang import launch as fleet
from slime_rl.rollout_sglang.client import GenerateClient, GenerateError, served_routing_shape
from slime_rl.rollout_sglang.control import ServerControl
from slime_rl.rollout_sglang.hold import GenerationHold
from slime_rl.rollout_sglang.keys import EngineKeys
from slime_rl.rollout_sglang.recovery import EngineRecovery
from slime_rl.rollout_sglang.router import Router
from slime_rl.rollout_sglang.server import SGLangServer
from slime_rl.rollout_sglang.settings import SGLangSettings, sglang_settings
from slime_rl.rollout_sglang.weights import adapters, server_api
from slime_rl.rollout_sglang.weights.adapter_roster import AdapterRoster
from slime_rl.rollout_sglang.weights.engine_sync import EngineWeightSync
from slime_rl.rollout_sglang.weights.pusher import BucketPusher
from slime_rl.rollout_sglang.weights.server_api import Target

if TYPE_CHECKING:
    from slime_rl.core.config import Config

logger = logging.getLogger(__name__)

Transport = Literal["auto", "tensor", "nccl", "disk"]
ALL_MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")


@dataclass
class _Request:
    rid: str
    wire_rid: str | None = None  # the rid of the attempt on the wire; None while queued here
    aborted: bool = False  # the caller asked for it to stop
    done: bool = False


def _delegated(component: str, attr: str, doc: str) -> property:
    """An engine attribute that is its component's (``engine.verify_weights = True`` sets the sync's)."""
    return property(lambda self: getattr(getattr(self, component), attr),
                    lambda self, value: setattr(getattr(self, component), attr, value), doc=doc)


class SGLangEngine(RolloutEngine):
    """N SGLang servers behind one sglang-router. Build with `from_config`, `launch` or `attach`.
    Tunables beyond the config are attributes: ``verify_weights``, ``sync_timeout``,
    ``health_interval`` (0: no monitor), ``keep_weights_for_recovery``."""

    # The training loop has trainer rank 0 push weights straight to the servers (CUDA IPC, NCCL).
    weight_sender = "slime_rl.rollout_sglang.weights.trainer_sender:SGLangWeightSender"
    # No "pause": a weight sync holds requests itself (SGLang's pause_generation, then they continue), but
    # pause_generation/continue_generation are not offered to the loop. routed_experts needs a MoE model and
    # the server flag --enable-return-routed-experts (rollout.sglang.server_args.enable_return_routed_experts).
    capabilities = frozenset({"release_memory", "routed_experts"})
    settings = SGLangSettings  # rollout.sglang (settings.py, also the entry point the config loader reads)

    def __init__(self, servers: list[SGLangServer], router: Router, *, model_path: str, work_dir: str | Path,
                 max_concurrency: int = 512, transport: Transport = "auto", colocated: bool = True,
                 request_timeout: float = 3600.0, sync_timeout: float = 600.0, startup_timeout: float = 900.0,
                 health_interval: float = 5.0, keep_weights_for_recovery: bool | None = None,
                 verify_weights: bool = False, weights_cpu_backup: bool = False, keys: EngineKeys | None = None,
                 lora: LoraSpec | None = None):
        self.router = router
        self.model_path = model_path
        self.work_dir = Path(work_dir)
        self.weights_cpu_backup = weights_cpu_backup  # the servers keep weights over a memory release
        self.keys = keys or EngineKeys()  # the run's keys (keys.py); the servers and the router refuse others
        self.control = ServerControl(servers)  # which servers take control calls, and the threads to call on
        self.hold = GenerationHold()  # why generation is held; the sync and recovery change it too
        self._inflight: dict[str, _Request] = {}
        self.weights = EngineWeightSync(
            control=self.control, hold=self.hold, model_path=model_path, transport=transport, colocated=colocated,
            pusher=BucketPusher(weights_dir=self.work_dir / "weights", model_path=model_path, timeout=sync_timeout),
            # trainer.lora with rollout.lora_sync=adapter: syncs load adapters (adapter_roster.py), the base stays
            roster=AdapterRoster(lora, self.work_dir) if lora is not None else None,
            requests_out=lambda: bool(self._inflight), keep_weights_for_recovery=keep_weights_for_recovery,
            verify_weights=verify_weights)
        self.recovery = EngineRecovery(control=self.control, router=router, weights=self.weights, hold=self.hold,
                                       startup_timeout=startup_timeout, health_interval=health_interval)
        self.client = GenerateClient(router.url, max_concurrency=max_concurrency, request_timeout=request_timeout,
                                     retry_timeout=startup_timeout, api_key=router.key,
                                     recovering=self.recovery.restarting)
        self._engine_clients: dict[str, GenerateClient] = {}  # url -> a client straight to that engine
        self.accepts_images = vision.serves_images(model_path)  # a vision-language model (docs/vlm.md)
        self._vision_ids = vision.vision_token_ids(model_path) if self.accepts_images else frozenset()

    # ------------------------------------------------------------------ construction

    @classmethod
    def serve_role(cls, cfg: Config, name: str, **where: Any) -> Any:
        """``roles.<name>`` on an SGLang server of its own (role_server.py): a `RoleService`."""
        from slime_rl.rollout_sglang.role_server import SGLangRoleServer

        return SGLangRoleServer.start(cfg, name, **where)

    @classmethod
    def from_config(cls, cfg: Config) -> SGLangEngine:
        """Launch one server per engine of the placement plan (`plan_placement`, what ``slime-cli plan``
        prints), each on the GPUs the plan gives it, or attach to ``rollout.sglang.engine_urls``; start the
        router and register them."""
        r, c, s = cfg.rollout, cfg.cluster, sglang_settings(cfg)
        common = dict(work_dir=fleet.work_dir(cfg), policy=s.router_policy, max_concurrency=r.max_concurrency,
                      transport=r.update_weight_transport, colocated=c.colocate,
                      startup_timeout=s.engine_startup_timeout, sync_timeout=s.weight_sync_timeout,
                      lora=lora_spec(cfg) if syncs_adapters(cfg) else None)
        if s.engine_urls:
            engine = cls.attach(s.engine_urls, keys=EngineKeys.for_attached(api_key=s.api_key,
                                                                            admin_key=s.admin_api_key), **common)
        else:
            plan = plan_placement(cfg)
            gpu_ids = fleet.engine_gpu_ids(plan)
            fp8.check_gpus(cfg, gpu_ids)  # FP8 weights or KV cache: refused below compute capability 8.9
            # rollout.precision=fp8: the servers start from an FP8 copy of the model (fp8.py, docs/fp8.md)
            model_path = str(fp8.prepare_served_folder(cfg)) if r.precision == "fp8" else cfg.model.path
            engine = cls.launch(model_path, num_engines=len(plan.engines), tp_size=c.rollout_num_gpus_per_engine,
                                engine_args=fleet.engine_args(cfg), python=s.engine_python,
                                gpu_ids=gpu_ids, host=fleet.server_host(plan), **common)
        if r.precision == "fp8":  # buckets synced from this process go as FP8 pairs too (attached servers: docs/fp8.md)
            engine.weights.fp8 = fp8.fp8_format(cfg.model.path, c.rollout_num_gpus_per_engine)
        engine.max_recovery_attempts = s.max_engine_restarts
        engine.client.max_retries = s.generate_max_retries
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
               keys: EngineKeys | None = None, **kwargs) -> SGLangEngine:
        """Front servers someone else runs; a failed one is waited for (not restarted) and then
        given the current weights again. Their ``keys``: rollout.sglang.api_key / admin_api_key, else
        the environment (keys.py: ``SLIME_RL_ENGINE_API_KEY``, ``SLIME_RL_ENGINE_ADMIN_API_KEY``)."""
        work_dir = Path(work_dir or tempfile.mkdtemp(prefix="slime-rl-sglang-"))
        servers, router, keys, model_path = fleet.attach_servers(
            urls, work_dir=work_dir, policy=policy, request_timeout=kwargs.get("request_timeout", 3600.0), keys=keys)
        try:
            for server in servers if kwargs.get("lora") is not None else []:  # started without our LoRA flags?
                info = httpx.get(f"{server.url}/server_info", headers=server.headers, timeout=30).json()
                adapters.check_attached_server(server.name, info, kwargs["lora"])
        except BaseException:
            router.stop()
            raise
        return cls(servers, router, model_path=model_path, work_dir=work_dir, keys=keys, **kwargs)

    # ------------------------------------------------------------------ the components' attributes

    roster = _delegated("weights", "roster", "The LoRA adapters the servers hold (None: syncs load full weights).")
    transport = _delegated("weights", "transport", "auto, tensor, nccl or disk (rollout.update_weight_transport).")
    verify_weights = _delegated("weights", "verify_weights", "Compare engine and trainer weights after each sync.")
    keep_weights_for_recovery = _delegated("weights", "keep_weights_for_recovery",
                                           "A host copy of each engine-side sync, to restore a restarted engine.")
    pause_mode = _delegated("weights", "pause_mode", "abort, or in_place under cluster.async_mode=fully.")
    sync_timeout = _delegated("weights", "timeout", "One transfer step (one bucket into one engine, a pause, a flush).")
    health_interval = _delegated("recovery", "health_interval", "Seconds between health checks (0: no monitor).")
    max_recovery_attempts = _delegated("recovery", "max_recovery_attempts", "rollout.sglang.max_engine_restarts.")
    restarts = _delegated("recovery", "restarts", "Engines restarted after a failure (a metric).")

    @property
    def weight_version(self) -> int:
        return self.weights.version

    @property
    def servers(self) -> list[SGLangServer]:
        return self.control.servers

    @property
    def engine_urls(self) -> list[str]:
        return [s.url for s in self.servers]

    def targets(self) -> list[Target]:
        """The servers that take part in control calls now (`ServerControl.targets`)."""
        return self.control.targets()

    async def health(self) -> bool:
        return await self.recovery.health()

    async def _gate(self, req: _Request) -> None:
        """Wait while a sync or a memory release holds generation (unless the request is aborted);
        restore stale weights first."""
        hold = self.hold
        while (hold.closed_by or hold.weights_stale) and not req.aborted:
            if hold.shut:
                raise RuntimeError("SGLangEngine is shut down")
            if not hold.closed_by and hold.weights_stale:
                await self.weights.restore_stale()
                continue
            await asyncio.sleep(0.02)
        if hold.shut:
            raise RuntimeError("SGLangEngine is shut down")

    # ------------------------------------------------------------------ weight syncs (weights/engine_sync.py)

    async def update_weights(self, named_tensors: NamedTensors, *, version: int, last: bool) -> None:
        """One bucket of a sync from tensors in this process (`EngineWeightSync.update_weights`)."""
        self.recovery.start_monitor()
        await self.weights.update_weights(named_tensors, version=version, last=last)

    async def begin_weight_sync(self, version: int, *, transport: str = "tensor") -> list[Target]:
        """Hold generation for a sync the trainer pushes itself; returns the targets it sends to."""
        self.recovery.start_monitor()
        return await self.weights.begin_weight_sync(version, transport=transport)

    async def end_weight_sync(self, version: int, *, hf_folder: str | Path | None = None) -> None:
        """The pushed sync is complete: flush, check, and serve ``version``."""
        await self.weights.end_weight_sync(version, hf_folder=hf_folder)

    # ------------------------------------------------------------------ generation

    async def generate(self, input_ids: list[int], params: SamplingParams,
                       request_id: str | None = None, images: list[str] | None = None) -> GenerateOutput:
        self.recovery.start_monitor()
        prompt_len, image_data = len(input_ids), None
        if images:  # one pad per image and the images, which SGLang expands back to our ids (vision.py)
            input_ids, image_data = vision.request(input_ids, images, self.model_path)
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
                epoch = self.hold.pause_epoch
                if req.aborted:
                    return GenerateOutput(tokens, log_probs, "abort", self.weight_version, token_versions=versions)
                part_params = replace(params, max_new_tokens=params.max_new_tokens - len(tokens))
                wire_prefix = f"{rid}#{uuid.uuid4().hex[:12]}"  # a rid SGLang has not seen, for every part
                client, routed_shape, part_version = self.client, None, self.weight_version
                if params.return_routed_experts:
                    client, routed_shape = self._engine_client(rid), served_routing_shape(self.model_path)
                lora, version = self.roster.acquire() if self.roster else (None, self.weight_version)
                try:
                    out = await client.generate(list(input_ids) + tokens, part_params, wire_prefix,
                                                default_version=version, should_stop=lambda: req.aborted,
                                                routed_shape=routed_shape, routing_key=routing_key, lora_path=lora,
                                                image_data=image_data,
                                                expect_prompt_tokens=prompt_len + len(tokens) if images else None,
                                                on_attempt=lambda wire_rid: setattr(req, "wire_rid", wire_rid))
                except GenerateError as err:
                    raise GenerateError(f"{err}; the engines: {self.recovery.describe_servers()}") from None
                finally:
                    self.weights.release_adapter(lora)
                if lora is not None:  # the server's own version is the base's; the adapter is the policy
                    out = replace(out, weight_version=version)
                out = vision.end_before_vision_tokens(out, self._vision_ids, first=not tokens)  # no image pads out
                req.wire_rid = None  # back from the server: nothing there to abort
                cached = out.cached_tokens if not tokens and cached is None else cached
                tokens += out.token_ids
                log_probs += out.log_probs
                versions += [min(part_version, out.weight_version)] * len(out.token_ids)
                paused_meanwhile = epoch != self.hold.pause_epoch or bool(self.hold.closed_by)
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
                                                 recovering=self.recovery.restarting)
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
        self.hold.close("memory")
        self.hold.servers_paused = True
        targets, run = self.targets(), self.control.run
        await run(server_api.pause_generation, targets, timeout=self.sync_timeout, step="release: pause")
        await run(server_api.flush_cache, targets, timeout=self.sync_timeout, step="release: flush cache")
        await run(server_api.release_memory, targets, tags, timeout=self.sync_timeout)
        self.hold.released |= set(tags or ALL_MEMORY_TAGS)

    async def resume_memory(self, tags: list[str] | None = None) -> None:
        """Take the memory back (default: all that was released; SGLang refuses a tag it did not
        release). Weights released without a CPU backup hold garbage until the next sync; if
        generation is asked for first, the current version is restored from its copy."""
        hold = self.hold
        tags = sorted(hold.released) if tags is None else [t for t in tags if t in hold.released]
        if not tags:
            return
        await self.control.run(server_api.resume_memory, self.targets(), tags, timeout=self.sync_timeout)
        if "weights" in tags and "weights" in hold.released and not self.weights_cpu_backup:
            hold.weights_stale = True
        hold.released -= set(tags)
        if not hold.released:
            if "sync" not in hold.closed_by:
                await self.control.run(server_api.continue_generation, self.targets(), timeout=self.sync_timeout,
                                       step="resume: continue generation")
                hold.servers_paused = False
            hold.closed_by.discard("memory")

    async def shutdown(self) -> None:
        if self.hold.shut:
            return
        self.hold.shut = True
        self.recovery.stop_monitor()
        for client in (self.client, *self._engine_clients.values()):
            await client.aclose()
        self.weights.pusher.close()
        self.router.stop()
        for server in self.servers:
            if server.process is not None:
                server.process.stop()
        self.control.shutdown()

