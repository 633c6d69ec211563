"""A tiny random Qwen2.5-VL model folder for tests, built offline in a few seconds (no hub).

The folder is what a real Qwen2.5-VL checkpoint holds, small: config.json (a 2-layer Qwen2-style text model
with mRoPE and a 2-block vision tower: one windowed block, one full-attention block, a 2x2 patch merger),
model.safetensors, a chat tokenizer with Qwen's vision tokens, the chat template, and the image processor's
config (preprocessor_config.json, as the hub's Qwen2.5-VL folders ship it, naming Qwen2_5_VLProcessor).
transformers, SGLang and the Megatron trainer load it like the real one; `slime_rl.core.vision.load_processor`
loads its processor without torchvision.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerFast

#: Qwen's vision tokens, in the order Qwen2.5-VL's vocabulary has them.
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")
#: The image processor's pixel bounds: images are resized to between 56x56 and 112x112 pixels' worth, so a
#: picture is 4 to 16 tokens after the 2x2 merge (14-pixel patches): small enough for CPU tests.
TINY_MIN_PIXELS = 56 * 56
TINY_MAX_PIXELS = 112 * 112
VL_FAMILIES = ("qwen2_5_vl", "qwen3_vl")
QWEN3_VL_PATCH = 16

# Qwen2-VL's chat template (an image part renders as <|vision_start|><|image_pad|><|vision_end|>, which the
# processor expands to one pad per merged patch) with the tool calls and tool role of
# slime_rl.core.testing's ChatML template, so that multi-turn tests can return images from tools.
_VL_CHAT_TEMPLATE = (
    "{%- macro render(content) -%}"
    "{%- if content is string -%}{{- content -}}"
    "{%- else -%}{%- for part in content -%}"
    "{%- if part['type'] == 'image' or 'image' in part or 'image_url' in part -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif 'text' in part -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- if tools or messages[0]['role'] == 'system' -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages[0]['role'] == 'system' -%}{{- render(messages[0]['content']) -}}{%- endif -%}"
    "{%- if tools -%}{{- '\\n# Tools\\nCall a tool as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>."
    " The tools:' -}}{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' and loop.first -%}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' + render(message['content'] or '') -}}"
    "{%- for call in message.get('tool_calls') or [] -%}"
    "{{- '<tool_call>{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' -}}"
    "{{- (call['function']['arguments'] | tojson) + '}</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + render(message['content']) + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def vl_tokenizer(*, vocab_size: int = 1024, texts: list[str] | None = None) -> PreTrainedTokenizerFast:
    """`chat_tokenizer` plus Qwen's vision tokens (special, so they decode to their text and back to one id
    each) and the VL chat template."""
    from slime_rl.core.testing import chat_tokenizer

    tokenizer = chat_tokenizer(vocab_size=vocab_size, texts=texts)
    tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    tokenizer.chat_template = _VL_CHAT_TEMPLATE
    return tokenizer


def tiny_vl_config(tokenizer: PreTrainedTokenizerFast, *, family: str = "qwen2_5_vl", hidden_size: int = 64,
                   num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2, vision_hidden_size: int = 32,
                   vision_depth: int = 2, vision_heads: int = 2, tie_word_embeddings: bool = False,
                   **text_fields: Any) -> PretrainedConfig:
    """A tiny `Qwen2_5_VLConfig` (or, ``family="qwen3_vl"``, `Qwen3VLConfig`) on ``tokenizer``'s vocabulary and
    vision token ids.

    Text: Qwen2-style, head dim 16 with mRoPE sections (2, 3, 3) (temporal, height, width: Qwen's 16/24/24 of
    64 scaled down). Vision: 14-pixel patches, 2-frame temporal patches, a 2x2 merger into the text width,
    windowed attention (112-pixel windows) in every block but the last, which attends fully. Qwen3-VL: Qwen3
    text with interleaved mRoPE, 16-pixel patches, a 4x4 learned position grid, deepstack from vision block 0."""
    from transformers import Qwen2_5_VLConfig, Qwen3VLConfig

    if family not in VL_FAMILIES:
        raise ValueError(f"family: {family!r}; use one of {', '.join(VL_FAMILIES)}")

    head_dim = hidden_size // num_heads
    if head_dim != 16:
        raise ValueError(f"hidden_size / num_heads = {head_dim}: the mRoPE sections (2, 3, 3) need a head dim of 16")
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in (
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"),
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"))}
    eos = tokenizer.eos_token_id
    text = {"vocab_size": len(tokenizer), "hidden_size": hidden_size, "intermediate_size": 2 * hidden_size,
            "num_hidden_layers": num_layers, "num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads,
            "max_position_embeddings": 2048, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                                 "mrope_section": [2, 3, 3]},
            "eos_token_id": eos, "bos_token_id": eos, "pad_token_id": tokenizer.pad_token_id,
            "tie_word_embeddings": tie_word_embeddings, **text_fields}
    vision = {"depth": vision_depth, "hidden_size": vision_hidden_size, "intermediate_size": 2 * vision_hidden_size,
              "num_heads": vision_heads, "patch_size": 14, "temporal_patch_size": 2, "spatial_merge_size": 2,
              "window_size": 112, "fullatt_block_indexes": [vision_depth - 1], "out_hidden_size": hidden_size,
              "tokens_per_second": 2}
    if family == "qwen3_vl":
        text["head_dim"] = head_dim
        text["rope_parameters"] = {**text["rope_parameters"], "mrope_interleaved": True}
        for key in ("window_size", "fullatt_block_indexes", "tokens_per_second"):
            del vision[key]
        vision.update(patch_size=QWEN3_VL_PATCH, num_position_embeddings=16, deepstack_visual_indexes=[0])
        return Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=tie_word_embeddings, **ids)
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=tie_word_embeddings,
                            eos_token_id=eos, pad_token_id=tokenizer.pad_token_id, **ids)


def tiny_vl_model(config: PretrainedConfig, *, seed: int = 0) -> PreTrainedModel:
    """A random model of ``config`` (Qwen2.5-VL's or Qwen3-VL's) in float32, eval mode, the same per seed."""
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen3VLForConditionalGeneration

    torch.manual_seed(seed)
    model_class = Qwen3VLForConditionalGeneration if config.model_type == "qwen3_vl" else \
        Qwen2_5_VLForConditionalGeneration
    return model_class(config).float().eval()


def tiny_vl_model_folder(out_dir: Path, family: str = "qwen2_5_vl", *, seed: int = 0,
                         dtype: torch.dtype = torch.float32, tokenizer: PreTrainedTokenizerFast | None = None,
                         min_pixels: int = TINY_MIN_PIXELS, max_pixels: int = TINY_MAX_PIXELS, **shape: Any) -> Path:
    """A complete HF folder of a tiny random Qwen2.5-VL model (``family="qwen3_vl"``: Qwen3-VL), its tokenizer
    (`vl_tokenizer` by default) and image processor (images resized to ``min_pixels``..``max_pixels``);
    ``shape`` as `tiny_vl_config` takes it. Returns ``out_dir``."""
    from slime_rl.core.vision.processor import image_only_processor, pil_image_processor_class

    Qwen2VLImageProcessorPil = pil_image_processor_class()  # noqa: N806 (a class)

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = tokenizer or vl_tokenizer()
    model = tiny_vl_model(tiny_vl_config(tokenizer, family=family, **shape), seed=seed)
    model.to(dtype).save_pretrained(out_dir)
    qwen3 = family == "qwen3_vl"  # Qwen3-VL's processor: 16-pixel patches, mean and std 0.5
    image_processor = Qwen2VLImageProcessorPil(
        size={"shortest_edge": min_pixels, "longest_edge": max_pixels},
        **({"patch_size": QWEN3_VL_PATCH, "image_mean": [0.5] * 3, "image_std": [0.5] * 3} if qwen3 else {}))
    processor_class = "Qwen3VLProcessor" if qwen3 else "Qwen2_5_VLProcessor"
    processor = image_only_processor(image_processor, tokenizer, base_name=processor_class,
                                     chat_template=_VL_CHAT_TEMPLATE)
    processor.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    # The hub's layout, read by every transformers version (SGLang's GPU bundle has 5.12.1): the image
    # processor's own file naming the processor class; processor_config.json names the class too, not our
    # image-only subclass, so that a machine with torchvision builds the full processor.
    image_config = {**image_processor.to_dict(), "image_processor_type": "Qwen2VLImageProcessor",
                    "processor_class": processor_class, "min_pixels": min_pixels, "max_pixels": max_pixels}
    (out_dir / "preprocessor_config.json").write_text(json.dumps(image_config, indent=2) + "\n")
    processor_config = out_dir / "processor_config.json"
    saved = json.loads(processor_config.read_text()) if processor_config.exists() else {}
    saved.pop("image_processor", None)
    (out_dir / "processor_config.json").write_text(json.dumps({**saved, "processor_class": processor_class},
                                                              indent=2) + "\n")
    return out_dir
