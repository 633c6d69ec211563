"""The run's keys for SGLang servers and sglang-router: without them, nothing that changes an
engine (weights, memory, abort, pause) answers, on loopback as well as across nodes.

What each key unlocks (read from SGLang 0.5.17 ``srt/utils/auth.py`` and checked on
sglang-router 0.3.2; docs/multi-node.md "Keys and ports"):

- ``api_key``: a server's ``--api-key``. Its "normal" endpoints: ``/generate``, ``/v1/*``,
  ``/server_info``, ``/model_info``, ``/load_lora_adapter_from_tensors``. The router sends it
  to the server (given per worker in ``POST /workers``).
- ``admin_key``: a server's ``--admin-api-key``. Every admin endpoint: ``/update_weights_*``,
  ``/init_weights_update_group``, ``/release_memory_occupation``, ``/abort_request``,
  ``/pause_generation``, ``/flush_cache``, ``/load_lora_adapter`` ... (with an admin key set,
  SGLang does not accept the api key there). Only this process and the trainer hold it.
- ``router_key``: the router's ``--api-key`` (its ``/generate`` and ``/v1/*``) and its one
  admin control-plane key (``/workers``, ``/flush_cache``, ``/get_loads``).

``/health*`` and ``/metrics`` stay open on both (SGLang and the router never check them).
Keys are sent as ``Authorization: Bearer <key>``. SGLang's ``/server_info`` returns the
server's arguments, both keys among them, to any holder of the api key: treat the api key as
secret as the admin key.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, field

from slime_rl.core.config.secrets import Secret, remember

# Attaching to servers someone else runs (rollout.sglang.engine_urls): their keys come from here.
ENV_API_KEY = "SLIME_RL_ENGINE_API_KEY"
ENV_ADMIN_KEY = "SLIME_RL_ENGINE_ADMIN_API_KEY"  # defaults to SLIME_RL_ENGINE_API_KEY


def new_key() -> str:
    """A fresh random key. Hex after a letter: never read as a flag (a leading '-') or as a
    YAML number, and no ':' (the router's ``id:name:role:key`` format)."""
    return "sk" + secrets.token_hex(32)


def bearer(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


@dataclass(frozen=True)
class EngineKeys:
    api_key: str | None = field(default=None, repr=False)
    admin_key: str | None = field(default=None, repr=False)
    router_key: str | None = field(default=None, repr=False)

    @classmethod
    def generate(cls) -> EngineKeys:
        """Fresh keys for a run that launches its own servers and router."""
        return cls(api_key=new_key(), admin_key=new_key(), router_key=new_key())

    def __post_init__(self) -> None:
        for key in (self.api_key, self.admin_key, self.router_key):  # out of every error text (secrets.redact)
            if key:
                remember(key)

    @classmethod
    def for_attached(cls, environ: dict[str, str] | None = None, *, api_key: Secret | None = None,
                     admin_key: Secret | None = None) -> EngineKeys:
        """Keys of servers the user runs: ``rollout.sglang.api_key`` / ``admin_api_key`` (Secrets: inline
        or ``env:NAME``, redacted wherever the config is saved), else the environment's
        ``SLIME_RL_ENGINE_API_KEY`` / ``SLIME_RL_ENGINE_ADMIN_API_KEY``; the admin key defaults to the api
        key. The router in front of them is ours and gets a fresh key."""
        env = os.environ if environ is None else environ
        api = (api_key.reveal() if api_key is not None else env.get(ENV_API_KEY)) or None
        admin = (admin_key.reveal() if admin_key is not None else env.get(ENV_ADMIN_KEY)) or api
        return cls(api_key=api, admin_key=admin, router_key=new_key())

    def server_config(self) -> dict[str, str]:
        """The keys as SGLang server arguments (written to a private ``--config`` YAML file, so they
        never appear in a process listing)."""
        return {k: v for k, v in (("api-key", self.api_key), ("admin-api-key", self.admin_key)) if v}
