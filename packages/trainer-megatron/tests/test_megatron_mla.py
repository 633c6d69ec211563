"""DeepSeek-V3 (multi-head latent attention, mla.py, with GLM-4.5's routing, dense first layer and shared expert) in
the Megatron trainer at TP=1 (TP=2: test_megatron_sequence_parallel): HF -> Megatron -> HF is bit-exact for every MLA tensor, log-probs equal transformers'
(fp32, <= 1e-4) on padded and packed micro-batches (both CPU kernels), without a q down-projection (V2-Lite's
q_lora_rank null) and with YaRN, and each MLA part moves transformers' log-probs by far more than that when changed:
a trainer that got one wrong would fail the parity check."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from megatron_testlib import (
    load_hf,
    make_samples,
    max_gap_to_hf,
    sample_log_probs,
    to_batch,
    trainer_for,
    wide_model,
)

from slime_rl.trainer_megatron.convert import SafetensorsFolder

VOCAB = 256
MLA_TENSORS = ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj")
# DeepSeek-V3's own YaRN fields (factor 40 there); mscale != mscale_all_dim also scales cos and sin
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
        "mscale": 0.9, "mscale_all_dim": 1.0}


def deepseek_model(path, **fields):
    """A tiny random DeepSeek-V3 folder, its weights drawn wide (megatron_testlib.wide_model)."""
    return wide_model(path, "deepseek_v3", vocab=VOCAB, **fields)


def _samples():
    return make_samples(5, VOCAB, prompt=(4, 12), response=(4, 20))


def test_deepseek_round_trip_is_bit_exact_and_log_probs_match_transformers(tmp_path):
    model_dir = deepseek_model(tmp_path / "m")
    trainer = trainer_for(model_dir)
    reader = SafetensorsFolder(model_dir)
    exported = dict(item for bucket in trainer.named_weights(bucket_bytes=64 << 10) for item in bucket)
    assert sorted(exported) == sorted(reader.weight_map)
    for layer in (0, 1):  # the dense layer and the MoE layer each have every MLA tensor
        assert all(any(f"layers.{layer}.self_attn.{t}." in n for n in exported) for t in MLA_TENSORS)
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in exported
    assert all(torch.equal(t, reader.get(n)) for n, t in exported.items())

    samples = _samples()
    assert max_gap_to_hf(samples, sample_log_probs(trainer, samples), load_hf(model_dir)) <= 1e-4
    batch = to_batch(samples)
    batch.old_log_probs = trainer.compute_log_probs(batch)
    trainer.train_step(batch)
    trainer.save_hf(str(tmp_path / "out"))
    saved = SafetensorsFolder(tmp_path / "out")
    assert sorted(saved.weight_map) == sorted(reader.weight_map)
    kv_b = "model.layers.0.self_attn.kv_b_proj.weight"
    assert not torch.equal(saved.get(kv_b), reader.get(kv_b))  # trained, and written back under HF's name


def test_sync_buckets_keep_each_q_a_proj_with_its_kv_a_proj(tmp_path):
    """SGLang fuses a layer's q_a_proj and kv_a_proj_with_mqa at load and drops a half that arrives alone in one
    update call: with buckets of one tensor each, every q_a_proj still shares its bucket with its kv_a_proj_with_mqa,
    and nothing else is bundled."""
    trainer = trainer_for(deepseek_model(tmp_path / "m"))
    buckets = [[name for name, _ in bucket] for bucket in trainer.named_weights(bucket_bytes=1)]
    pairs = [b for b in buckets if len(b) > 1]
    assert pairs == [[f"model.layers.{i}.self_attn.q_a_proj.weight", f"model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight"]
                     for i in (0, 1)]


@pytest.mark.parametrize("kernel", ["padded", "per_sequence"])
def test_packed_micro_batches_match_transformers(kernel, tmp_path):
    """Packed rows (q/k head dim 20, v head dim 10) through each CPU kernel of attention.py."""
    model_dir = deepseek_model(tmp_path / "m")
    trainer = trainer_for(model_dir, ["trainer.max_tokens_per_gpu=64",
                                      f"trainer.megatron.packed_attention={kernel}"])
    samples = _samples()
    assert max_gap_to_hf(samples, sample_log_probs(trainer, samples), load_hf(model_dir)) <= 1e-4


def _hf_folder_with(model_dir, tmp_path, name: str, **config_fields):
    """A copy of ``model_dir`` with ``config_fields`` changed in its config.json."""
    folder = tmp_path / name
    shutil.copytree(model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **config_fields}))
    return folder


def test_each_mla_part_shows_in_the_log_probs(tmp_path):
    """Each MLA part moves transformers' log-probs by more than 1e-3 (ten times the parity tolerance) when changed:
    the rope pairs' interleaved layout, the q and kv latent norms, the decoupled rope key and the softmax scale of
    the full q/k head dim."""
    model_dir = deepseek_model(tmp_path / "m")
    samples = _samples()
    ours = sample_log_probs(trainer_for(model_dir), samples)
    assert max_gap_to_hf(samples, ours, load_hf(model_dir)) <= 1e-4

    def changed(edit) -> torch.nn.Module:
        hf = load_hf(model_dir)
        with torch.no_grad():
            for layer in hf.model.layers:
                edit(layer.self_attn)
        return hf

    rope = 8  # the tiny model's qk_rope_head_dim: the last rows of kv_a_proj_with_mqa make the shared rope key
    variants = {
        "rope not interleaved": load_hf(_hf_folder_with(model_dir, tmp_path, "plain", rope_interleave=False)),
        "q_a_layernorm left out": changed(lambda a: a.q_a_layernorm.weight.fill_(1.0)),
        "kv_a_layernorm left out": changed(lambda a: a.kv_a_layernorm.weight.fill_(1.0)),
        "no rope key": changed(lambda a: a.kv_a_proj_with_mqa.weight[-rope:].zero_()),
        "softmax scale of the nope dims": changed(lambda a: setattr(a, "scaling", 12 ** -0.5)),
    }
    for name, variant in variants.items():
        assert max_gap_to_hf(samples, ours, variant) > 1e-3, name


def test_without_q_down_projection_as_v2_lite(tmp_path):
    """q_lora_rank null: one q_proj (V2-Lite's layout) round-trips and matches transformers."""
    model_dir = deepseek_model(tmp_path / "m", q_lora_rank=None)
    trainer = trainer_for(model_dir)
    reader = SafetensorsFolder(model_dir)
    exported = dict(item for bucket in trainer.named_weights(bucket_bytes=1 << 20) for item in bucket)
    assert "model.layers.0.self_attn.q_proj.weight" in exported and not any("q_a_proj" in n for n in exported)
    assert sorted(exported) == sorted(reader.weight_map)
    assert all(torch.equal(t, reader.get(n)) for n, t in exported.items())
    samples = _samples()
    assert max_gap_to_hf(samples, sample_log_probs(trainer, samples), load_hf(model_dir)) <= 1e-4


@pytest.mark.parametrize("fields", [{"rope_interleave": False},
                                    {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}}],
                         ids=["rope-half-split", "linear-rope-scaling"])
