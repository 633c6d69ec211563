"""``cluster.device`` resolved to the device a run computes on: one rule for the plan, the trainer
and the rollout engines."""

from __future__ import annotations

from typing import Literal

Device = Literal["cuda", "cpu"]
DEVICE_SETTINGS = ("auto", "cuda", "cpu")  # what cluster.device accepts


def resolve_device(setting: str, *, here: bool = False) -> Device:
    """``auto`` is CUDA when torch sees a GPU, else the CPU; ``cuda`` and ``cpu`` are themselves.

    ``here=True`` is for a process that is about to compute on the device: ``cuda`` without a GPU
    visible to it is an error then. Without it (``slime-cli plan`` printing a GPU cluster's
    layout on a laptop) the setting is taken at its word."""
    if setting not in DEVICE_SETTINGS:
        raise ValueError(f"cluster.device: {setting!r} is not one of {', '.join(DEVICE_SETTINGS)}")
    if setting == "cpu":
        return "cpu"
    import torch

    has_gpu = torch.cuda.is_available()
    if setting == "auto":
        return "cuda" if has_gpu else "cpu"
    if here and not has_gpu:
        raise RuntimeError("cluster.device: cuda requested but torch sees no GPU in this process; "
                           "set cluster.device=cpu (or auto)")
    return "cuda"
