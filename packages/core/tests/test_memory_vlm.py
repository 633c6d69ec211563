"""The memory estimate of a vision-language checkpoint (issue 41): its config.json keeps the language model under
text_config, which ModelSize did not read (plan made no estimate), and the vision tower's parameters, which every
trainer TP rank holds whole, were not counted."""

from __future__ import annotations

import pytest
import torch

from slime_rl.core.config.memory import ModelSize


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_the_parameter_count_of_a_vl_shape_is_transformers(family):
    """Qwen2.5-VL-7B's shape and a Qwen3-VL-8B-like one, built by transformers on the meta device: the estimate's
    count is the model's own within 0.5% (norms and biases aside)."""
    import transformers

    if family == "qwen2_5_vl":
        config = transformers.Qwen2_5_VLConfig(
            text_config=dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                             num_attention_heads=28, num_key_value_heads=4),
            vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584))
    else:
        config = transformers.Qwen3VLConfig(
            text_config=dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                             num_attention_heads=32, num_key_value_heads=8, head_dim=128),
            vision_config=dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=4096,
                               patch_size=16, num_position_embeddings=2304, deepstack_visual_indexes=[8, 16, 24]))
    with torch.device("meta"):
        model = transformers.AutoModelForImageTextToText.from_config(config)
    actual = sum(p.numel() for p in model.parameters())
    visual = sum(p.numel() for n, p in model.named_parameters() if ".visual." in f".{n}")
    size = ModelSize.from_hf(config.to_dict())
    assert size.vision_params == pytest.approx(visual, rel=5e-3)
    assert size.total_params == pytest.approx(actual, rel=5e-3)
    assert size.layers == config.text_config.num_hidden_layers and size.vocab == config.text_config.vocab_size
