"""TEST DOUBLE (CPU tests only): what stands between a request and SGLang 0.5.17's scheduler, for the
stand-in server (server.py).

In SGLang's TokenizerManager (managers/tokenizer_manager.py ``generate_request``) a request first waits
while generation is paused (``is_pause_cond``), then holds ``model_update_lock`` as a reader for as long as
it runs; a weight update while not paused takes that lock as the writer (so it waits for every running
request to end, and new requests wait for it), while paused it goes ahead at once
(tokenizer_control_mixin.py ``update_weights_from_tensor``). An abort that lands before the request is in
the model (aborted while waiting at the pause) is answered HTTP 499 ``Request <rid> was aborted``
(``RequestAbortedError``), not a finished response.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class RequestAborted(Exception):
    """SGLang's RequestAbortedError: HTTP 499 with ``{"error": {"message": "Request <rid> was aborted"}}``."""

    status = 499

    def __init__(self, rid: str):
        super().__init__(rid)  # the rid alone, so a pickled copy rebuilds the same message
        self.rid = rid

    def __str__(self) -> str:
        return f"Request {self.rid} was aborted"


class ModelGate:
    """The pause and the model-update lock of one stand-in server."""

    def __init__(self) -> None:
        self.paused = False
        self.in_model: set[str] = set()  # readers: requests past the pause, running or held in place
        self._writer_active = False
        self._writers_waiting = 0
        self._changed = asyncio.Condition()

    async def enter(self, rid: str, aborted: asyncio.Event) -> None:
        """Wait out a pause and any weight update, then count the request in the model."""
        async with self._changed:
            await self._changed.wait_for(lambda: not self.paused)
        if aborted.is_set():  # SGLang's _raise_if_logical_request_aborted after the pause
            raise RequestAborted(rid)
        async with self._changed:
            await self._changed.wait_for(lambda: not self._writer_active and not self._writers_waiting)
            if aborted.is_set():  # and again under the lock
                raise RequestAborted(rid)
            self.in_model.add(rid)

    async def leave(self, rid: str) -> None:
        async with self._changed:
            self.in_model.discard(rid)
            self._changed.notify_all()

    async def set_paused(self, paused: bool) -> None:
        async with self._changed:
            self.paused = paused
            self._changed.notify_all()

    @contextlib.asynccontextmanager
    async def weight_update(self) -> AsyncIterator[None]:
        """SGLang's writer lock around a weight update, skipped while paused (held requests stay in)."""
        if self.paused:
            yield
            return
        async with self._changed:
            self._writers_waiting += 1
            try:
                await self._changed.wait_for(lambda: not self.in_model and not self._writer_active)
            finally:
                self._writers_waiting -= 1
            self._writer_active = True
        try:
            yield
        finally:
            async with self._changed:
                self._writer_active = False
                self._changed.notify_all()
