"""The trainer's weights as FP8 (e4m3) for engines that serve FP8 (``rollout.precision: fp8``, docs/fp8.md).

Two scale layouts, both symmetric with ``scale = amax / 448`` (448: e4m3's largest finite value), so that
``weight ~= fp8 * scale``:

- ``block``: one scale per ``block x block`` tile (DeepSeek-V3's FP8 checkpoints: 128x128, the scale named
  ``<module>.weight_scale_inv``, float32 ``[ceil(N/b), ceil(K/b)]``); edge tiles are partial;
- ``channel``: one scale per output row (``<module>.weight_scale``, float32 ``[N, 1]``).

Deterministic and device-independent: amax is exact, the division and the cast to e4m3 are IEEE
round-to-nearest-even on the CPU and on CUDA, so the same bf16 weights give the same bytes anywhere (the
equality check after a sync compares them bit for bit). It runs where the tensors are (the trainer's GPU).

Only the projections of attention and MLP blocks (dense and MoE experts) are quantised: embeddings, lm_head,
norms, biases and MoE router gates stay in the trainer's dtype, as SGLang serves them (its FP8 linear methods
cover the ``LinearBase`` projections; Qwen3-MoE's router gate is built without a quant config).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import torch

from slime_rl.core.contracts import NamedTensors

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
Scales = Literal["block", "channel"]
SCALE_NAMES: dict[str, str] = {"block": "weight_scale_inv", "channel": "weight_scale"}
BLOCK_EDGES = (128, 64, 32, 16)  # the block edges `block_edge` tries, largest first

# The leaf modules whose ``.weight`` an FP8 engine holds in FP8 (Llama/Qwen2/Qwen3 attention and MLP, MoE experts
# and shared experts, DeepSeek's MLA projections). A router gate (``mlp.gate``) is not among them.
PROJECTIONS = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                         "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"})


@dataclass(frozen=True)
class FP8Format:
    """How weights are quantised: the scale layout and, for ``block``, the tile edge."""

    scales: Scales = "block"
    block: int = 128

    def __post_init__(self) -> None:
        if self.scales not in SCALE_NAMES:
            raise ValueError(f"FP8 scales {self.scales!r}: use block or channel")
        if self.block < 1:
            raise ValueError(f"FP8 block edge {self.block} must be >= 1")

    @property
    def scale_suffix(self) -> str:
        return SCALE_NAMES[self.scales]

    def quantization_config(self) -> dict:
        """The HF ``quantization_config`` an engine reading this format's checkpoints is given (SGLang's
        ``Fp8Config`` for blocks: quant_method fp8, dynamic activations; ``W8A8Fp8Config`` for channels)."""
        if self.scales == "block":
            return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                    "weight_block_size": [self.block, self.block]}
        return {"quant_method": "w8a8_fp8"}


def is_quantized(name: str, tensor: torch.Tensor) -> bool:
    """Whether an FP8 engine holds ``name`` in FP8: a 2-D ``<projection>.weight`` (see PROJECTIONS)."""
    if tensor.dim() != 2 or not name.endswith(".weight"):
        return False
    leaf = name[: -len(".weight")].rsplit(".", 1)[-1]
    return leaf in PROJECTIONS


def _check_finite(name: str, amax: torch.Tensor) -> None:
    if not bool(torch.isfinite(amax).all()):  # amax carries a nan or inf of any element
        raise ValueError(f"{name}: holds inf or nan; FP8 cannot represent it (the trainer's weights diverged)")


def _scale_of(amax: torch.Tensor) -> torch.Tensor:
    """amax / 448, and 1 for an all-zero tile (its FP8 values are 0 whatever the scale)."""
    return torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))


def quantize_block(weight: torch.Tensor, block: int = 128, *, name: str = "weight") -> tuple[torch.Tensor,
                                                                                            torch.Tensor]:
    """``weight`` [N, K] as (FP8 [N, K], float32 scales [ceil(N/block), ceil(K/block)])."""
    if weight.dim() != 2:
        raise ValueError(f"{name}: block FP8 needs a 2-D weight, got shape {tuple(weight.shape)}")
    n, k = weight.shape
    nb, kb = -(-n // block), -(-k // block)
    x = weight.detach()
    if n % block or k % block:  # zero padding: |0| never raises a tile's amax
        x = torch.nn.functional.pad(x, (0, kb * block - k, 0, nb * block - n))
    tiles = x.view(nb, block, kb, block)
    amax = tiles.abs().amax(dim=(1, 3)).float()  # exact in the weight's own dtype: no float32 copy for it
    _check_finite(name, amax)
    scale = _scale_of(amax)
    q = (tiles.float() / scale[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(nb * block, kb * block)[:n, :k].contiguous(), scale


def quantize_channel(weight: torch.Tensor, *, name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [N, K] as (FP8 [N, K], float32 scales [N, 1]): one scale per output row."""
    if weight.dim() != 2:
        raise ValueError(f"{name}: channel FP8 needs a 2-D weight, got shape {tuple(weight.shape)}")
    amax = weight.detach().abs().amax(dim=1, keepdim=True).float()
    _check_finite(name, amax)
    scale = _scale_of(amax)
    return (weight.detach().float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, fmt: FP8Format, dtype: torch.dtype = torch.float32
               ) -> torch.Tensor:
    """The weight an FP8 engine computes with: ``fp8 * scale`` (block scales spread over their tiles)."""
    if fmt.scales == "channel":
        return (q.float() * scale).to(dtype)
    n, k = q.shape
    spread = scale.repeat_interleave(fmt.block, dim=0)[:n].repeat_interleave(fmt.block, dim=1)[:, :k]
    return (q.float() * spread).to(dtype)


