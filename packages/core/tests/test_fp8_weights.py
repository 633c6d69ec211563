"""FP8 quantisation of synced weights (core/weights/fp8.py) against a float64 reference: the e4m3 grid is
enumerated from its 256 bit patterns and a weight rounded to it by hand (nearest, ties to the even pattern)."""

from __future__ import annotations

import pytest
import torch

from slime_rl.core.weights.fp8 import (
    FP8_DTYPE,
    FP8Format,
    block_edge,
    dequantize,
    model_partitions,
    quantize_block,
    quantize_buckets,
    quantize_channel,
    quantize_named,
)


def _e4m3_grid() -> tuple[torch.Tensor, torch.Tensor]:
    """Every finite non-negative e4m3 value (float64, ascending) and its bit pattern."""
    bits = torch.arange(128, dtype=torch.uint8)  # sign bit 0
    values = bits.view(FP8_DTYPE).to(torch.float64)
    keep = torch.isfinite(values)
    return values[keep], bits[keep].to(torch.int64)


def _scaled(w64: torch.Tensor, s32: torch.Tensor | float) -> torch.Tensor:
    """w / scale as the quantiser computes it, in float32: the float64 quotient rounded to float32 is the
    float32 quotient (53 >= 2 * 24 + 2 bits: rounding twice cannot differ from once). It can land exactly on a
    tie of the e4m3 grid (-168.0 between -160 and -176) where the float64 quotient is just past it."""
    return (w64 / s32).to(torch.float32).to(torch.float64)


def _round_e4m3(y: torch.Tensor) -> torch.Tensor:
    """float64 values (|y| <= 448) to the nearest e4m3 value, ties to the even bit pattern."""
    grid, bits = _e4m3_grid()
    mag = y.abs().clamp(max=448.0)
    hi = torch.searchsorted(grid, mag).clamp(max=len(grid) - 1)
    lo = (hi - 1).clamp(min=0)
    below, above = mag - grid[lo], grid[hi] - mag
    pick_hi = (above < below) | ((above == below) & (bits[hi] % 2 == 0))
    return torch.where(pick_hi, grid[hi], grid[lo]) * torch.sign(y)


def _reference_block(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the e4m3 values, float64 scales) of block quantisation done tile by tile in float64."""
    w64 = w.to(torch.float64)
    n, k = w64.shape
    scales = torch.empty(-(-n // block), -(-k // block), dtype=torch.float64)
    out = torch.empty_like(w64)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            tile = w64[i * block:(i + 1) * block, j * block:(j + 1) * block]
            amax = tile.abs().max().item()
            scale = amax / 448.0 if amax > 0 else 1.0
            scales[i, j] = scale
            s32 = float(torch.tensor(scale, dtype=torch.float32))  # the scale the engine multiplies by
            out[i * block:(i + 1) * block, j * block:(j + 1) * block] = _round_e4m3(_scaled(tile, s32))
    return out, scales


def _weights(shape: tuple[int, int], seed: int = 0) -> torch.Tensor:
    """bf16 weights with an all-zero tile, large and tiny magnitudes: what a real layer may hold."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=gen, dtype=torch.float32) * 0.02
    w[: min(16, shape[0]), : min(16, shape[1])] = 0.0
    w[-1, -1] = 3.0e4  # one outlier: its tile's other values become FP8 subnormals or zero
    w[0, -1] = 1.0e-8
    return w.to(torch.bfloat16)


