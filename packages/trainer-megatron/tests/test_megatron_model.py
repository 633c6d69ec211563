"""The Megatron model built from an HF config scores tokens as transformers does (fp32, <= 1e-4),
and its weights go back to HF bit-exactly (named_weights and save_hf)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from megatron_testlib import (
    load_hf,
    make_hf_model,
    make_samples,
    max_gap_to_hf,
    sample_log_probs,
    to_batch,
    trainer_for,
)

from slime_rl.trainer_megatron.convert import SafetensorsFolder

VOCAB = 256


def max_diff_to_hf(trainer, hf_dir, samples, temperature=1.0):
    return max_gap_to_hf(samples, sample_log_probs(trainer, samples), load_hf(hf_dir), temperature)


@pytest.mark.parametrize("family,tie", [("llama", False), ("llama", True), ("qwen2", False), ("qwen2", True),
                                        ("qwen3", False), ("qwen3", True)])
def test_log_probs_match_transformers(family, tie, tmp_path):
    model_dir = make_hf_model(tmp_path / "m", family, tie=tie, vocab=VOCAB)
    samples = make_samples(5, VOCAB, prompt=(1, 12), response=(1, 20))
    assert max_diff_to_hf(trainer_for(model_dir), model_dir, samples) <= 1e-4


@pytest.mark.parametrize("rope", [{"rope_type": "linear", "factor": 4.0},
                                  {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64}])
def test_rope_scaling_matches_transformers(rope, tmp_path):
    model_dir = make_hf_model(tmp_path / "m", "llama", vocab=VOCAB, rope_scaling=rope)
    samples = make_samples(3, VOCAB, prompt=(40, 60), response=(30, 60))
    assert max_diff_to_hf(trainer_for(model_dir), model_dir, samples) <= 1e-4


def test_temperature_scales_logits_like_the_engine(tmp_path):
    model_dir = make_hf_model(tmp_path / "m", "qwen2", vocab=VOCAB)
    samples = make_samples(3, VOCAB)
    trainer = trainer_for(model_dir, ["rollout.temperature=0.6"])
    assert max_diff_to_hf(trainer, model_dir, samples, temperature=0.6) <= 1e-4


def test_packing_and_padding_and_micro_batch_sizes_agree(tmp_path):
    model_dir = make_hf_model(tmp_path / "m", "qwen3", vocab=VOCAB)
    batch = to_batch(make_samples(7, VOCAB))
    results = [trainer_for(model_dir, ov).compute_log_probs(batch) for ov in
               (["trainer.micro_batch_size=1"], ["trainer.micro_batch_size=3"], ["trainer.max_tokens_per_gpu=30"])]
    for other in results[1:]:
        assert torch.allclose(results[0], other, atol=1e-5)


def test_hf_round_trip_is_bit_exact(tmp_path):
    model_dir = make_hf_model(tmp_path / "m", "qwen2", vocab=VOCAB)
    trainer = trainer_for(model_dir)
    reader = SafetensorsFolder(model_dir)
    buckets = list(trainer.named_weights(bucket_bytes=40_000))
    assert len(buckets) > 1 and all(buckets)
    exported = dict(item for bucket in buckets for item in bucket)
    assert sorted(exported) == sorted(reader.weight_map)
    for name, t in exported.items():
        assert torch.equal(t, reader.get(name)), name

    trainer.save_hf(str(tmp_path / "out"))
    saved = SafetensorsFolder(tmp_path / "out")
    assert all(torch.equal(saved.get(n), reader.get(n)) for n in reader.weight_map)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    reloaded = load_hf(tmp_path / "out")
    original = load_hf(model_dir)
    ids = torch.tensor([[1, 2, 3, 4]])
    assert torch.equal(reloaded(ids).logits, original(ids).logits)


def test_trained_weights_export_as_what_the_trainer_scores(tmp_path):
    """After an update, the exported HF weights give transformers the trainer's own log-probs."""
    model_dir = make_hf_model(tmp_path / "m", "llama", tie=True, vocab=VOCAB)
    trainer = trainer_for(model_dir, ["trainer.lr=0.01"])
    samples = make_samples(4, VOCAB)
    batch = to_batch(samples)
    before = trainer.compute_log_probs(batch)
    trainer.train_step(batch)
    trainer.save_hf(str(tmp_path / "out"))
    assert max_diff_to_hf(trainer, tmp_path / "out", samples) <= 1e-4
    after = trainer.compute_log_probs(batch)
    assert float((before - after).abs().max()) > 1e-3


