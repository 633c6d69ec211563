"""Qwen3-VL in the Megatron trainer where it differs from Qwen2.5-VL (vision_qwen3.py, vlm.py): its vision tower
(learned position grid resampled to each image, LayerNorms, GELU MLP, full attention) and deepstack features equal
transformers'; HF -> Megatron -> HF is bit-exact under the checkpoint's own prefixes (``model.language_model.``,
``model.visual.``); log-probs equal transformers' (fp32, <= 1e-4) packed and padded; the deepstack additions and the
interleaved mRoPE each move them by far more than that; TP=2 equals one rank."""

from __future__ import annotations

import pytest
import torch
from megatron_testlib import launch, make_config, sample_log_probs, to_batch, trainer_for
from vlm_scenario import (
    GRIDS,
    assert_two_ranks_equal_one,
    hf_vision,
    load_hf_vl,
    make_vl_model,
    make_vl_samples,
    patch_dim,
    vl_max_gap,
)

from slime_rl.trainer_megatron.convert import SafetensorsFolder
from slime_rl.trainer_megatron.vision import build_tower, vision_shape

PARITY = 1e-4


@pytest.fixture(scope="module")
def qwen3_vl(tmp_path_factory):
    return make_vl_model(tmp_path_factory.mktemp("q3vl") / "m", family="qwen3_vl")