def test_other_rope_layouts_match_transformers(fields, tmp_path):
    """Rope dims stored half-split (rope_interleave: false) and linear RoPE scaling, as transformers computes them."""
    model_dir = deepseek_model(tmp_path / "m", **fields)
    samples = _samples()
    assert max_gap_to_hf(samples, sample_log_probs(trainer_for(model_dir), samples), load_hf(model_dir)) <= 1e-4


def test_yarn_rope_scaling_matches_transformers(tmp_path):
    """DeepSeek's YaRN: scaled frequencies, cos/sin times mscale(factor, mscale) / mscale(factor, mscale_all_dim),
    and the softmax scale times mscale(factor, mscale_all_dim)^2; without any of it the log-probs move."""
    model_dir = deepseek_model(tmp_path / "m", rope_parameters={"rope_theta": 10000.0, **YARN})
    trainer = trainer_for(model_dir)
    assert trainer.shape.mla.rope_mscale != 1.0 and trainer.shape.mla.softmax_scale > 20 ** -0.5
    samples = _samples()
    ours = sample_log_probs(trainer, samples)
    assert max_gap_to_hf(samples, ours, load_hf(model_dir)) <= 1e-4
    config = json.loads((model_dir / "config.json").read_text())
    plain = {**config["rope_parameters"], "rope_type": "default"}
    assert max_gap_to_hf(samples, ours, load_hf(_hf_folder_with(model_dir, tmp_path, "plain", rope_parameters=plain))) > 1e-3
    hf = load_hf(model_dir)
    for layer in hf.model.layers:
        layer.self_attn.scaling = 20 ** -0.5  # the softmax scale without mscale(factor, mscale_all_dim)^2
    assert max_gap_to_hf(samples, ours, hf) > 1e-3
    hf = load_hf(model_dir)
    hf.model.rotary_emb.attention_scaling = 1.0  # cos and sin without YaRN's factor
    assert max_gap_to_hf(samples, ours, hf) > 1e-3


