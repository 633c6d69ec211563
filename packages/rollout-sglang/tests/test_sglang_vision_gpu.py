"""GPU acceptance for images through real SGLang 0.5.17 (issue 41; scripts/gpu/run.sh stage vlm-sglang).

    python -m pytest packages/rollout-sglang/tests/test_sglang_vision_gpu.py -m gpu -s

A tiny random Qwen2.5-VL (slime_rl.core.testing.tiny_vl_model_folder) is served with the vision attention the
bundle has (``--mm-attention-backend sdpa``, set by the launch for a vision-language model). For prompts of one
and two images of several sizes, built by our data path (processor expansion, the CPU round-trip check), SGLang's
``meta_info.prompt_tokens`` of each request must equal our prompt's length: the contract of docs/vlm.md (one pad
per image on the wire, SGLang expands it back). The same ids with their pads left expanded must fail, as in
strands-sglang#31: SGLang 0.5.17 never answers such a request (its multimodal loader's ``next(futures_iter)``
runs out of images and the ``StopIteration`` is lost in an asyncio future; seen on 2026-12-05), so no answer in
30 s counts as the failure, and the server must still serve a proper request after it. The gap between SGLang's
log-probs and transformers' over the sampled tokens is printed.
"""

from __future__ import annotations

import asyncio
import inspect

import pytest
import torch
from test_sglang_gpu import ENGINE_ARGS, gpu_config

from slime_rl.core.contracts import SamplingParams
from slime_rl.core.testing import tiny_vl_model_folder
from slime_rl.core.vision.contract import engine_request
from slime_rl.core.vision.processor import load_processor
from slime_rl.core.vision.prompt import encode_prompt, prompt_text, train_inputs
from slime_rl.rollout_sglang.client import build_payload
from slime_rl.rollout_sglang.engine import SGLangEngine

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]

SIZES = [[(56, 56)], [(90, 60)], [(200, 100)], [(112, 112), (60, 90)], [(300, 40)]]
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=8, ignore_eos=True, seed=3)


def _images(tmp_path, sizes):
    from PIL import Image, ImageDraw

    refs = []
    for k, (w, h) in enumerate(sizes):
        image = Image.new("RGB", (w, h), (255, 255, 255))
        ImageDraw.Draw(image).ellipse((2, 2, w // 2, h // 2), fill=(40 * k, 120, 200))
        path = tmp_path / f"img_{w}x{h}_{k}.png"
        image.save(path)
        refs.append(str(path))
    return refs


def test_sglang_prompt_tokens_equal_ours(tmp_path):
    import httpx

    model = tiny_vl_model_folder(tmp_path / "tiny-vl", dtype=torch.bfloat16)
    processor = load_processor(model)
    engine = SGLangEngine.from_config(gpu_config(model, tmp_path / "run", engine_args=dict(ENGINE_ARGS)))
    rows = []
    try:
        assert engine.accepts_images
        for i, sizes in enumerate(SIZES):
            refs = _images(tmp_path, sizes)
            text = prompt_text(f"Describe picture set {i}.", len(refs), processor, f"prompt {i}",
                               apply_chat_template=True)
            ours = encode_prompt(text, refs, processor, f"prompt {i}").token_ids  # CPU round trip checked here
            wire, image_data = engine_request(ours, refs, processor.image_token_id)
            body = httpx.post(f"{engine.router.url}/generate", timeout=120,
                              headers={"Authorization": f"Bearer {engine.router.key}"},
                              json=build_payload(wire, PARAMS, f"vl-{i}", image_data=image_data)).json()
            theirs = body["meta_info"]["prompt_tokens"]
            rows.append((sizes, len(ours), len(wire), theirs))
            out = asyncio.run(engine.generate(ours, PARAMS, images=refs))  # raises on a prompt-token mismatch
            gap = _log_prob_gap(model, ours, refs, processor, out)
            print(f"| {sizes} | ours {len(ours)} | sent {len(wire)} | SGLang {theirs} | log-prob gap max {gap:.4f} |")
        assert all(ours == theirs for _, ours, _, theirs in rows), rows
        # The pads as they are: SGLang's processor expands each one again and the request fails.
        refs = _images(tmp_path, SIZES[1])
        text = prompt_text("Pre-expanded.", 1, processor, "raw", apply_chat_template=True)
        ours = encode_prompt(text, refs, processor, "raw").token_ids
        _, image_data = engine_request(ours, refs, processor.image_token_id)
        try:
            raw = httpx.post(f"{engine.router.url}/generate", timeout=30,
                             headers={"Authorization": f"Bearer {engine.router.key}"},
                             json=build_payload(ours, PARAMS, "vl-raw", image_data=image_data))
        except httpx.TimeoutException:
            print("pre-expanded pads: no answer in 30 s (SGLang lost the request)")
        else:
            print(f"pre-expanded pads: HTTP {raw.status_code} {raw.text[:300]}")
            assert raw.status_code != 200 or raw.json()["meta_info"]["prompt_tokens"] != len(ours)
        # What our engine sends still works after it: one lost request must not take the server with it.
        again = asyncio.run(engine.generate(ours, PARAMS, images=refs))
        assert len(again.token_ids) == PARAMS.max_new_tokens
        print(f"after it, a proper request: {len(again.token_ids)} tokens")
    finally:
        asyncio.run(engine.shutdown())


def _log_prob_gap(model, ids, refs, processor, out) -> float:
    """max |SGLang's log-prob - transformers' (fp32, on the GPU)| over the sampled tokens."""
    from transformers import AutoModelForImageTextToText

    hf = AutoModelForImageTextToText.from_pretrained(model, dtype=torch.float32).cuda().eval()
    full = torch.tensor([ids + out.token_ids], device="cuda")
    extra = {k: v.cuda() for k, v in train_inputs(refs, processor).items()}
    if "mm_token_type_ids" in inspect.signature(hf.forward).parameters:  # 5.25 needs them for mRoPE; 5.12 has none
        extra["mm_token_type_ids"] = (full == processor.image_token_id).int()
    with torch.no_grad():
        logits = hf(input_ids=full, **extra).logits
    log_probs = torch.log_softmax(logits[0, len(ids) - 1:-1].float(), -1)
    expected = log_probs.gather(1, torch.tensor(out.token_ids, device="cuda")[:, None])[:, 0].cpu()
    return float((expected - torch.tensor(out.log_probs)).abs().max())
