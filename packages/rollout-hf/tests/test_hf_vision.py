"""HFEngine serves a tiny Qwen2.5-VL with the prompts' images: its log-probs equal transformers' full forward
over prompt + response with the same pixel values (mRoPE positions through left padding, the shared prefill of
a group, several images a prompt, a text prompt in the same batch), and bad image requests are refused."""

from __future__ import annotations

import asyncio

import pytest
import torch

pytest.importorskip("PIL")
from PIL import Image  # noqa: E402

from slime_rl.core.contracts import SamplingParams  # noqa: E402
from slime_rl.core.testing import tiny_vl_model_folder  # noqa: E402
from slime_rl.core.vision.prompt import encode_prompt, prompt_text  # noqa: E402
from slime_rl.rollout_hf.engine import HFEngine  # noqa: E402


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def folder(request, tmp_path_factory):
    return tiny_vl_model_folder(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def engine(folder):
    return HFEngine.from_pretrained(folder, dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    out = tmp_path_factory.mktemp("img")
    specs = {"red": ((90, 60), (220, 20, 20)), "blue": ((90, 60), (20, 20, 220)), "wide": ((200, 100), (0, 160, 0))}
    for name, (size, colour) in specs.items():
        image = Image.new("RGB", size, colour)
        image.paste((255, 255, 255), (10, 10, 30, 30))  # not uniform: the patches differ
        image.save(out / f"{name}.png")
    return {name: str(out / f"{name}.png") for name in specs}


def _prompt(engine, text: str, refs: list[str]) -> list[int]:
    processor = engine.vision.processor
    if not refs:
        tokenizer = processor.tokenizer
        return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                              add_generation_prompt=True), add_special_tokens=False)
    rendered = prompt_text(text, len(refs), processor, "test", apply_chat_template=True)
    return encode_prompt(rendered, refs, processor, "test").token_ids


def _reference(engine, prompt: list[int], refs: list[str], response: list[int]) -> torch.Tensor:
    """transformers' own forward over prompt + response, no cache, as the processor's output feeds it: with
    ``mm_token_type_ids`` (without them transformers 5.25 silently falls back to 1-D positions)."""
    ids = torch.tensor([prompt + response])
    extra = dict(engine.vision.pixels(tuple(refs)), mm_token_type_ids=(ids == engine.vision.pad_id).int()) if refs else {}
    with torch.no_grad():
        logits = engine.model(input_ids=ids, **extra).logits[0, len(prompt) - 1:-1]
    return torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(response)[:, None])[:, 0]


def test_log_probs_match_transformers_with_images(engine, images):
    requests = [("What colour?", [images["red"]]), ("What colour?", [images["blue"]]),
                ("What colour?", [images["red"]]),  # the same prompt and image: the shared prefill
                ("Compare the two.", [images["wide"], images["red"]]), ("No picture, a longer text prompt here.", [])]
    prompts = [_prompt(engine, text, refs) for text, refs in requests]
    params = [SamplingParams(temperature=1.0, max_new_tokens=8, seed=i, ignore_eos=True) for i in range(len(prompts))]

    async def run():
        return await asyncio.gather(*[engine.generate(p, sp, images=refs or None)
                                      for p, sp, (_, refs) in zip(prompts, params, requests, strict=True)])

    outputs = asyncio.run(run())
    worst = 0.0
    for prompt, (_, refs), out in zip(prompts, requests, outputs, strict=True):
        assert len(out.token_ids) == 8
        expected = _reference(engine, prompt, refs, out.token_ids)
        worst = max(worst, (expected - torch.tensor(out.log_probs)).abs().max().item())
    assert worst <= 1e-4
    # the images reach the engine's logits: the same text with another image scores the same tokens differently
    red, blue = outputs[0], outputs[1]
    assert _reference(engine, prompts[1], [images["blue"]], red.token_ids).sub(
        _reference(engine, prompts[0], [images["red"]], red.token_ids)).abs().max() > 1e-3
    assert len(blue.token_ids) == 8


def test_bad_image_requests_are_refused(engine, images, tmp_path):
    prompt = _prompt(engine, "What colour?", [images["red"]])
    params = SamplingParams(max_new_tokens=2)
    with pytest.raises(ValueError, match=r"1 run\(s\) of image pad tokens for 2 image\(s\)"):
        asyncio.run(engine.generate(prompt, params, images=[images["red"], images["blue"]]))
    with pytest.raises(ValueError, match=r"1 run\(s\) of image pad tokens for 0 image\(s\)"):
        asyncio.run(engine.generate(prompt, params))
    assert engine.accepts_images


def test_a_text_model_takes_no_images(tmp_path):
    from slime_rl.core.testing import tiny_model_folder

    text_engine = HFEngine.from_pretrained(tiny_model_folder(tmp_path / "m"), dtype="float32", device="cpu")
    assert not text_engine.accepts_images
    with pytest.raises(ValueError, match="has no vision tower"):
        asyncio.run(text_engine.generate([1, 2, 3], SamplingParams(max_new_tokens=1), images=["x.png"]))


def test_weight_sync_takes_the_checkpoint_names(folder):
    """The trainer syncs the checkpoint's names (Qwen2.5-VL: ``visual.*``, ``model.layers.*``, ``lm_head``;
    Qwen3-VL's are the module's own): every one lands in transformers 5's module (``model.visual.*``,
    ``model.language_model.*``)."""
    from safetensors.torch import load_file

    engine = HFEngine.from_pretrained(folder, dtype="float32", device="cpu")
    named = sorted(load_file(str(folder / "model.safetensors")).items())
    if engine.model.config.model_type == "qwen2_5_vl":
        assert any(n.startswith("visual.") for n, _ in named) and any(n.startswith("model.layers.") for n, _ in named)
    bumped = [(n, t + 0.5) for n, t in named]
    asyncio.run(engine.update_weights(bumped, version=1, last=True))
    for name, tensor in bumped:
        assert torch.equal(engine.current_weight(name), tensor), name
    assert engine.weight_version == 1


def test_the_vision_tokens_are_never_sampled(folder, images):
    """Even where the model puts almost all its mass on them (a hook adds 50 to their logits): a pad in a
    response would claim an image that is not there. The reported log-prob stays the whole distribution's,
    the one the trainer scores."""
    engine = HFEngine.from_pretrained(folder, dtype="float32", device="cpu")
    banned = engine.vision.banned
    assert engine.vision.pad_id in banned and len(banned) == 4

    def push(_module, _inputs, logits):
        logits[..., banned] += 50.0
        return logits

    hook = engine.model.lm_head.register_forward_hook(push)
    try:
        prompt = _prompt(engine, "What colour?", [images["red"]])
        for temperature in (1.0, 0.0):
            out = asyncio.run(engine.generate(prompt, SamplingParams(temperature=temperature, max_new_tokens=6,
                                                                     seed=1, ignore_eos=True),
                                              images=[images["red"]]))
            assert not set(out.token_ids) & set(banned)
            assert max(out.log_probs) < -30  # under the unmasked distribution, where the banned ids hold the mass
    finally:
        hook.remove()
