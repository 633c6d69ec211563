"""Qwen2.5-VL's vision tower and patch merger for the Megatron trainer (Qwen3-VL's: vision_qwen3.py): plain torch
modules, replicated on every tensor-parallel rank.

Why not Megatron's TP layers: the tower is small beside the language model (Qwen2.5-VL-7B: 0.67B of 8.3B
parameters, 32 blocks of width 1280) and sees a few thousand patches a sample, so splitting it buys little, and a
replicated tower gives every TP rank the same image embeddings by construction (no collective, nothing to keep in
step). Its gradients are the same on every TP rank too: the decoder's input gradient reaches the embeddings after
the first column-parallel layer's all-reduce, so the replicated weights take the same update, as the LM's
replicated norms do (megatron counts such weights once in the grad norm).

The modules mirror transformers 5.25's ``Qwen2_5_VisionTransformerPretrainedModel`` name for name (``patch_embed``,
``blocks.{i}.{norm1,attn,norm2,mlp}``, ``merger``), so the HF <-> Megatron mapping of the tower is the identity
(``visual.X`` <-> ``vision.X``): a 3D patch embedding, window attention with full attention at
``fullatt_block_indexes``, 2D rotary over (h, w) patch positions, RMSNorm, SwiGLU MLPs with biases, and the
merger's RMSNorm + 2-layer GELU MLP over each ``spatial_merge_size``^2 block of patches.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint


@dataclass(frozen=True)
class VisionShape:
    """What the vision tower and the mRoPE language model need from a Qwen2.5-VL or Qwen3-VL config.json."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    window_size: int
    out_hidden_size: int
    fullatt_block_indexes: tuple[int, ...]
    hidden_act: str
    rope_theta: float
    image_token_id: int
    mrope_section: tuple[int, ...]  # the language model's rotary dims per position stream (t, h, w)
    # Qwen3-VL (vision_qwen3.py): learned position embeddings resampled to each image, LayerNorms, a GELU MLP,
    # full attention in every block, features of some blocks added to the first LM layers' outputs (deepstack),
    # and the rotary dims' streams interleaved (t, h, w, t, h, w, ...) rather than in three runs
    family: str = "qwen2_5_vl"
    num_position_embeddings: int = 0
    deepstack_visual_indexes: tuple[int, ...] = ()
    mrope_interleaved: bool = False
    # the checkpoint's name prefixes of the language model and the tower: (model., visual.) as Qwen2.5-VL's hub
    # folders and transformers 5's save_pretrained write them, (model.language_model., model.visual.) as
    # transformers 4.52-4.57 saved them and Qwen3-VL's hub folders hold them; read from the folder's weights
    prefixes: tuple[str, str] = ("model.", "visual.")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values per patch in ``pixel_values``: channels x temporal patch x patch x patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2


def vision_shape(hf_config) -> VisionShape:
    v, text = hf_config.vision_config, hf_config.text_config
    family = "qwen3_vl" if hf_config.model_type == "qwen3_vl" else "qwen2_5_vl"
    rope = dict(getattr(v, "rope_parameters", None) or {})
    text_rope = dict(getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {})
    section = text_rope.get("mrope_section")
    if not section:
        raise ValueError("model.path: text_config.rope_parameters has no mrope_section (Qwen2.5-VL's is [16, 24, 24])")
    if v.hidden_act not in _ACTIVATIONS:
        raise ValueError(f"model.path: vision_config.hidden_act={v.hidden_act!r}; the vision tower has"
                         f" {', '.join(_ACTIVATIONS)}")
    return VisionShape(
        depth=v.depth, hidden_size=v.hidden_size, intermediate_size=v.intermediate_size, num_heads=v.num_heads,
        in_channels=v.in_channels, patch_size=v.patch_size, temporal_patch_size=v.temporal_patch_size,
        spatial_merge_size=v.spatial_merge_size, window_size=getattr(v, "window_size", 0) or 0,
        out_hidden_size=v.out_hidden_size, hidden_act=v.hidden_act,
        fullatt_block_indexes=tuple(getattr(v, "fullatt_block_indexes", None) or range(v.depth)),
        rope_theta=float(rope.get("rope_theta", 10000.0)), image_token_id=int(hf_config.image_token_id),
        mrope_section=tuple(int(s) for s in section), family=family,
        num_position_embeddings=int(getattr(v, "num_position_embeddings", 0) or 0),
        deepstack_visual_indexes=tuple(getattr(v, "deepstack_visual_indexes", None) or ()),
        mrope_interleaved=bool(text_rope.get("mrope_interleaved", family == "qwen3_vl")),
        prefixes=checkpoint_prefixes(getattr(hf_config, "_name_or_path", "") or "", family))