def quantize(weight: torch.Tensor, fmt: FP8Format, *, name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    if fmt.scales == "block":
        return quantize_block(weight, fmt.block, name=name)
    return quantize_channel(weight, name=name)


def quantize_named(named_tensors: NamedTensors, fmt: FP8Format) -> NamedTensors:
    """A bucket as an FP8 engine loads it: each quantised ``<m>.weight`` followed by its ``<m>.<scale>``; the
    others as they were."""
    out: NamedTensors = []
    for name, tensor in named_tensors:
        if not is_quantized(name, tensor):
            out.append((name, tensor))
            continue
        q, scale = quantize(tensor, fmt, name=name)
        out.append((name, q))
        out.append((f"{name[: -len('weight')]}{fmt.scale_suffix}", scale))
    return out


def quantize_buckets(buckets: Iterator[NamedTensors], fmt: FP8Format) -> Iterator[NamedTensors]:
    """`quantize_named` over a sync's buckets, one at a time (the bf16 bucket is freed as its FP8 one goes)."""
    for bucket in buckets:
        yield quantize_named(bucket, fmt)


def block_edge(partitions: list[int], edges: tuple[int, ...] = BLOCK_EDGES) -> int | None:
    """The largest of ``edges`` dividing every partition (the output sizes an engine fuses, per TP rank, and
    the input sizes it splits); None if none does. SGLang refuses a block that does not divide them."""
    for edge in edges:
        if all(p % edge == 0 for p in partitions):
            return edge
    return None


def model_partitions(hf_config: dict, tp_size: int = 1) -> list[int]:
    """The weight dimensions an engine of ``tp_size`` splits or fuses for an HF config: hidden size, the
    q/k/v outputs, the MLP (and MoE expert / shared expert) intermediates, each per TP rank where split."""
    hidden = hf_config["hidden_size"]
    heads = hf_config["num_attention_heads"]
    head_dim = hf_config.get("head_dim") or hidden // heads
    kv_heads = hf_config.get("num_key_value_heads") or heads
    dims = [hidden, heads * head_dim // tp_size, max(1, kv_heads // tp_size) * head_dim]
    for key in ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size"):
        if hf_config.get(key):
            dims.append(hf_config[key] // tp_size)
    return dims