def test_vision_tower_and_deepstack_features_equal_transformers(qwen3_vl):
    hf = load_hf_vl(qwen3_vl)
    v = vision_shape(hf.config)
    assert (v.family, v.deepstack_visual_indexes, v.mrope_interleaved, v.num_position_embeddings) == (
        "qwen3_vl", (0, 2), True, 16)
    tower = build_tower(v)
    weights = {k.removeprefix("model.visual."): t for k, t in hf.state_dict().items() if k.startswith("model.visual.")}
    tower.load_state_dict(weights, strict=True)
    grid = torch.tensor([*GRIDS, (1, 2, 2)])  # a 2 x 2 image too: one merge block, the grid's corners only
    pixels = torch.randn(int(grid.prod(-1).sum()), patch_dim(), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        (ours, deepstack), (theirs, their_deepstack) = tower(pixels, grid), hf_vision(hf, pixels, grid)
    assert float((ours - theirs).abs().max()) <= 1e-5
    assert len(deepstack) == len(their_deepstack) == 2
    assert all(float((a - b).abs().max()) <= 1e-5 for a, b in zip(deepstack, their_deepstack, strict=True))


def test_round_trip_is_bit_exact_and_log_probs_match_transformers(qwen3_vl, tmp_path):
    reader = SafetensorsFolder(qwen3_vl)
    hf = load_hf_vl(qwen3_vl)
    samples = make_vl_samples(6)
    for overrides in (["trainer.max_tokens_per_gpu=4096"], ["trainer.micro_batch_size=3"]):  # packed, padded
        trainer = trainer_for(qwen3_vl, overrides)
        exported = dict(item for bucket in trainer.named_weights(bucket_bytes=64 << 10) for item in bucket)
        assert sorted(exported) == sorted(reader.weight_map)
        assert any(n.startswith("model.language_model.layers.2.self_attn.q_norm") for n in exported)
        assert any(n.startswith("model.visual.deepstack_merger_list.1.") for n in exported)
        assert all(torch.equal(t, reader.get(n)) for n, t in exported.items())
        assert vl_max_gap(samples, sample_log_probs(trainer, samples), hf) <= PARITY
    trainer.save_hf(str(tmp_path / "out"))
    saved = SafetensorsFolder(tmp_path / "out")
    assert sorted(saved.weight_map) == sorted(reader.weight_map)
    assert all(torch.equal(saved.get(n), reader.get(n)) for n in reader.weight_map)


def test_deepstack_and_interleaved_mrope_matter(qwen3_vl):
    """Qwen2.5-VL's mRoPE layout (runs of t, h, w dims) in place of the interleaved one, or a deepstack merger
    changed, moves the log-probs off transformers' by far more than the parity bound."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import MultimodalRotaryEmbedding

    samples = make_vl_samples(6)
    hf = load_hf_vl(qwen3_vl)
    trainer = trainer_for(qwen3_vl, ["trainer.max_tokens_per_gpu=4096"])
    interleaved = trainer.model.rotary_pos_emb
    runs = MultimodalRotaryEmbedding(kv_channels=16, rotary_percent=1.0, rotary_base=10000)
    try:
        trainer.model.rotary_pos_emb = runs
        assert vl_max_gap(samples, sample_log_probs(trainer, samples), hf) > 100 * PARITY
    finally:
        trainer.model.rotary_pos_emb = interleaved
    assert vl_max_gap(samples, sample_log_probs(trainer, samples), hf) <= PARITY
    with torch.no_grad():
        trainer.model.vision.deepstack_merger_list[1].linear_fc2.bias.add_(0.5)  # added after LM layer 1
    assert vl_max_gap(samples, sample_log_probs(trainer, samples), hf) > 100 * PARITY


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tensor_parallel_equals_one_rank(qwen3_vl, tmp_path, sequence_parallel):
    """TP=2, and with sequence parallelism (the deepstack features added to each rank's chunk of the sequence),
    against one rank."""
    spec = {"scenario": "vlm", "model": str(qwen3_vl), "num_samples": 6, "steps": 2,
            "overrides": ["trainer.max_tokens_per_gpu=4096"]}  # the default lr, 1e-3
    one = launch(1, spec, tmp_path)
    two = launch(2, {**spec, "overrides": [*spec["overrides"], "parallel.tensor_model_parallel_size=2",
                                           f"parallel.sequence_parallel={str(sequence_parallel).lower()}"]}, tmp_path)
    assert_two_ranks_equal_one(one, two)  # the steps moved the deepstack mergers too: they get gradients


@pytest.mark.parametrize(("overrides", "match"), [
    (["trainer.megatron.recompute=true"], "recompute: true"),
    (["parallel.pipeline_model_parallel_size=3"], "first pipeline stage of fewer than the 2 deepstack layers"),
])
def test_refuses_what_deepstack_cannot_do(qwen3_vl, overrides, match):
    from slime_rl.trainer_megatron.support import model_support

    said = dict(model_support(qwen3_vl)[1])
    assert said["architecture"] == "Qwen3VLForConditionalGeneration: supported (family qwen3_vl)"
    assert "deepstack from blocks [0, 2]" in said["vision"] and "[2, 3, 3] interleaved" in said["vision"]
    from slime_rl.trainer_megatron import vlm

    shape = trainer_for(qwen3_vl, ["trainer.max_tokens_per_gpu=4096"]).shape
    with pytest.raises(ValueError, match=match):
        vlm.configure(None, shape, make_config(qwen3_vl, ["trainer.max_tokens_per_gpu=4096", *overrides]))


def test_a_step_trains_every_tower_weight_and_freezing_keeps_them(qwen3_vl):
    """The deepstack mergers and the learned position grid get gradients through the LM layers they feed; with
    trainer.freeze_vision_tower none of the tower moves."""
    batch = to_batch(make_vl_samples(6))
    for freeze in (False, True):
        trainer = trainer_for(qwen3_vl, ["trainer.max_tokens_per_gpu=4096", "trainer.lr=0.01",
                                          f"trainer.freeze_vision_tower={str(freeze).lower()}"])
        before = {n: p.detach().clone() for n, p in trainer.model.vision.named_parameters()}
        batch.old_log_probs = trainer.compute_log_probs(batch)
        assert trainer.train_step(batch)["update_skipped"] == 0.0
        changed = {n for n, p in trainer.model.vision.named_parameters() if not torch.equal(p, before[n])}
        assert changed == (set() if freeze else set(before)), sorted(set(before) - changed)
