"""Loading a config: YAML in (bounded), dotted ``key=value`` overrides, relative paths, every mistake one line.

`load_config` reads, validates and then runs the cross-field checks (config_checks.py).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from slime_rl.core.config.backends import (
    BACKEND_SECTIONS,
    registered_settings,
    section_key,
    section_models,
    settings_model,
)
from slime_rl.core.config.builtin_models import BUILTIN_PREFIX
from slime_rl.core.config.checks import check_config
from slime_rl.core.config.errors import field_error, unknown_key_error
from slime_rl.core.config.renamed import move_renamed_keys
from slime_rl.core.config.schema import Config, ConfigError
from slime_rl.core.infra.plugins import PluginError


def _section_fields(model: type[BaseModel]) -> dict[str, Any]:
    """Accepted keys of a section (aliases included) -> field info."""
    out = {}
    for name, info in model.model_fields.items():
        out[info.alias or name] = info
        out[name] = info
    return out


def _backend_section_models(data: dict[str, Any], model: type[BaseModel], prefix: str) -> dict[str, str]:
    """The backend sections section ``prefix`` may hold (config/backends.py) -> their backends; none when it
    names no backend, or when it holds no key besides its own fields."""
    if prefix not in BACKEND_SECTIONS or not set(data) - set(_section_fields(model)):
        return {}
    field = BACKEND_SECTIONS[prefix][0]
    return section_models(prefix, str(data.get(field, model.model_fields[field].default)))


def _check_keys(data: Any, model: type[BaseModel], prefix: str) -> None:
    """Refuse unknown keys, naming the nearest valid one; backend sections against their backend's settings."""
    if not isinstance(data, dict):
        raise ConfigError(prefix or "config", f"expected a mapping, got {type(data).__name__}")
    fields = _section_fields(model)
    backends = _backend_section_models(data, model, prefix)
    for key, value in data.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if key in backends and key not in fields:
            try:
                _check_keys(value, settings_model(BACKEND_SECTIONS[prefix][1], backends[key]), dotted)
            except PluginError as err:
                raise ConfigError(dotted, f"its backend does not load: {err}") from None
            continue
        if key not in fields:
            raise unknown_key_error(prefix, key, [*fields, *backends])
        annotation = fields[key].annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            _check_keys(value, annotation, dotted)


MAX_CONFIG_BYTES = 1 << 20  # a config is a few KB; a bigger file is the wrong file
MAX_YAML_VALUES = 100_000  # values once aliases are expanded: a 300-byte alias bomb expands to billions
MAX_YAML_DEPTH = 64  # nesting; an alias that refers to itself nests forever


class _ConfigLoader(yaml.SafeLoader):
    """SafeLoader that reads `1e-6` as a number, as YAML 1.2 does (YAML 1.1 makes it a string), and stops at
    deep `[[[...` nesting as soon as it sees it (PyYAML's scanner is quadratic in it)."""

    def fetch_flow_collection_start(self, TokenClass: Any) -> None:
        if self.flow_level >= MAX_YAML_DEPTH:
            raise yaml.scanner.ScannerError(None, None, f"nests deeper than {MAX_YAML_DEPTH} levels", self.get_mark())
        super().fetch_flow_collection_start(TokenClass)


_ConfigLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                  |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
                  |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
                  |[-+]?\.(?:inf|Inf|INF)
                  |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."),
)


def parse_yaml(text: str, where: str, *, in_file: bool = False) -> Any:
    """YAML text -> plain values, bounded: no more than MAX_YAML_VALUES values once aliases are expanded and
    no deeper than MAX_YAML_DEPTH, so a small bomb is refused at once instead of filling memory later
    (validation, error messages and `plan` all walk the expanded tree). ``where`` names the source in errors;
    ``in_file``: it is a file, and a syntax error is named at its ``file:line``."""
    try:
        value = yaml.load(text, Loader=_ConfigLoader)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        problem = getattr(err, "problem", None) or str(err)
        at = f"{where}:{mark.line + 1}" if mark is not None and in_file else where
        raise ConfigError(at, f"is not valid YAML: {' '.join(str(problem).split())}; fix the syntax") from None
    except RecursionError:
        raise ConfigError(where, f"nests deeper than {MAX_YAML_DEPTH} levels; a config needs a few") from None
    count, stack = 0, [(value, 0)] if isinstance(value, dict | list) else []
    while stack:  # walk the containers, counting their values
        node, depth = stack.pop()
        if depth > MAX_YAML_DEPTH:
            raise ConfigError(where, f"nests deeper than {MAX_YAML_DEPTH} levels (or a YAML alias refers to itself);"
                                     " a config needs a few")
        children = list(node.values()) if isinstance(node, dict) else node
        count += len(children)
        if count > MAX_YAML_VALUES:
            raise ConfigError(where, f"holds more than {MAX_YAML_VALUES} values once its YAML aliases are expanded;"
                                     " a config needs far fewer (an alias bomb?): remove the aliases")
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return value


