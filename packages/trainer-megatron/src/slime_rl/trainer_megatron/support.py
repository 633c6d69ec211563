"""Which Hugging Face architectures the Megatron trainer builds, read from a config.json without importing
torch or megatron-core: `slime-cli plan` refuses an unsupported one (``MegatronSettings.check``) and
`slime-cli doctor --model` says what the trainer makes of a checkpoint (`model_support`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

#: HF architecture -> the trainer's family name (model.py builds each).
SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                           "Qwen3MoeForCausalLM": "qwen3_moe", "Qwen2MoeForCausalLM": "qwen2_moe",
                           "Glm4MoeForCausalLM": "glm4_moe", "DeepseekV3ForCausalLM": "deepseek_v3",
                           "DeepseekV2ForCausalLM": "deepseek_v2",
                           "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl", "Qwen3VLForConditionalGeneration": "qwen3_vl"}
#: Architectures users ask for that are not built yet, with the part that is missing.
MISSING_PARTS = {
    "DeepseekV32ForCausalLM": "DeepSeek Sparse Attention (V3.2's lightning indexer and top-k token selection); its"
                              " multi-head latent attention and routing are DeepSeek-V3's, which it has",
}


def architecture_family(hf: dict[str, Any]) -> str:
    """The family of an HF config.json's mapping, found by ``architectures`` (by ``model_type`` where no entry is
    a causal LM); a ValueError naming the supported architectures, and what is missing where that is known."""
    archs = list(hf.get("architectures") or [])
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is not None:
        return SUPPORTED_ARCHITECTURES[arch]
    causal_lms = [a for a in archs if a.endswith("ForCausalLM")]
    if not causal_lms and hf.get("model_type") in SUPPORTED_ARCHITECTURES.values():
        return hf["model_type"]  # no architectures, or another head on a supported backbone (a reward model's)
    named = archs or [hf.get("model_type")]
    missing = next((MISSING_PARTS[a] for a in named if a in MISSING_PARTS), None)
    why = f": the Megatron trainer lacks {missing}" if missing else ""
    raise ValueError(f"architecture {', '.join(map(str, named))} is not supported{why}; the Megatron trainer handles"
                     f" {', '.join(SUPPORTED_ARCHITECTURES)}")


def read_config(path: str | Path) -> dict[str, Any] | None:
    """``path/config.json`` as a mapping; None where there is none (or it is not a JSON object)."""
    try:
        hf = json.loads((Path(path) / "config.json").read_bytes())
    except (OSError, ValueError):
        return None
    return hf if isinstance(hf, dict) else None


def model_support(path: str | Path) -> tuple[bool, list[tuple[str, str]]]:
    """`slime-cli doctor --model`: whether the trainer builds the checkpoint at ``path`` and, if not, which
    part is missing: its architecture, then every field the trainer reads from the full config (this imports
    transformers and megatron-core). Returns (supported, (name, status) lines)."""
    hf = read_config(path)
    if hf is None:
        return False, [("config.json", f"{Path(path) / 'config.json'} is missing or not a JSON object")]
    archs = ", ".join(hf.get("architectures") or [str(hf.get("model_type"))])
    try:
        family = architecture_family(hf)
    except ValueError as err:
        return False, [("architecture", str(err))]
    from slime_rl.trainer_megatron.model import hf_model_shape, read_hf_config

    try:
        shape = hf_model_shape(read_hf_config(path))
    except (ValueError, OSError) as err:  # a field the trainer does not handle (hidden_act, routing, ...)
        return False, [("architecture", f"{archs}: family {family}"),
                       ("config", str(err).removeprefix("model.path: "))]
    lines = [("architecture", f"{archs}: supported (family {family})")]
    if shape.moe is not None:
        moe = shape.moe
        experts = f"{moe.num_experts} routed, top-{moe.topk}, " + (
            f"sigmoid scores with the correction bias (frozen in training), {moe.num_groups or 1} group(s)"
            if moe.expert_bias else "softmax scores")
        if moe.dense_layers:
            experts += f"; the first {len(moe.dense_layers)} layer(s) dense"
        experts += "; TP > 1 with parallel.sequence_parallel"
        lines.append(("experts", experts))
    if shape.mla is not None:
        mla = shape.mla
        q = f"q rank {mla.q_lora_rank}" if mla.q_lora_rank else "q unprojected (q_lora_rank null)"
        lines.append(("attention", f"multi-head latent attention ({q}, kv rank {mla.kv_lora_rank}, qk"
                                   f" {mla.qk_nope_head_dim}+{mla.qk_rope_head_dim}, v {mla.v_head_dim}); TP > 1 with"
                                   " sequence parallelism, CP=1"))
    if shape.vision is not None:
        v = shape.vision
        deepstack = f", deepstack from blocks {list(v.deepstack_visual_indexes)}" if v.deepstack_visual_indexes else ""
        lines.append(("vision", f"vision tower of {v.depth} blocks (width {v.hidden_size}, full attention at"
                                f" {list(v.fullatt_block_indexes)}{deepstack}), merged {v.spatial_merge_size}x"
                                f"{v.spatial_merge_size}; mRoPE sections {list(v.mrope_section)}"
                                f"{' interleaved' if v.mrope_interleaved else ''}; TP (with sequence parallelism)"
                                " and PP, CP=1, no LoRA"))
    if shape.mtp_layers:
        lines.append(("mtp", f"{shape.mtp_layers} multi-token-prediction layer(s): not loaded (neither trained nor"
                             " synced to engines), copied unchanged into saved checkpoints"))
    return True, lines
