"""`RecordingEngine`: any rollout engine, with every call written to a JSONL file for debugging.

Select it in a run's config; its own keys are ``rollout.recording`` (settings.py, checked when the config
loads), and the engine it wraps is named like any other (an entry-point name or ``module:attr``) and reads its
own section as usual::

    rollout:
      engine: recording
      recording:
        record_inner: hf                  # the engine to wrap (default: hf)
        record_to: runs/x/requests.jsonl  # default: <logging.dir>/rollout_records.jsonl
      hf:
        max_batch_size: 64                # the wrapped engine's own keys

One JSON object a line, with an ``event`` field: ``generate`` (request id, input ids, sampling
parameters, then the response's token ids, log-probs, finish reason, weight version and seconds, or
the error it raised), ``abort``, ``update_weights`` (version, tensor names, last) and memory calls.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from recording_engine.settings import RecordingSettings
from slime_rl.core.contracts import GenerateOutput, NamedTensors, RolloutEngine, SamplingParams
from slime_rl.core.infra.plugins import load_plugin

if TYPE_CHECKING:
    from slime_rl.core.config import Config

class RecordingEngine(RolloutEngine):
    """Delegates every call to ``inner`` and appends a record of it to ``path``. Its optional capabilities
    are the wrapped engine's (set per instance); the class claims none of its own."""

    settings = RecordingSettings  # rollout.recording

    def __init__(self, inner: RolloutEngine, path: str | Path):
        self.inner = inner
        self.capabilities = inner.capabilities  # type: ignore[misc]  # what it forwards is what it has
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", buffering=1)  # one line a record, flushed as written

    @classmethod
    def from_config(cls, cfg: Config) -> RecordingEngine:
        settings = cfg.rollout.settings_of(RecordingSettings, "recording")
        path = settings.record_to or Path(cfg.logging.dir) / "rollout_records.jsonl"
        # the wrapped engine, chosen: it reads its own section (rollout.hf), checked with the config already
        inner_cfg = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"engine": settings.record_inner})})
        inner = load_plugin("slime_rl.rollout_engines", settings.record_inner).from_config(inner_cfg)
        return cls(inner, path)

    def _record(self, event: str, **fields: Any) -> None:
        if not self._file.closed:
            self._file.write(json.dumps({"event": event, "time": time.time(), **fields}) + "\n")

    # ------------------------------------------------------------------ the contract, recorded

    async def generate(self, input_ids: list[int], params: SamplingParams,
                       request_id: str | None = None) -> GenerateOutput:
        request = {"request_id": request_id, "input_ids": list(input_ids), "params": dataclasses.asdict(params)}
        start = time.perf_counter()
        try:
            out = await self.inner.generate(input_ids, params, request_id)
        except BaseException as err:  # a refused or cancelled request is worth a record too
            self._record("generate", **request, error=f"{type(err).__name__}: {err}",
                         seconds=time.perf_counter() - start)
            raise
        self._record("generate", **request, token_ids=out.token_ids, log_probs=out.log_probs,
                     finish_reason=out.finish_reason, weight_version=out.weight_version,
                     seconds=time.perf_counter() - start)
        return out

    async def abort(self, request_id: str | None = None) -> None:
        self._record("abort", request_id=request_id)
        await self.inner.abort(request_id)

    async def update_weights(self, named_tensors: NamedTensors, *, version: int, last: bool) -> None:
        self._record("update_weights", version=version, last=last, names=[name for name, _ in named_tensors])
        await self.inner.update_weights(named_tensors, version=version, last=last)

    @property
    def weight_version(self) -> int:
        return self.inner.weight_version

    async def pause_generation(self) -> bool:
        paused = await self.inner.pause_generation()
        self._record("pause_generation", paused=paused)
        return paused

    async def continue_generation(self) -> None:
        self._record("continue_generation")
        await self.inner.continue_generation()

    async def release_memory(self) -> None:
        self._record("release_memory")
        await self.inner.release_memory()

    async def resume_memory(self, tags: list[str] | None = None) -> None:
        self._record("resume_memory", tags=tags)
        await self.inner.resume_memory(tags)

    async def health(self) -> bool:
        return await self.inner.health()

    def stats(self) -> dict[str, float]:
        return self.inner.stats()

    async def shutdown(self) -> None:
        await self.inner.shutdown()
        if not self._file.closed:
            self._record("shutdown")
            self._file.close()
