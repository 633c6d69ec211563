"""Where a run's served roles answer: one private JSON file the run rewrites when a role (re)starts.

The rollout worker, and the reward workers it starts, read it through ``$SLIME_RL_ROLES_FILE``: a user's
reward function, in a worker process, gets a client with `role_client` and never sees the URL or key
(the client's repr and errors keep them out). A role restarted on a new port is found on the next call.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from slime_rl.core.roles.client import RoleClient

ENV_ROLES_FILE = "SLIME_RL_ROLES_FILE"
ROLES_FILE_NAME = "roles.json"  # in the run's rollout state folder (run/run_dir.py)


@dataclass(frozen=True)
class Endpoint:
    name: str
    kind: str  # teacher | reward_model | judge
    url: str
    api_key: str | None
    timeout_s: float
    attempts: int
    batch_size: int
    max_new_tokens: int

    def __repr__(self) -> str:  # never the key or the URL
        return f"Endpoint({self.name!r}, kind={self.kind!r})"

    def client(self) -> RoleClient:
        return RoleClient(self.name, self.url, self.api_key, timeout_s=self.timeout_s, attempts=self.attempts)


def write_endpoints(path: Path, endpoints: dict[str, Endpoint]) -> None:
    """Replace ``path`` at once (readers never see half a file), readable by this user only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(path.name + ".part")
    fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump({name: asdict(e) for name, e in endpoints.items()}, out)
    os.replace(part, path)


def read_endpoints(path: str | Path | None = None) -> dict[str, Endpoint]:
    where = path or os.environ.get(ENV_ROLES_FILE)
    if not where:
        raise LookupError(f"no served roles here (${ENV_ROLES_FILE} is unset): a role client works inside a"
                          " run that declares roles (config: roles.<name>)")
    return {name: Endpoint(**fields) for name, fields in json.loads(Path(where).read_text()).items()}


def role_client(name: str | None = None, *, kind: str = "judge") -> RoleClient:
    """A client of the run's role ``name`` (default: its one role of ``kind``), for a reward function:
    ``await role_client("judge").generate(prompt)``. Its timeouts, retries and key are the role's config."""
    endpoints = read_endpoints()
    if name is None:
        named = [e.name for e in endpoints.values() if e.kind == kind]
        if len(named) != 1:
            raise LookupError(f"role_client: the run has {len(named)} roles of kind {kind} ({', '.join(named)});"
                              " name the one to call")
        name = named[0]
    if name not in endpoints:
        raise LookupError(f"role_client: the run serves no role {name!r}; it serves {', '.join(endpoints) or 'none'}")
    return endpoints[name].client()
