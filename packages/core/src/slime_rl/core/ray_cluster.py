"""A Ray instance on loopback, and the placement of trainer ranks and engines on it."""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

from slime_rl.core.config import Config, ConfigError
from slime_rl.core.data import DataError
from slime_rl.core.plugins import PluginError

# Keep Ray on 127.0.0.1 and self-contained (shared/notes/ray.md).
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def resolve_device(cfg: Config) -> str:
    if cfg.cluster.device != "auto":
        return cfg.cluster.device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


# The user's mistakes: found in an actor, they leave `local_ray` as themselves (one line for the
# CLI, exit 2), not wrapped in Ray's error with the actor's traceback.
USER_ERRORS = (ConfigError, DataError, PluginError)


def users_mistake(err: BaseException) -> Exception | None:
    """The ConfigError, DataError or PluginError an error from an actor carries, if any."""
    import ray.exceptions

    while isinstance(err, ray.exceptions.RayTaskError):  # an actor's call that called another actor nests
        err = err.cause
    return err if isinstance(err, USER_ERRORS) else None


class KeepsInitMistake:
    """Base of the run's actors. A user's mistake in ``__init__`` (a DataError from the data source, a
    ConfigError from a backend) would kill the actor: Ray prints its traceback and raises ActorDiedError,
    which holds only text. With ``__init__`` decorated by `keep_init_mistake`, the actor lives and the
    first call raises the mistake (`raise_init_mistake` in the loop's readiness check, or any call that
    needs what ``__init__`` did not build), which leaves `local_ray` as itself."""

    init_mistake: Exception | None = None

    def __getattr__(self, name: str) -> Any:  # only for attributes __init__ did not set
        if not name.startswith("_"):  # Ray probes private and dunder names with hasattr
            self.raise_init_mistake()
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def raise_init_mistake(self) -> None:
        if self.init_mistake is not None:
            raise self.init_mistake


def keep_init_mistake(init: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(init)
    def kept(self: KeepsInitMistake, *args: Any, **kwargs: Any) -> None:
        try:
            init(self, *args, **kwargs)
        except USER_ERRORS as err:
            self.init_mistake = err

    return kept


@contextlib.contextmanager
def mistakes_unwrapped() -> Iterator[None]:
    """Re-raise a user's mistake that comes wrapped in a Ray error as itself."""
    import ray.exceptions

    try:
        yield
    except ray.exceptions.RayTaskError as err:
        mistake = users_mistake(err)
        if mistake is None:
            raise
        raise mistake from None


@contextlib.contextmanager
def local_ray(cfg: Config) -> Iterator[None]:
    """Start (or join, when RAY_ADDRESS is set) Ray; shut it down on exit if we started it. A user's
    mistake raised in an actor comes out of the block as itself (`users_mistake`)."""
    import ray

    for key, value in LOOPBACK_ENV.items():
        os.environ.setdefault(key, value)
    if ray.is_initialized():
        with mistakes_unwrapped():
            yield
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=True)
    else:
        temp_dir = tempfile.mkdtemp(prefix="slime-rl-ray-")
        ray.init(
            num_cpus=cfg.cluster.num_cpus or max(os.cpu_count() or 1, 2),
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            _temp_dir=temp_dir,
            object_store_memory=2 * 1024**3,
            log_to_driver=True,
            configure_logging=False,
        )
    try:
        with mistakes_unwrapped():
            yield
    finally:
        ray.shutdown()
