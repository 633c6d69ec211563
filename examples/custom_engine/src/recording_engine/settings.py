"""``rollout.recording``: this engine's typed config keys, checked by slime-rl when the config loads.

Light on purpose (pydantic and slime_rl.core.config only): pyproject.toml registers this model under the entry
point group ``slime_rl.rollout_engines.settings``, so ``slime-cli`` checks the keys without importing the
engine (torch). Without that entry point slime-rl would import the engine class and read its ``settings``.
"""

from __future__ import annotations

from pydantic import Field, field_validator

from slime_rl.core.config import BackendSettings


class RecordingSettings(BackendSettings):
    """Wraps another engine and records every call of it to a JSONL file."""

    record_inner: str = Field("hf", description=(
        "the engine to wrap: an entry-point name or `module:attr`; its own keys stay in its section"
        " (`rollout.hf`)"))
    record_to: str | None = Field(None, description="the JSONL file; `null`: `<logging.dir>/rollout_records.jsonl`")

    @field_validator("record_inner")
    @classmethod
    def _not_itself(cls, name: str) -> str:
        if name == "recording":
            raise ValueError("'recording' would record itself; name the engine to wrap (hf, sglang or module:attr)")
        return name
