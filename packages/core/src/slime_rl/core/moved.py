"""Old import paths of the modules that moved into core's layers (algorithms, config, run, weights,
infra, testing), kept for one release: ``import slime_rl.core.rollout`` still works, warns once, and
gives the very module at its new path (so a ``mock.patch`` through either name patches the same code).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from types import ModuleType

# old module (under slime_rl.core) -> where it lives now
MOVED = {
    "advantages": "algorithms.advantages", "losses": "algorithms.losses", "staleness": "algorithms.staleness",
    "filters": "algorithms.filters", "lora": "algorithms.lora",
    "config_schema": "config.schema", "config_loader": "config.loader", "config_checks": "config.checks",
    "placement": "config.placement", "device": "config.device", "cpu": "config.cpu",
    "builtin_models": "config.builtin_models",
    "loop": "run.loop", "actors": "run.actors", "rollout": "run.rollout", "fully_async": "run.fully_async",
    "checkpoint": "run.checkpoint", "run_dir": "run.run_dir", "metrics": "run.metrics", "data": "run.data",
    "weight_sync": "weights.sync", "tensor_transport": "weights.transport",
    "ray_cluster": "infra.ray_cluster", "ray_env": "infra.ray_env", "ray_placement": "infra.ray_placement",
    "net": "infra.net", "distributed": "infra.distributed", "plugins": "infra.plugins", "workers": "infra.workers",
    "worker_main": "infra.worker_main", "watchdog": "infra.watchdog", "host_memory": "infra.host_memory",
    "leftovers": "infra.leftovers", "safe_pickle": "infra.safe_pickle",
    "standins": "testing.standins",
}
_PREFIX = "slime_rl.core."


class MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers an old name with the module at its new one."""

    def __init__(self) -> None:
        self._specs: dict[str, importlib.machinery.ModuleSpec] = {}

    def find_spec(self, fullname: str, path=None, target=None):
        if fullname.startswith(_PREFIX) and fullname[len(_PREFIX):] in MOVED:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec) -> ModuleType:
        new = _PREFIX + MOVED[spec.name[len(_PREFIX):]]
        warnings.warn(f"{spec.name} moved to {new}; the old path goes in the next release",
                      DeprecationWarning, stacklevel=3)
        module = importlib.import_module(new)
        self._specs[spec.name] = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # the import machinery has set the old name's spec on the real module: give it back its own
        module.__spec__ = self._specs.pop(module.__spec__.name)


def install() -> None:
    if not any(isinstance(finder, MovedModules) for finder in sys.meta_path):
        sys.meta_path.append(MovedModules())
