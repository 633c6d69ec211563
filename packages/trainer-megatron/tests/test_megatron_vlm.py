"""Qwen2.5-VL in the Megatron trainer (vlm.py, vision.py) on tiny random configs: the vision tower and mRoPE
positions equal transformers', HF -> Megatron -> HF is bit-exact, log-probs of samples with several images equal
transformers' (fp32, <= 1e-4) in packed and padded micro-batches, and the images, their positions and the
vision weights each move those log-probs by far more than that (a trainer that dropped one would fail);
``trainer.freeze_vision_tower`` keeps the tower as loaded; TP=2 gives TP=1's log-probs and steps."""

from __future__ import annotations

import json

import pytest
import torch
from megatron_testlib import launch, make_config, sample_log_probs, to_batch, trainer_for
from vlm_scenario import (
    GRIDS,
    IMAGE,
    assert_two_ranks_equal_one,
    hf_rope_index,
    hf_vision,
    load_hf_vl,
    make_vl_model,
    make_vl_samples,
    patch_dim,
    vl_max_gap,
)

from slime_rl.trainer_megatron.convert import SafetensorsFolder
from slime_rl.trainer_megatron.trainer import MegatronTrainer
from slime_rl.trainer_megatron.vision import VisionTower, vision_shape
from slime_rl.trainer_megatron.vlm import mrope_positions

PARITY = 1e-4


@pytest.fixture(scope="module")
def vl_model(tmp_path_factory):
    return make_vl_model(tmp_path_factory.mktemp("vl") / "m")


