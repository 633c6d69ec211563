"""The served roles of a run (config/roles.py) as Ray actors: one `RoleWorker` a role, each holding the
`RoleService` its engine backend started (``serve_role`` of the engine class roles.<name>.engine names), and
`Roles`, the driver's handle on all of them: started after the rollout engines are healthy (on a shared GPU the
second server must find the first one's memory taken), health-checked between steps, restarted when one
stops answering (at most ``max_restarts`` times, then the run fails in one line), stopped with the run.

Roles are frozen: the run's weight sync (weights/sync.py) knows only the policy's engines, and a
`RoleService` has no weight-update path. Where they answer goes to the endpoints file
(core/roles/endpoints.py) that the rollout worker and its reward workers read.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slime_rl.core.config import Config, RunFailedError
from slime_rl.core.config.roles import RoleConfig
from slime_rl.core.config.secrets import remember
from slime_rl.core.infra.net import LOOPBACK
from slime_rl.core.infra.plugins import PluginError, load_plugin
from slime_rl.core.infra.private_files import keep_files_private
from slime_rl.core.infra.ray_cluster import KeepsInitMistake, keep_init_mistake
from slime_rl.core.infra.stall import Party, StallWatch
from slime_rl.core.roles.client import RoleClient
from slime_rl.core.roles.endpoints import Endpoint, write_endpoints

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from slime_rl.core.infra.ray_placement import Reservation


def role_service(cfg: Config, name: str, *, api_key: str | None, host: str = LOOPBACK,
                 gpu_ids: list[int] | None = None) -> Any:
    """Start roles.<name> with its engine backend's ``serve_role``; a `RoleService`."""
    role = cfg.roles[name]
    engine_cls = load_plugin("slime_rl.rollout_engines", role.engine)
    serve = getattr(engine_cls, "serve_role", None)
    if serve is None:
        raise PluginError(f"roles.{name}.engine: the {role.engine} engine cannot serve a role (no serve_role);"
                          " use hf or sglang")
    return serve(cfg, name, api_key=api_key, host=host, gpu_ids=gpu_ids)


class RoleWorker(KeepsInitMistake):
    """One role's server, in a process of its own (a Ray actor on its planned node)."""

    @keep_init_mistake
    def __init__(self, cfg_dict: dict[str, Any], name: str, api_key: str | None, gpu_ids: list[int] | None = None):
        keep_files_private()
        self.cfg = Config.model_validate(cfg_dict)
        self.name, self.api_key, self.gpu_ids = name, api_key, gpu_ids
        threads = int(os.environ.get("SLIME_RL_TORCH_THREADS", "0"))
        if threads:
            import torch

            torch.set_num_threads(threads)
        self.service = role_service(self.cfg, name, api_key=api_key, gpu_ids=gpu_ids)

    def ready(self) -> str:
        """The URL it answers at, once started (raises the construction error otherwise)."""
        self.raise_init_mistake()
        return self.service.url

    def process(self) -> tuple[str, int]:
        import ray

        return ray.get_runtime_context().get_node_id(), os.getpid()

    def healthy(self) -> bool:
        return bool(self.service.healthy())

    def restart(self) -> str:
        """Stop the server and start it again (same key); its new URL."""
        try:
            self.service.stop()
        except Exception:  # noqa: BLE001 - a dead server may not stop cleanly; a new one starts either way
            pass
        self.service = role_service(self.cfg, self.name, api_key=self.api_key, gpu_ids=self.gpu_ids)
        return self.service.url

    def shutdown(self) -> None:
        self.service.stop()


def endpoint_of(name: str, role: RoleConfig, url: str, api_key: str | None) -> Endpoint:
    return Endpoint(name=name, kind=role.kind, url=url, api_key=api_key, timeout_s=role.timeout_s,
                    attempts=role.attempts, batch_size=role.batch_size, max_new_tokens=role.max_new_tokens)


