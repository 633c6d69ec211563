"""Backend settings: the typed section each backend adds to the config (``rollout.sglang``, ``trainer.megatron``).

A backend class declares ``settings``, a pydantic model (contracts.py; `BackendSettings` is its base). Its
section in the config is named after the backend: ``rollout.engine: sglang`` reads ``rollout.sglang``; a backend
given as ``module:attr`` reads the section named after its attribute (``my_pkg.engine:MyEngine`` ->
``rollout.MyEngine``). Sections of other installed backends may stay in a config (switching ``rollout.engine``
back and forth) and are checked too; a section named after nothing installed is an unknown key.

Finding a model must not import the backend (torch, megatron: the CLI's driver never holds them), so an
installed backend also registers its model under ``<group>.settings`` (``slime_rl.rollout_engines.settings``),
in a light module of its own; without that entry point the class is imported and its ``settings`` read.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, ValidationError

from slime_rl.core.config.errors import ConfigError, field_error, unknown_key_error
from slime_rl.core.infra.plugins import PluginError, installed, load_attr, load_plugin


class BackendSettings(BaseModel):
    """Base of a backend's settings model: as strict as core's sections (unknown keys refused, no type
    coercion, no .inf/.nan), so its keys get the same one-line errors and did-you-mean."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=True, allow_inf_nan=False)

    #: For one release, where an old ``rollout.engine_args`` mapping goes: the name of a dict field of this
    #: model (SGLang's server flags), or None: its keys are this model's own fields (renamed.py).
    engine_args_field: ClassVar[str | None] = None
    #: A rollout engine's: it serves FP8 weights and KV cache (rollout.precision / kv_cache_dtype, docs/fp8.md).
    serves_fp8: ClassVar[bool] = False

    def check(self, cfg: Any, where: str) -> None:
        """Checks the values alone cannot make (a file exists, a key fits the rest of ``cfg``), run with core's
        cross-field checks for the chosen backend; raise ConfigError naming ``<where>.<field>``. None here."""

    @classmethod
    def model_support(cls, path: str) -> tuple[bool, list[tuple[str, str]]] | None:
        """`slime-cli doctor --model PATH`: whether this backend runs the model folder at ``path`` and, if not,
        which part is missing, as (supported, (name, status) lines). None: nothing to say (here)."""
        return None


class NoSettings(BackendSettings):
    """The settings of a backend that declares none: no keys."""


#: Config sections that name a backend: section -> (the field naming it, its entry-point group).
BACKEND_SECTIONS = {
    "rollout": ("engine", "slime_rl.rollout_engines"),
    "trainer": ("backend", "slime_rl.trainers"),
    "data": ("source", "slime_rl.data_sources"),
    "eval": ("source", "slime_rl.data_sources"),
}


def settings_group(group: str) -> str:
    """The entry-point group where the backends of ``group`` register their settings models."""
    return f"{group}.settings"


def section_key(backend: str) -> str:
    """The config key of a backend's settings: its name, or a ``module:attr``'s last attribute."""
    return backend.partition(":")[2].rsplit(".", 1)[-1] if ":" in backend else backend


def registered_settings(group: str, backend: str) -> type[BaseModel] | None:
    """The settings model ``backend`` registers under ``<group>.settings``; None when it registers none."""
    spec = installed(settings_group(group)).get(backend) if ":" not in backend else None
    return _checked(group, backend, load_attr(spec, what="settings model")) if spec else None


def settings_model(group: str, backend: str) -> type[BaseModel]:
    """The settings model of ``backend`` (an entry-point name or ``module:attr``), found without importing an
    installed backend when it registers its model. Raises PluginError when there is no such backend."""
    return registered_settings(group, backend) or _checked(
        group, backend, getattr(load_plugin(group, backend), "settings", NoSettings))


def _checked(group: str, backend: str, model: Any) -> type[BaseModel]:
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        raise PluginError(f"{group} {backend!r}: its settings is a {type(model).__name__}, not a pydantic model")
    return model


def section_models(section: str, chosen: str) -> dict[str, str]:
    """The backend sections ``section`` may hold -> the backend each belongs to: the chosen backend's, and
    every installed backend's of the section's group."""
    group = BACKEND_SECTIONS[section][1]
    keys = {name: name for name in installed(group)}
    keys[section_key(chosen)] = chosen
    return keys


def validate_sections(section: str, chosen: str, extras: dict[str, Any], fields: list[str]) -> dict[str, BaseModel]:
    """Each backend section of ``section`` (raw mappings or models) as its backend's settings model; ``fields``
    are the section's own keys (for did-you-mean). Raises ConfigError naming the full dotted field
    (``rollout.sglang.chunked_prefill_size``)."""
    known = section_models(section, chosen) if extras else {}
    out: dict[str, BaseModel] = {}
    for key, raw in extras.items():
        if key not in known:
            raise unknown_key_error(section, key, [*fields, *known])
        try:
            model = settings_model(BACKEND_SECTIONS[section][1], known[key])
        except PluginError as err:
            raise ConfigError(f"{section}.{key}", f"its backend does not load: {err}") from None
        if isinstance(raw, model):
            out[key] = raw
            continue
        if isinstance(raw, BaseModel):
            raw = raw.model_dump()
        if isinstance(raw, dict) and (unknown := [k for k in raw if k not in model.model_fields]):
            raise unknown_key_error(f"{section}.{key}", unknown[0], model.model_fields)
        try:
            out[key] = model.model_validate(raw)
        except ValidationError as err:
            raise field_error(err, prefix=f"{section}.{key}") from None
    return out
