"""TEST DOUBLE: how the stand-in SGLang server (server.py) holds FP8 weights, as SGLang 0.5.17 does for a
checkpoint with an FP8 ``quantization_config`` (docs/fp8.md): each projection's ``weight`` in float8_e4m3fn
with its float32 ``weight_scale_inv``, loaded in place whatever dtype arrives (a parameter's weight loader
copies into it: a bf16 tensor is cast unscaled), and ``/weights_checker`` hashing each (weight, scale) pair
dequantised to bf16 under the weight's name (weight_checker_comparator.Fp8BlockComparable), the scale not
listed on its own."""

from __future__ import annotations

import hashlib
import os

import torch

SCALE_SUFFIX = "weight_scale_inv"
FP8_DTYPE = torch.float8_e4m3fn


def scales_dropped(hf_config: dict) -> bool:
    """Whether this server, as SGLang 0.5.17 would, loads no block-FP8 scale: its own ``LlamaForCausalLM`` renames
    every ``*.weight_scale_inv`` to ``*.weight_scale``, a name no block-FP8 layer has, unless our model package
    replaces it (rollout_sglang/model_fixes.py, which every server we start of a Llama gets)."""
    from slime_rl.rollout_sglang.model_fixes import PACKAGE

    return ("LlamaForCausalLM" in (hf_config.get("architectures") or ())
            and os.environ.get("SGLANG_EXTERNAL_MODEL_PACKAGE") != PACKAGE)


def as_loaded(weights: dict[str, torch.Tensor], *, scales_dropped: bool) -> dict[str, torch.Tensor]:
    """A folder's ``weights`` as the server holds them after its start: with ``scales_dropped`` every block scale
    as SGLang leaves one it never loaded, float32's minimum."""
    if not scales_dropped:
        return weights
    return {name: torch.full_like(t, torch.finfo(torch.float32).min) if name.endswith(f".{SCALE_SUFFIX}") else t
            for name, t in weights.items()}


def held(param: torch.Tensor, loaded: torch.Tensor) -> torch.Tensor:
    """What a parameter holds after ``loaded`` went in. SGLang's loaders ``copy_`` into the parameter, so an FP8
    one stays FP8 (a bf16 tensor is cast, unscaled, as the real server would). The others take the loaded
    tensor's dtype: the stand-in reads its dtype from the folder's files, where SGLang builds them in --dtype,
    the trainer's dtype (launch.py), so a pushed tensor has the dtype the real parameter has."""
    return loaded.detach().to("cpu", dtype=param.dtype if param.dtype == FP8_DTYPE else None, copy=True)


def _hash(tensor: torch.Tensor) -> str:
    """SGLang's CPU checksum: the first 8 bytes of SHA-256 over the raw bytes."""
    digest = hashlib.sha256(tensor.contiguous().reshape(-1).view(torch.uint8).numpy()).digest()[:8]
    return f"{int.from_bytes(digest, byteorder='big', signed=False):016x}"


def _dequantized(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """SGLang's block_quant_dequant with the block inferred as its checker does (K // scale columns)."""
    n, k = q.shape
    block = k // scale.shape[-1]
    spread = scale.float().repeat_interleave(block, dim=0)[:n].repeat_interleave(block, dim=1)[:, :k]
    return (q.float() * spread).to(torch.bfloat16)


def weight_checksums(weights: dict[str, torch.Tensor]) -> dict[str, str]:
    """``/weights_checker``'s checksums of the held weights: raw bytes, FP8 pairs dequantised (see the module),
    an embedding's or LM head's rows zero-padded to a multiple of 64 first, as SGLang's VocabParallelEmbedding
    holds them (its ``pad_vocab_size``; the weight loader fills the padding rows with zeros)."""
    out = {}
    for name, tensor in weights.items():
        if name.endswith(f".{SCALE_SUFFIX}"):
            continue
        scale = weights.get(f"{name[: -len('weight')]}{SCALE_SUFFIX}") if name.endswith(".weight") else None
        if scale is None and name.endswith(("embed_tokens.weight", "lm_head.weight")) and tensor.shape[0] % 64:
            tensor = torch.nn.functional.pad(tensor, (0, 0, 0, -tensor.shape[0] % 64))
        out[name] = _hash(_dequantized(tensor, scale) if scale is not None else tensor)
    return out
