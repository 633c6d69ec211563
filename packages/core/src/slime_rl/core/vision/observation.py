"""Images in multi-turn observations: a tool (or an environment) that returns a picture (docs/vlm.md).

A tool returns ``{"text": ..., "images": [path, data URI or bytes, ...]}``; its tool message becomes one image
part per picture, then the text, rendered by the chat template's tool role (the text stays plain text: it
cannot forge turns). The template renders each image part as the model's one placeholder, which this module
expands to the picture's pad count with the model's processor, as the prompt's were (prompt.py): the
observation's ids are then what the trainer scores and what the engine gets back from one pad per image
(contract.py). The pictures join ``Sample.multimodal_inputs["images"]`` after the prompt's, in order;
``prompt_images`` there counts the prompt's own, so that `Sample.reset_to_prompt` drops the rest.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from slime_rl.core.vision.contract import ContractProblem, expand, image_token_counts
from slime_rl.core.vision.images import DEFAULT_MAX_IMAGE_PIXELS, bytes_to_data_uri, load_images

if TYPE_CHECKING:
    from slime_rl.core.config import Config
    from slime_rl.core.sample import Sample


def tool_images(result: Any) -> tuple[str, list[str]] | None:
    """(text, image references) of a tool's result that brings pictures; None for any other result."""
    if not (isinstance(result, dict) and "images" in result):
        return None
    images = result["images"] if isinstance(result["images"], list) else [result["images"]]
    refs = []
    for item in images:
        if isinstance(item, bytes | bytearray):
            refs.append(bytes_to_data_uri(bytes(item)))
        elif isinstance(item, str | Path) and str(item):
            refs.append(str(item) if str(item).startswith("data:") else str(Path(item).expanduser().resolve()))
        else:
            raise ValueError(f"a tool's images are paths, data URIs or bytes; got {type(item).__name__}")
    return str(result.get("text", "")), refs


def image_message(name: str, text: str, refs: list[str]) -> dict[str, Any]:
    """A tool message with its pictures first, then its text."""
    parts = [{"type": "image", "image": ref} for ref in refs] + [{"type": "text", "text": text}]
    return {"role": "tool", "name": name, "content": parts}


def message_images(messages: list[dict[str, Any]]) -> list[str]:
    """The image references of ``messages``' image parts (``{"type": "image", "image": ref}``), in order."""
    refs = []
    for message in messages:
        content = message.get("content")
        for part in content if isinstance(content, list) else []:
            if isinstance(part, dict) and part.get("type") == "image":
                if not isinstance(part.get("image"), str):
                    raise ValueError("an observation's image part needs its picture: {\"type\": \"image\", "
                                     "\"image\": <path or data URI>}")
                refs.append(part["image"])
    return refs


class ObservationImages:
    """Expands an observation's image placeholders and records its pictures on the sample."""

    def __init__(self, processor: Any, *, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS):
        self.processor, self.max_pixels = processor, max_pixels
        self.pad_id = processor.image_token_id

    @classmethod
    def from_config(cls, cfg: Config) -> ObservationImages | None:
        """None for text-only data (``data.image_key`` unset): then an observation with pictures fails its sample."""
        if cfg.data.image_key is None:
            return None
        from slime_rl.core.vision.processor import load_processor

        return cls(load_processor(cfg.model.tokenizer_path or cfg.model.path), max_pixels=cfg.data.max_image_pixels)

    def expand(self, ids: list[int], refs: list[str]) -> list[int]:
        """The observation's ``ids`` (one pad per picture, as the template rendered them) with each pad
        expanded to its picture's count."""
        images = load_images(refs, "a tool's image", max_pixels=self.max_pixels)
        try:
            return expand(ids, image_token_counts(images, self.processor), self.pad_id)
        except ContractProblem as problem:
            raise ValueError(f"the observation's images: {problem.reason}; the chat template must render each "
                             f"image part as the model's placeholder") from None

    @staticmethod
    def record(sample: Sample, refs: list[str]) -> None:
        """``refs`` after the sample's images (module doc); the trainer's tensors are rebuilt for them."""
        inputs = dict(sample.multimodal_inputs or {"images": []})
        inputs.setdefault("prompt_images", len(inputs["images"]))
        inputs["images"] = list(inputs["images"]) + list(refs)
        sample.multimodal_inputs, sample.multimodal_train_inputs = inputs, None
