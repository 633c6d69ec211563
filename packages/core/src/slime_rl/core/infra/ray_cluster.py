"""A Ray instance on loopback with a per-run token (or the cluster at RAY_ADDRESS), and the
placement of trainer ranks and engines on it. ray_env sets Ray's environment; this checks it."""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
from collections.abc import Callable, Iterator
from typing import Any

from slime_rl.core.config import Config, ConfigError
from slime_rl.core.infra import leftovers, ray_env
from slime_rl.core.infra.plugins import PluginError
from slime_rl.core.run.data import DataError

_IMPORT_ORDER = ("ray was imported before slime_rl, so Ray would listen on every network interface without the"
                 " run's token; import slime_rl (e.g. `import slime_rl.core`) before ray")
_NO_AUTH = (f"or, on an isolated network, set RAY_AUTH_MODE=disabled and {ray_env.ALLOW_NO_AUTH}=1 to run"
            " without authentication")


def _auth_mode() -> str:
    return os.environ.get("RAY_AUTH_MODE", "").lower()


def _token_mode_cached() -> bool:
    """Whether ray runs with the token mode it read from the environment at its import."""
    from ray._raylet import AuthenticationMode, get_authentication_mode

    return get_authentication_mode() == AuthenticationMode.TOKEN


def check_local() -> None:
    """Refuse a local Ray that would listen beyond loopback or run without authentication."""
    from ray._private import ray_constants

    if ray_constants.ENABLE_RAY_CLUSTER or not _auth_mode():  # ray_env.prepare came after ray's import
        raise ConfigError("import order", _IMPORT_ORDER)
    if _auth_mode() != "token" and not ray_env.no_auth_allowed():
        raise ConfigError("RAY_AUTH_MODE", f"is {os.environ.get('RAY_AUTH_MODE')!r} in the environment, which"
                          " turns off Ray's authentication: anyone who can reach the run's Ray ports could run code"
                          f" as you. Unset it (slime-rl then runs Ray with a fresh token per run), {_NO_AUTH}")
    if _auth_mode() == "token" and (not _token_mode_cached() or not os.environ.get("RAY_AUTH_TOKEN")):
        raise ConfigError("import order", _IMPORT_ORDER)


def _gcs_answers(gcs_address: str, headers: dict[str, str]) -> bool | None:
    """Whether the cluster's GCS answers a call with ``headers``: False when it refuses them as
    unauthenticated, None when it cannot be reached (ray.init then says so)."""
    import grpc
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    with grpc.insecure_channel(gcs_address) as channel:
        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        try:
            stub.GetClusterId(gcs_service_pb2.GetClusterIdRequest(), timeout=10, metadata=tuple(headers.items()))
        except grpc.RpcError as err:
            return False if err.code() == grpc.StatusCode.UNAUTHENTICATED else None
    return True


def check_cluster(address: str) -> None:
    """Refuse to join a cluster without authentication, or with a token it does not accept."""
    from ray._private.services import canonicalize_bootstrap_address_or_die
    from ray._raylet import AuthenticationTokenLoader

    if address.startswith("ray://"):  # Ray Client: its server checks the token; ray.init reports
        return
    if not _auth_mode():  # ray_env.prepare came after ray's import
        raise ConfigError("import order", _IMPORT_ORDER)
    gcs = canonicalize_bootstrap_address_or_die(address)
    if _gcs_answers(gcs, {}):
        if not ray_env.no_auth_allowed():
            raise ConfigError("RAY_ADDRESS", f"the Ray cluster at {gcs} has authentication off: anyone who can reach"
                              " it can run code on it. Restart it with RAY_AUTH_MODE=token and a token"
                              f" (docs/multi-node.md), {_NO_AUTH}")
        if _auth_mode() != "disabled":
            raise ConfigError("RAY_AUTH_MODE", f"the Ray cluster at {gcs} has authentication off; to join it set"
                              f" RAY_AUTH_MODE=disabled (with {ray_env.ALLOW_NO_AUTH}=1)")
        return
    if _auth_mode() != "token":
        raise ConfigError("RAY_AUTH_MODE", f"is {os.environ.get('RAY_AUTH_MODE')!r}, but the Ray cluster at {gcs}"
                          " requires a token: unset RAY_AUTH_MODE and give the cluster's token in RAY_AUTH_TOKEN")
    if not _token_mode_cached():
        raise ConfigError("import order", _IMPORT_ORDER)
    loader = AuthenticationTokenLoader.instance()
    fix = ("set RAY_AUTH_TOKEN (or RAY_AUTH_TOKEN_PATH, a file) to the cluster's token; `ray get-auth-token` on"
           " its head node prints it")
    if not loader.has_token(ignore_auth_mode=True):  # (without it, no token raises)
        raise ConfigError("RAY_AUTH_TOKEN", f"no token for the Ray cluster at {gcs}: {fix}")
    if _gcs_answers(gcs, loader.get_token_for_http_header()) is False:
        raise ConfigError("RAY_AUTH_TOKEN", f"the Ray cluster at {gcs} refused our token: {fix}")


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


def check_ray_environment() -> None:
    """The checks `local_ray` starts with: the cluster at RAY_ADDRESS, or a local instance."""
    address = os.environ.get("RAY_ADDRESS")
    if address:
        check_cluster(address)
    else:
        check_local()


@contextlib.contextmanager
def local_ray(cfg: Config) -> Iterator[None]:
    """Start a local Ray instance, or join the cluster at RAY_ADDRESS; shut down on exit what we started.

    Locally: loopback, the run's token, a private temporary folder removed at the end, and a
    reaper that ends Ray's processes and removes the folders if this process is killed; what
    a killed run left is removed first (leftovers). A user's mistake raised in an actor comes out
    of the block as itself (`users_mistake`)."""
    import ray

    address = os.environ.get("RAY_ADDRESS")
    check_ray_environment()
    if ray.is_initialized():
        with mistakes_unwrapped():
            yield
        return
    if address:
        ray.init(address=address, log_to_driver=True)
        try:
            with mistakes_unwrapped():
                yield
        finally:
            ray.shutdown()
        return
    leftovers.remove_dead()
    # Ray makes its folder 0777 ("so others can use it"), again whenever a process of it starts:
    # it goes inside one of ours (0700). "r": Ray's socket paths below it must fit in 107 bytes.
    temp_dir = leftovers.private_folder(leftovers.RAY_PREFIX)
    reaper = leftovers.start_reaper()
    try:
        ray.init(
            num_cpus=cfg.cluster.num_cpus or max(os.cpu_count() or 1, 2),
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            _temp_dir=str(temp_dir / "r"),
            object_store_memory=2 * 1024**3,
            log_to_driver=True,
            configure_logging=False,
        )
        with mistakes_unwrapped():
            yield
    finally:
        started = leftovers.ray_processes(temp_dir)
        ray.shutdown()
        # The raylet's agents see its end by polling: on a loaded 2-core machine one outlived the driver's
        # SIGTERM exit by more than 20 s (CI, 2026-12-06); the run's processes go with the run
        leftovers.end_processes(started, grace_s=5.0)
        leftovers.stop_reaper(reaper)
        shutil.rmtree(temp_dir, ignore_errors=True)
