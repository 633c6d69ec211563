"""Tiny random Qwen2.5-VL models, samples with images, transformers' log-probs of them, and the multi-rank VL
scenario megatron_worker.py runs (``scenario: vlm``)."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 256
IMAGE, VIDEO, START, END = 250, 251, 248, 249  # image/video placeholder, vision start/end ids
TEXT_IDS = 240  # text tokens are drawn below this
# (frames, patch rows, patch columns) of the test images: windows of 2 x 2 merged blocks (window_size 16, patch 4,
# merge 2), so a 8 x 12 grid has 6 windows, a 6 x 10 one windows cut at the edge, a 2-frame image two frames
GRIDS = ((1, 8, 12), (1, 4, 4), (1, 6, 10), (2, 4, 6))


def vl_config(vision: dict | None = None, family: str = "qwen2_5_vl", **text):
    """A tiny Qwen2.5-VL config, or Qwen3-VL's (``family: qwen3_vl``: Qwen3 text with q/k norms and interleaved
    mRoPE, 3 LM layers of which the first 2 take deepstack features from vision blocks 0 and 2, a 4 x 4 learned
    position grid, no windows)."""
    from transformers import Qwen2_5_VLConfig, Qwen3VLConfig

    text_config = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                       bos_token_id=0, eos_token_id=1, pad_token_id=1, initializer_range=0.1,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
    vision_config = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=4, spatial_merge_size=2,
                         temporal_patch_size=2, window_size=16, out_hidden_size=64, fullatt_block_indexes=[1],
                         initializer_range=0.1)
    if family == "qwen3_vl":
        text_config.update(num_hidden_layers=3, head_dim=16, rms_norm_eps=1e-6, rope_parameters={
            "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3], "mrope_interleaved": True})
        for key in ("window_size", "fullatt_block_indexes"):
            del vision_config[key]
        vision_config.update(num_position_embeddings=16, deepstack_visual_indexes=[0, 2])
    config_class = Qwen3VLConfig if family == "qwen3_vl" else Qwen2_5_VLConfig
    architecture = "Qwen3VLForConditionalGeneration" if family == "qwen3_vl" else "Qwen2_5_VLForConditionalGeneration"
    return config_class(text_config={**text_config, **text}, vision_config={**vision_config, **(vision or {})},
                        image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END,
                        architectures=[architecture])


def make_vl_model(path: Path, *, seed: int = 0, dtype: torch.dtype = torch.float32, vision: dict | None = None,
                  family: str = "qwen2_5_vl", **text) -> Path:
    """A random Qwen2.5-VL (or Qwen3-VL) folder (config.json + model.safetensors), norms, biases and the learned
    position grid perturbed so that every weight shows in the outputs."""
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(vl_config(vision, family, **text)).float()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "ln_q" in name or "bias" in name:
                param.add_(torch.randn_like(param) * 0.1)
            elif "pos_embed" in name:
                param.normal_(0.0, 0.5)
    model.to(dtype).save_pretrained(path)
    return Path(path)


def load_hf_vl(path: Path, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(str(path), dtype=dtype).eval()


def patch_dim() -> int:
    return 3 * 2 * 4 * 4


def image_tokens(grid) -> int:
    t, h, w = grid
    return t * (h // 2) * (w // 2)


def make_vl_samples(n: int, *, seed: int = 1, images_per_sample: tuple[int, ...] = (2, 0, 1, 3, 1, 2),
                    response: tuple[int, int] = (3, 10)) -> list:
    """``n`` samples, sample i with ``images_per_sample[i % len]`` images (grids from GRIDS in turn) between
    text runs, then a text response; their vision inputs as ``multimodal_train_inputs``."""
    from slime_rl.core.sample import Sample

    g = torch.Generator().manual_seed(seed)
    out, k = [], 0

    def text(lo: int, hi: int) -> list[int]:
        return torch.randint(2, TEXT_IDS, (int(torch.randint(lo, hi + 1, (1,), generator=g)),), generator=g).tolist()

    for i in range(n):
        tokens, grids = text(1, 4), []
        for _ in range(images_per_sample[i % len(images_per_sample)]):
            grid = GRIDS[k % len(GRIDS)]
            k += 1
            grids.append(grid)
            tokens += [START] + [IMAGE] * image_tokens(grid) + [END] + text(1, 3)
        r = int(torch.randint(response[0], response[1] + 1, (1,), generator=g))
        tokens += text(r, r)
        adv = float(torch.randn((), generator=g))
        inputs = None
        if grids:
            patches = sum(t * h * w for t, h, w in grids)
            inputs = {"pixel_values": torch.randn(patches, patch_dim(), generator=g), "image_grid_thw": torch.tensor(grids)}
        out.append(Sample(index=i, group_index=i // 2, tokens=tokens, response_length=r, loss_mask=[1] * r,
                          rollout_log_probs=[-1.0] * r, reward=adv, advantages=[adv] * r,
                          multimodal_train_inputs=inputs))
    return out


def hf_vision(hf, pixels: torch.Tensor, grid: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """transformers' vision tower output: the merged embeddings and the deepstack features (Qwen3-VL), from a model
    output (transformers 5.25) or a tensor / (tensor, features) pair (5.12)."""
    out = hf.model.visual(pixels, grid_thw=grid)
    if hasattr(out, "pooler_output"):
        return out.pooler_output, list(getattr(out, "deepstack_features", None) or [])
    return (out[0], list(out[1])) if isinstance(out, tuple) else (out, [])


def hf_rope_index(hf, ids: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """transformers' ``[3, b, s]`` mRoPE positions of ``ids`` (5.25 takes the token types, 5.12 finds the images)."""
    import inspect

    if "mm_token_type_ids" in inspect.signature(hf.model.get_rope_index).parameters:
        return hf.model.get_rope_index(ids, mm_token_type_ids=(ids == IMAGE).int(), image_grid_thw=grid)[0]
    return hf.model.get_rope_index(ids, image_grid_thw=grid)[0]