@pytest.mark.parametrize("shape", [(256, 384), (300, 200), (130, 129), (1, 5)])
@pytest.mark.parametrize("block", [128, 64])
def test_block_quantisation_matches_the_float64_reference(shape, block):
    w = _weights(shape)
    q, scale = quantize_block(w, block)
    assert q.dtype == FP8_DTYPE and q.shape == w.shape
    assert scale.dtype == torch.float32 and scale.shape == (-(-shape[0] // block), -(-shape[1] // block))
    want, want_scale = _reference_block(w, block)
    torch.testing.assert_close(scale.double(), want_scale, rtol=2**-23, atol=0)
    got = q.to(torch.float64)
    assert torch.equal(got, want), f"{int((got != want).sum())} of {got.numel()} elements differ"


@pytest.mark.parametrize("shape", [(64, 576), (300, 200), (7, 3)])
def test_channel_quantisation_matches_the_float64_reference(shape):
    w = _weights(shape, seed=1)
    q, scale = quantize_channel(w)
    assert q.dtype == FP8_DTYPE and scale.shape == (shape[0], 1)
    w64 = w.to(torch.float64)
    amax = w64.abs().amax(dim=1, keepdim=True)
    want_scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    torch.testing.assert_close(scale.double(), want_scale, rtol=2**-23, atol=0)
    s32 = scale.double()
    assert torch.equal(q.to(torch.float64), _round_e4m3(_scaled(w64, s32)))


@pytest.mark.parametrize("fmt", [FP8Format("block", 128), FP8Format("block", 64), FP8Format("channel")])
def test_the_dequantised_error_stays_within_e4m3s_bound(fmt):
    """e4m3 keeps 3 mantissa bits: a normal value is off by at most 2^-4 of itself, a subnormal (below 2^-6
    in scaled units) by at most half the smallest step, 2^-10, times its scale."""
    w = _weights((384, 520), seed=2)
    q, scale = quantize_block(w, fmt.block) if fmt.scales == "block" else quantize_channel(w)
    got = dequantize(q, scale, fmt, torch.float64)
    w64 = w.to(torch.float64)
    spread = (scale.double().repeat_interleave(fmt.block, 0)[:384].repeat_interleave(fmt.block, 1)[:, :520]
              if fmt.scales == "block" else scale.double().expand_as(w64))
    bound = torch.maximum(w64.abs() * 2**-4, spread * 2**-10) * (1 + 2**-20)
    assert bool(((got - w64).abs() <= bound).all())
    assert (got - w64).abs().max() > 0  # it did quantise: 520 columns of bf16 do not all fit 3 mantissa bits


def test_zeros_keep_scale_one_and_large_values_reach_448():
    q, scale = quantize_block(torch.zeros(200, 130, dtype=torch.bfloat16), 128)
    assert torch.equal(scale, torch.ones(2, 2)) and not q.float().any()
    w = torch.full((128, 128), -9.0e3, dtype=torch.bfloat16)
    q, scale = quantize_block(w, 128)
    assert q.float().unique().tolist() == [-448.0] and scale.item() == pytest.approx(-w[0, 0].item() / 448)


def test_quantisation_is_bit_exact_from_run_to_run_and_layout_to_layout():
    w = _weights((384, 256), seed=3)
    first = quantize_block(w, 128)
    again = quantize_block(w.t().contiguous().t(), 128)  # same values, another memory layout
    as_fp32 = quantize_block(w.float(), 128)  # bf16 widens exactly
    for other in (again, as_fp32):
        assert torch.equal(first[0].view(torch.uint8), other[0].view(torch.uint8))
        assert torch.equal(first[1], other[1])


def test_non_finite_weights_are_refused_by_name():
    w = _weights((128, 128))
    w[5, 5] = float("nan")
    with pytest.raises(ValueError, match="model.layers.0.self_attn.q_proj.weight: holds inf or nan"):
        quantize_block(w, 128, name="model.layers.0.self_attn.q_proj.weight")
    w[5, 5] = float("inf")
    with pytest.raises(ValueError, match="holds inf or nan"):
        quantize_channel(w)


def test_only_projections_become_fp8_with_their_scales_next_to_them():
    h = torch.randn(256, 256, dtype=torch.bfloat16)
    bucket = [
        ("model.embed_tokens.weight", torch.randn(1000, 256, dtype=torch.bfloat16)),
        ("model.layers.0.input_layernorm.weight", torch.ones(256, dtype=torch.bfloat16)),
        ("model.layers.0.self_attn.q_proj.weight", h),
        ("model.layers.0.self_attn.q_proj.bias", torch.zeros(256, dtype=torch.bfloat16)),
        ("model.layers.0.mlp.gate.weight", torch.randn(8, 256, dtype=torch.bfloat16)),  # MoE router
        ("model.layers.0.mlp.experts.3.down_proj.weight", h),
        ("lm_head.weight", torch.randn(1000, 256, dtype=torch.bfloat16)),
    ]
    out = dict(quantize_named(bucket, FP8Format("block", 128)))
    fp8 = sorted(n for n, t in out.items() if t.dtype == FP8_DTYPE)
    assert fp8 == ["model.layers.0.mlp.experts.3.down_proj.weight", "model.layers.0.self_attn.q_proj.weight"]
    assert out["model.layers.0.self_attn.q_proj.weight_scale_inv"].shape == (2, 2)
    for name, tensor in bucket:
        if out[name].dtype != FP8_DTYPE:
            assert out[name] is tensor
    channel = [n for n, _ in quantize_named(bucket, FP8Format("channel"))]
    assert channel.index("model.layers.0.self_attn.q_proj.weight_scale") == \
        channel.index("model.layers.0.self_attn.q_proj.weight") + 1
    assert len(list(quantize_buckets(iter([bucket, bucket[:2]]), FP8Format()))) == 2


def test_block_edge_follows_the_models_partitions():
    qwen_7b = {"hidden_size": 3584, "num_attention_heads": 28, "num_key_value_heads": 4, "intermediate_size": 18944}
    assert block_edge(model_partitions(qwen_7b)) == 128
    assert block_edge(model_partitions(qwen_7b, tp_size=2)) == 128
    smollm2 = {"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536}
    assert model_partitions(smollm2) == [576, 576, 192, 1536]  # SGLang's 128x128 blocks fail on 576/192/192
    assert block_edge(model_partitions(smollm2)) == 64
    qwen3_moe = {"hidden_size": 2048, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                 "intermediate_size": 6144, "moe_intermediate_size": 768}
    assert block_edge(model_partitions(qwen3_moe, tp_size=2)) == 128
    assert block_edge([100, 36]) is None
