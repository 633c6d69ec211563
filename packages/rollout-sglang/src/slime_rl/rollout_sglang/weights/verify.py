"""After a sync, whether the engines hold the trainer's weights (``rollout.sglang.check_weight_update``,
`SGLangEngine.verify_weights`): checksums of a sample of each bucket's tensors (`check_sample`) against
what SGLang's ``/weights_checker`` reports for its parameters (`check_weights`).
"""

from __future__ import annotations

import hashlib

import torch

from slime_rl.core.contracts import NamedTensors
from slime_rl.core.weights import fp8
from slime_rl.rollout_sglang.weights.server_api import Target, WeightSyncError, post

# SGLang loads these into fused parameters (qkv_proj, gate_up_proj; DeepSeek's fused_qkv_a_proj_with_mqa), whose
# checksum no single trainer tensor has; the check compares the parameters both sides hold under one name.
FP8_SCALE = fp8.SCALE_NAMES["block"]
_FUSED_IN_SGLANG = (".q_proj.", ".k_proj.", ".v_proj.", ".gate_proj.", ".up_proj.", ".q_a_proj.",
                    ".kv_a_proj_with_mqa.")
# SGLang's vocabulary-parallel layers (VocabParallelEmbedding, ParallelLMHead) hold the vocabulary padded to a
# multiple of 64 with zero rows (vocab_parallel_embedding.py: pad_vocab_size, and weight_loader's fill_(0)), so
# their checksum is of the padded tensor: a tiny VL model's 1,029 ids failed the H100 run of 2026-12-06
VOCAB_PADDING = 64
_VOCAB_PARALLEL = ("embed_tokens.weight", "lm_head.weight")


def tensor_checksum(tensor: torch.Tensor) -> str:
    """A tensor's checksum as SGLang's ``/weights_checker`` reports it (``weight_checker._hash_tensor``:
    its GPU hash kernel for CUDA tensors, the first 8 bytes of SHA-256 over the raw bytes otherwise).

    SGLang's servers hold their parameters on the GPU, so where this process has one, a host tensor (a
    disk sync's, a CPU trainer's) is hashed there too: hashed on the host it could never match the
    server's GPU hash (the H200 run of test_disk_sync found it). Two tensors a bucket are sampled."""
    flat = tensor.detach().contiguous()
    if not flat.is_cuda and torch.cuda.is_available():
        flat = flat.cuda()
    if flat.is_cuda:
        try:
            from sglang.kernels.ops.memory.gpu_tensor_hash import gpu_tensor_hash
        except ImportError as err:
            raise WeightSyncError("rollout.sglang.check_weight_update: checksums of CUDA weights use SGLang's GPU hash "
                                  "kernel, and sglang is not importable in this process; install it here or "
                                  "set rollout.sglang.check_weight_update=false") from err
        return f"{gpu_tensor_hash(flat):016x}"
    digest = hashlib.sha256(flat.reshape(-1).view(torch.uint8).numpy()).digest()[:8]
    return f"{int.from_bytes(digest, byteorder='big', signed=False):016x}"


def as_sglang_holds(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as one SGLang rank holds it whole: a vocabulary's rows padded with zeros to `VOCAB_PADDING`."""
    rows = tensor.shape[0] if tensor.dim() else 0
    if not name.endswith(_VOCAB_PARALLEL) or rows % VOCAB_PADDING == 0:
        return tensor
    return torch.cat([tensor, tensor.new_zeros((VOCAB_PADDING - rows % VOCAB_PADDING, *tensor.shape[1:]))])


def widest_tp(targets: list[Target]) -> int:
    return max((t.tp_size for t in targets), default=1)


def _comparable(name: str, tensor: torch.Tensor, tp_size: int) -> bool:
    """Whether an engine holds this tensor whole under the same name: not fused by SGLang and, with
    tensor parallelism, replicated on every rank (the norms; the other weights are sharded)."""
    if any(part in name for part in _FUSED_IN_SGLANG):
        return False
    return tp_size == 1 or (tensor.dim() == 1 and "norm" in name)


def check_sample(named_tensors: NamedTensors, *, tp_size: int = 1, every: bool = False) -> dict[str, str]:
    """What `check_weights` compares after a sync: the checksums of a bucket's first and last tensors
    that an engine of ``tp_size`` holds whole (``every``: all of them), and its first FP8 weight with its scale
    (rollout.precision=fp8: a bucket's first and last are often an embedding and a norm, which never show a
    scale the engine dropped). An FP8 weight is checked as SGLang's checker reports it: its (bytes, scales)
    pair dequantised to bf16 under the weight's name; the scale has no checksum of its own."""
    scales = {n: t for n, t in named_tensors if n.endswith(f".{FP8_SCALE}")}
    candidates = [(n, t) for n, t in named_tensors if n not in scales and _comparable(n, t, tp_size)]
    picked = candidates if every else candidates[:1] + candidates[-1:]
    if not every:
        pair = next(((n, t) for n, t in candidates if t.dtype == fp8.FP8_DTYPE and _scale_name(n) in scales), None)
        if pair is not None and pair[0] not in {n for n, _ in picked}:
            picked.append(pair)
    out = {}
    for name, tensor in picked:
        scale = scales.get(_scale_name(name)) if tensor.dtype == fp8.FP8_DTYPE else None
        if tensor.dtype == fp8.FP8_DTYPE and scale is None:
            continue  # its scale went in another bucket: SGLang hashes the pair, this bucket cannot
        out[name] = tensor_checksum(as_sglang_holds(name, tensor) if scale is None else _dequantized(tensor, scale))
    return out


def _scale_name(weight_name: str) -> str:
    """``...q_proj.weight`` -> ``...q_proj.weight_scale_inv``."""
    return f"{weight_name[: -len('weight')]}{FP8_SCALE}"


def _dequantized(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """SGLang's block_quant_dequant (float32 product, then bf16) with the block its checker infers."""
    return fp8.dequantize(q, scale.to(q.device), fp8.FP8Format("block", q.shape[-1] // scale.shape[-1]),
                          torch.bfloat16)


def check_weights(target: Target, expected: dict[str, str], *, timeout: float, step: str) -> int:
    """Compare the engine's parameters with the trainer's by checksum (SGLang's ``/weights_checker``,
    which hashes every parameter on every TP rank; ``/get_weights_by_name`` does not serve Qwen2/Qwen3).
    Returns how many tensors were compared; raises when one differs or none could be compared."""
    answer = post(target, "/weights_checker", {"action": "checksum"}, timeout=timeout, step=f"{step}: checksums")
    ranks = answer.get("ranks") if isinstance(answer, dict) else None
    if not ranks:
        raise WeightSyncError(f"{target.name}: {step}: /weights_checker returned no checksums: {str(answer)[:300]}")
    problems, compared = [], 0
    for rank in ranks:
        held = rank.get("checksums", {})
        for name, want in expected.items():
            if name not in held:
                continue  # a tied or renamed parameter: the engine holds it under another name
            compared += 1
            if held[name] != want:
                problems.append(f"{name} (TP rank {rank.get('parallelism_info', {}).get('tp_rank', '?')}): "
                                f"engine checksum {held[name]} != trainer's {want}")
    if problems:
        raise WeightSyncError(f"{target.name}: {step}: engine weights differ from the trainer's: "
                              + "; ".join(problems[:5]) + (f" (+{len(problems) - 5} more)" if len(problems) > 5 else ""))
    if expected and not compared:
        raise WeightSyncError(f"{target.name}: {step}: none of the {len(expected)} sampled tensors "
                              f"({', '.join(sorted(expected)[:3])}...) is a parameter of the engine under that name")
    return compared
