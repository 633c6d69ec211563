"""What this CPU offers for training, and the dtype a CPU run uses when its config leaves it open.

bf16 pays on the CPU only where its matmuls run on bf16 hardware and beat fp32 by enough to
cover the casts between bf16 weights and the fp32 master copies, softmax and norms. The flags
settle two cases: AMX tiles (Intel Sapphire Rapids and later) run bf16 ~4x fp32, so bf16; no
bf16 instructions at all (plain AVX2, older Xeons) means emulated bf16, so fp32. In between,
the flags do not say: the CPU demo took 7.1 s a step in bf16 and 5.6 s in fp32 on a Xeon with
avx512_bf16 and no AMX, but 4.0 s in bf16 and 7.5 s in fp32 on an AMD EPYC with the same flags
(benchmarks/README.md). There a calibration decides: the model's MLP matmuls timed in both
dtypes, the best of a few tries each (a busy machine slows a try, never speeds it up), in well
under a second.
"""

from __future__ import annotations

import json
import platform
import time
from dataclasses import dataclass
from pathlib import Path

# The flags that matter here, in /proc/cpuinfo's spelling (x86, then ARM's "Features").
RELEVANT_FLAGS = ("amx_bf16", "amx_tile", "avx512_bf16", "avx512f", "avx2", "fma", "bf16", "sve")
BF16_INSTRUCTIONS = ("avx512_bf16", "bf16")  # bf16 dot products without AMX (x86, ARM)
# bf16 must beat fp32 by this much on the matmuls alone to pay for the casts around them.
BF16_MIN_SPEEDUP = 1.25


@dataclass(frozen=True)
class CpuInfo:
    model: str
    arch: str  # platform.machine(): x86_64, aarch64, arm64
    flags: frozenset[str]

    @property
    def features(self) -> list[str]:
        """The relevant flags this CPU has, in RELEVANT_FLAGS' order."""
        return [f for f in RELEVANT_FLAGS if f in self.flags]

    def describe(self) -> str:
        return f"{self.model} ({self.arch}; {' '.join(self.features) or 'none of ' + ', '.join(RELEVANT_FLAGS)})"


@dataclass(frozen=True)
class DtypeChoice:
    dtype: str  # a model.dtype value
    reason: str


@dataclass(frozen=True)
class MatmulShape:
    """The matmuls a calibration times: [rows, hidden] @ [hidden, intermediate] and back."""

    hidden: int = 576  # the built-in SmolLM2-135M
    intermediate: int = 1536
    rows: int = 1024  # tokens in a micro-batch

    @classmethod
    def of_model(cls, folder: str | Path) -> MatmulShape:
        """The MLP shape in an HF folder's config.json; the built-in model's when it has none."""
        try:
            hf = json.loads((Path(folder) / "config.json").read_text())
            return cls(hidden=int(hf["hidden_size"]), intermediate=int(hf["intermediate_size"]))
        except (OSError, ValueError, KeyError, TypeError):
            return cls()


def cpu_info(cpuinfo: Path = Path("/proc/cpuinfo")) -> CpuInfo:
    """This machine's CPU model and flags (Linux: /proc/cpuinfo; elsewhere the model only)."""
    model, flags = platform.processor() or "unknown CPU", frozenset()
    try:
        text = cpuinfo.read_text()
    except OSError:
        return CpuInfo(model, platform.machine(), flags)
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name":
            model = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = frozenset(value.split())
    return CpuInfo(model, platform.machine(), flags)


def time_matmuls(shape: MatmulShape, tries: int = 5) -> dict[str, float]:
    """Best-of-``tries`` seconds for one up and one down projection, in float32 and bfloat16."""
    import torch

    best: dict[str, float] = {}
    operands = {}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        x = torch.randn(shape.rows, shape.hidden, dtype=dtype)
        up = torch.randn(shape.hidden, shape.intermediate, dtype=dtype)
        operands[name] = (x, up)
        torch.mm(torch.mm(x, up), up.t())  # oneDNN builds its kernel on the first call
        best[name] = float("inf")
    for _ in range(tries):  # interleaved: a neighbour's burst hits both dtypes alike
        for name, (x, up) in operands.items():
            start = time.perf_counter()
            torch.mm(torch.mm(x, up), up.t())
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def choose_cpu_dtype(info: CpuInfo, shape: MatmulShape | None = None, *, timer=time_matmuls) -> DtypeChoice:
    """bfloat16 or float32 for training on this CPU (the module docstring says how)."""
    if "amx_bf16" in info.flags:
        return DtypeChoice("bfloat16", "AMX runs bf16 matmuls ~4x faster than fp32")
    if not any(flag in info.flags for flag in BF16_INSTRUCTIONS):
        return DtypeChoice("float32", "no bf16 instructions (no AMX, no AVX-512 BF16): bf16 would be emulated")
    seconds = timer(shape or MatmulShape())
    speedup = seconds["float32"] / seconds["bfloat16"]
    measured = f"bf16 matmuls {speedup:.2f}x fp32 here (the model's MLP shapes, best of 5)"
    if speedup >= BF16_MIN_SPEEDUP:
        return DtypeChoice("bfloat16", f"bf16 instructions without AMX; {measured}")
    return DtypeChoice("float32", f"bf16 instructions without AMX; {measured}, below the {BF16_MIN_SPEEDUP}x"
                                  " that pays for the casts")