class Roles:
    """The driver's handle on the run's role actors."""

    def __init__(self, cfg: Config, reservation: Reservation, watch: StallWatch, endpoints_file: Path):
        self.cfg, self.watch, self.endpoints_file, self.reservation = cfg, watch, endpoints_file, reservation
        self.keys: dict[str, str] = {}
        self.workers: dict[str, ActorHandle] = {}
        self.restarts: dict[str, int] = dict.fromkeys(cfg.roles, 0)
        self.last_check = time.monotonic()
        for name, role in cfg.roles.items():
            key = role.api_key.reveal() if role.api_key is not None else "sk" + secrets.token_hex(32)
            remember(key)  # out of every error text this process prints
            self.keys[name] = key
            self.workers[name] = self._spawn(name)
        self.urls: dict[str, str] = {}

    def _spawn(self, name: str) -> ActorHandle:
        """A new actor for roles.<name> on its planned bundle (its server starts in the actor's constructor)."""
        import ray

        role = self.cfg.roles[name]
        worker = ray.remote(**self.reservation.role_options(name))(RoleWorker).remote(
            self.cfg.to_dict(reveal_secrets=True), name, self.keys[name], self.reservation.role_gpu_ids(name))
        self.watch.register(worker, Party(f"role {name} ({role.kind}, engine {role.engine})"))
        return worker

    def wait_ready(self) -> None:
        """Once every role answers; writes the endpoints file."""
        for name, worker in self.workers.items():  # one at a time: a shared GPU's servers start in turn
            self.urls[name] = self.watch.get("role start", [worker.ready.remote()], [worker])[0]
        self._write()

    def _write(self) -> None:
        write_endpoints(self.endpoints_file, {name: endpoint_of(name, self.cfg.roles[name], url, self.keys[name])
                                              for name, url in self.urls.items()})

    def check(self, force: bool = False) -> list[str]:
        """Health-check every role whose interval passed (all with ``force``); restart those that do not
        answer. Returns notes of what was restarted; RunFailedError past a role's max_restarts."""
        now = time.monotonic()
        interval = min((r.health_interval_s for r in self.cfg.roles.values()), default=0.0)
        if not self.workers or (not force and now - self.last_check < interval):
            return []
        self.last_check = now
        notes = []
        for name, worker in list(self.workers.items()):
            answers = self._answers(name, worker)
            if answers:
                continue
            self.restarts[name] += 1
            role = self.cfg.roles[name]
            if self.restarts[name] > role.max_restarts:
                raise RunFailedError(f"roles.{name}.max_restarts: the {role.kind} role stopped answering"
                                     f" {self.restarts[name]} times; see its log, or raise max_restarts")
            if answers is None:  # its process died: a new actor, on the same bundle
                worker = self.workers[name] = self._spawn(name)
                self.urls[name] = self.watch.get("role start", [worker.ready.remote()], [worker])[0]
            else:
                self.urls[name] = self.watch.get("role start", [worker.restart.remote()], [worker])[0]
            self._write()
            notes.append(f"role {name} stopped answering; restarted ({self.restarts[name]} of {role.max_restarts})")
        return notes

    def _answers(self, name: str, worker: ActorHandle) -> bool | None:
        """Whether the role's server answers; None when its actor (the process) is gone."""
        try:
            alive = self.watch.get("role health", [worker.healthy.remote()], [worker])[0]
        except Exception:  # noqa: BLE001 - the actor itself died: a restart needs a new actor
            return None
        client = RoleClient(name, self.urls[name], self.keys[name])
        return bool(alive) and asyncio.run(client.healthy())

    def shutdown(self) -> None:
        for name, worker in self.workers.items():
            try:
                self.watch.get("role stop", [worker.shutdown.remote()], [worker])
            except Exception:  # noqa: BLE001 - stopping the rest matters more than one that failed to stop
                print(f"slime-rl: role {name} did not stop cleanly", flush=True)
