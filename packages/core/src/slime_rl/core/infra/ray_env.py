"""Ray's environment, set before anything imports ray (``slime_rl.core`` imports this first).

Ray reads where it listens and whether it authenticates when ``ray`` is first imported
(shared/notes/ray.md): ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` keeps a local instance on
127.0.0.1, and ``RAY_AUTH_MODE`` is cached in its config. Setting them later does nothing, so
every module of ours that imports ray is in this package, whose ``__init__`` runs this first;
`ray_cluster.local_ray` refuses to start when ray was imported before (`check_local`).

- Local run (no ``RAY_ADDRESS``): loopback only, token authentication, and a fresh random
  token per driver process in ``RAY_AUTH_TOKEN`` (Ray then writes nothing to ~/.ray).
- Joining a cluster (``RAY_ADDRESS``): token authentication expected; the token is the
  cluster's, from ``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH`` or ~/.ray/auth_token.

An inherited ``RAY_AUTH_MODE=disabled`` is kept here and refused at start, unless
``SLIME_RL_ALLOW_RAY_WITHOUT_AUTH=1`` says the user means it (an isolated network).
Standard library only: Ray's workers import this after ray, where it does nothing.
"""

from __future__ import annotations

import os
import secrets
import sys

ALLOW_NO_AUTH = "SLIME_RL_ALLOW_RAY_WITHOUT_AUTH"
LOOPBACK = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def joining_cluster() -> bool:
    return bool(os.environ.get("RAY_ADDRESS"))


def no_auth_allowed() -> bool:
    return os.environ.get(ALLOW_NO_AUTH, "").lower() in ("1", "true", "yes")


def prepare() -> None:
    """Set Ray's environment for this process and its children, if ray is not imported yet."""
    if "ray" in sys.modules:  # too late to matter (a Ray worker, or the user's import came first)
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "token")  # an inherited "disabled" is refused at start
    if joining_cluster():
        return
    os.environ[LOOPBACK] = "0"
    # Our own token, never one inherited from a shell that talks to some cluster; Ray reads it
    # from here before any file, so nothing is written to ~/.ray/auth_token.
    os.environ["RAY_AUTH_TOKEN"] = secrets.token_urlsafe(32)
    os.environ.pop("RAY_AUTH_TOKEN_PATH", None)


prepare()
