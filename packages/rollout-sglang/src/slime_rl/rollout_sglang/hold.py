"""Why an `SGLangEngine` holds generation and what its servers gave up: the state its memory calls, its
weight syncs (weights/engine_sync.py) and its recovery (recovery.py) each change, on the engine's event loop."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class GenerationHold:
    closed_by: set[str] = field(default_factory=set)  # why new requests wait: "sync", "memory"
    pause_epoch: int = 0  # grows with every pause; a request aborted by one continues
    servers_paused: bool = False  # a pause went out and no continue since: opening again sends one
    released: set[str] = field(default_factory=set)  # memory tags the servers released
    weights_stale: bool = False  # weights were released without a backup; restore before generating
    shut: bool = False  # the engine shut down: nothing generates or syncs again

    def close(self, reason: str) -> None:
        """Hold new requests for ``reason`` (the caller pauses those out: each continues after the hold)."""
        self.closed_by.add(reason)
        self.pause_epoch += 1
