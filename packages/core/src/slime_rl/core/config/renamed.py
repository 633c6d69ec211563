"""Keys that moved or went away, and what a config that still uses one gets.

`RENAMED_KEYS` changed meaning with the backends' own settings (issue 33): it used to refuse an old name; now
a config using one still loads for one release, the value moved to the new name, with a one-line notice
(`RenamedKeyWarning`) naming the new key. `RETIRED_KEYS` are refused, their message naming the replacement.
"""

from __future__ import annotations

import warnings
from typing import Any

from slime_rl.core.config.backends import BACKEND_SECTIONS, section_key, settings_model
from slime_rl.core.config.errors import ConfigError
from slime_rl.core.infra.plugins import PluginError

#: Old dotted key -> its new dotted key: accepted for one release with a notice. ``{engine}`` stands for the
#: chosen rollout engine's section. SGLang's and Megatron's own keys moved into their backends' sections.
RENAMED_KEYS = {
    **{f"rollout.{key}": f"rollout.sglang.{key}" for key in (
        "engine_urls", "engine_python", "router_policy", "engine_startup_timeout", "weight_sync_timeout",
        "max_engine_restarts", "generate_max_retries", "check_weight_update")},
    # the engine's section, or the field of it that its settings name (`BackendSettings.engine_args_field`)
    "rollout.engine_args": "rollout.{engine}",
    **{f"trainer.{key}": f"trainer.megatron.{key}" for key in (
        "recompute", "moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_router_load_balancing_type", "moe_grouped_gemm")},
}
#: Old dotted key -> why it is refused and what to write instead.
RETIRED_KEYS = {"cluster.async": "renamed: use cluster.async_mode (off | one_step | fully); async: true is one_step"}


class RenamedKeyWarning(FutureWarning):
    """A config used an old key name; the message (one line) names the new key."""


def _pop(tree: dict[str, Any], dotted: str) -> tuple[bool, Any]:
    *parents, last = dotted.split(".")
    node = tree
    for part in parents:
        node = node.get(part) if isinstance(node, dict) else None
    if not isinstance(node, dict) or last not in node:
        return False, None
    return True, node.pop(last)


def _engine_args_target(data: dict[str, Any]) -> str:
    """Where ``rollout.engine_args`` goes: the chosen engine's section, or the field its settings name."""
    rollout = data.get("rollout") if isinstance(data.get("rollout"), dict) else {}
    engine = rollout.get("engine", "hf")
    target = f"rollout.{section_key(str(engine))}"
    try:
        field = getattr(settings_model(BACKEND_SECTIONS["rollout"][1], str(engine)), "engine_args_field", None)
    except PluginError:
        return target  # the engine is not installed: `wire` names rollout.engine
    return f"{target}.{field}" if field else target


def move_renamed_keys(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` (a raw config tree; changed in place) with every old key moved to its new name, each with a
    `RenamedKeyWarning`; a retired key, or an old key given beside its new one, is a ConfigError."""
    for old, message in RETIRED_KEYS.items():
        if _pop(data, old)[0]:
            raise ConfigError(old, message)
    for old, new in RENAMED_KEYS.items():
        found, value = _pop(data, old)
        if not found:
            continue
        if "{engine}" in new:
            new = _engine_args_target(data)
        *parents, last = new.split(".")
        node = data
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(old, f"moved to {new}, but `{part}` is a value there; give a mapping")
        if last in node and not (isinstance(node[last], dict) and isinstance(value, dict)):
            raise ConfigError(old, f"is now {new}, which the config sets too; drop {old}")
        if isinstance(value, dict) and isinstance(node.get(last), dict):
            clash = sorted(set(value) & set(node[last]))
            if clash:
                raise ConfigError(f"{old}.{clash[0]}", f"is now {new}.{clash[0]}, which the config sets too;"
                                                      f" drop {old}.{clash[0]}")
            node[last].update(value)
        else:
            node[last] = value
        warnings.warn(f"{old} is now {new}; the old name works until the next release", RenamedKeyWarning,
                      stacklevel=3)
    return data
