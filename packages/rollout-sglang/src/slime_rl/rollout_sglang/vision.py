"""Images through SGLang (docs/vlm.md; the contract is slime_rl.core.vision.contract's).

SGLang 0.5.17 re-runs the HF processor on a request with ``image_data``, so it is sent our ids with one
image pad per image (`request`) and expands them itself; its answer's ``meta_info.prompt_tokens`` must then
equal our prompt's length (`check_prompt_tokens`), else the engine scored another prompt than the trainer
will and the request fails with the reason. The launch keeps SGLang's tokenizer for a vision-language model
(the processor decodes the ids) and sets a vision attention backend the GPU bundle has (`launch_flags`), with
SGLang's image-embedding cache off (`launch_env`: it would outlive weight syncs).
"""

from __future__ import annotations

import functools
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from slime_rl.core.contracts import GenerateOutput
from slime_rl.core.vision.contract import ContractProblem, engine_request

#: SGLang's default vision attention on Hopper is FA3, which the GPU bundle drops (docs/gpu-results.md);
#: sdpa is torch's own, in every build (triton_attn also works there).
MM_ATTENTION_BACKEND = "sdpa"


@functools.cache
def image_token_id(model_path: str | Path) -> int | None:
    """The served model's image pad id (config.json's ``image_token_id``); None for a text-only model."""
    config = json.loads((Path(model_path) / "config.json").read_text())
    if config.get("vision_config") is None:
        return None
    return int(config["image_token_id"])


def serves_images(model_path: str | Path) -> bool:
    """Whether the folder holds a vision-language model (False when it cannot be read here: an attached
    server's model may live elsewhere, and then image data is refused up front)."""
    try:
        return image_token_id(model_path) is not None
    except (OSError, ValueError, KeyError):
        return False


def vision_token_ids(model_path: str | Path) -> frozenset[int]:
    """The ids only the processor may place: image and video pads, vision start and end."""
    config = json.loads((Path(model_path) / "config.json").read_text())
    names = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    return frozenset(int(config[n]) for n in names if config.get(n) is not None)


def end_before_vision_tokens(out: GenerateOutput, vision_ids: frozenset[int], *, first: bool) -> GenerateOutput:
    """``out`` ended (``stop``) before the first vision token it sampled, if any. A pad in a response claims an
    image that is not there (the trainer refuses the sample; a continuation would miscount the images), and
    sglang-router 0.3.x drops the ``logit_bias`` that could forbid them (the hf engine never samples them).
    ``first``: ``out`` starts the response; a response that would be empty fails (ValueError: the trainer takes
    no empty response), which fails its sample alone and drops its group."""
    k = next((i for i, t in enumerate(out.token_ids) if t in vision_ids), None)
    if k is None:
        return out
    if k == 0 and first:
        raise ValueError(f"the model's first response token was the vision token {out.token_ids[0]} (SGLang "
                         f"cannot be told to avoid them through sglang-router: docs/vlm.md)")
    dropped = len(out.token_ids) - k
    routed = out.routed_experts[:len(out.routed_experts) - dropped] if out.routed_experts is not None else None
    versions = out.token_versions[:k] if out.token_versions is not None else None
    return replace(out, token_ids=out.token_ids[:k], log_probs=out.log_probs[:k], finish_reason="stop",
                   routed_experts=routed, token_versions=versions)


def launch_flags(model_path: str | Path) -> dict[str, Any]:
    """Server flags a vision-language model needs (none for a text model); the user's server_args win."""
    if not serves_images(model_path):
        return {}
    return {"skip_tokenizer_init": False, "mm_attention_backend": MM_ATTENTION_BACKEND}


def launch_env(model_path: str | Path) -> dict[str, str]:
    """Environment a vision-language model's server needs: no image-embedding cache. SGLang 0.5.17 keeps each
    image's vision-tower output by the image's pixels (``SGLANG_VLM_CACHE_SIZE_MB``, 100 MB) and never clears
    it, neither on a flush nor on a weight update: after a sync a seen image would keep the embedding of the
    weights it was first seen under (the vision tower trains unless ``trainer.freeze_vision_tower``), and
    rollouts and evals would come from another policy than the trainer's. SGLang turns it off itself for its
    RL on-policy mode (server_args.py ``_handle_deterministic_inference``)."""
    return {"SGLANG_VLM_CACHE_SIZE_MB": "0"} if serves_images(model_path) else {}


def request(input_ids: list[int], images: list[str], model_path: str | Path) -> tuple[list[int], list[str]]:
    """(the ids SGLang is sent, its ``image_data``) for our ``input_ids`` with ``images``; ValueError when
    the model takes no images or the ids do not hold one run of pads per image."""
    pad_id = image_token_id(model_path)
    if pad_id is None:
        raise ValueError(f"images: the served model ({model_path}) has no vision tower")
    try:
        return engine_request(list(input_ids), list(images), pad_id)
    except ContractProblem as problem:
        raise ValueError(f"images: {problem.reason}") from None


def check_prompt_tokens(body: dict[str, Any], expected: int) -> str | None:
    """Why SGLang's prompt differs from ours (its ``meta_info.prompt_tokens`` against ``expected``), or None."""
    got = (body.get("meta_info") or {}).get("prompt_tokens")
    if got is None or int(got) == expected:
        return None
    return (f"SGLang expanded the request's images into a prompt of {got} tokens, ours has {expected}: its image "
            f"processor resizes them otherwise (server-side min/max pixels?); the trainer would score other "
            f"tokens than the engine sampled from (docs/vlm.md)")
