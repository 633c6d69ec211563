"""The rollout contract for images: what an engine is sent, and the check that it sees our ids.

Our prompt ids hold each image as a run of pad tokens, one per merged patch (the processor's expansion,
prompt.py); the trainer scores exactly those ids. SGLang 0.5.17 does not take such ids as they are: its
multimodal path (tokenizer_manager -> QwenVLImageProcessor.process_mm_data_async -> base_processor.load_mm_data)
decodes ``input_ids`` back to text and re-runs the HF processor on it with the request's ``image_data``. A
pre-expanded run decodes to N pads, which the processor expands again (N x N pads: the count no longer
matches the images, strands-sglang#31). So the contract is:

- the engine is sent ONE pad per image (`collapse`: each run becomes one ``<|image_pad|>``, inside its
  ``<|vision_start|>``/``<|vision_end|>``), and the images in placeholder order as ``image_data`` (data URIs:
  a server reads no path of ours);
- SGLang expands each pad back to the image's token count: by default (SGLANG_MM_AVOID_RETOKENIZE) it keeps
  our other ids verbatim and puts ``counts[i]`` pads in place of the i-th (`expand`, its ``_expand_input_ids``,
  counts from the processor's ``_get_num_multimodal_tokens`` for the image's size); if that raises it falls
  back to decode -> processor. Both must give back our ids.

`check_round_trip` proves both for one prompt on the CPU, with the model's own processor, and names the
first token where they differ; the data source refuses (file:line and the reason) a prompt that fails it.
On the GPU the engine compares SGLang's ``meta_info.prompt_tokens`` with our count on every image request.
"""

from __future__ import annotations

import base64
from typing import Any

from slime_rl.core.vision.images import DATA_URI_PREFIX, bytes_to_data_uri, read_bytes


class ContractProblem(Exception):
    """Why an engine would not see a prompt's ids as ours. A plain exception, not a frozen dataclass: it must survive the pickle round trip that carries it
    across Ray (tests/unit/test_errors_pickle.py)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def placeholder_runs(ids: list[int], pad_id: int) -> list[tuple[int, int]]:
    """(start, length) of every run of ``pad_id`` in ``ids``."""
    runs: list[tuple[int, int]] = []
    for i, token in enumerate(ids):
        if token != pad_id:
            continue
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


def collapse(ids: list[int], pad_id: int) -> list[int]:
    """``ids`` with every run of ``pad_id`` cut to one token: what an engine is sent."""
    return [t for i, t in enumerate(ids) if t != pad_id or i == 0 or ids[i - 1] != pad_id]


def expand(ids: list[int], counts: list[int], pad_id: int) -> list[int]:
    """The i-th single ``pad_id`` of ``ids`` made ``counts[i]`` pads: SGLang's ``_expand_input_ids``."""
    singles = sum(1 for t in ids if t == pad_id)
    if singles != len(counts):
        raise ContractProblem(f"{singles} image pad token(s) for {len(counts)} image(s)")
    out: list[int] = []
    it = iter(counts)
    for t in ids:
        out.extend([pad_id] * next(it) if t == pad_id else [t])
    return out


def image_token_counts(images: list[Any], processor: Any) -> list[int]:
    """Each image's pad count as SGLang computes it (``resolve_image_token_counts``: the processor's
    ``_get_num_multimodal_tokens`` of the image's height and width)."""
    sizes = [(image.height, image.width) for image in images]
    return [int(n) for n in processor._get_num_multimodal_tokens(image_sizes=sizes).num_image_tokens]


def _first_difference(ours: list[int], theirs: list[int], tokenizer: Any) -> str:
    k = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), min(len(ours), len(theirs)))
    show = lambda ids: f"{ids[max(0, k - 3):k + 3]} = {tokenizer.decode(ids[max(0, k - 3):k + 3])!r}"  # noqa: E731
    return (f"{len(theirs)} ids against our {len(ours)}, first different at token {k} (ours {show(ours)}, the "
            f"engine's {show(theirs)})")


def check_round_trip(ids: list[int], images: list[Any], processor: Any) -> None:
    """Both of SGLang's ways from our collapsed ids back to full ids give ``ids`` (module doc); ContractProblem
    with the reason otherwise. ``images``: the decoded images in placeholder order."""
    tokenizer = processor.tokenizer
    pad_id = processor.image_token_id
    runs = placeholder_runs(ids, pad_id)
    if len(runs) != len(images):
        raise ContractProblem(f"{len(runs)} run(s) of image pad tokens for {len(images)} image(s) (text that "
                              f"tokenizes to the pad token, or a placeholder without an image)")
    counts = image_token_counts(images, processor)
    for k, ((_, length), count, image) in enumerate(zip(runs, counts, images, strict=True)):
        if length != count:
            raise ContractProblem(f"image {k} ({image.width}x{image.height}) has {length} pad tokens; the processor "
                                  f"makes {count} for its size")
    collapsed = collapse(ids, pad_id)
    expanded = expand(collapsed, counts, pad_id)
    if expanded != ids:
        raise ContractProblem(f"expanding the engine's pads gives {_first_difference(ids, expanded, tokenizer)}")
    # The fallback, as SGLang runs it: decode (special tokens kept), then the processor on that text.
    text = tokenizer.decode(collapsed)
    kwargs: dict[str, Any] = {}
    bos = getattr(tokenizer, "bos_token", None)
    if bos and text.startswith(bos):
        kwargs["add_special_tokens"] = False  # SGLang avoids a second BOS the same way
    again = processor(text=[text], images=images, padding=True, return_tensors="pt", **kwargs)["input_ids"][0].tolist()
    if again != ids:
        raise ContractProblem(f"decoding the engine's ids and re-running the processor gives "
                              f"{_first_difference(ids, again, tokenizer)}")


def engine_request(ids: list[int], refs: list[str], pad_id: int) -> tuple[list[int], list[str]]:
    """What an engine that re-runs the processor (SGLang) is sent for ``ids`` with images ``refs``: the ids
    with one pad per image, and the images as data URIs (a file of ours is not the server's to read)."""
    collapsed = collapse(ids, pad_id)
    singles = sum(1 for t in collapsed if t == pad_id)
    if singles != len(refs):
        raise ContractProblem(f"{singles} image placeholder(s) in the ids for {len(refs)} image(s): a response "
                              f"that generated the image pad token cannot be continued with images")
    return collapsed, [ref if ref.startswith(DATA_URI_PREFIX) else bytes_to_data_uri(read_bytes(ref)) for ref in refs]


def data_uri_bytes(uri: str) -> bytes:
    """The bytes of a base64 data URI (what `engine_request` sends)."""
    return base64.b64decode(uri.partition(",")[2])
