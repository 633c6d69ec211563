"""What one trainer rank holds in memory, estimated from the model's config.json, against what its
device has: `slime-cli plan` prints it, and `check_config` refuses a run that clearly cannot fit.

Per rank, in bytes (the Megatron trainer's layout: fp32 gradient buffers, Adam with fp32 moments
and, under bf16/fp16, fp32 main weights; trainer_megatron/optimizer.py):

- weights: every parameter of the rank's shard in ``model.dtype`` (TP splits the layers and the
  vocabulary, PP the layers, EP x ETP the experts; the worst pipeline stage, which also holds the
  embedding or the output layer);
- gradients: the trainable parameters in fp32 (all of them, or only LoRA's adapters);
- optimizer: Adam's two fp32 moments of the trainable parameters, plus an fp32 main copy when the
  model is not fp32; divided by DP x CP with the distributed optimizer
  (``trainer.megatron.use_distributed_optimizer``, on by default);
- activations: one micro-batch, :func:`activation_bytes`: this rank's tokens (the token budget is per
  CP rank; a sample longer than it is split over the CP ranks), with ``trainer.megatron.recompute``;
- a PPO critic beside the actor: its weights, gradients and optimizer too; the reference model's
  copy (a KL term without LoRA) only where it shares the memory, on the CPU (on a GPU it is in host memory).

The limit is the GPU's memory (torch, when this machine has the GPU, or ``slime-cli plan
--gpu-memory``), or on the CPU the RAM available now (``MemAvailable`` in /proc/meminfo)
shared by the node's trainer ranks. Above the limit a run is refused, naming the changes that
would fit (`fitting_changes`); above :data:`WARN_FRACTION` of it, warned about. An SGLang engine's
GPU (`engine_estimate`): its share of the weights and the KV cache that the rest of
``mem_fraction_static`` leaves, which must hold one sample of the longest length the config allows.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from slime_rl.core.algorithms.registry import advantage_estimator_of
from slime_rl.core.config.device import resolve_device
from slime_rl.core.config.dtype import model_dtype
from slime_rl.core.config.errors import ConfigError
from slime_rl.core.config.schema import Config

GiB = 1 << 30
WARN_FRACTION = 0.8  # an estimate above this share of the limit is warned about: the estimate is rough
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# The trainer's log-probs hold a chunk of fp32 logits of at most this at a time (trainer_megatron/logprobs.py)
LOGITS_CHUNK_BYTES = {"cpu": 128 << 20, "cuda": 1 << 30}


class MemoryWarning(UserWarning):
    """An estimate close to the device's memory: the run may still fit."""


