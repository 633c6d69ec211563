"""Every place a run writes is writable, checked before anything starts (`check_config`): a read-only or
unwritable ``logging.dir`` or ``checkpoint.save_dir`` had been found only when first written (all steps
trained, then the save failed), and a ``HOME`` that does not exist was created, as root, and filled with
the built-in model (260 MB). Nothing here creates a folder: a missing one is judged by the nearest folder
above it that exists, which the run would create it in."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from slime_rl.core.config.builtin_models import BUILTIN_PREFIX, MODEL_PATH_FIELDS, default_cache_dir
from slime_rl.core.config.schema import Config, ConfigError

CACHE_VARIABLE = "SLIME_RL_CACHE"


def check_writable(cfg: Config) -> None:
    """``logging.dir``, ``checkpoint.save_dir`` and, when a ``builtin:`` model is converted into the cache
    under it, ``HOME`` (or ``SLIME_RL_CACHE``): ConfigError naming the field or variable and the fix."""
    for field, folder in (("logging.dir", Path(cfg.logging.dir)), ("checkpoint.save_dir", cfg.checkpoint_dir)):
        check_folder(field, folder)
    if any((getattr(cfg.model, key) or "").startswith(BUILTIN_PREFIX) for key in MODEL_PATH_FIELDS):
        check_model_cache()


def check_model_cache() -> None:
    """The built-in models' cache can be written: ``$SLIME_RL_CACHE``, else ``$HOME/.cache/slime-rl``, whose
    HOME must exist (a run never creates a home folder)."""
    if os.environ.get(CACHE_VARIABLE):
        check_folder(CACHE_VARIABLE, default_cache_dir())
        return
    home = os.environ.get("HOME", "")
    fix = f"set HOME to this user's home folder, or {CACHE_VARIABLE} to a folder for the built-in model (~270 MB)"
    if not home or not Path(home).is_dir():
        said = f"{home} does not exist" if home else "is not set"
        raise ConfigError("HOME", f"{said}, and the built-in model is converted into $HOME/.cache/slime-rl; {fix}")
    check_folder("HOME", default_cache_dir(), fix=fix)


def check_folder(field: str, folder: Path, fix: str | None = None) -> None:
    """``folder`` (or, when missing, the nearest folder above it that exists) is a folder this process can
    create files in; else ConfigError naming ``field``."""
    fix = fix or f"give {field} a folder this user can write, or make it writable"
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(field, f"{folder} cannot be created: {existing} is a file; {fix}")
    if existing == folder:
        try:  # a real write: permissions, ACLs, a read-only or root-squashed mount all show here
            fd, probe = tempfile.mkstemp(prefix=".slime-rl-write-check-", dir=folder)
        except OSError as err:
            raise ConfigError(field, f"{folder} is not writable ({err.strerror}); {fix}") from None
        os.close(fd)
        os.unlink(probe)
    elif not os.access(existing, os.W_OK | os.X_OK):  # (a read-only mount answers no here too)
        raise ConfigError(field, f"{folder} cannot be created: {existing} is not writable; {fix}")
