"""Load backends by entry-point name and user code by ``module:attr``."""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import traceback
from importlib.metadata import EntryPoint, entry_points
from typing import Any

GROUPS = ("slime_rl.rollout_engines", "slime_rl.trainers", "slime_rl.buffers", "slime_rl.data_sources")

# Which distribution provides a built-in backend name, for "pip install" hints.
KNOWN_PROVIDERS = {
    ("slime_rl.rollout_engines", "hf"): "slime-rl-rollout-hf",
    ("slime_rl.rollout_engines", "sglang"): "slime-rl-rollout-sglang",
    ("slime_rl.trainers", "megatron"): "slime-rl-trainer-megatron",
    ("slime_rl.buffers", "default"): "slime-rl-buffer",
    ("slime_rl.data_sources", "jsonl"): "slime-rl-buffer",
    ("slime_rl.data_sources", "parquet"): "slime-rl-buffer",
}


class PluginError(LookupError):
    """A name or ``module:attr`` that resolves to nothing; the message says what is installed."""


def installed(group: str) -> dict[str, str]:
    """Entry-point name -> ``module:attr`` for one group."""
    return {ep.name: ep.value for ep in entry_points(group=group)}


def load_attr(spec: str, *, what: str = "object") -> Any:
    """Import ``module:attr`` (``attr`` may be dotted)."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise PluginError(f"{what} {spec!r}: expected the form `package.module:attribute`")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as err:
        if err.name is not None and (module_name + ".").startswith(err.name + "."):  # the module is not there
            raise PluginError(f"{what} {spec!r}: cannot import module {module_name!r} ({err})") from None
        raise _broken_module(what, spec, err) from None
    except (Exception, SystemExit) as err:  # SyntaxError, NameError, ...: the user's module is broken
        raise _broken_module(what, spec, err) from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise PluginError(f"{what} {spec!r}: module {module_name!r} has no attribute {attr!r}") from None
    return obj


def _broken_module(what: str, spec: str, err: BaseException) -> PluginError:
    """An exception raised while importing a user's module, as one line starting at its file:line."""
    if isinstance(err, SyntaxError):
        where, detail = f"{err.filename}:{err.lineno}", err.msg
    else:
        frames = [f for f in traceback.extract_tb(err.__traceback__) if not f.filename.startswith("<frozen")]
        where = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"
        detail = str(err)
    return PluginError(f"{where}: {type(err).__name__}: {detail} (importing {what} {spec!r}); fix the module")


def _did_you_mean(name: str, names: Any) -> str:
    close = difflib.get_close_matches(name, list(names), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}? Or" if close else "; or"


def _entry_point(group: str, name: str) -> EntryPoint:
    available = installed(group)
    if name not in available:
        provider = KNOWN_PROVIDERS.get((group, name))
        hint = f"; `pip install {provider}` provides it" if provider else ""
        names = ", ".join(sorted(available)) or "none"
        raise PluginError(f"no {group} named {name!r} (installed: {names}){hint}{_did_you_mean(name, available)}"
                          " give `module:attr`")
    (ep,) = [ep for ep in entry_points(group=group) if ep.name == name]
    return ep


def _does_not_load(group: str, name: str, ep: EntryPoint, err: object) -> PluginError:
    # Installed but broken (a missing optional dependency, a renamed class): say which and why.
    dist = f" from {ep.dist.name}" if ep.dist is not None else ""
    return PluginError(f"{group} {name!r} ({ep.value}{dist}) is installed but does not load: {err}")


def load_plugin(group: str, name: str) -> Any:
    """A backend by entry-point name (``"sglang"``) or a user's own by ``module:attr``."""
    if ":" in name:
        return load_attr(name, what=group.rsplit(".", 1)[-1].rstrip("s"))
    ep = _entry_point(group, name)
    try:
        return ep.load()
    except (ImportError, AttributeError) as err:
        raise _does_not_load(group, name, ep, err) from None


def check_plugin(group: str, name: str) -> None:
    """`load_plugin`'s checks without importing an installed backend: the name is installed and
    its module is there. For a process that only starts others (slime-cli's driver), which
    then need not hold megatron or transformers; an error inside the module shows where it loads."""
    if ":" in name:
        load_plugin(group, name)  # the user's own code: import it now
        return
    ep = _entry_point(group, name)
    module = ep.value.partition(":")[0].strip()
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise _does_not_load(group, name, ep, f"No module named {module!r}")


def load_function(spec: str, builtins: dict[str, Any], *, what: str) -> Any:
    """A user function: a built-in name from ``builtins`` or ``module:attr``."""
    if ":" in spec:
        fn = load_attr(spec, what=what)
    elif spec in builtins:
        fn = builtins[spec]
    else:
        raise PluginError(f"no built-in {what} named {spec!r} (built in: {', '.join(sorted(builtins)) or 'none'})"
                          f"{_did_you_mean(spec, builtins)} give `module:attr`")
    if not callable(fn):
        raise PluginError(f"{what} {spec!r} is a {type(fn).__name__}, not a callable; name a function")
    return fn
