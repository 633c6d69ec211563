"""Tiny models and tokenizers for tests, built offline in about a second: no model hub, no download.

Every package's tests build theirs with these (core is every package's dependency):
- `train_tokenizer`: a byte-level BPE trained on the text given (`stdlib_text` when any text will do);
- `tiny_config` and `tiny_model`: a random causal LM of a few layers (each of `FAMILIES`), in memory;
- `save_model`, `tiny_model_folder`: an HF folder (config.json, model.safetensors, tokenizer files)
  that transformers, SGLang and the Megatron trainer load like any model;
- `tiny_vl_model_folder` (vision.py): the same for a tiny random Qwen2.5-VL with its image processor.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerFast

FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "glm4_moe", "deepseek_v3", "deepseek_v2")
#: Tiny mixture-of-experts defaults (8 experts, top-2; Qwen2-MoE adds its gated shared expert).
MOE_DEFAULTS = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "decoder_sparse_step": 1,
                "mlp_only_layers": []}
#: Tiny GLM-4.5-style defaults: a dense first layer, then MoE layers of 8 experts in 2 groups (top-2 from the
#: best group: sigmoid scores plus the correction bias), one shared expert, a routed scaling factor other
#: than 1, half the head dim rotated, attention biases and q/k norms (GLM-4.5 ships biases; use_qk_norm is
#: the config's choice): every GLM-specific path matters to the outputs. No MTP layers (transformers makes none).
GLM4_MOE_DEFAULTS = {"n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                     "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1,
                     "norm_topk_prob": True, "routed_scaling_factor": 2.5, "attention_bias": True,
                     "use_qk_norm": True, "num_nextn_predict_layers": 0}
#: Tiny DeepSeek-V3 defaults: GLM-4.5's routing (dense first layer, 8 experts in 2 groups, a shared expert, routed
#: scaling) with multi-head latent attention: low-rank q and kv projections and their norms, and nope, rope and
#: v head dims that all differ (12, 8, 10), so that a mix-up of any two changes a shape or a result. No MTP layers.
DEEPSEEK_V3_DEFAULTS = {"n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                        "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1,
                        "norm_topk_prob": True, "routed_scaling_factor": 2.5, "q_lora_rank": 24, "kv_lora_rank": 16,
                        "qk_nope_head_dim": 12, "qk_rope_head_dim": 8, "v_head_dim": 10, "rope_interleave": True,
                        "num_nextn_predict_layers": 0}
#: Tiny DeepSeek-V2 defaults: DeepSeek-V3's multi-head latent attention and layer layout (dense first layer, 8 experts,
#: a shared expert) with V2's routing: softmax over the experts, greedy top-2 unrenormalised, times a routed scaling
#: factor other than 1. ``q_lora_rank=None`` gives V2-Lite's q_proj; ``topk_method="group_limited_greedy"`` with
#: ``n_group``/``topk_group`` V2's group-limited search.
DEEPSEEK_V2_DEFAULTS = {"n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                        "n_shared_experts": 1, "first_k_dense_replace": 1, "topk_method": "greedy",
                        "norm_topk_prob": False, "routed_scaling_factor": 2.5, "q_lora_rank": 24, "kv_lora_rank": 16,
                        "qk_nope_head_dim": 12, "qk_rope_head_dim": 8, "v_head_dim": 10}


def stdlib_text(num_files: int = 60) -> list[str]:
    """The first ``num_files`` of Python's own modules: plenty of offline text to train a tokenizer on."""
    stdlib = Path(os.__file__).parent
    return [path.read_text(errors="ignore") for path in sorted(stdlib.glob("*.py"))[:num_files]]


def train_tokenizer(texts: Iterable[str], *, vocab_size: int, special_tokens: Sequence[str] = ("<|endoftext|>",),
                    bos_token: str | None = None, eos_token: str | None = None,
                    pad_token: str | None = None) -> PreTrainedTokenizerFast:
    """A byte-level BPE of at most ``vocab_size`` ids trained on ``texts``; ``special_tokens`` take the first
    ids. ``eos_token`` defaults to the first special token; bos and pad are set only when given."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(special_tokens), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(texts, trainer)
    named = {"bos_token": bos_token, "eos_token": eos_token or special_tokens[0], "pad_token": pad_token}
    return PreTrainedTokenizerFast(tokenizer_object=bpe, **{k: v for k, v in named.items() if v is not None})


def tiny_config(family: str = "llama", *, vocab_size: int, hidden_size: int = 64, intermediate_size: int | None = None,
                num_layers: int = 2, num_heads: int = 4, num_kv_heads: int | None = None,
                tie_word_embeddings: bool = False, max_position_embeddings: int = 2048,
                **fields: Any) -> PretrainedConfig:
    """The HF config of a tiny ``family`` model; ``intermediate_size`` defaults to ``2 * hidden_size`` and
    ``num_kv_heads`` to half the heads. ``fields`` sets any other config field (``head_dim``,
    ``initializer_range``, ``eos_token_id``, ...)."""
    import transformers

    classes = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config,
               "qwen3_moe": transformers.Qwen3MoeConfig, "qwen2_moe": transformers.Qwen2MoeConfig,
               "glm4_moe": transformers.Glm4MoeConfig, "deepseek_v3": transformers.DeepseekV3Config,
               "deepseek_v2": transformers.DeepseekV2Config}
    if family not in classes:
        raise ValueError(f"family: {family!r}; use one of {', '.join(FAMILIES)}")
    if family == "glm4_moe":
        rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
        fields = {**GLM4_MOE_DEFAULTS, "rope_parameters": rope, **fields}
    elif family in ("deepseek_v3", "deepseek_v2"):
        rope = {"rope_type": "default", "rope_theta": 10000.0}
        defaults = DEEPSEEK_V3_DEFAULTS if family == "deepseek_v3" else DEEPSEEK_V2_DEFAULTS
        fields = {**defaults, "rope_parameters": rope, **fields}
        num_kv_heads = num_heads  # MLA: every head has its own keys and values, expanded from one latent
    elif family.endswith("_moe"):
        shared = {"shared_expert_intermediate_size": 48} if family == "qwen2_moe" else {}
        fields = {**MOE_DEFAULTS, **shared, **fields}
    return classes[family](
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads if num_kv_heads is not None else num_heads // 2,
        tie_word_embeddings=tie_word_embeddings, max_position_embeddings=max_position_embeddings, **fields)


def tiny_model(config: PretrainedConfig, *, seed: int = 0, perturb_norms: bool = False) -> PreTrainedModel:
    """A random causal LM of ``config`` in float32, in eval mode, the same for the same ``seed``.

    ``perturb_norms``: noise on the norm weights and biases, which start as ones and zeros, so that a
    weight loaded into the wrong place (or not at all) shows in the outputs. GLM/DeepSeek routers'
    ``e_score_correction_bias`` (zeros in a fresh model; learnt in a real checkpoint) always gets random
    values: with zeros, routing that ignored the bias would pass every test."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn_like(buffer) * 0.05)
    if perturb_norms:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name or "bias" in name:
                    param.add_(torch.randn_like(param) * 0.1)
    return model.eval()


