"""``model.dtype`` as one concrete dtype for the whole run, so the trainer and every engine build the
model alike (an engine in fp16 beside a bf16 trainer samples from another policy than the one trained).

The driver resolves ``auto`` once, before any backend starts (`resolve_model_dtype`), and the actors
get the config with the result in it: bfloat16 on a GPU; on the CPU what this CPU trains fastest in
(config/cpu.py); on a resume what the checkpoint was trained in. Backends read it through
`model_dtype`, which answers a config nobody resolved (a backend built by hand) with the same rule
for every backend: bfloat16 on a GPU, float32 on the CPU (a calibration in each process could
choose differently, so only the driver calibrates).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, cast

from slime_rl.core.config.cpu import MatmulShape, choose_cpu_dtype, cpu_info
from slime_rl.core.config.device import resolve_device

if TYPE_CHECKING:
    from slime_rl.core.config.schema import Config

ModelDtype = Literal["float32", "bfloat16", "float16"]
MODEL_DTYPES: tuple[ModelDtype, ...] = ("float32", "bfloat16", "float16")


def model_dtype(setting: str, device: str) -> ModelDtype:
    """The dtype a backend builds the model in on ``device`` ("cuda" or "cpu"): ``setting`` itself
    when concrete (the driver has resolved ``auto`` for a run), else bfloat16 on CUDA, float32 elsewhere."""
    if setting in MODEL_DTYPES:
        return cast(ModelDtype, setting)
    if setting != "auto":
        raise ValueError(f"model.dtype: {setting!r} is not one of auto, {', '.join(MODEL_DTYPES)}")
    return "bfloat16" if device == "cuda" else "float32"


def resolve_model_dtype(cfg: Config, resumed_meta: dict[str, Any] | None) -> str | None:
    """Set ``model.dtype: auto`` to the run's concrete dtype (the module docstring says which); returns
    the line saying which and why. An explicit dtype is left as it is (None)."""
    if cfg.model.dtype != "auto":
        return None
    device = resolve_device(cfg.cluster.device)
    if resumed_meta is not None:
        # A checkpoint keeps what auto resolved to; one written before the driver resolved it has
        # none (CPU) or "auto" (GPU), which then meant the backends' rule.
        cfg.model.dtype = model_dtype(resumed_meta.get("model_dtype") or "auto", device)
        return f"model.dtype=auto -> {cfg.model.dtype}, as the checkpoint this run resumes was trained"
    if device == "cuda":
        cfg.model.dtype = model_dtype("auto", device)
        return f"model.dtype=auto -> {cfg.model.dtype} on the GPU, for the trainer and the engines alike"
    info = cpu_info()
    choice = choose_cpu_dtype(info, MatmulShape.of_model(cfg.model.path))
    cfg.model.dtype = choice.dtype
    return f"model.dtype=auto -> {choice.dtype} on {info.describe()}: {choice.reason}"
