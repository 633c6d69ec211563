"""A vision-language prompt's ids: the model's processor expands each image's one placeholder into a run of
image pad tokens (one per merged patch), and makes the pixel values the trainer feeds its vision tower.

Where the images go in the prompt (docs/vlm.md):
- chat messages: one ``{"type": "image"}`` content part per image, in order (the chat template renders each
  as the model's placeholder, ``<|vision_start|><|image_pad|><|vision_end|>`` for Qwen2-VL and 2.5-VL);
- a plain-text prompt with ``data.apply_chat_template``: one user turn of the images, then the text;
- a plain-text prompt without it: the text holds the placeholder itself, once per image.
Every prompt's ids go through the rollout contract's check (contract.py) before a sample is made.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from slime_rl.core.run.data import DataError
from slime_rl.core.vision.contract import ContractProblem, check_round_trip
from slime_rl.core.vision.images import DEFAULT_MAX_IMAGE_PIXELS, load_images

#: What a chat template renders for an image part, by the processor's image token (Qwen2-VL's family).
PLACEHOLDERS = {"<|image_pad|>": "<|vision_start|><|image_pad|><|vision_end|>"}


@dataclass
class VisionPrompt:
    """One prompt's ids (placeholders expanded) and the processor's tensors for its images."""

    token_ids: list[int]
    train_inputs: dict[str, torch.Tensor]  # pixel_values [patches, C*T*P*P], image_grid_thw [images, 3]


def placeholder_text(processor: Any) -> str:
    """The text of one image's placeholder before expansion."""
    return PLACEHOLDERS.get(processor.image_token, processor.image_token)


def image_parts(messages: list[dict[str, Any]]) -> int:
    """How many image content parts ``messages`` hold (what the chat template turns into placeholders)."""
    count = 0
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            count += sum(1 for part in content if isinstance(part, dict) and (
                part.get("type") in ("image", "image_url") or "image" in part or "image_url" in part))
    return count


def prompt_text(prompt: str | list[dict[str, Any]], num_images: int, processor: Any, where: str, *,
                apply_chat_template: bool, tools: list[Any] | None = None,
                chat_template_kwargs: dict[str, Any] | None = None) -> str:
    """The prompt as text with one placeholder per image; DataError when the images and the prompt's image
    slots disagree in number."""
    tokenizer = processor.tokenizer
    if isinstance(prompt, str) and not apply_chat_template:
        found = prompt.count(placeholder_text(processor))
        if found != num_images:
            raise DataError(where, f"the prompt holds {found} image placeholder(s) {placeholder_text(processor)!r} "
                                   f"and the record {num_images} image(s); put one placeholder per image in the "
                                   f"text, or set data.apply_chat_template=true (images before the text)")
        return prompt
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": [{"type": "image"}] * num_images + [{"type": "text", "text": prompt}]}]
    else:
        messages = prompt
        slots = image_parts(messages)
        if slots != num_images:
            raise DataError(where, f"the messages hold {slots} image part(s) ({{\"type\": \"image\"}}) and the "
                                   f"record {num_images} image(s); give one image part per image, in order")
    template_owner = tokenizer if getattr(tokenizer, "chat_template", None) else processor
    if getattr(template_owner, "chat_template", None) is None:
        raise DataError("model.tokenizer_path", "image prompts in chat form need a chat template; the model's "
                                                "tokenizer and processor have none")
    text = template_owner.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False,
                                              **(chat_template_kwargs or {}))
    found = text.count(placeholder_text(processor))
    if found != num_images:
        raise DataError(where, f"the chat template rendered {found} image placeholder(s) for {num_images} image(s); "
                               f"use a template that renders {{\"type\": \"image\"}} parts (the model's own)")
    return text


def encode_prompt(text: str, refs: list[str], processor: Any, where: str, *,
                  max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS, check_contract: bool = True) -> VisionPrompt:
    """``text``'s ids with each placeholder expanded for its image in ``refs``, and the processor's tensors.
    With ``check_contract``, DataError when an engine that re-runs the processor on the decoded prompt
    (SGLang) would not arrive at the same ids (contract.py)."""
    images = load_images(refs, where, max_pixels=max_pixels)
    try:
        encoded = processor(text=[text], images=images, return_tensors="pt", add_special_tokens=False)
    except ValueError as err:  # e.g. the text holds the pad token itself: more pads than images
        raise DataError(where, f"the processor refuses the prompt ({err}); fix the prompt's text") from None
    ids = encoded["input_ids"][0].tolist()
    if check_contract:
        try:
            check_round_trip(ids, images, processor)
        except ContractProblem as problem:
            raise DataError(where, f"the engine would not see this prompt's ids: {problem.reason}") from None
    return VisionPrompt(ids, {"pixel_values": encoded["pixel_values"],
                              "image_grid_thw": encoded["image_grid_thw"].to(torch.int64)})


def train_inputs(refs: list[str], processor: Any, *, where: str = "sample",
                 max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> dict[str, torch.Tensor]:
    """The processor's pixel_values and image_grid_thw of ``refs`` (a sample's ``multimodal_inputs["images"]``):
    what `Sample.multimodal_train_inputs` holds, rebuilt for a sample that was saved without it."""
    images = load_images(refs, where, max_pixels=max_pixels)
    out = processor.image_processor(images=images, return_tensors="pt")
    return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"].to(torch.int64)}


def fill_train_inputs(samples: list[Any], processor: Any) -> int:
    """Give every sample with images and without ``multimodal_train_inputs`` its tensors (a sample of one group
    shares them with its siblings: same images); returns how many were rebuilt."""
    cache: dict[tuple[str, ...], dict[str, torch.Tensor]] = {}
    rebuilt = 0
    for sample in samples:
        refs = (sample.multimodal_inputs or {}).get("images") or []
        if not refs or sample.multimodal_train_inputs is not None:
            continue
        key = tuple(refs)
        if key not in cache:
            cache[key] = train_inputs(refs, processor, where=f"sample {sample.index}")
        sample.multimodal_train_inputs = cache[key]
        rebuilt += 1
    return rebuilt