NESTED_PREFIXES = ("model.language_model.", "model.visual.")
FLAT_PREFIXES = ("model.", "visual.")


def checkpoint_prefixes(folder: str, family: str) -> tuple[str, str]:
    """The name prefixes the checkpoint in ``folder`` uses (its safetensors index or file); the family's own where
    there is no checkpoint to read (a config alone)."""
    from safetensors import safe_open

    path = Path(folder)
    names: list[str] = []
    try:
        if (path / "model.safetensors.index.json").is_file():
            names = list(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"])
        elif (path / "model.safetensors").is_file():
            with safe_open(path / "model.safetensors", "pt") as f:
                names = list(f.keys())
    except (OSError, ValueError, KeyError):
        names = []
    if any(n.startswith(NESTED_PREFIXES[1]) for n in names):
        return NESTED_PREFIXES
    if any(n.startswith(FLAT_PREFIXES[1]) for n in names):
        return FLAT_PREFIXES
    return NESTED_PREFIXES if family == "qwen3_vl" else FLAT_PREFIXES


_ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
                "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x)}


def build_tower(v: VisionShape) -> nn.Module:
    """The vision tower of ``v``'s family."""
    if v.family == "qwen3_vl":
        from slime_rl.trainer_megatron.vision_qwen3 import Qwen3VisionTower

        return Qwen3VisionTower(v)
    return VisionTower(v)


@functools.cache
def hf_tensor_shapes(v: VisionShape) -> dict[str, tuple[int, ...]]:
    """Every vision tensor's HF name (``visual.X``: the tower's parameter ``X``, as the HF module names it) and
    shape, from the tower built on the meta device (no memory)."""
    with torch.device("meta"):
        tower = build_tower(v)
    return {f"visual.{name}": tuple(t.shape) for name, t in tower.state_dict().items()}


# ---------------------------------------------------------------- layout of the patches


@dataclass
class PatchLayout:
    """Where each image's patches go, from ``grid_thw`` alone (host work, once a forward): the (h, w) rotary
    position of every patch, the window order of the merged blocks, and the attention segments."""

    positions: Tensor  # [patches, 2] (h, w), in the processor's order (merge blocks contiguous)
    window_index: Tensor  # [merged tokens]: the window order of the merge blocks
    windows: list[int]  # patches per attention window, in window order
    images: list[int]  # patches per image frame (full-attention segments)


def patch_positions(grid_thw: Tensor, m: int) -> Tensor:
    """``[patches, 2]``: each patch's (row, column) in its image, patches in the processor's order (each m x m
    merge block contiguous, blocks row by row, frames one after the other)."""
    positions = []
    for t, h, w in grid_thw.tolist():
        hpos, wpos = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        block = (h // m, m, w // m, m)
        pos = torch.stack([hpos.reshape(block).transpose(1, 2).flatten(),
                           wpos.reshape(block).transpose(1, 2).flatten()], dim=-1)
        positions.append(pos.repeat(t, 1))
    return torch.cat(positions)


def rotary_tables(positions: Tensor, v: VisionShape) -> tuple[Tensor, Tensor]:
    """cos and sin ``[patches, head_dim]`` of the 2D rotary: half the frequencies turn with the row, half with the
    column, the whole head rotated. The frequencies are made here in float32, never held as a buffer: a bf16 model's
    cast (Float16Module) would round them, where transformers and SGLang keep them in float32."""
    spatial = v.head_dim // 2
    inv_freq = 1.0 / (v.rope_theta ** (torch.arange(0, spatial, 2, dtype=torch.float, device=positions.device) / spatial))
    freqs = positions[..., None].float() * inv_freq  # [n, 2, d / 4]
    freqs = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def patch_layout(grid_thw: Tensor, v: VisionShape) -> PatchLayout:
    m = v.spatial_merge_size
    per_window = v.window_size // m // v.patch_size  # merged blocks per window side
    window_index, windows, images = [], [], []
    offset = 0
    for t, h, w in grid_thw.tolist():
        images += [h * w] * t
        gh, gw = h // m, w // m
        index = torch.arange(t * gh * gw).reshape(t, gh, gw)
        pad_h, pad_w = per_window - gh % per_window, per_window - gw % per_window
        nh, nw = (gh + pad_h) // per_window, (gw + pad_w) // per_window
        padded = F.pad(index, (0, pad_w, 0, pad_h), value=-1)
        padded = padded.reshape(t, nh, per_window, nw, per_window).permute(0, 1, 3, 2, 4)
        padded = padded.reshape(t, nh * nw, per_window * per_window)
        sizes = (padded >= 0).sum(-1).flatten()
        flat = padded.flatten()
        window_index.append(flat[flat >= 0] + offset)
        windows += [int(n) * m * m for n in sizes if n > 0]
        offset += t * gh * gw
    return PatchLayout(positions=patch_positions(grid_thw, m), window_index=torch.cat(window_index), windows=windows,
                       images=images)


# ---------------------------------------------------------------- modules


def run_block(block: nn.Module, recompute: bool, *args) -> Tensor:
    """``block(*args)``, its activations recomputed in backward when ``recompute`` (trainer.megatron.recompute:
    true reaches the vision tower too: a 1,024-patch image holds more activations in the tower than its 256 tokens
    do in Qwen2.5-VL-7B's LM)."""
    if recompute and torch.is_grad_enabled():
        return checkpoint(block, *args, use_reentrant=False)
    return block(*args)


class RMSNorm(nn.Module):
    """transformers' Qwen2RMSNorm op for op: normalised in float32, weight applied in the input's dtype."""

    def __init__(self, size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class PatchEmbed(nn.Module):
    """The 3D convolution whose stride is its kernel, as the matmul it is (one GEMM; the same weight, ``proj``)."""

    def __init__(self, v: VisionShape, bias: bool = False):
        super().__init__()
        kernel = (v.temporal_patch_size, v.patch_size, v.patch_size)
        self.proj = nn.Conv3d(v.in_channels, v.hidden_size, kernel_size=kernel, stride=kernel, bias=bias)

    def forward(self, pixel_values: Tensor) -> Tensor:
        weight = self.proj.weight
        return F.linear(pixel_values.to(weight.dtype), weight.reshape(weight.shape[0], -1), self.proj.bias)


class VisionMLP(nn.Module):
    def __init__(self, v: VisionShape):
        super().__init__()
        self.gate_proj = nn.Linear(v.hidden_size, v.intermediate_size)
        self.up_proj = nn.Linear(v.hidden_size, v.intermediate_size)
        self.down_proj = nn.Linear(v.intermediate_size, v.hidden_size)
        self.act = _ACTIVATIONS[v.hidden_act]

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class VisionAttention(nn.Module):
    """Bidirectional attention within each segment (a window or a whole image), 2D rotary on q and k."""

    def __init__(self, v: VisionShape):
        super().__init__()
        self.num_heads = v.num_heads
        self.qkv = nn.Linear(v.hidden_size, 3 * v.hidden_size)
        self.proj = nn.Linear(v.hidden_size, v.hidden_size)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, segments: list[int]) -> Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).reshape(n, 3, self.num_heads, -1).permute(1, 0, 2, 3).unbind(0)  # [n, heads, d]
        cos, sin = cos[:, None].float(), sin[:, None].float()
        q = (q.float() * cos + _rotate_half(q.float()) * sin).to(x.dtype)
        k = (k.float() * cos + _rotate_half(k.float()) * sin).to(x.dtype)
        return self.proj(segment_attention(q, k, v, segments).reshape(n, -1))


def segment_attention(q: Tensor, k: Tensor, v: Tensor, segments: list[int]) -> Tensor:
    """Full attention inside each segment of consecutive rows (``[n, heads, d]`` each). Segments of one length
    share one SDPA call (windows are mostly of one size), so a forward makes a few calls, not one a window."""
    out = torch.empty_like(q)
    starts = [0]
    for size in segments[:-1]:
        starts.append(starts[-1] + size)
    by_size: dict[int, list[int]] = {}
    for start, size in zip(starts, segments, strict=True):
        by_size.setdefault(size, []).append(start)
    for size, group in by_size.items():
        rows = (torch.tensor(group)[:, None] + torch.arange(size)).flatten().to(q.device)
        qs, ks, vs = (t.index_select(0, rows).reshape(len(group), size, *t.shape[1:]).transpose(1, 2)
                      for t in (q, k, v))  # [segments, heads, size, d]
        o = F.scaled_dot_product_attention(qs, ks, vs)
        out.index_copy_(0, rows, o.transpose(1, 2).reshape(len(group) * size, *q.shape[1:]))
    return out


class VisionBlock(nn.Module):
    def __init__(self, v: VisionShape):
        super().__init__()
        self.norm1 = RMSNorm(v.hidden_size)
        self.norm2 = RMSNorm(v.hidden_size)
        self.attn = VisionAttention(v)
        self.mlp = VisionMLP(v)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, segments: list[int]) -> Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, v: VisionShape):
        super().__init__()
        self.merged = v.hidden_size * v.spatial_merge_size ** 2
        self.ln_q = RMSNorm(v.hidden_size)
        self.mlp = nn.Sequential(nn.Linear(self.merged, self.merged), nn.GELU(), nn.Linear(self.merged, v.out_hidden_size))

    def forward(self, x: Tensor) -> Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.merged))