def test_deepseek_checkpoint_carries_its_mtp_layer_through(tmp_path, caplog):
    """A bf16 DeepSeek-V3 checkpoint as released: float32 correction bias and a multi-token-prediction layer after
    the last decoder layer (num_nextn_predict_layers: 1; transformers builds none). The trainer neither builds nor
    syncs the MTP layer, says so when it loads, and save_hf writes every tensor of the checkpoint back, the MTP
    layer's bit for bit."""
    from safetensors.torch import load_file, save_file

    model_dir = deepseek_model(tmp_path / "m")
    tensors = load_file(model_dir / "model.safetensors")
    tensors = {n: t if n.endswith("e_score_correction_bias") else t.to(torch.bfloat16) for n, t in tensors.items()}
    g = torch.Generator().manual_seed(5)
    mtp = {"eh_proj.weight": (64, 128), "enorm.weight": (64,), "hnorm.weight": (64,),
           "self_attn.kv_b_proj.weight": (88, 16), "mlp.experts.0.gate_proj.weight": (32, 64)}
    for suffix, size in mtp.items():
        tensors[f"model.layers.2.{suffix}"] = torch.randn(size, generator=g).to(torch.bfloat16)
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1, "dtype": "bfloat16"}))
    mtp_names = sorted(f"model.layers.2.{suffix}" for suffix in mtp)

    with caplog.at_level("WARNING", logger="slime_rl.trainer_megatron.convert"):
        trainer = trainer_for(model_dir, ["model.dtype=bfloat16"])
    assert trainer.shape.mtp_layers == 1
    assert "1 multi-token-prediction layer(s) (5 tensors, model.layers.2.*) not loaded" in caplog.text
    reader = SafetensorsFolder(model_dir)
    synced = dict(item for bucket in trainer.named_weights(bucket_bytes=1 << 20) for item in bucket)
    assert sorted(synced) == sorted(set(reader.weight_map) - set(mtp_names))
    assert all(torch.equal(t, reader.get(n)) for n, t in synced.items())
    trainer.save_hf(str(tmp_path / "out"))
    saved = SafetensorsFolder(tmp_path / "out")
    assert sorted(saved.weight_map) == sorted(reader.weight_map)
    for name in mtp_names + ["model.layers.1.mlp.gate.e_score_correction_bias"]:
        assert saved.get(name).dtype == reader.get(name).dtype and torch.equal(saved.get(name), reader.get(name)), name


def test_selective_recompute_of_core_attention_gives_the_same_step(tmp_path, monkeypatch):
    """trainer.megatron.recompute: [core_attn] reruns MLA's core attention in backward (twice the calls in a training
    step) and gives the step without it: the same loss and gradient norm."""
    from slime_rl.trainer_megatron.attention import SDPAttention

    calls = []
    forward = SDPAttention.forward
    monkeypatch.setattr(SDPAttention, "forward", lambda self, *a, **k: calls.append(1) or forward(self, *a, **k))
    model_dir = deepseek_model(tmp_path / "m")
    steps = {}
    for recompute in ([], ["trainer.megatron.recompute=[core_attn]"]):
        trainer = trainer_for(model_dir, recompute)
        batch = to_batch(_samples())
        batch.old_log_probs = trainer.compute_log_probs(batch)
        calls.clear()
        steps[bool(recompute)] = (trainer.train_step(batch), len(calls))
    (plain, plain_calls), (recomputed, recomputed_calls) = steps[False], steps[True]
    assert recomputed_calls == 2 * plain_calls > 0
    assert abs(plain["loss"] - recomputed["loss"]) <= 1e-6 and abs(plain["grad_norm"] - recomputed["grad_norm"]) <= 1e-6


