"""Qwen3-VL's vision tower for the Megatron trainer, where it differs from Qwen2.5-VL's (vision.py): the patch
embedding has a bias and a learned position embedding (a square grid of ``num_position_embeddings``, resampled
bilinearly, corners aligned, to each image's patch grid); every block attends to its whole image (no windows);
norms are LayerNorms with biases, the MLP a plain GELU one (``linear_fc1``/``linear_fc2``); the blocks of
``deepstack_visual_indexes`` each feed a merger of their own (``deepstack_merger_list``, normalised after the
2x2 shuffle) whose outputs the language model adds to its image tokens after its first layers (vlm.py).
Names follow transformers 5.25's ``Qwen3VLVisionModel``; the reference for every op is that module.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from slime_rl.trainer_megatron.vision import (
    _ACTIVATIONS,
    PatchEmbed,
    VisionAttention,
    VisionShape,
    patch_positions,
    rotary_tables,
    run_block,
)


class Qwen3VisionMLP(nn.Module):
    def __init__(self, v: VisionShape):
        super().__init__()
        self.linear_fc1 = nn.Linear(v.hidden_size, v.intermediate_size)
        self.linear_fc2 = nn.Linear(v.intermediate_size, v.hidden_size)
        self.act = _ACTIVATIONS[v.hidden_act]

    def forward(self, x: Tensor) -> Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class Qwen3VisionBlock(nn.Module):
    def __init__(self, v: VisionShape):
        super().__init__()
        self.norm1 = nn.LayerNorm(v.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(v.hidden_size, eps=1e-6)
        self.attn = VisionAttention(v)
        self.mlp = Qwen3VisionMLP(v)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, segments: list[int]) -> Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        return x + self.mlp(self.norm2(x))


class Qwen3PatchMerger(nn.Module):
    """LayerNorm (before the 2x2 shuffle, or after it for the deepstack mergers), then fc1, GELU, fc2."""

    def __init__(self, v: VisionShape, postshuffle: bool):
        super().__init__()
        self.merged = v.hidden_size * v.spatial_merge_size ** 2
        self.postshuffle = postshuffle
        self.norm = nn.LayerNorm(self.merged if postshuffle else v.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.merged, self.merged)
        self.linear_fc2 = nn.Linear(self.merged, v.out_hidden_size)

    def forward(self, x: Tensor) -> Tensor:
        x = self.norm(x.view(-1, self.merged) if self.postshuffle else x).view(-1, self.merged)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


def position_taps(grid_thw: Tensor, side: int, m: int) -> tuple[Tensor, Tensor]:
    """For each patch (processor order), the 4 cells of the ``side`` x ``side`` learned grid it interpolates and
    their bilinear weights (align_corners: an image's first and last rows/columns land on the grid's)."""
    positions = patch_positions(grid_thw, m).float()
    sizes = torch.cat([torch.tensor([[h, w]]).expand(t * h * w, 2) for t, h, w in grid_thw.tolist()]).float()
    src = positions * (side - 1) / (sizes - 1).clamp(min=1)  # [n, 2] fractional (row, column) on the grid
    floor = src.floor()
    taps = (floor.long()[..., None] + torch.arange(2)).clamp(0, side - 1)  # [n, 2 axes, 2 taps]
    weights = (1 - (src[..., None] - floor[..., None] - torch.arange(2)).abs()).clamp(min=0)
    index = (taps[:, 0, :, None] * side + taps[:, 1, None, :]).reshape(-1, 4)
    weight = (weights[:, 0, :, None] * weights[:, 1, None, :]).reshape(-1, 4)
    return index, weight


class Qwen3VisionTower(nn.Module):
    """As vision.VisionTower, for Qwen3-VL: the merged embeddings and one feature map per deepstack block."""

    def __init__(self, v: VisionShape):
        super().__init__()
        self.shape = v
        self.recompute = False  # vlm.configure: trainer.megatron.recompute true
        self.patch_embed = PatchEmbed(v, bias=True)
        self.pos_embed = nn.Embedding(v.num_position_embeddings, v.hidden_size)
        self.blocks = nn.ModuleList([Qwen3VisionBlock(v) for _ in range(v.depth)])
        self.merger = Qwen3PatchMerger(v, postshuffle=False)
        self.deepstack_merger_list = nn.ModuleList(
            [Qwen3PatchMerger(v, postshuffle=True) for _ in v.deepstack_visual_indexes])

    def forward(self, pixel_values: Tensor, grid_thw: Tensor) -> tuple[Tensor, list[Tensor]]:
        v = self.shape
        grid = grid_thw.cpu()
        device = pixel_values.device
        x = self.patch_embed(pixel_values)
        index, weight = position_taps(grid, int(v.num_position_embeddings ** 0.5), v.spatial_merge_size)
        pos = (self.pos_embed(index.to(device)) * weight.to(device)[..., None]).sum(1)
        x = x + pos.to(x.dtype)
        cos, sin = rotary_tables(patch_positions(grid, v.spatial_merge_size).to(device), v)
        segments = [h * w for t, h, w in grid.tolist() for _ in range(t)]
        deepstack = []
        for i, block in enumerate(self.blocks):
            x = run_block(block, self.recompute, x, cos, sin, segments)
            if i in v.deepstack_visual_indexes:
                deepstack.append(self.deepstack_merger_list[v.deepstack_visual_indexes.index(i)](x))
        return self.merger(x), deepstack