def save_model(out_dir: Path, model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast | None = None, *,
               dtype: torch.dtype = torch.float32) -> Path:
    """``model`` (cast to ``dtype`` in place) and ``tokenizer`` as an HF folder; returns ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.to(dtype).save_pretrained(out_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    return out_dir


def tiny_model_folder(out_dir: Path, family: str = "qwen2", *, tokenizer: PreTrainedTokenizerFast | None = None,
                      seed: int = 0, dtype: torch.dtype = torch.float32, **shape: Any) -> Path:
    """A complete HF folder of a tiny random model and its tokenizer; ``shape`` as `tiny_config` takes it.

    ``tokenizer`` (default: a 1,024-id BPE of `stdlib_text`, ``<|endoftext|>`` its eos and pad) sets the
    vocabulary and the model's eos, bos (the eos when it has none) and pad ids."""
    if tokenizer is None:
        tokenizer = train_tokenizer(stdlib_text(), vocab_size=1024, eos_token="<|endoftext|>",
                                    pad_token="<|endoftext|>")
    eos = tokenizer.eos_token_id
    config = tiny_config(family, vocab_size=len(tokenizer), eos_token_id=eos,
                         bos_token_id=eos if tokenizer.bos_token_id is None else tokenizer.bos_token_id,
                         pad_token_id=tokenizer.pad_token_id, **shape)
    return save_model(out_dir, tiny_model(config, seed=seed), tokenizer, dtype=dtype)


# A ChatML template with Hermes/Qwen tool calls (`<tool_call>{json}</tool_call>`), a tool role and the tools'
# schemas in the system turn: what Qwen2.5-style models use, small enough to read. With drop_thinking, earlier
# assistant turns lose their <think> blocks, as Qwen3's template does (a history rewrite the parity check reports).
_CHAT_TEMPLATE = (
    "{%- if tools or messages[0]['role'] == 'system' -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages[0]['role'] == 'system' -%}{{- messages[0]['content'] -}}{%- endif -%}"
    "{%- if tools -%}{{- '\\n# Tools\\nCall a tool as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>."
    " The tools:' -}}{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- set ns = namespace(last=-1) -%}"
    "{%- for message in messages -%}{%- if message['role'] == 'assistant' -%}{%- set ns.last = loop.index0 -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' and loop.first -%}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{%- set content = message['content'] or '' -%}"
    "{%- if DROP_THINKING and loop.index0 < ns.last and '</think>' in content -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}{%- endif -%}"
    "{{- '<|im_start|>assistant\\n' + content -}}"
    "{%- for call in message.get('tool_calls') or [] -%}"
    "{{- '<tool_call>{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' -}}"
    "{{- (call['function']['arguments'] | tojson) + '}</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
CHAT_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_ADDED_TOKENS = ("<tool_call>", "</tool_call>", "<think>", "</think>")  # plain added tokens, as in Qwen's


def chat_tokenizer(*, vocab_size: int = 1024, drop_thinking: bool = False,
                   texts: Iterable[str] | None = None) -> PreTrainedTokenizerFast:
    """A small BPE with a ChatML chat template that renders tools, tool calls and a tool role; ``<|im_end|>`` is
    its eos (the end of an assistant turn) and ``<|endoftext|>`` its pad. ``drop_thinking``: the template drops
    ``<think>...</think>`` from assistant turns before the last, as Qwen3's does. Trained on `stdlib_text` and a
    few chat words unless ``texts`` is given."""
    corpus = list(texts) if texts is not None else stdlib_text() + [
        "You are a helpful assistant. What is 2 + 3? The answer is 5. Use the tool: add, python, code, result.",
    ] * 20
    tokenizer = train_tokenizer(corpus, vocab_size=vocab_size - len(CHAT_ADDED_TOKENS),
                                special_tokens=CHAT_SPECIAL_TOKENS, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.add_tokens(list(CHAT_ADDED_TOKENS))
    tokenizer.chat_template = _CHAT_TEMPLATE.replace("DROP_THINKING", "true" if drop_thinking else "false")
    return tokenizer


# The tiny Qwen2.5-VL folder (vision.py; its imports are lazy like the ones above).
from slime_rl.core.testing.vision import tiny_vl_model_folder  # noqa: E402,F401
