"""The tiny Qwen2.5-VL folder (slime_rl.core.testing.vision) loads as a real checkpoint does, and its processor
(without torchvision) expands one image placeholder into one pad per merged 14-pixel patch."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("PIL")
from PIL import Image  # noqa: E402

from slime_rl.core.testing import tiny_vl_model_folder  # noqa: E402
from slime_rl.core.vision.processor import load_processor  # noqa: E402


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def folder(request, tmp_path_factory):
    return tiny_vl_model_folder(tmp_path_factory.mktemp(request.param), request.param)


def test_folder_is_a_qwen2_5_vl_checkpoint(folder):
    from transformers import AutoConfig, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(folder)
    assert config.model_type == folder.name.rstrip("0123456789")  # the fixture's folder is named after the family
    assert config.vision_config.out_hidden_size == config.text_config.hidden_size
    assert config.text_config.rope_parameters["mrope_section"] == [2, 3, 3]
    expected_class = {"qwen2_5_vl": "Qwen2_5_VLProcessor", "qwen3_vl": "Qwen3VLProcessor"}[config.model_type]
    assert json.loads((folder / "preprocessor_config.json").read_text())["processor_class"] == expected_class
    model = AutoModelForImageTextToText.from_pretrained(folder)
    processor = load_processor(folder)
    assert processor.image_token_id == config.image_token_id
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.count("<|image_pad|>") == 1
    inputs = processor(images=[Image.new("RGB", (90, 60), (255, 0, 0))], text=[text], return_tensors="pt")
    blue = processor(images=[Image.new("RGB", (90, 60), (0, 0, 255))], text=[text], return_tensors="pt")
    # 90x60 resizes to 84x56 (Qwen2.5-VL: multiples of 28) or 96x64 (Qwen3-VL: of 32) within the pixel bounds:
    # 6x4 patches, 2x2 merged -> 6 pads.
    assert inputs["image_grid_thw"].tolist() == [[1, 4, 6]]
    assert int((inputs["input_ids"] == config.image_token_id).sum()) == 6
    with torch.no_grad():
        red = model(**inputs).logits[0, -1]
        other = model(**blue).logits[0, -1]
    assert red.shape == (config.text_config.vocab_size,)
    assert not torch.allclose(red, other), "the image must reach the logits"