@pytest.mark.parametrize("q_lora_rank", [24, None])
def test_the_micro_batch_cost_counts_mla_projections_as_transformers_builds_them(q_lora_rank, tmp_path):
    """Dynamic batching weighs a token's attention against its layer's matmuls (model.attention_cost_weight): MLA's
    projection weights counted from its shape are the weights transformers' attention layer holds."""
    from slime_rl.trainer_megatron.mla import projection_params
    from slime_rl.trainer_megatron.model import attention_cost_weight, hf_model_shape

    hf = load_hf(deepseek_model(tmp_path / "m", q_lora_rank=q_lora_rank))
    shape = hf_model_shape(hf.config)
    attention = hf.model.layers[0].self_attn
    held = sum(p.numel() for name, p in attention.named_parameters() if "layernorm" not in name)
    assert projection_params(shape.mla, shape.num_heads, shape.hidden_size) == held
    assert 0 < attention_cost_weight(shape) < 1


def test_compiled_rope_gives_the_same_log_probs_with_yarn(tmp_path, monkeypatch):
    """On CUDA the trainer routes RoPE through fused_rope's compiled kernel (compiled_fusions), which takes no
    mscale: MLA applies YaRN's cos/sin factor after RoPE, so the compiled path (compiled here on the CPU) gives the
    unfused path's log-probs, padded and packed."""
    from megatron.core.models.common.embeddings import rope_utils

    from slime_rl.trainer_megatron import fused_rope

    calls = []
    for name, kernel in (("fused_apply_rotary_pos_emb", fused_rope.rope_bshd),
                         ("fused_apply_rotary_pos_emb_thd", fused_rope.rope_thd)):
        monkeypatch.setattr(rope_utils, name, lambda *a, kernel=kernel, **k: calls.append(kernel) or kernel(*a, **k))
    model_dir = deepseek_model(tmp_path / "m", rope_parameters={"rope_theta": 10000.0, **YARN})
    samples = _samples()
    for batching, kernel in (([], fused_rope.rope_bshd), (["trainer.max_tokens_per_gpu=64"], fused_rope.rope_thd)):
        trainer = trainer_for(model_dir, batching)
        plain = sample_log_probs(trainer, samples)
        calls.clear()
        config = next(m.config for m in trainer.model.modules() if hasattr(m, "config"))
        config.apply_rope_fusion = True  # what transformer_config sets with compiled_fusions (CUDA)
        fused = sample_log_probs(trainer, samples)
        config.apply_rope_fusion = False
        assert trainer.shape.mla.rope_mscale != 1.0 and calls and set(calls) == {kernel}
        assert max(float((torch.tensor(a) - torch.tensor(b)).abs().max()) for a, b in zip(plain, fused, strict=True)
                   ) <= 1e-5


