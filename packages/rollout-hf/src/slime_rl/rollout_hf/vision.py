"""Images in the transformers engine: a Qwen2-VL-family model served with the prompts' images (docs/vlm.md).

The engine takes our ids as they are (pads expanded: transformers' model wants them so) and the images'
references; this module makes the processor's pixel values (cached per image list: a group's samples share
their prompt), and the prefill's multimodal RoPE positions (``get_rope_index``: three streams, an image's
tokens placed by row and column). A decode step's position is the token's text position plus the prompt's
RoPE delta (an image advances the positions by max(rows, columns), not by its token count), the same on all
three streams, as transformers' own generate does.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from slime_rl.core.vision.contract import placeholder_runs
from slime_rl.core.vision.processor import load_processor
from slime_rl.core.vision.prompt import train_inputs

PIXEL_CACHE_SIZE = 64  # distinct image lists kept (a wave of groups)


def is_vision_language(config: Any) -> bool:
    return getattr(config, "vision_config", None) is not None and hasattr(config, "image_token_id")


def vision_token_ids(config: Any) -> list[int]:
    """The ids that only the processor may place: image and video pads, vision start and end."""
    names = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    return sorted({int(getattr(config, n)) for n in names if getattr(config, n, None) is not None})


def vl_module_name(name: str) -> str:
    """A Qwen2-VL-family checkpoint name (what the trainer syncs: ``visual.*``, ``model.layers.*``) as
    transformers 5's module holds it (``model.visual.*``, ``model.language_model.layers.*``); ``lm_head`` stays."""
    if name.startswith("visual."):
        return f"model.{name}"
    if name.startswith("model.") and not name.startswith(("model.visual.", "model.language_model.")):
        return f"model.language_model.{name[len('model.'):]}"
    return name


def load_model(path: Path, dtype: torch.dtype) -> Any:
    """A vision-language checkpoint (AutoModelForCausalLM does not map their configs)."""
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(path, dtype=dtype)


class VisionInputs:
    """The engine's image side: checks, pixel values and prefill positions."""

    def __init__(self, model: Any, processor: Any):
        self.model, self.processor = model, processor
        self.pad_id = int(model.config.image_token_id)
        self.banned = vision_token_ids(model.config)
        self._pixels: OrderedDict[tuple[str, ...], dict[str, torch.Tensor]] = OrderedDict()

    @classmethod
    def for_model(cls, model: Any, path: str | Path | None) -> VisionInputs | None:
        """None for a text-only model."""
        if not is_vision_language(model.config):
            return None
        if path is None:
            raise ValueError("a vision-language model needs its folder (model.name_or_path) for the processor")
        return cls(model, load_processor(path))

    def sampler(self, sample: Callable[..., tuple[torch.Tensor, torch.Tensor]]) -> Callable[..., Any]:
        """``sample`` (the engine's ``_sample``) that never draws the vision tokens (a pad in a response would
        claim an image that is not there: the trainer refuses such a sample, SGLang's expansion miscounts) and
        still reports the log-prob under the whole distribution, which the trainer scores (as top-k/top-p)."""
        banned = torch.tensor(self.banned)

        def sample_text(logits: torch.Tensor, requests: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
            tokens, _ = sample(logits.index_fill(1, banned.to(logits.device), float("-inf")), requests)
            temperature = torch.tensor([r.params.temperature or 1.0 for r in requests], device=logits.device)
            log_probs = torch.log_softmax(logits / temperature.to(logits.dtype)[:, None], dim=-1)
            return tokens, log_probs.gather(1, tokens[:, None])[:, 0]

        return sample_text

    def check(self, input_ids: list[int], images: list[str]) -> None:
        runs = placeholder_runs(input_ids, self.pad_id)
        if len(runs) != len(images):
            raise ValueError(f"input_ids hold {len(runs)} run(s) of image pad tokens for {len(images)} image(s); "
                             f"give one image per run, in order")

    def pixels(self, images: tuple[str, ...]) -> dict[str, torch.Tensor]:
        if images not in self._pixels:
            self._pixels[images] = train_inputs(list(images), self.processor, where="rollout request")
            while len(self._pixels) > PIXEL_CACHE_SIZE:
                self._pixels.popitem(last=False)
        self._pixels.move_to_end(images)
        return self._pixels[images]

    def prefill(self, input_ids: torch.Tensor, mask: torch.Tensor, images: list[tuple[str, ...]]
                ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """For the distinct prompts ``input_ids [P, W]`` (left-padded, ``mask``) with their ``images``: the
        positions ``[3, P, W]``, each prompt's RoPE delta ``[P]``, and the forward's image arguments."""
        per_prompt = [self.pixels(refs) for refs in images if refs]
        grid = torch.cat([p["image_grid_thw"] for p in per_prompt]) if per_prompt else None
        dtype = next(self.model.parameters()).dtype
        extra = {} if grid is None else {
            "pixel_values": torch.cat([p["pixel_values"] for p in per_prompt]).to(input_ids.device, dtype),
            "image_grid_thw": grid.to(input_ids.device)}
        token_types = (input_ids == self.pad_id).to(torch.int32)
        positions, deltas = self.model.model.get_rope_index(input_ids, token_types, image_grid_thw=grid,
                                                            attention_mask=mask)
        return positions, deltas.reshape(-1), extra
