"""TEST DOUBLE: the stand-in server's ``image_data`` path, as SGLang 0.5.17 runs it (for CPU tests only).

SGLang's tokenizer manager hands a request with images to the model's multimodal processor
(srt/multimodal/processors/qwen_vl.py, base_processor.py): it decodes ``input_ids`` to text
(``tokenizer.decode``, special tokens kept), runs the HF processor on that text with the loaded images
(an error there fails the request: what pre-expanded placeholders cause, strands-sglang#31), and then,
with SGLANG_MM_AVOID_RETOKENIZE (on by default), keeps the request's ids and puts each image's token count
of pads in place of its one pad (``_expand_input_ids``); when that raises (not one pad per image) it keeps
the processor's re-tokenisation instead. The stand-in does the same with the model folder's processor, so
that ``meta_info.prompt_tokens`` is the length SGLang would report.
"""

from __future__ import annotations

import functools
import io
import json
from pathlib import Path
from typing import Any

from aiohttp import web

from slime_rl.core.vision.contract import ContractProblem, data_uri_bytes, expand, image_token_counts


def with_text_fields(config: dict[str, Any]) -> dict[str, Any]:
    """A vision-language config.json with its text model's fields (vocab_size, layers, ...) at the top, as
    SGLang reads them through ``get_text_config``; the top level's own win (architectures, eos)."""
    return {**(config.get("text_config") or {}), **config}


@functools.cache
def _processor(model_path: str) -> Any:
    from slime_rl.core.vision.processor import load_processor

    return load_processor(model_path)


def _image(item: str) -> Any:
    from PIL import Image

    data = data_uri_bytes(item) if item.startswith("data:") else Path(item).read_bytes()
    return Image.open(io.BytesIO(data)).convert("RGB")


def _refuse(message: str) -> web.HTTPBadRequest:
    """SGLang's 400 answer (the stand-in's ``_error`` shape), raised from inside the handler."""
    return web.HTTPBadRequest(text=json.dumps({"error": {"message": message}}), content_type="application/json")


def request_ids(server: Any, body: dict[str, Any]) -> Any:
    """The request's ``input_ids`` as SGLang's multimodal path leaves them (the module doc); unchanged without
    ``image_data``. Raises a 400 answer where SGLang fails the request."""
    ids, items = body.get("input_ids"), body.get("image_data")
    if items is None or ids is None:
        return ids
    if ids and isinstance(ids[0], list):
        raise _refuse("the stand-in models image_data for one request at a time")
    processor = _processor(str(server.args.tokenizer_path or server.args.model_path))
    images = [_image(item) for item in (items if isinstance(items, list) else [items])]
    text = processor.tokenizer.decode(ids)
    try:
        retokenized = processor(text=[text], images=images, padding=True, return_tensors="pt")["input_ids"][0].tolist()
    except Exception as err:  # the HF processor's check of placeholders against images (5.25: ValueError;
        # 5.12.1 runs out of images instead: StopIteration)
        raise _refuse(f"An exception occurred while processing the multimodal data: {type(err).__name__}: "
                      f"{err}") from None
    server.record("image_request", images=len(images), sent=len(ids))
    try:
        return expand(list(ids), image_token_counts(images, processor), processor.image_token_id)
    except ContractProblem:  # SGLang logs "falling back to decode+retokenize" and goes on
        return retokenized