def test_mla_refuses_what_it_does_not_build(tmp_path):
    from slime_rl.trainer_megatron.model import check_parallel_fits, hf_model_shape

    config = load_hf(deepseek_model(tmp_path / "m")).config
    shape = hf_model_shape(config)
    assert (shape.family, shape.head_dim, shape.num_kv_heads, shape.mla.qk_head_dim, shape.mla.v_head_dim,
            shape.moe.dense_layers, shape.moe.num_groups) == ("deepseek_v3", 8, 4, 20, 10, (0,), 2)
    check_parallel_fits(shape, tp=2, pp=1)  # TP=2 splits the 4 heads (test_megatron_sequence_parallel)
    with pytest.raises(ValueError, match="multi-head latent attention .* runs at CP=1 .*CP=2"):
        check_parallel_fits(shape, tp=1, pp=1, cp=2)
    with pytest.raises(ValueError, match="must divide the model's 4 heads"):
        check_parallel_fits(shape, tp=8, pp=1)
    config.topk_method, config.scoring_func = "group_limited_greedy", "softmax"  # DeepSeek-V2's routing
    with pytest.raises(ValueError, match="topk_method='group_limited_greedy' with scoring_func='softmax'"):
        hf_model_shape(config)
    config.topk_method, config.scoring_func, config.attention_bias = "noaux_tc", "sigmoid", True
    with pytest.raises(ValueError, match="attention_bias=true with multi-head latent attention"):
        hf_model_shape(config)
    config.attention_bias = False
    # DeepSeek-V3 as released: block-FP8 weights, which mean nothing without their scales
    config.quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    with pytest.raises(ValueError, match=r"quantized checkpoint \(quantization_config: fp8\) is not supported"):
        hf_model_shape(config)


def test_varlen_pads_v_to_the_qk_head_dim_and_slices_the_output(monkeypatch):
    """The flash varlen kernel takes one head dim for q, k and v: MLA's V is zero-padded to the q/k head dim and the
    output's extra columns sliced off, which equals causal attention with V as it is (a stand-in kernel on the CPU
    that refuses unequal dims; the real kernel runs in the GPU test below)."""
    import torch.nn.functional as F

    from slime_rl.trainer_megatron import attention

    def flash_like(q, k, v, cu_q, cu_k, max_q, max_k, scale):
        assert q.shape[-1] == k.shape[-1] == v.shape[-1]
        bounds = cu_q.tolist()
        return torch.cat([F.scaled_dot_product_attention(*(x[a:b].transpose(0, 1) for x in (q, k, v)), is_causal=True,
                                                         scale=scale).transpose(0, 1)
                          for a, b in zip(bounds[:-1], bounds[1:], strict=True)])

    monkeypatch.setattr(attention, "varlen_attention", flash_like)
    g = torch.Generator().manual_seed(0)
    lengths = [5, 9, 3]
    query, key = (torch.randn(sum(lengths), 4, 20, generator=g) for _ in range(2))
    value = torch.randn(sum(lengths), 4, 10, generator=g)
    out = attention.varlen_causal(query, key, value, attention.packed_seq_params(lengths), 20 ** -0.5)
    assert out.shape == (sum(lengths), 4, 10)
    start = 0
    for n in lengths:
        expected = F.scaled_dot_product_attention(*(x[start:start + n].transpose(0, 1) for x in (query, key, value)),
                                                  is_causal=True, scale=20 ** -0.5).transpose(0, 1)
        torch.testing.assert_close(out[start:start + n], expected)
        start += n


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_varlen_with_v_padded_to_the_qk_head_dim_matches_the_per_sequence_path(tmp_path):
    """bf16 on CUDA, packed: one flash varlen call a layer, V (head dim 32) zero-padded to the q/k head dim (64) and
    the output sliced back, gives the per-sequence SDPA path's log-probs before and after a GRPO step."""
    from megatron_testlib import launch

    model_dir = deepseek_model(tmp_path / "m", qk_nope_head_dim=48, qk_rope_head_dim=16, v_head_dim=32)
    packed = ["cluster.device=cuda", "model.dtype=bfloat16", "trainer.micro_batch_size=4",
              "trainer.max_tokens_per_gpu=512", "trainer.lr=1e-5"]
    out = launch(1, dict(scenario="packed_kernels", model=str(model_dir), num_samples=16, vocab=VOCAB, prompt=(8, 32),
                         response=(2, 96), kernels=["per_sequence", "varlen"], overrides=packed), tmp_path)
    reference, varlen = out["per_sequence"], out["varlen"]
    for when in ("before", "after"):
        diff = torch.cat([(torch.tensor(a) - torch.tensor(b)).abs() for a, b in
                          zip(reference[when], varlen[when], strict=True)])
        print(f"\nMLA log-probs {when} the step, |varlen - per sequence|: mean {diff.mean():.2e}, max {diff.max():.2e}")
        assert diff.mean() < 1e-2 and diff.max() < 0.25