def test_vision_tower_and_mrope_positions_equal_transformers(vl_model):
    hf = load_hf_vl(vl_model)
    v = vision_shape(hf.config)
    tower = VisionTower(v)
    weights = {k.removeprefix("model.visual."): t for k, t in hf.state_dict().items() if k.startswith("model.visual.")}
    tower.load_state_dict(weights, strict=True)
    grid = torch.tensor(GRIDS)
    pixels = torch.randn(int(grid.prod(-1).sum()), patch_dim(), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        (ours, deepstack), (theirs, _) = tower(pixels, grid), hf_vision(hf, pixels, grid)
    assert deepstack == []  # Qwen2.5-VL has none
    assert ours.shape == theirs.shape == (sum(t * h * w for t, h, w in GRIDS) // 4, 64)
    assert float((ours - theirs).abs().max()) <= 1e-5
    for sample in make_vl_samples(4):  # 2, 0, 1 and 3 images
        ids = torch.tensor([sample.tokens])
        inputs = sample.multimodal_train_inputs
        grid = inputs["image_grid_thw"] if inputs else None
        if grid is None:
            assert torch.equal(mrope_positions(ids[0], None, v), torch.arange(ids.shape[1]).expand(3, -1))
            continue
        expected = hf_rope_index(hf, ids, grid)
        assert torch.equal(mrope_positions(ids[0], grid, v), expected[:, 0])


def test_round_trip_is_bit_exact_and_log_probs_match_transformers(vl_model, tmp_path):
    reader = SafetensorsFolder(vl_model)
    hf = load_hf_vl(vl_model)
    samples = make_vl_samples(6)
    assert sum(1 for s in samples if s.multimodal_train_inputs) == 5
    for overrides in (["trainer.max_tokens_per_gpu=4096"], ["trainer.micro_batch_size=3"]):  # packed, padded
        trainer = trainer_for(vl_model, overrides)
        exported = dict(item for bucket in trainer.named_weights(bucket_bytes=64 << 10) for item in bucket)
        assert sorted(exported) == sorted(reader.weight_map)
        assert sum(n.startswith("visual.") for n in exported) == 1 + 3 * 12 + 5  # patch embed, 3 blocks, merger
        assert all(torch.equal(t, reader.get(n)) for n, t in exported.items())
        ours = sample_log_probs(trainer, samples)
        assert vl_max_gap(samples, ours, hf) <= PARITY
        # the images count: transformers' log-probs with other pixels are far from ours
        assert vl_max_gap(samples, ours, hf, pixel_scale=0.5) > 100 * PARITY
    trainer.save_hf(str(tmp_path / "out"))
    saved = SafetensorsFolder(tmp_path / "out")
    assert sorted(saved.weight_map) == sorted(reader.weight_map)
    assert all(torch.equal(saved.get(n), reader.get(n)) for n in reader.weight_map)
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == json.loads((vl_model / "config.json").read_text())


def test_positions_and_vision_weights_matter(vl_model, tmp_path):
    """Without mRoPE's image positions (every stream counting on as text), or with a vision block changed, the
    log-probs leave transformers' by far more than the parity bound."""
    from slime_rl.trainer_megatron import vlm

    samples = make_vl_samples(6)
    hf = load_hf_vl(vl_model)
    trainer = trainer_for(vl_model, ["trainer.max_tokens_per_gpu=4096"])
    real = vlm.mrope_positions
    try:
        vlm.mrope_positions = lambda ids, grid, v: torch.arange(len(ids)).expand(3, -1)
        assert vl_max_gap(samples, sample_log_probs(trainer, samples), hf) > 100 * PARITY
    finally:
        vlm.mrope_positions = real
    with torch.no_grad():
        trainer.model.vision.blocks[2].mlp.down_proj.bias.add_(0.5)  # a window-attention block, the last one
    assert vl_max_gap(samples, sample_log_probs(trainer, samples), hf) > 100 * PARITY


@pytest.mark.parametrize("freeze", [True, False])
def test_freeze_vision_tower(vl_model, freeze):
    trainer = trainer_for(vl_model, ["trainer.max_tokens_per_gpu=4096", "trainer.lr=0.01",
                                     f"trainer.freeze_vision_tower={str(freeze).lower()}"])
    vision = {n: p.detach().clone() for n, p in trainer.model.vision.named_parameters()}
    lm = trainer.model.decoder.layers[0].mlp.linear_fc2.weight.detach().clone()
    batch = to_batch(make_vl_samples(6))
    batch.old_log_probs = trainer.compute_log_probs(batch)
    metrics = trainer.train_step(batch)
    assert metrics["update_skipped"] == 0.0
    assert not torch.equal(lm, trainer.model.decoder.layers[0].mlp.linear_fc2.weight)
    changed = [n for n, p in trainer.model.vision.named_parameters() if not torch.equal(p, vision[n])]
    if freeze:
        assert changed == []
    else:  # every tower weight, the patch embedding through the merger, got a gradient from the images
        assert sorted(changed) == sorted(vision)


# at the default lr (1e-3) two steps move the log-probs by ~2; at 1e-2 Adam's normalised steps turn TP's other
# summation order into ~1e-4 of log-prob
VLM_SPEC = {"scenario": "vlm", "num_samples": 6, "steps": 2, "overrides": ["trainer.max_tokens_per_gpu=4096"]}


@pytest.fixture(scope="module")
def one_rank(vl_model, tmp_path_factory):
    return launch(1, {**VLM_SPEC, "model": str(vl_model)}, tmp_path_factory.mktemp("one"))


@pytest.mark.parametrize("layout", ["parallel.tensor_model_parallel_size=2", "parallel.pipeline_model_parallel_size=2",
                                    "parallel.tensor_model_parallel_size=2 parallel.sequence_parallel=true"])
def test_two_ranks_equal_one_rank(vl_model, one_rank, layout, tmp_path):
    """TP=2 (each rank its replicated vision tower and half of every LM layer), PP=2 (the tower on the first
    stage, mRoPE positions on both) and TP=2 with sequence parallelism (each rank merges the images of its sequence
    chunk; the tower's gradients summed over TP) against one rank: the same log-probs before and after two steps,
    the ranks holding a shard agreeing, the same losses and grad norms, and the HF export bit-exact."""
    two = launch(2, {**VLM_SPEC, "model": str(vl_model), "overrides": [*VLM_SPEC["overrides"], *layout.split()]},
                 tmp_path)
    assert_two_ranks_equal_one(one_rank, two)


def test_checkpoint_resumes_the_vision_tower(vl_model, tmp_path):
    """Megatron's distributed checkpoint holds the vision tower: a fresh trainer loaded from it scores as the
    trained one does, not as the HF weights do."""
    overrides = ["trainer.max_tokens_per_gpu=4096", "trainer.lr=0.01"]
    trainer = trainer_for(vl_model, overrides)
    batch = to_batch(make_vl_samples(6))
    batch.old_log_probs = trainer.compute_log_probs(batch)
    trainer.train_step(batch)
    trained = trainer.compute_log_probs(batch)
    tower = {n: p.detach().clone() for n, p in trainer.model.vision.named_parameters()}
    trainer.save(str(tmp_path / "ckpt"))
    fresh = trainer_for(vl_model, overrides)
    assert float((fresh.compute_log_probs(batch) - trained).abs().max()) > 1e-3
    fresh.load(str(tmp_path / "ckpt"))
    assert all(torch.equal(p, tower[n]) for n, p in fresh.model.vision.named_parameters())
    assert float((fresh.compute_log_probs(batch) - trained).abs().max()) <= 1e-6


@pytest.mark.parametrize("overrides", [["parallel.context_parallel_size=2"], ["trainer.lora.rank=4"]])
def test_refuses_what_it_does_not_build(vl_model, overrides):
    from slime_rl.trainer_megatron import vlm

    cfg = make_config(vl_model, ["trainer.max_tokens_per_gpu=4096", *overrides])
    shape = trainer_for(vl_model, ["trainer.max_tokens_per_gpu=4096"]).shape
    with pytest.raises(ValueError, match="not supported with a vision-language model"):
        vlm.configure(None, shape, cfg)


def test_compiled_rope_takes_the_per_token_mrope_table(vl_model, monkeypatch):
    """On CUDA the trainer routes RoPE through fused_rope's compiled kernels (compiled_fusions); mRoPE's packed table
    has a row per token, not per position, and the compiled thd kernel (compiled here on the CPU) must read it so:
    the same log-probs as the unfused path, packed (thd) and one row padded (bshd)."""
    from megatron.core.models.common.embeddings import rope_utils

    from slime_rl.trainer_megatron import fused_rope

    calls = []
    for name, kernel in (("fused_apply_rotary_pos_emb", fused_rope.rope_bshd),
                         ("fused_apply_rotary_pos_emb_thd", fused_rope.rope_thd)):
        monkeypatch.setattr(rope_utils, name, lambda *a, kernel=kernel, **k: calls.append(kernel) or kernel(*a, **k))
    samples = make_vl_samples(4)
    for batching, kernel in ((["trainer.max_tokens_per_gpu=4096"], fused_rope.rope_thd),
                             (["trainer.micro_batch_size=1"], fused_rope.rope_bshd)):
        trainer = trainer_for(vl_model, batching)
        plain = sample_log_probs(trainer, samples)
        calls.clear()
        trainer.tconfig.apply_rope_fusion = True  # what transformer_config sets with compiled_fusions (CUDA)
        try:
            fused = sample_log_probs(trainer, samples)
        finally:
            trainer.tconfig.apply_rope_fusion = False
        assert calls and set(calls) == {kernel}
        assert max(float((torch.tensor(a) - torch.tensor(b)).abs().max()) for a, b in zip(plain, fused, strict=True)
                   ) <= 1e-5


def test_doctor_and_plan_see_the_vision_tower(vl_model):
    from slime_rl.trainer_megatron.settings import MegatronSettings
    from slime_rl.trainer_megatron.support import model_support

    supported, lines = model_support(vl_model)
    said = dict(lines)
    assert supported and said["architecture"] == "Qwen2_5_VLForConditionalGeneration: supported (family qwen2_5_vl)"
    assert said["vision"].startswith("vision tower of 3 blocks (width 32, full attention at [1]), merged 2x2;"
                                     " mRoPE sections [2, 3, 3]")
    MegatronSettings().check(make_config(vl_model), "trainer.megatron")  # plan's check: nothing to refuse


def test_processor_made_samples_through_the_trainer(tmp_path):
    """The data half's contract end to end: real images (files of different sizes) through the model's processor
    (slime_rl.core.vision: the prompt's ids with the placeholders expanded, Sample.multimodal_train_inputs) into
    the trainer; its log-probs equal transformers' on the same ids and pixels (fp32), and the same prompt with
    another picture scores differently."""
    from PIL import Image

    from slime_rl.core.sample import Sample
    from slime_rl.core.testing.vision import tiny_vl_model_folder
    from slime_rl.core.vision.processor import load_processor
    from slime_rl.core.vision.prompt import encode_prompt, prompt_text

    folder = tiny_vl_model_folder(tmp_path / "m")
    processor = load_processor(folder)
    g = torch.Generator().manual_seed(0)
    refs = []
    for i, (w, h) in enumerate([(112, 112), (84, 56), (70, 98)]):
        pixels = torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8).numpy()
        Image.fromarray(pixels).save(tmp_path / f"{i}.png")
        refs.append(str(tmp_path / f"{i}.png"))
    samples = []
    for i, images in enumerate([refs[:2], refs[2:], refs[::-1], []]):
        text = prompt_text(f"describe picture {i}", len(images), processor, f"sample {i}", apply_chat_template=True)
        if images:
            prompt = encode_prompt(text, images, processor, f"sample {i}")
            ids, inputs = prompt.token_ids, prompt.train_inputs
        else:
            ids, inputs = processor.tokenizer(text, add_special_tokens=False)["input_ids"], None
        response = processor.tokenizer(f" answer {i} is here", add_special_tokens=False)["input_ids"]
        samples.append(Sample(index=i, group_index=i, tokens=ids + response, response_length=len(response),
                              loss_mask=[1] * len(response), rollout_log_probs=[-1.0] * len(response), reward=0.0,
                              multimodal_inputs={"images": images} if images else None,
                              multimodal_train_inputs=inputs))
    assert [len(s.multimodal_train_inputs["image_grid_thw"]) for s in samples[:3]] == [2, 1, 3]
    hf = load_hf_vl(folder)
    image_id = hf.config.image_token_id
    trainer = trainer_for(folder, ["trainer.max_tokens_per_gpu=4096"])
    ours = sample_log_probs(trainer, samples)
    for sample, lp in zip(samples, ours, strict=True):
        ids = torch.tensor([sample.tokens])
        kwargs = {}
        if sample.multimodal_train_inputs is not None:
            kwargs = {**sample.multimodal_train_inputs, "mm_token_type_ids": (ids == image_id).int()}
        with torch.no_grad():
            logits = hf(input_ids=ids, **kwargs).logits[0].float()
        theirs = torch.log_softmax(logits, -1)[:-1].gather(1, ids[0, 1:, None]).squeeze(1)[-sample.response_length:]
        assert float((torch.tensor(lp) - theirs).abs().max()) <= PARITY
    # sample 1's picture replaced by another of its size: the same ids, other pixels, other log-probs
    other = torch.randint(0, 256, (98, 70, 3), generator=g, dtype=torch.uint8).numpy()
    Image.fromarray(other).save(tmp_path / "other.png")
    text = prompt_text("describe picture 1", 1, processor, "sample 1", apply_chat_template=True)
    prompt = encode_prompt(text, [str(tmp_path / "other.png")], processor, "sample 1")
    assert prompt.token_ids == samples[1].tokens[:-samples[1].response_length]
    samples[1].multimodal_train_inputs = prompt.train_inputs
    moved = torch.tensor(sample_log_probs(trainer, samples[1:2])[0]) - torch.tensor(ours[1])
    assert float(moved.abs().max()) > 100 * PARITY


def test_a_text_model_refuses_samples_with_images(tmp_path):
    """Images in the batch of a text-only model would be dropped without a word; the trainer names the mismatch."""
    from megatron_testlib import make_hf_model

    trainer = trainer_for(make_hf_model(tmp_path / "text", "qwen2", vocab=256))
    with pytest.raises(ValueError, match="carry images and model.path is a text-only model"):
        trainer.compute_log_probs(to_batch(make_vl_samples(3)))


def test_full_recompute_reaches_the_vision_tower(vl_model, monkeypatch):
    """trainer.megatron.recompute: true recomputes the vision blocks in backward too (each runs twice a train step),
    with the same loss and gradient norm."""
    from slime_rl.trainer_megatron.vision import VisionBlock

    calls = []
    forward = VisionBlock.forward
    monkeypatch.setattr(VisionBlock, "forward", lambda self, *a: calls.append(1) or forward(self, *a))
    batch = to_batch(make_vl_samples(6))
    metrics = {}
    for recompute in ("false", "true"):
        trainer = trainer_for(vl_model, ["trainer.max_tokens_per_gpu=4096", f"trainer.megatron.recompute={recompute}"])
        batch.old_log_probs = trainer.compute_log_probs(batch)
        calls.clear()
        metrics[recompute] = trainer.train_step(batch)
        metrics[recompute]["block_calls"] = len(calls)
    assert metrics["false"]["block_calls"] == 3 and metrics["true"]["block_calls"] == 6  # 3 blocks, one micro-batch
    assert metrics["true"]["loss"] == pytest.approx(metrics["false"]["loss"], abs=1e-6)
    assert metrics["true"]["grad_norm"] == pytest.approx(metrics["false"]["grad_norm"], rel=1e-5)


def test_mrope_positions_of_images_back_to_back_and_mismatches(vl_model):
    """Two images with no token between them (one placeholder run; the processor always puts vision start/end
    tokens between images, and transformers' get_rope_index takes a run for one image) take their positions in
    turn; placeholders that do not match the images are refused."""
    v = vision_shape(load_hf_vl(vl_model).config)
    grid = torch.tensor([[1, 4, 4], [1, 2, 6]])  # 2 x 2 and 1 x 3 merged tokens
    ids = torch.tensor([5, 6, *[IMAGE] * 7, 7, 8])
    expected = torch.tensor([[0, 1, 2, 2, 2, 2, 4, 4, 4, 7, 8],   # t: text, image 1 from 2, image 2 from 4, text on
                             [0, 1, 2, 2, 3, 3, 4, 4, 4, 7, 8],   # h: rows
                             [0, 1, 2, 3, 2, 3, 4, 5, 6, 7, 8]])  # w: columns
    assert torch.equal(mrope_positions(ids, grid, v), expected)
    with pytest.raises(ValueError, match="needs 3 placeholder tokens in a row; the sequence has 2"):
        mrope_positions(ids[:-3], grid, v)
    with pytest.raises(ValueError, match="2 image\\(s\\) but placeholder tokens for 1"):
        mrope_positions(torch.tensor([5, *[IMAGE] * 4, 6]), grid, v)
    with pytest.raises(ValueError, match="more image placeholder tokens than its 2 image"):
        mrope_positions(torch.tensor([*[IMAGE] * 7, 5, IMAGE]), grid, v)


def test_a_checkpoint_in_transformers_4_52_layout_round_trips_under_its_own_names(vl_model, tmp_path):
    """Qwen2.5-VL saved by transformers 4.52-4.57 (``model.language_model.*``, ``model.visual.*``): the trainer
    reads that layout from the folder, scores as transformers does, and exports and saves under the same names."""
    import shutil

    from safetensors.torch import load_file, save_file

    nested = tmp_path / "nested"
    shutil.copytree(vl_model, nested)
    tensors = load_file(vl_model / "model.safetensors")
    renamed = {("model.visual." + n.removeprefix("visual.") if n.startswith("visual.") else
                "model.language_model." + n.removeprefix("model.") if n.startswith("model.") else n): t
               for n, t in tensors.items()}
    assert any(n.startswith("model.language_model.layers.") for n in renamed)
    save_file(renamed, nested / "model.safetensors", metadata={"format": "pt"})
    trainer = trainer_for(nested, ["trainer.max_tokens_per_gpu=4096"])
    assert trainer.shape.vision.prefixes == ("model.language_model.", "model.visual.")
    exported = dict(item for bucket in trainer.named_weights(bucket_bytes=1 << 20) for item in bucket)
    assert sorted(exported) == sorted(renamed) and all(torch.equal(t, renamed[n]) for n, t in exported.items())
    samples = make_vl_samples(4)
    assert vl_max_gap(samples, sample_log_probs(trainer, samples), load_hf_vl(nested)) <= PARITY
    trainer.save_hf(str(tmp_path / "out"))
    assert sorted(SafetensorsFolder(tmp_path / "out").weight_map) == sorted(renamed)


def test_reference_and_critic_of_a_vl_model(vl_model):
    """The KL reference (a host copy of the loaded weights, vision tower included) still scores the samples as the
    untrained policy did after the policy trained; a PPO critic on the VL model (value head on the same trunk, its
    forward through the vision tower) computes values of samples with images and lowers its loss."""
    batch = to_batch(make_vl_samples(6))
    actor = trainer_for(vl_model, ["trainer.max_tokens_per_gpu=4096", "trainer.lr=0.01", "algorithm.use_kl_loss=true",
                                   "algorithm.kl_loss_coef=0.1"])
    start = actor.compute_log_probs(batch)
    assert torch.equal(actor.compute_log_probs(batch, model="ref"), start)
    batch.old_log_probs, batch.ref_log_probs = start, start
    actor.train_step(batch)
    assert float((actor.compute_log_probs(batch) - start).abs().max()) > 1e-2
    assert torch.equal(actor.compute_log_probs(batch, model="ref"), start)
    critic = MegatronTrainer.from_config(make_config(vl_model, ["trainer.max_tokens_per_gpu=4096"]), role="critic")
    batch.values = critic.compute_values(batch)
    batch.returns = torch.linspace(-1.0, 1.0, batch.num_response_tokens)
    first = critic.train_step(batch)["loss"]
    batch.values = critic.compute_values(batch)
    assert critic.train_step(batch)["loss"] < first
