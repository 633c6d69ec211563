"""What an engine backend gives a run to serve a role: `RoleService`, from the engine class's
``serve_role(cfg, name, *, api_key, host, gpu_ids)`` (rollout_hf's HFEngine, rollout_sglang's SGLangEngine).
The run holds it in a role's own Ray actor (core/run/role_workers.py)."""

from __future__ import annotations

from typing import Protocol


class RoleService(Protocol):
    """A role's server, started: where it answers, whether it does, and how it stops. A frozen model: it has
    no weight-update path at all (no weight sync ever reaches a role)."""

    @property
    def url(self) -> str: ...

    def healthy(self) -> bool: ...

    def stop(self) -> None: ...
