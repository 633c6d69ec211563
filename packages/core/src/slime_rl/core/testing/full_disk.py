"""A disk that fills during a torch.distributed.checkpoint save, for the tests of each trainer's checkpoint path:
torch's file streams take ``room`` more bytes, then a write past it writes what fits and raises ENOSPC, as
write(2) does. Patched at torch's lowest file hook (``FileSystem.create_stream``)."""

from __future__ import annotations

import contextlib
import errno


class DiskThatFills:
    def __init__(self, room: int):
        self.room = room

    def patch(self, monkeypatch) -> None:
        """Through ``monkeypatch`` (pytest's), until the test ends or ``monkeypatch.undo()``."""
        from torch.distributed.checkpoint.filesystem import FileSystem

        real = FileSystem.create_stream

        @contextlib.contextmanager
        def create_stream(fs, path, mode):
            with real(fs, path, mode) as stream:
                yield _FillingStream(stream, self)

        monkeypatch.setattr(FileSystem, "create_stream", create_stream)


class _FillingStream:
    def __init__(self, stream, disk: DiskThatFills):
        self._stream, self._disk = stream, disk

    def write(self, data) -> int:
        size = memoryview(data).nbytes
        if size > self._disk.room:
            self._stream.write(memoryview(data).cast("B")[:self._disk.room])
            self._disk.room = 0
            raise OSError(errno.ENOSPC, "No space left on device")
        self._disk.room -= size
        return self._stream.write(data)

    def __getattr__(self, name):
        return getattr(self._stream, name)
