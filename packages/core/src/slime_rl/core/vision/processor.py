"""A vision-language model's processor (tokenizer + image processor), loaded without torchvision.

transformers 5.25's `Qwen2_5_VLProcessor` insists on a video processor, and Qwen2-VL's video processor imports
torchvision. The only torchvision wheel that matches the CPU venv's torch 2.13 (0.28.0 on PyPI) is a CUDA build
whose ops do not register against a CPU torch (`operator torchvision::nms does not exist` on import), so the CPU
extras cannot carry it. We serve images only: `load_processor` builds the model's own processor class, minus
the video processor, when the full one cannot be built. SGLang's GPU bundle has torchvision and loads the
folder's processor the ordinary way; both paths expand an image placeholder into the same tokens (the image
processor and the tokenizer are the same objects), which docs/vlm.md's contract relies on.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

#: The processor classes whose video half we can drop, by the name a folder's configs give.
IMAGE_ONLY_BASES = ("Qwen2_5_VLProcessor", "Qwen2VLProcessor", "Qwen3VLProcessor")


def _image_only_class(base_name: str) -> type:
    """``base_name`` with an ``__init__`` that takes no video processor (transformers reads a processor's
    parts from its ``__init__`` signature)."""
    import transformers
    from transformers.processing_utils import ProcessorMixin

    base = getattr(transformers, base_name)

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        # What the base's __init__ sets before its ProcessorMixin call, without touching a video processor.
        self.image_token = getattr(tokenizer, "image_token", None) or "<|image_pad|>"
        self.video_token = getattr(tokenizer, "video_token", None) or "<|video_pad|>"
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
        if base_name == "Qwen3VLProcessor":
            self.vision_start_token = "<|vision_start|>"
            self.vision_end_token = "<|vision_end|>"
            self.vision_start_token_id = tokenizer.convert_tokens_to_ids(self.vision_start_token)
            self.vision_end_token_id = tokenizer.convert_tokens_to_ids(self.vision_end_token)
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    return type(f"ImageOnly{base_name}", (base,), {"__init__": __init__, "__module__": __name__})


def processor_class_name(folder: Path) -> str | None:
    """The processor class a model folder names (processor_config.json, then preprocessor_config.json)."""
    for name in ("processor_config.json", "preprocessor_config.json", "tokenizer_config.json"):
        path = Path(folder) / name
        if path.exists():
            found = json.loads(path.read_text()).get("processor_class")
            if found:
                return found
    return None


def image_only_processor(image_processor: Any, tokenizer: Any, *, base_name: str = "Qwen2_5_VLProcessor",
                         chat_template: str | None = None) -> Any:
    """``base_name``'s processor from its parts, without a video processor."""
    if base_name not in IMAGE_ONLY_BASES:
        raise ValueError(f"processor class {base_name!r}: image-only loading knows {', '.join(IMAGE_ONLY_BASES)}")
    return _image_only_class(base_name)(image_processor, tokenizer,
                                        chat_template=chat_template or getattr(tokenizer, "chat_template", None))


def load_processor(folder: str | Path) -> Any:
    """The processor of the vision-language model in ``folder``: transformers' own where it loads, else (no
    torchvision, see the module doc) the same class without its video processor."""
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

    folder = Path(folder)
    try:
        return AutoProcessor.from_pretrained(folder)
    except (ImportError, AttributeError, ValueError, OSError, TypeError) as err:  # transformers' ways to say it
        base_name = processor_class_name(folder)
        if base_name not in IMAGE_ONLY_BASES:
            raise ValueError(f"{folder}: no processor loads ({err}); a vision-language model folder needs "
                             f"a processor_class among {', '.join(IMAGE_ONLY_BASES)}") from err
    tokenizer = AutoTokenizer.from_pretrained(folder)
    try:
        image_processor = AutoImageProcessor.from_pretrained(folder)
    except ImportError:  # transformers 5.12's auto class asks for torchvision too: Qwen2-VL's PIL class by name
        image_processor = pil_image_processor_class().from_pretrained(folder)
    return image_only_processor(image_processor, tokenizer, base_name=base_name)


def pil_image_processor_class() -> type:
    """Qwen2-VL's image processor on PIL and numpy (no torchvision): 5.25 names it ``...Pil``, 5.12 has it as
    the plain class."""
    try:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    except ImportError:
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import (
            Qwen2VLImageProcessor as Qwen2VLImageProcessorPil,
        )
    return Qwen2VLImageProcessorPil
