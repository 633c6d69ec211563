"""The weights of the delta-sync tests (test_delta_sync on the stand-in, test_sglang_gpu_elastic on SGLang) from one
version to the next. (A plain module: 'conftest' resolves to another package's in a whole-repo run.)"""

from __future__ import annotations

import torch

from slime_rl.core.weights.delta import bits


def next_version(weights: dict[str, torch.Tensor], generator: torch.Generator) -> None:
    """Moves ``weights`` to the next version in place: each tensor's raw bits raised by one at about 5% of its
    elements, drawn from ``generator`` (a sparse change, so that a delta moves less than the full tensors)."""
    for name, w in weights.items():
        flat = bits(w).clone()
        flat[torch.rand(w.numel(), generator=generator) < 0.05] += 1
        weights[name] = flat.view(w.dtype).reshape(w.shape)