class VisionTower(nn.Module):
    """``pixel_values [patches, patch_dim]`` of the images of ``grid_thw [images, 3]`` -> one embedding per
    merged token ``[patches / merge^2, out_hidden_size]``, in the order the images' placeholder tokens come, and
    the deepstack features (none in Qwen2.5-VL)."""

    def __init__(self, v: VisionShape):
        super().__init__()
        self.shape = v
        self.recompute = False  # vlm.configure: trainer.megatron.recompute true
        self.patch_embed = PatchEmbed(v)
        self.blocks = nn.ModuleList([VisionBlock(v) for _ in range(v.depth)])
        self.merger = PatchMerger(v)

    def forward(self, pixel_values: Tensor, grid_thw: Tensor) -> tuple[Tensor, list[Tensor]]:
        v = self.shape
        layout = patch_layout(grid_thw.cpu(), v)
        unit = v.spatial_merge_size ** 2
        device = pixel_values.device
        window_index = layout.window_index.to(device)
        x = self.patch_embed(pixel_values)
        n = x.shape[0]
        x = x.reshape(n // unit, unit, -1)[window_index].reshape(n, -1)
        positions = layout.positions.to(device).reshape(n // unit, unit, 2)[window_index].reshape(n, 2)
        cos, sin = rotary_tables(positions, v)
        for i, block in enumerate(self.blocks):
            segments = layout.images if i in v.fullatt_block_indexes else layout.windows
            x = run_block(block, self.recompute, x, cos, sin, segments)
        return self.merger(x)[torch.argsort(window_index)], []
