"""What one update costs besides its time (``trainer_throughput.py`` prints them): the kernels a train
step launches (CUDA) or the operators it runs (CPU), and how evenly its micro-batches split the work."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


def launches(fn: Callable[[], object], device: str) -> tuple[int, str]:
    """(how many, of what) ``fn()`` launches, by torch.profiler: device kernels on CUDA (copies and
    memsets left out), leaf operators on the CPU (operators that call no other, user ranges left out)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
    events = prof.events()
    if device == "cuda":
        kernels = [e for e in events if e.device_type == DeviceType.CUDA and not e.is_user_annotation
                   and not e.name.startswith(("Memcpy", "Memset"))]
        return len(kernels), "CUDA kernels"
    ops = [e for e in events
           if e.device_type == DeviceType.CPU and not e.cpu_children and not e.is_user_annotation]
    return len(ops), "CPU leaf ops"


@dataclass
class Balance:
    micro_batches: int
    tokens_max_over_mean: float  # real tokens of the fullest micro-batch / the mean
    attention_max_over_mean: float  # sum of L_i^2 (attention work) of the heaviest / the mean
    padded_over_real: float  # tokens the model runs (padding included) / real tokens


def balance(groups: list[list[int]], lengths: list[int], *, padded: bool) -> Balance:
    """How evenly ``groups`` (rows per micro-batch) split ``lengths``; ``padded``: each micro-batch
    runs rows x its longest row (a packed one runs its real tokens)."""
    tokens = [sum(lengths[i] for i in g) for g in groups]
    squares = [sum(lengths[i] ** 2 for i in g) for g in groups]
    run = [len(g) * max(lengths[i] for i in g) for g in groups] if padded else tokens
    n = len(groups)
    return Balance(n, max(tokens) * n / sum(tokens), max(squares) * n / sum(squares), sum(run) / sum(tokens))


def percentiles(values: list[int], points=(50, 90, 99)) -> str:
    """``p50 X / p90 Y / p99 Z / max M`` (nearest rank)."""
    ordered = sorted(values)
    picks = [ordered[min(len(ordered) - 1, max(0, -(-p * len(ordered) // 100) - 1))] for p in points]
    return " / ".join([f"p{p} {v}" for p, v in zip(points, picks, strict=True)] + [f"max {ordered[-1]}"])