def hf_vl_log_probs(hf, sample, *, pixel_scale: float = 1.0) -> torch.Tensor:
    """transformers' log-probs of ``sample``'s response tokens (its images through the model's own vision tower and
    get_rope_index; ``pixel_scale`` scales the pixels)."""
    import inspect

    device = next(hf.parameters()).device
    ids = torch.tensor([sample.tokens], device=device)
    kwargs = {}
    inputs = sample.multimodal_train_inputs
    if inputs is not None:
        kwargs = {"pixel_values": inputs["pixel_values"].to(device) * pixel_scale,
                  "image_grid_thw": inputs["image_grid_thw"].to(device)}
        if "mm_token_type_ids" in inspect.signature(hf.model.forward).parameters:  # transformers 5.25; not 5.12
            kwargs["mm_token_type_ids"] = (ids == IMAGE).int()
    with torch.no_grad():
        logits = hf(input_ids=ids, **kwargs).logits[0].float()
    logp = torch.log_softmax(logits, -1)[:-1].gather(1, ids[0, 1:, None]).squeeze(1)
    return logp[-sample.response_length:].cpu()


def vl_max_gap(samples: list, ours: list[list[float]], hf, **kwargs) -> float:
    """The largest difference between ``ours`` (per-sample log-probs) and transformers' (`hf_vl_log_probs` with
    ``kwargs``) over every response token."""
    return max(float((torch.tensor(lp) - hf_vl_log_probs(hf, s, **kwargs)).abs().max())
               for s, lp in zip(samples, ours, strict=True))


def assert_two_ranks_equal_one(one: dict, two: dict) -> None:
    """`run_vlm`'s results on one rank and on two: both exports bit-exact, the ranks holding a shard agreeing, the
    same log-probs (<= 1e-4) before and after the steps, which moved them (> 1e-2), and the same losses and grad
    norms."""
    import pytest

    assert one["round_trip"] and two["round_trip"] and two["peers_agree"]
    for key in ("log_probs", "trained_log_probs"):
        gap = max(abs(a - b) for x, y in zip(one[key], two[key], strict=True) for a, b in zip(x, y, strict=True))
        assert gap <= 1e-4, key
    moved = max(abs(a - b) for x, y in zip(one["log_probs"], one["trained_log_probs"], strict=True)
                for a, b in zip(x, y, strict=True))
    assert moved > 1e-2  # the steps changed the model: the comparison after them is not of the start again
    for m1, m2 in zip(one["metrics"], two["metrics"], strict=True):
        assert m1["loss"] == pytest.approx(m2["loss"], abs=1e-5)
        assert m1["grad_norm"] == pytest.approx(m2["grad_norm"], rel=1e-4)


def run_vlm(spec: dict) -> dict:
    """One rank of a VL trainer: log-probs of the samples, the exported weights' agreement with the checkpoint,
    then ``steps`` training steps (their metrics and the log-probs after)."""
    from megatron_testlib import make_config
    from megatron_worker import shard_for, whole_step

    from slime_rl.trainer_megatron.convert import SafetensorsFolder
    from slime_rl.trainer_megatron.trainer import MegatronTrainer

    torch.set_num_threads(1)
    trainer = MegatronTrainer.from_config(make_config(Path(spec["model"]), spec.get("overrides", [])))
    batch = shard_for(trainer, make_vl_samples(spec["num_samples"]))
    reader = SafetensorsFolder(spec["model"])
    exported = dict(item for bucket in trainer.named_weights(bucket_bytes=1 << 20) for item in bucket)
    round_trip = sorted(exported) == sorted(reader.weight_map) and all(
        torch.equal(t, reader.get(n)) for n, t in exported.items())
    logp, peers_agree = whole_step(batch, trainer.compute_log_probs(batch))
    result = {"log_probs": logp, "peers_agree": peers_agree, "round_trip": round_trip, "metrics": []}
    batch.old_log_probs = trainer.compute_log_probs(batch)
    for _ in range(spec.get("steps", 2)):
        result["metrics"].append(trainer.train_step(batch))
    result["trained_log_probs"], agree = whole_step(batch, trainer.compute_log_probs(batch))
    result["peers_agree"] = peers_agree and agree
    return result


def run_vlm_hf_parity(spec: dict) -> dict:
    """The trainer's log-probs (the config's device and dtype) against transformers' in the trainer's dtype on the
    same device: ``abs_diff`` over every response token of ``num_samples`` samples with images."""
    from megatron_testlib import make_config
    from megatron_worker import shard_for

    from slime_rl.trainer_megatron.trainer import MegatronTrainer

    trainer = MegatronTrainer.from_config(make_config(Path(spec["model"]), spec.get("overrides", [])))
    samples = make_vl_samples(spec["num_samples"], response=tuple(spec.get("response", (3, 10))))
    ours = trainer.compute_log_probs(shard_for(trainer, samples))
    hf = load_hf_vl(Path(spec["model"]), trainer.dtype).to(trainer.device)
    theirs = torch.cat([hf_vl_log_probs(hf, s) for s in samples])
    return {"abs_diff": (ours - theirs).abs()}
