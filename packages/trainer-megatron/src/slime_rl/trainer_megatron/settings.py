"""``trainer.megatron``: the Megatron trainer's own config keys, checked when the config loads.

Light on purpose (pydantic only): the config loader finds this model through the entry point
``slime_rl.trainers.settings`` without importing the trainer (torch, megatron-core).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, field_validator

from slime_rl.core.config import BackendSettings, ConfigError
from slime_rl.trainer_megatron.support import architecture_family, read_config

if TYPE_CHECKING:
    from slime_rl.core.config import Config

SELECTIVE_RECOMPUTE_MODULES = ("core_attn", "mlp")  # Megatron's recompute_modules the local spec supports


class MegatronSettings(BackendSettings):
    """The Megatron-core trainer; these were `trainer.*` keys."""

    recompute: bool | list[str] = Field(False, description=(
        "`true`: full activation recompute (`--recompute-granularity full`); a list of `core_attn`, `mlp`:"
        " Megatron's selective recompute of those modules (its `layernorm` needs TransformerEngine)"
        " (`--recompute-granularity selective --recompute-modules ...`)"))
    moe_aux_loss_coeff: float = Field(0.0, ge=0.0, description=(
        "MoE router load-balancing loss weight, per micro-batch (`--moe-aux-loss-coeff`). GLM-4.5's and"
        " DeepSeek-V3's router correction bias (`e_score_correction_bias`) is frozen: used to choose experts, loaded and saved as the"
        " checkpoint has it, never updated from the expert loads (no auxiliary-loss-free balancing)"))
    moe_z_loss_coeff: float | None = Field(None, ge=0.0, description=(
        "MoE router z-loss weight; `null`: off (`--moe-z-loss-coeff`)"))
    moe_router_load_balancing_type: Literal["aux_loss", "seq_aux_loss", "global_aux_loss", "none"] = Field(
        "aux_loss", description="`aux_loss`, `seq_aux_loss`, `global_aux_loss`, `none`"
                                " (`--moe-router-load-balancing-type`)")
    moe_grouped_gemm: bool = Field(True, description=(
        "MoE experts: all local experts in one `torch._grouped_mm` per projection (CUTLASS on sm90+ in bf16; a"
        " per-expert loop where it cannot run); `false`: Megatron's SequentialMLP, one GEMM per expert"
        " (`--moe-grouped-gemm`)"))

    use_distributed_optimizer: bool = Field(True, description=(
        "Megatron's distributed optimizer: Adam's fp32 moments (and main weights under bf16) sharded over the"
        " data-parallel x context-parallel ranks (gradients reduce-scattered, weights all-gathered after the"
        " step): 8-12 bytes a parameter divided by DP x CP instead of on every rank, the same updates to fp32"
        " rounding (`--use-distributed-optimizer`, on as in slime). Not applied to embeddings tied across"
        " pipeline stages under TP > 1 (they resume wrongly with it). Its checkpoints hold the state per parameter"
        " (megatron-core's fully_reshardable format) and resume only with the same setting (one from before it: `false`)"))
    packed_attention: Literal["auto", "varlen", "padded", "per_sequence"] = Field("auto", description=(
        "How packed micro-batches (`trainer.max_tokens_per_gpu`) attend within each sequence. `auto`: one flash"
        " varlen call per layer on CUDA in bf16/fp16, else one padded SDPA call (the CPU's choice), else one"
        " call per sequence; `varlen`, `padded`, `per_sequence` force one (benchmarks, debugging). Multi-head latent"
        " attention (DeepSeek-V3) takes every kernel: varlen with V zero-padded to the q/k head dim"))

    @field_validator("recompute", mode="before")
    @classmethod
    def _recompute_modules(cls, value: Any) -> Any:
        if isinstance(value, list | tuple):
            unknown = [m for m in value if m not in SELECTIVE_RECOMPUTE_MODULES]
            if unknown or not value:
                raise ValueError(
                    f"{unknown or value!r}: give true (full recompute) or a list of {', '.join(SELECTIVE_RECOMPUTE_MODULES)}"
                    " (Megatron's layernorm recompute needs TransformerEngine, which the local spec does not use)")
            return list(value)
        return value

    def check(self, cfg: Config, where: str) -> None:
        """The model's architecture is one the trainer builds (read from its config.json: `slime-cli plan`
        refuses the others with the list, before anything starts). ``builtin:`` models are Llama."""
        hf = read_config(cfg.model.path)
        if hf is None or not (hf.get("architectures") or hf.get("model_type")):
            return  # a builtin: name or a folder check_model reports; one naming no model is left to the build
        try:
            architecture_family(hf)
        except ValueError as err:
            raise ConfigError("model.path", f"{cfg.model.path}: {err}") from None

    @classmethod
    def model_support(cls, path: str) -> tuple[bool, list[tuple[str, str]]]:
        """Whether the trainer builds the checkpoint at ``path``, and if not which part is missing (support.py)."""
        from slime_rl.trainer_megatron.support import model_support

        return model_support(path)


def megatron_settings(cfg: Config) -> MegatronSettings:
    """The run's ``trainer.megatron`` (its defaults when the config gives none)."""
    return cfg.trainer.settings_of(MegatronSettings, "megatron")
