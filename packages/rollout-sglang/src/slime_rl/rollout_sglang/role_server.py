"""A served role on SGLang (roles.<name>.engine: sglang, GPUs): one server of the role's ``num_gpus`` (its
tensor-parallel size) on the GPUs the placement plan gives it, started by the role's Ray actor
(core/run/role_workers.py) once the rollout engines are healthy.

- a teacher or a judge: a plain generation server (it keeps its tokenizer: judges send text);
- a reward model: ``--is-embedding``, scored through the native ``/classify`` (its reply's ``embedding`` is the
  scalar head's output). SGLang 0.5.17 serves these scalar-head families (srt/models): Gemma2ForSequenceClassification,
  InternLM2ForRewardModel, LlamaForSequenceClassification (and ...WithNormal_Weights), Qwen2ForSequenceClassification,
  Qwen2ForRewardModel, Qwen3ForSequenceClassification, Qwen3ForRewardModel.

The server demands the role's key (``--api-key``) on every request but ``/health``; its admin key is a fresh
one nobody keeps, so no weight update, memory release or flush ever reaches a role: it is frozen. On a GPU it
shares with the rollout engines (``colocate``) give ``engine_args.mem_fraction_static`` so that the fractions sum
below 1 (docs/roles.md).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from slime_rl.core.config.dtype import model_dtype
from slime_rl.core.infra.net import LOOPBACK
from slime_rl.rollout_sglang import launch as fleet
from slime_rl.rollout_sglang.keys import EngineKeys, new_key
from slime_rl.rollout_sglang.server import SGLangServer, is_healthy, start_server, wait_healthy
from slime_rl.rollout_sglang.settings import sglang_settings

if TYPE_CHECKING:
    from slime_rl.core.config import Config


def role_server_args(cfg: Config, name: str) -> dict[str, Any]:
    """The server flags of roles.<name>: its engine_args, with what its kind and the run imply (the user's win)."""
    role = cfg.roles[name]
    args = dict(role.engine_args)
    if role.kind == "reward_model":
        args.setdefault("is_embedding", True)
    if role.tokenizer_path:
        args.setdefault("tokenizer_path", role.tokenizer_path)
    args.setdefault("dtype", model_dtype(cfg.model.dtype, "cuda"))
    return args


def physical_gpus(planned: list[int], visible: str | None = None) -> list[int]:
    """The planned local GPU indexes read through CUDA_VISIBLE_DEVICES when it lists enough of them."""
    listed = [d.strip() for d in (os.environ.get("CUDA_VISIBLE_DEVICES", "") if visible is None else visible).split(",")
              if d.strip()]
    return [int(listed[g]) for g in planned] if planned and len(listed) > max(planned) else list(planned)


class SGLangRoleServer:
    """`RoleService` of a role served by one SGLang server."""

    def __init__(self, server: SGLangServer):
        self.server = server

    @classmethod
    def start(cls, cfg: Config, name: str, *, api_key: str | None, host: str = LOOPBACK,
              gpu_ids: list[int] | None = None) -> SGLangRoleServer:
        role = cfg.roles[name]
        settings = sglang_settings(cfg)
        keys = EngineKeys(api_key=api_key, admin_key=new_key())  # the admin key is kept by no one: frozen
        server = start_server(0, role.path, log_dir=fleet.work_dir(cfg) / "roles" / name, python=settings.engine_python,
                              tp_size=role.num_gpus, engine_args=role_server_args(cfg, name),
                              gpu_ids=physical_gpus(gpu_ids) if gpu_ids else None, host=host, keys=keys)
        wait_healthy(server, role.startup_timeout_s)
        return cls(server)

    @property
    def url(self) -> str:
        return self.server.url

    def healthy(self) -> bool:
        return (self.server.process is None or self.server.process.alive()) and is_healthy(self.server.url)

    def stop(self) -> None:
        if self.server.process is not None:
            self.server.process.stop()