def test_unsupported_models_and_layouts_get_clear_errors(tmp_path):
    from slime_rl.trainer_megatron.model import check_parallel_fits, hf_model_shape, read_hf_config

    model_dir = make_hf_model(tmp_path / "m", "llama", vocab=VOCAB, kv_heads=2)
    shape = hf_model_shape(read_hf_config(model_dir))
    with pytest.raises(ValueError, match="tensor_model_parallel_size: 4 must divide the model's 2 KV heads"):
        check_parallel_fits(shape, tp=4, pp=1)
    with pytest.raises(ValueError, match="pipeline_model_parallel_size: 3"):
        check_parallel_fits(shape, tp=1, pp=3)
    with pytest.raises(FileNotFoundError, match="config.json"):
        read_hf_config(tmp_path / "nowhere")
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["hidden_act"] = "gelu"
    (model_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="hidden_act"):
        hf_model_shape(read_hf_config(model_dir))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_core_attention_padded_and_packed_match_reference(dtype, tmp_path, monkeypatch):
    """SDPAttention: causal within each sequence, GQA, for the padded layout and every packed kernel
    (the scatter into a padded batch, one call per sequence, and flash varlen's arguments as our
    adapter builds them, here through a CPU stand-in of the kernel: the real one is CUDA-only and
    test_megatron_gpu.py checks it against the per-sequence path)."""
    from megatron.core.transformer.enums import AttnMaskType

    from slime_rl.trainer_megatron import attention
    from slime_rl.trainer_megatron.attention import SDPAttention, packed_seq_params
    from slime_rl.trainer_megatron.model import hf_model_shape, read_hf_config, transformer_config

    model_dir = make_hf_model(tmp_path / "m", "llama", vocab=VOCAB, hidden=64, heads=4, kv_heads=2)
    trainer_for(model_dir)  # the process group and Megatron's parallel state
    shape = hf_model_shape(read_hf_config(model_dir))  # head_dim 16, 4 query heads over 2 KV heads
    attn = SDPAttention(transformer_config(shape, tp=1, pp=1, dtype=dtype), layer_number=1,
                        attn_mask_type=AttnMaskType.causal, attention_type="self")
    g = torch.Generator().manual_seed(0)
    lens = [5, 1, 9]

    def reference(q, k, v):  # [s, n, d] one sequence, fp64 math
        k, v = (x.repeat_interleave(2, dim=1) for x in (k, v))
        scores = torch.einsum("snd,tnd->nst", q.double(), k.double()) / 16**0.5
        scores = scores.masked_fill(torch.ones(len(q), len(q), dtype=torch.bool).triu(1), float("-inf"))
        return torch.einsum("nst,tnd->snd", scores.softmax(-1), v.double()).reshape(len(q), -1)

    seqs = [[torch.randn(n, h, 16, generator=g) for h in (4, 2, 2)] for n in lens]
    expected = [reference(*s) for s in seqs]
    tol = 1e-5 if dtype == torch.float32 else 3e-2

    # padded: [s, b, n, d], right padding
    longest = max(lens)
    padded = [torch.zeros(longest, len(lens), h, 16) for h in (4, 2, 2)]
    for j, s in enumerate(seqs):
        for x, part in zip(padded, s, strict=True):
            x[: len(part), j] = part
    out = attn(*(x.to(dtype) for x in padded), None)
    for j, n in enumerate(lens):
        assert torch.allclose(out[:n, j].double(), expected[j], atol=tol)

    # packed: [t, n, d]
    packed = [torch.cat([s[i] for s in seqs]).to(dtype) for i in range(3)]
    params = packed_seq_params(lens)
    monkeypatch.setattr(attention, "varlen_applies", lambda query, dropout: True)
    calls = []
    for flagged in (True, False):  # torch 2.13's signature (enable_gqa), and 2.11's without the flag
        monkeypatch.setattr(attention, "_varlen_function", lambda f=flagged: _cpu_varlen_standin(calls, f))
        monkeypatch.setattr(attention, "_GQA_WITHOUT_FLAG", None)
        for kernel in ("padded", "per_sequence", "varlen"):
            attn.config.packed_attention = kernel
            out = attn(*packed, None, packed_seq_params=params)
            assert out.shape == (sum(lens), 4 * 16)
            assert torch.allclose(out.double(), torch.cat(expected), atol=tol), kernel
    # one call each for the whole row; K/V never repeated where the flag says GQA; without the flag the
    # first call with unrepeated K/V raised (as a kernel without GQA would) and the adapter repeated them
    assert [(heads, n) for heads, n, _ in calls] == [(2, 1), (2, "refused"), (4, 1)]
    assert all(cu.dtype == torch.int32 and cu.tolist() == [0, 5, 6, 15] for *_, cu in calls)


