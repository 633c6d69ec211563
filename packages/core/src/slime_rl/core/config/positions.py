"""The positions a model covers against the longest sample the config asks for (prompt + response):
a model whose ``max_position_embeddings`` (extended by the RoPE scaling its config.json asks for) is
below it is refused before anything starts, for the trainer and the engines alike (both read the same
config.json), naming the fix.

RoPE scaling counts as SGLang counts it (``get_context_length``): a ``factor`` with an
``original_max_position_embeddings`` means ``max_position_embeddings`` is already the extended length
(Llama 3.1), or ``factor x original`` where that is larger (Qwen's YaRN recipe leaves
``max_position_embeddings`` at the original); a ``factor`` alone multiplies ``max_position_embeddings``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slime_rl.core.config.errors import ConfigError
from slime_rl.core.config.schema import Config


@dataclass(frozen=True)
class ModelPositions:
    """How many token positions a model covers, and how it got there."""

    max_position_embeddings: int
    positions: int  # with the RoPE scaling of its config.json
    rope_type: str | None  # None: no scaling

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelPositions | None:
        """From an HF config.json's dict (its ``text_config`` for multimodal ones); None without positions."""
        hf = hf.get("text_config") or hf
        base = hf.get("max_position_embeddings")
        if not isinstance(base, int) or isinstance(base, bool) or base < 1:
            return None
        # transformers 5: rope_parameters holds the scaling; 4.x: rope_scaling
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
        factor = rope.get("factor") if isinstance(rope, dict) else None
        if rope_type in (None, "default") or not isinstance(factor, int | float) or factor <= 1:
            return cls(base, base, None)
        original = rope.get("original_max_position_embeddings")
        extended = max(base, int(factor * original)) if isinstance(original, int) else int(base * factor)
        return cls(base, extended, str(rope_type))

    @classmethod
    def of_folder(cls, folder: str | Path) -> ModelPositions | None:
        try:
            return cls.from_hf(json.loads((Path(folder) / "config.json").read_bytes()))
        except (OSError, ValueError, TypeError, AttributeError):
            return None


def asked_length(cfg: Config) -> int:
    """The longest sample the config allows: ``rollout.max_prompt_len`` (1 when unbounded: at least one
    prompt token) plus the longer of the rollout's and the eval's ``max_response_len``."""
    response = max(cfg.rollout.max_response_len, cfg.eval.max_response_len or 0)
    return (cfg.rollout.max_prompt_len or 1) + response


def check_positions(cfg: Config) -> ModelPositions | None:
    """Refuse (ConfigError on ``rollout.max_response_len``) a config asking for more tokens than the model
    has positions; the model's positions, or None when its config.json does not say."""
    model = ModelPositions.of_folder(cfg.model.path)
    if model is None:
        return None
    asked = asked_length(cfg)
    if asked <= model.positions:
        return model
    prompt = cfg.rollout.max_prompt_len
    parts = f"rollout.max_prompt_len {prompt:,} + " if prompt else "a prompt + "
    scaled = f" with its {model.rope_type} RoPE scaling" if model.rope_type else ""
    factor = -(-asked // model.max_position_embeddings)
    raise ConfigError("rollout.max_response_len", (
        f"{parts}max_response_len {asked - (prompt or 1):,} = {asked:,} tokens exceed the {model.positions:,}"
        f" positions of {cfg.model.path}{scaled}; shorten them, or extend the model's positions in its config.json"
        f' ("rope_scaling": {{"rope_type": "linear", "factor": {factor}}}, or a "llama3" scaling where the model'
        " was trained for it), which the trainer and the engines both read"))