@dataclass(frozen=True)
class ModelSize:
    """The shape numbers of an HF config.json that set the parameter count."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    intermediate: int
    tied_embeddings: bool = False
    experts: int = 0  # MoE: routed experts per layer (0: dense)
    expert_intermediate: int = 0
    experts_per_token: int = 0
    shared_expert_intermediate: int = 0
    # DeepSeek's multi-head latent attention: its projections' weights a layer, and what SGLang caches a token and
    # layer (the kv latent and the shared rope key, on every engine TP rank); 0 for q/k/v attention
    mla_attention_params: int = 0
    mla_cache_dim: int = 0
    # of those, the down-projections (q_a_proj, kv_a_proj_with_mqa), which every trainer TP rank holds whole
    mla_replicated_params: int = 0
    # a vision-language model's vision tower and merger(s), which every trainer TP rank of the first stage holds whole
    vision_params: int = 0

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelSize:
        """Llama-style names; MoE under Mixtral's, Qwen's or DeepSeek's; a vision-language config's text_config
        plus its vision_config (Qwen2.5-VL's and Qwen3-VL's names)."""
        if "text_config" in hf and "vision_config" in hf and "num_attention_heads" not in hf:
            text = {"tie_word_embeddings": hf.get("tie_word_embeddings", False), **hf["text_config"]}
            return replace(cls.from_hf(text), vision_params=_vision_params(hf["vision_config"]))
        heads = hf["num_attention_heads"]
        experts = hf.get("num_local_experts") or hf.get("num_experts") or hf.get("n_routed_experts") or 0
        mla = _mla_fields(hf, heads)
        return cls(
            hidden=hf["hidden_size"], layers=hf["num_hidden_layers"], heads=heads,
            kv_heads=heads if mla else hf.get("num_key_value_heads") or heads,
            # MLA: the mean of the q/k and v head dims, which the activations hold
            head_dim=mla.pop("head_dim", None) or hf.get("head_dim") or hf["hidden_size"] // heads,
            vocab=hf["vocab_size"],
            intermediate=hf.get("intermediate_size") or 0, tied_embeddings=bool(hf.get("tie_word_embeddings", False)),
            experts=experts,
            expert_intermediate=(hf.get("moe_intermediate_size") or hf.get("intermediate_size") or 0) if experts else 0,
            experts_per_token=hf.get("num_experts_per_tok") or 0,
            # Qwen2-MoE names the shared expert's width; GLM-4.5 and DeepSeek count shared experts of the routed width
            shared_expert_intermediate=hf.get("shared_expert_intermediate_size")
            or (hf.get("n_shared_experts") or 0) * (hf.get("moe_intermediate_size") or 0),
            **mla,
        )

    @classmethod
    def of_folder(cls, folder: str | Path) -> ModelSize | None:
        """From ``folder/config.json``; None when there is none or it lacks a shape key."""
        import json

        try:
            return cls.from_hf(json.loads((Path(folder) / "config.json").read_bytes()))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    @property
    def attention_params(self) -> int:  # per layer: q, k, v, o (MLA: its q, kv down and up, o)
        if self.mla_attention_params:
            return self.mla_attention_params
        q = self.heads * self.head_dim
        return self.hidden * (2 * q + 2 * self.kv_heads * self.head_dim)

    @property
    def dense_mlp_params(self) -> int:  # per layer, gated (SwiGLU): gate, up, down
        return 3 * self.hidden * (self.shared_expert_intermediate if self.experts else self.intermediate)

    @property
    def expert_params(self) -> int:  # per layer, all routed experts
        return self.experts * 3 * self.hidden * self.expert_intermediate

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def total_params(self) -> int:
        """The whole model's (norms aside)."""
        per_layer = self.attention_params + self.dense_mlp_params + self.expert_params
        return (self.layers * per_layer + self.embedding_params * (1 if self.tied_embeddings else 2)
                + self.vision_params)

    def lora_params(self, rank: int, targets: tuple[str, ...]) -> int:
        """Adapter parameters of the whole model: ``rank * (in + out)`` per targeted projection and layer."""
        q, kv, mlp = self.heads * self.head_dim, self.kv_heads * self.head_dim, self.intermediate
        dims = {"q_proj": (self.hidden, q), "k_proj": (self.hidden, kv), "v_proj": (self.hidden, kv),
                "o_proj": (q, self.hidden), "gate_proj": (self.hidden, mlp), "up_proj": (self.hidden, mlp),
                "down_proj": (mlp, self.hidden)}
        return self.layers * sum(rank * sum(dims[t]) for t in targets)


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one trainer rank holds, by what holds them."""

    terms: dict[str, int]
    dtype: str
    trainable: str  # "full" or "LoRA rank r"

    @property
    def total(self) -> int:
        return sum(self.terms.values())

    def format(self) -> str:
        parts = ", ".join(f"{name} {gib(size)}" for name, size in self.terms.items() if size)
        return f"{gib(self.total)} ({parts}; {self.dtype}, {self.trainable})"


@dataclass(frozen=True)
class MemoryLimit:
    bytes_per_rank: int
    source: str  # where the number comes from, for the message


def gib(size: float) -> str:
    return f"{size / GiB:.1f} GiB"


def activation_bytes(size: ModelSize, *, tokens: int, tp: int, pp: int, sequence_parallel: bool,
                     recompute: bool | list[str], dtype_bytes: int, device: str) -> int:
    """Activations a rank keeps for the backward pass of ``tokens`` tokens (one micro-batch), at its peak.

    Per token and layer, the tensors saved for the backward pass (flash/SDPA attention keeps no
    ``s x s`` scores, and RL configs use no dropout), in elements::

        per_layer = 4 h / (tp if sequence_parallel else 1)           # two norms' inputs and outputs
                  + ((2 heads + 2 kv_heads) head_dim + 4 I) / tp     # q, k, v, attention out; gate, up, act, act*up

    with ``I`` the MLP width (MoE: ``experts_per_token x expert I``, plus the shared expert's).
    1F1B pipelining keeps ``pp`` micro-batches in flight on the first stage, of ``layers / pp``
    layers each: ``layers`` layers' worth. Full recompute (``True``) keeps only each layer's input (``h``)
    plus one layer's full set. Selective recompute (a list) of ``mlp`` drops its ``4 I / tp``; of
    ``core_attn`` nothing here: flash attention keeps no scores, and q, k, v and its output are saved
    by the linear layers anyway (it pays only where attention keeps ``s x s`` scores: padded SDPA).
    ``tokens`` are this rank's: with context parallelism, its share of the micro-batch.
    The output layer's logits, fp32, one chunk at a time with the
    backward's recomputed copy: ``3 x min(tokens x vocab / tp x 4, LOGITS_CHUNK_BYTES[device])``::

        activation_bytes = tokens x dtype_bytes x (layers x kept_per_layer) + logits
    """
    mlp = (size.experts_per_token * size.expert_intermediate + size.shared_expert_intermediate
           if size.experts else size.intermediate)
    norms = 4 * size.hidden / (tp if sequence_parallel else 1)
    attention = (2 * size.heads + 2 * size.kv_heads) * size.head_dim
    per_layer = norms + (attention + 4 * mlp) / tp
    if recompute is True:
        kept = size.layers * size.hidden / (tp if sequence_parallel else 1) + per_layer
    else:
        mlp_dropped = 4 * mlp / tp if isinstance(recompute, list) and "mlp" in recompute else 0
        kept = size.layers * (per_layer - mlp_dropped)
    logits = 3 * min(tokens * size.vocab / tp * 4, LOGITS_CHUNK_BYTES[device])
    return int(tokens * dtype_bytes * kept + logits)


@dataclass(frozen=True)
class TrainerLayout:
    """What sets one trainer rank's memory besides the model: the knobs a fix turns."""

    tp: int
    pp: int
    cp: int
    ep: int
    etp: int
    dp_cp: int  # the ranks of one model shard's data: DP x CP (the distributed optimizer shards over them)
    sequence_parallel: bool
    recompute: bool | list[str]
    distributed_optimizer: bool
    max_tokens_per_gpu: int | None  # per CP rank
    lora_rank: int

    @classmethod
    def of(cls, cfg: Config) -> TrainerLayout:
        p, t = cfg.parallel, cfg.trainer
        tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
        return cls(tp=tp, pp=pp, cp=getattr(p, "context_parallel_size", 1), ep=p.expert_model_parallel_size,
                   etp=p.expert_tensor_parallel_size, dp_cp=max(1, cfg.actor_num_gpus // (tp * pp)),
                   sequence_parallel=p.sequence_parallel, recompute=_megatron_setting(cfg, "recompute", False),
                   distributed_optimizer=_megatron_setting(cfg, "use_distributed_optimizer", False),
                   max_tokens_per_gpu=t.max_tokens_per_gpu, lora_rank=t.lora.rank)


def sample_tokens(cfg: Config) -> int:
    """The longest sample the config allows: prompt (when bounded) and response."""
    return (cfg.rollout.max_prompt_len or 0) + cfg.rollout.max_response_len


def micro_batch_tokens(cfg: Config, layout: TrainerLayout | None = None) -> int:
    """The most tokens one rank's micro-batch holds: the token budget (per CP rank), or micro_batch_size
    samples, at most the rank's share of a step, and at least its share of one sample (a longer one gets a
    micro-batch of its own, split over the CP ranks)."""
    layout = layout or TrainerLayout.of(cfg)
    sample, cp = sample_tokens(cfg), layout.cp
    per_rank = -(-cfg.global_batch_size * sample // layout.dp_cp)
    budget = layout.max_tokens_per_gpu if layout.max_tokens_per_gpu is not None \
        else -(-cfg.trainer.micro_batch_size * sample // cp)
    return max(-(-sample // cp), min(budget, per_rank))


def estimate_memory(cfg: Config, size: ModelSize, device: str, *,
                    layout: TrainerLayout | None = None) -> MemoryEstimate:
    """One trainer rank's bytes for ``cfg`` on ``device`` (the module docstring lists the terms), under
    ``layout`` (by default the config's own; `fitting_changes` tries others)."""
    lay = layout or TrainerLayout.of(cfg)
    tp, pp = lay.tp, lay.pp
    dtype = model_dtype(cfg.model.dtype, device)
    dtype_bytes = DTYPE_BYTES[dtype]
    layers = size.layers / pp
    split = size.attention_params - size.mla_replicated_params + size.dense_mlp_params  # MLA's down-projections whole
    per_layer = split / tp + size.mla_replicated_params + size.expert_params / (lay.ep * lay.etp)
    embeddings = size.embedding_params / tp
    ends = embeddings * (1 if size.tied_embeddings else 2) if pp == 1 else embeddings  # the worst stage's
    params = layers * per_layer + ends + size.vision_params  # the tower on the first stage, whole on every TP rank
    lora = cfg.trainer.lora
    trainable = size.lora_params(lay.lora_rank, tuple(lora.target_modules)) / pp / tp if lay.lora_rank else params
    weights = params + (trainable if lay.lora_rank else 0)  # adapters sit beside the frozen weights
    optimizer_per_param = 8 + (4 if dtype != "float32" else 0)  # Adam's moments, fp32 main weights
    optimizer = trainable * optimizer_per_param / (lay.dp_cp if lay.distributed_optimizer else 1)
    terms = {"weights": weights * dtype_bytes, "gradients": trainable * 4, "optimizer": optimizer,
             "activations": activation_bytes(size, tokens=micro_batch_tokens(cfg, lay), tp=tp, pp=pp,
                                             sequence_parallel=lay.sequence_parallel, recompute=lay.recompute,
                                             dtype_bytes=dtype_bytes, device=device)}
    a = cfg.algorithm
    if advantage_estimator_of(a).needs_critic:
        terms["critic"] = params * (dtype_bytes + 4 + optimizer_per_param)
    needs_reference = a.use_kl_loss or a.kl_coef != 0 or cfg.model.ref_path is not None
    if device == "cpu" and needs_reference and not lay.lora_rank:
        terms["reference"] = params * dtype_bytes
    return MemoryEstimate({k: int(v) for k, v in terms.items()}, dtype,
                          f"LoRA rank {lay.lora_rank}" if lay.lora_rank else "full fine-tuning")


def available_ram_bytes(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """``MemAvailable`` of /proc/meminfo in bytes; None where there is none (not Linux)."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def gpu_memory_bytes() -> tuple[int, str] | None:
    """The first GPU's total memory and name, when torch sees one here."""
    import torch

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    return props.total_memory, props.name


def memory_limit(cfg: Config, device: str) -> MemoryLimit | None:
    """What one trainer rank may use on ``device``; None when this machine cannot say (a GPU plan on a
    machine without that GPU)."""
    if device == "cuda":
        gpu = gpu_memory_bytes()
        return None if gpu is None else MemoryLimit(gpu[0], f"{gib(gpu[0])} on each {gpu[1]}")
    ram = available_ram_bytes()
    if ram is None:
        return None
    ranks = cfg.cluster.actor_num_gpus_per_node
    shared = f", shared by {ranks} trainer ranks" if ranks > 1 else ""
    return MemoryLimit(ram // ranks, f"{gib(ram)} of RAM available on this machine{shared}")


def fitting_changes(cfg: Config, size: ModelSize, device: str, limit: int) -> str:
    """What to change so that one trainer rank fits ``limit`` bytes: each single change that fits, with its
    estimate; else the changes together (distributed optimizer, full recompute, one sample a micro-batch,
    context parallelism), when they fit; else what is left (LoRA, more GPUs)."""
    lay = TrainerLayout.of(cfg)
    changes: list[tuple[str, dict[str, Any]]] = []
    if not lay.distributed_optimizer and lay.dp_cp > 1:
        changes.append(("trainer.megatron.use_distributed_optimizer=true", {"distributed_optimizer": True}))
    if lay.recompute is not True:
        changes.append(("trainer.megatron.recompute=true", {"recompute": True}))
    one_sample = -(-sample_tokens(cfg) // lay.cp)
    if micro_batch_tokens(cfg, lay) > one_sample:
        changes.append((f"trainer.max_tokens_per_gpu={one_sample}", {"max_tokens_per_gpu": one_sample}))
    for cp in (2, 4, 8, 16):
        if cp > lay.cp:
            gpus = cp * lay.tp * lay.pp
            changes.append((f"parallel.context_parallel_size={cp} ({gpus} GPUs a model replica)",
                            {"cp": cp, "dp_cp": max(lay.dp_cp, cp)}))

    def total(knobs: dict[str, Any]) -> int:
        return estimate_memory(cfg, size, device, layout=replace(lay, **knobs)).total

    singles = [f"{name} (about {gib(total(knobs))})" for name, knobs in changes if total(knobs) <= limit]
    if singles:
        return "fits with " + "; or ".join(singles[:4])
    together: dict[str, Any] = {}
    names: list[str] = []
    for name, knobs in changes:
        if "cp" in knobs and "cp" in together:
            names.pop()  # a larger CP replaces the smaller one
        together.update(knobs)
        names.append(name)
        if total(together) <= limit:
            return f"fits with all of {' + '.join(names)} (about {gib(total(together))})"
    rest = "trainer.lora.rank=16 (trains adapters only), or more GPUs with a larger parallel.tensor_model_parallel_size" \
           " or pipeline_model_parallel_size"
    if not names:
        return f"use {rest}"
    return f"even {' + '.join(names)} leave about {gib(total(together))}; use {rest}"


# SGLang's own mem_fraction_static on 80-141 GB GPUs is about this (weights and KV cache; the rest is
# its activations and CUDA graphs); rollout.sglang.server_args.mem_fraction_static overrides it.
SGLANG_STATIC_FRACTION = 0.85


@dataclass(frozen=True)
class EngineEstimate:
    """What one GPU of an SGLang engine holds: its share of the weights, and KV cache for the rest of
    ``static_fraction`` of the GPU; one sample of ``context_len`` tokens must fit that cache."""

    weights: int
    kv_bytes_per_token: int
    context_len: int
    static_fraction: float

    def kv_cache(self, gpu_bytes: int) -> int:
        return int(gpu_bytes * self.static_fraction) - self.weights

    def format(self, gpu_bytes: int) -> str:
        cache = self.kv_cache(gpu_bytes)
        tokens = max(0, cache) // self.kv_bytes_per_token
        return (f"weights {gib(self.weights)}, KV cache {gib(max(0, cache))} = {tokens:,} tokens"
                f" ({tokens / self.context_len:.1f} samples of {self.context_len:,} tokens at once;"
                f" mem_fraction_static {self.static_fraction:g})")


def _vision_params(vc: dict[str, Any]) -> int:
    """Parameters of a Qwen2.5-VL or Qwen3-VL vision tower (norms aside): the patch embedding, the blocks' qkv/proj
    and MLP (SwiGLU, or Qwen3-VL's two-matrix GELU one), the merger(s) over each merge block (Qwen3-VL: one per
    deepstack block too) and Qwen3-VL's learned position grid."""
    h, i = vc["hidden_size"], vc["intermediate_size"]
    qwen3 = vc.get("model_type") == "qwen3_vl_vision"
    patch = vc.get("in_channels", 3) * vc.get("temporal_patch_size", 2) * vc.get("patch_size", 14) ** 2
    merged = h * vc.get("spatial_merge_size", 2) ** 2
    block = 4 * h * h + (2 if qwen3 else 3) * h * i
    merger = merged * merged + merged * vc.get("out_hidden_size", h)
    mergers = 1 + len(vc.get("deepstack_visual_indexes") or [])
    return patch * h + vc["depth"] * block + mergers * merger + vc.get("num_position_embeddings", 0) * h


def _mla_fields(hf: dict[str, Any], heads: int) -> dict[str, int]:
    """ModelSize's MLA fields (and its head dim) from a DeepSeek config.json; {} without kv_lora_rank."""
    if hf.get("kv_lora_rank") is None:
        return {}
    hidden, q_rank, kv_rank = hf["hidden_size"], hf.get("q_lora_rank"), hf["kv_lora_rank"]
    nope, rope, v = hf["qk_nope_head_dim"], hf["qk_rope_head_dim"], hf["v_head_dim"]
    q = hidden * q_rank + q_rank * heads * (nope + rope) if q_rank else hidden * heads * (nope + rope)
    kv = hidden * (kv_rank + rope) + kv_rank * heads * (nope + v)
    return {"mla_attention_params": q + kv + heads * v * hidden, "mla_cache_dim": kv_rank + rope,
            "mla_replicated_params": hidden * ((q_rank or 0) + kv_rank + rope), "head_dim": (nope + rope + v) // 2}


def engine_estimate(cfg: Config, size: ModelSize, device: str) -> EngineEstimate | None:
    """An SGLang engine's GPU memory for the config's longest sample; None for other engines or the CPU."""
    if cfg.rollout.engine != "sglang" or device != "cuda":
        return None
    tp = cfg.cluster.rollout_num_gpus_per_engine
    dtype_bytes = DTYPE_BYTES[model_dtype(cfg.model.dtype, device)]
    kv_heads = max(1, size.kv_heads // tp)  # KV heads split over the engine's TP ranks (replicated past them)
    server_args = getattr((cfg.rollout.__pydantic_extra__ or {}).get("sglang"), "server_args", None) or {}
    fraction = next((v for k, v in server_args.items() if str(k).replace("-", "_") == "mem_fraction_static"),
                    SGLANG_STATIC_FRACTION)
    kv_per_layer = size.mla_cache_dim or 2 * kv_heads * size.head_dim  # MLA: one latent a token, not K and V
    weights = size.total_params * dtype_bytes
    if cfg.rollout.precision == "fp8":  # the projections at a byte each, embeddings and lm_head as they were
        embeddings = size.embedding_params * (1 if size.tied_embeddings else 2)
        weights = embeddings * dtype_bytes + (size.total_params - embeddings)
    kv_bytes = 1 if cfg.rollout.kv_cache_dtype == "fp8_e4m3" else dtype_bytes
    return EngineEstimate(weights=int(weights / tp), kv_bytes_per_token=size.layers * kv_per_layer * kv_bytes,
                          context_len=sample_tokens(cfg), static_fraction=float(fraction))


def memory_line(cfg: Config, device: str, limit: MemoryLimit | None = None) -> str:
    """`slime-cli plan`'s lines: the estimate per trainer rank (and per engine GPU) against the limit
    (by default this machine's), or why there is none."""
    size = ModelSize.of_folder(cfg.model.path)
    if size is None:
        return f"memory: no estimate ({cfg.model.path} has no config.json with the model's shape)"
    estimate = estimate_memory(cfg, size, device)
    limit = limit or memory_limit(cfg, device)
    against = (f"against {gib(limit.bytes_per_rank)} a rank ({limit.source})" if limit is not None
               else "no GPU here to compare it with (slime-cli plan --gpu-memory GIB compares with one)")
    lay = TrainerLayout.of(cfg)
    line = (f"memory per trainer rank: about {estimate.format()}, {against}; micro-batches of"
            f" {micro_batch_tokens(cfg, lay):,} tokens a rank, recompute {lay.recompute},"
            f" distributed optimizer {'on' if lay.distributed_optimizer else 'off'}")
    engine = engine_estimate(cfg, size, device)
    if engine is not None and limit is not None:
        line += f"\nmemory per SGLang engine GPU: {engine.format(limit.bytes_per_rank)}"
    return line


def check_memory(cfg: Config, device: str | None = None,
                 limit: MemoryLimit | None = None) -> tuple[MemoryEstimate, MemoryLimit] | None:
    """Refuse (ConfigError) a config whose estimate exceeds the limit, naming the changes that fit; warn
    (`MemoryWarning`) when it is close; refuse an SGLang engine whose KV cache cannot hold one sample.
    Returns both, or None when there is no estimate (no config.json) or no limit. ``device``:
    cluster.device resolved; by default resolved here (torch only where a GPU may be). ``limit``: by
    default this machine's (`memory_limit`); `slime-cli plan --gpu-memory` gives another."""
    size = ModelSize.of_folder(cfg.model.path)
    if size is None:
        return None
    device = device or _planned_device(cfg.cluster.device)
    limit = limit or memory_limit(cfg, device)
    if limit is None:
        return None
    estimate = estimate_memory(cfg, size, device)
    line = f"about {estimate.format()} per trainer rank; {limit.source} gives {gib(limit.bytes_per_rank)} a rank"
    if estimate.total > limit.bytes_per_rank:
        raise ConfigError("model.path", f"{cfg.model.path} does not fit: {line}; at"
                          f" {sample_tokens(cfg):,}-token samples it "
                          f"{fitting_changes(cfg, size, device, limit.bytes_per_rank)}")
    if estimate.total > WARN_FRACTION * limit.bytes_per_rank:
        warnings.warn(f"memory: {cfg.model.path} may not fit: {line}", MemoryWarning, stacklevel=2)
    engine = engine_estimate(cfg, size, device)
    if engine is not None and engine.kv_cache(limit.bytes_per_rank) < engine.kv_bytes_per_token * engine.context_len:
        raise ConfigError("rollout.max_response_len", f"one sample of {engine.context_len:,} tokens does not fit an"
                          f" SGLang engine: {engine.format(limit.bytes_per_rank)}; use a larger"
                          " cluster.rollout_num_gpus_per_engine, a higher"
                          " rollout.sglang.server_args.mem_fraction_static, or shorter samples")
    return estimate, limit


def _megatron_setting(cfg: Config, name: str, default: Any) -> Any:
    """A ``trainer.megatron`` key (given, or the Megatron trainer's default), read without importing the
    trainer; ``default`` for another trainer backend or where the Megatron trainer is not installed."""
    if cfg.trainer.backend != "megatron":
        return default
    try:
        settings = cfg.trainer.settings
    except ConfigError:
        return default
    return getattr(settings, name, default)


def _planned_device(setting: str) -> str:
    """cluster.device resolved as the run will (config/device.py), without importing torch (seconds)
    on a machine with no GPU device at all."""
    if setting == "auto" and not any(Path(node).exists() for node in ("/dev/nvidiactl", "/dev/kfd")):
        return "cpu"
    return resolve_device(setting)