def _cpu_varlen_standin(calls: list, gqa_flag: bool):
    """``varlen_attn``'s contract on the CPU (torch 2.11's keywords: ``window_size``, ``scale``; with
    ``gqa_flag`` 2.13's ``enable_gqa``), so the adapter's arguments can be checked without CUDA."""
    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                    enable_gqa=False):
        assert window_size == (-1, 0) and max_q == max_k == int(cu_seq_q.diff().max()) and cu_seq_k is cu_seq_q
        if key.shape[1] != query.shape[1] and not (gqa_flag and enable_gqa):
            calls.append((key.shape[1], "refused", cu_seq_q))
            raise RuntimeError("number of heads in key/value must equal the query's")
        calls.append((key.shape[1], 1, cu_seq_q))
        rep = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
        bounds = cu_seq_q.tolist()
        return torch.cat([
            F.scaled_dot_product_attention(*(x[a:b].transpose(0, 1) for x in (query, key, value)), is_causal=True,
                                           scale=scale).transpose(0, 1)
            for a, b in zip(bounds[:-1], bounds[1:], strict=True)])

    names = {"scale", "window_size"} | ({"enable_gqa"} if gqa_flag else set())
    return varlen_attn, frozenset(names)


def test_auto_packed_kernel_without_varlen_pads_short_rows_and_never_a_long_tail():
    from types import SimpleNamespace

    from slime_rl.trainer_megatron.attention import choose_packed_kernel, packed_seq_params

    short = packed_seq_params([40] * 127 + [48])
    tail = packed_seq_params([8000] + [200] * 127)

    def query(where: str, dtype: torch.dtype, params) -> SimpleNamespace:  # what the choice reads of a query
        return SimpleNamespace(device=torch.device(where), dtype=dtype, shape=(sum(params.seq_lens), 2, 16))

    # one padded call for short rows; a long tail would pad 128 x 8000 for 33k real tokens: a call per sample
    for where, dtype in (("cpu", torch.bfloat16), ("cpu", torch.float32), ("cuda", torch.float32)):
        assert choose_packed_kernel("auto", query(where, dtype, short), short, 0.0) == "padded"
        assert choose_packed_kernel("auto", query(where, dtype, tail), tail, 0.0) == "per_sequence"
    assert choose_packed_kernel("per_sequence", query("cpu", torch.bfloat16, short), short, 0.0) == "per_sequence"
    with pytest.raises(ValueError, match="trainer.megatron.packed_attention: varlen needs CUDA"):
        choose_packed_kernel("varlen", query("cpu", torch.bfloat16, short), short, 0.0)


def test_compiled_rope_takes_transformer_engines_place_with_the_same_values(tmp_path):
    """compiled_fusions (on for CUDA) routes Megatron's RoPE through fused_rope's compiled kernel;
    compiled here on the CPU, it must give what Megatron's unfused RoPE gives, padded and packed."""
    from megatron.core import parallel_state
    from megatron.core.models.common.embeddings import rope_utils

    from slime_rl.trainer_megatron import fused_rope
    from slime_rl.trainer_megatron.model import hf_model_shape, read_hf_config, transformer_config

    model_dir = make_hf_model(tmp_path / "m", "qwen2", vocab=VOCAB, hidden=64, heads=4, kv_heads=2)
    trainer_for(model_dir)
    shape = hf_model_shape(read_hf_config(model_dir))
    plain = transformer_config(shape, tp=1, pp=1, dtype=torch.float32)
    fused = transformer_config(shape, tp=1, pp=1, dtype=torch.float32, compiled_fusions=True)
    assert fused.apply_rope_fusion and rope_utils.fused_apply_rotary_pos_emb is fused_rope.rope_bshd
    g = torch.Generator().manual_seed(0)
    freqs = torch.randn(9, 1, 1, 16, generator=g)
    cp = parallel_state.get_context_parallel_group()
    t = torch.randn(9, 3, 4, 16, generator=g)  # [s, b, heads, dim]
    expected = rope_utils.apply_rotary_pos_emb(t, freqs, config=plain, cp_group=cp)
    assert torch.allclose(rope_utils.apply_rotary_pos_emb(t, freqs, config=fused, cp_group=cp), expected, atol=1e-6)
    packed = torch.randn(12, 4, 16, generator=g)  # sequences of 5, 3 and 4 tokens
    cu = torch.tensor([0, 5, 8, 12], dtype=torch.int32)
    expected = rope_utils.apply_rotary_pos_emb(packed, freqs, config=plain, cu_seqlens=cu, cp_group=cp)
    got = rope_utils.apply_rotary_pos_emb(packed, freqs, config=fused, cu_seqlens=cu, cp_group=cp)
    assert torch.allclose(got, expected, atol=1e-6)
    # the positions are kept for the next call of the same micro-batch, never reused for another one
    again = rope_utils.apply_rotary_pos_emb(packed, freqs, config=fused, cu_seqlens=cu, cp_group=cp)
    assert torch.equal(again, got)
    other = torch.tensor([0, 7, 12], dtype=torch.int32)  # same tokens, other sequences
    expected = rope_utils.apply_rotary_pos_emb(packed, freqs, config=plain, cu_seqlens=other, cp_group=cp)
    got = rope_utils.apply_rotary_pos_emb(packed, freqs, config=fused, cu_seqlens=other, cp_group=cp)
    assert torch.allclose(got, expected, atol=1e-6) and not torch.allclose(got, again)