def _read_config_file(path: Path) -> dict[str, Any]:
    """A YAML config file -> its mapping; every way it can be unreadable is a one-line ConfigError."""
    if path.is_dir():
        raise ConfigError("config", f"{path} is a directory; give the YAML file in it")
    if not path.is_file():
        raise ConfigError("config", f"file {path} does not exist")
    try:
        size = path.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise ConfigError(str(path), f"is {size} bytes, more than a config's {MAX_CONFIG_BYTES}; is it the right file?")
        raw = path.read_bytes()
    except OSError as err:
        raise ConfigError(str(path), f"cannot be read: {err.strerror or err}") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = raw[:err.start].count(b"\n") + 1
        raise ConfigError(f"{path}:{line}", f"is not UTF-8 text (byte 0x{raw[err.start]:02x}); save the file as"
                                            " UTF-8") from None
    data = parse_yaml(text, str(path), in_file=True) or {}
    if not isinstance(data, dict):
        raise ConfigError(str(path), f"expected a mapping of sections (model:, data:, ...), got {type(data).__name__}")
    return data


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(dotted, f"`{part}` is a value, not a section")
        node = child
    node[parts[-1]] = value


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """``["rollout.temperature=0.7", "eval.prompt_data={a: x.jsonl}"]`` -> nested dict (values parsed as YAML)."""
    tree: dict[str, Any] = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(item, "an override is `section.key=value`")
        key, raw = item.split("=", 1)
        value = parse_yaml(raw, key.strip()) if raw != "" else ""
        _set_dotted(tree, key.strip(), value)
    return tree


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def load_config(path: str | Path | None = None, overrides: list[str] | None = None, *, check: bool = True) -> Config:
    """Read YAML (or nothing: the CPU default), apply overrides, validate, and run the cross-field checks."""
    data: dict[str, Any] = {}
    base_dir = Path.cwd()
    if path is not None:
        path = Path(path)
        data = _read_config_file(path)
        base_dir = path.parent
    data = move_renamed_keys(_merge(data, parse_overrides(overrides or [])))
    _check_keys(data, Config, "")
    try:
        cfg = Config.model_validate(data)
    except ValidationError as err:
        raise field_error(err) from None
    _add_chosen_sections(cfg)
    _resolve_paths(cfg, base_dir)
    if check:
        check_config(cfg)
    return cfg


def _add_chosen_sections(cfg: Config) -> None:
    """Each chosen backend's section, with its defaults where the config gives none, so that the resolved
    config (`slime-cli plan`) shows every setting a run uses. Only models a backend registers (no backend is
    imported here); a backend that is not installed is `wire`'s error."""
    for name, (field, group) in BACKEND_SECTIONS.items():
        section = getattr(cfg, name)
        chosen = getattr(section, field)
        extras = section.__pydantic_extra__
        if section_key(chosen) in extras:
            continue
        try:
            model = registered_settings(group, chosen)
        except PluginError:
            continue
        if model is not None and model.model_fields:
            extras[section_key(chosen)] = model()


def _resolve_paths(cfg: Config, base_dir: Path) -> None:
    """Relative file paths in a config file are relative to that file."""

    def fix(p: str | None) -> str | None:
        if p is None or p.startswith(BUILTIN_PREFIX) or Path(p).is_absolute() or ":" in p.split("/")[0]:
            return p
        candidate = base_dir / p
        return str(candidate) if candidate.exists() or not Path(p).exists() else p

    cfg.data.prompt_data = fix(cfg.data.prompt_data)
    cfg.model.path = fix(cfg.model.path) or cfg.model.path
    cfg.model.tokenizer_path = fix(cfg.model.tokenizer_path)
    cfg.model.ref_path = fix(cfg.model.ref_path)
    cfg.eval.prompt_data = {name: fix(p) or p for name, p in cfg.eval.prompt_data.items()}
