"""`GroupStore`: groups of samples in one SQLite file that a SIGKILL cannot corrupt.

SQLite in WAL mode with ``synchronous=FULL``: a transaction is on disk when
``COMMIT`` returns, and a torn write at the end of the WAL fails its frame
checksum and is ignored on the next open, so a reader sees whole commits only.
Each group is one row (its samples, see encode_group) with a CRC32 of the payload as a
second line of defence against a damaged file. Several processes may share the
file: writers take the lock with ``BEGIN IMMEDIATE``.
"""

from __future__ import annotations

import dataclasses
import json
import sqlite3
import struct
import sys
import threading
import zlib
from array import array
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slime_rl.core.sample import Sample, SampleStatus

UNFINISHED = (SampleStatus.PENDING, SampleStatus.ABORTED)

SCHEMA = """
CREATE TABLE IF NOT EXISTS groups (
    id INTEGER PRIMARY KEY AUTOINCREMENT,  -- insertion order, never reused
    partial INTEGER NOT NULL,              -- 1: some sample is pending or aborted (to resume generating)
    min_version INTEGER NOT NULL,          -- oldest weight_version among samples with a response
    num_samples INTEGER NOT NULL,
    crc INTEGER NOT NULL,                  -- zlib.crc32 of payload
    payload BLOB NOT NULL                  -- encode_group(): JSON of the samples, then packed token arrays
);
CREATE INDEX IF NOT EXISTS groups_by_kind ON groups (partial, id);
CREATE INDEX IF NOT EXISTS groups_by_version ON groups (partial, min_version);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""

COMPACT_MIN_FREE_PAGES = 256


class StoreError(RuntimeError):
    """The buffer file is damaged or unreadable; the message names the file and the row."""


@dataclass
class StoredGroup:
    id: int
    samples: list[Sample]


def is_partial(group: list[Sample]) -> bool:
    return any(s.status in UNFINISHED for s in group)


SAMPLE_FIELDS = tuple(f.name for f in dataclasses.fields(Sample))
# Per-token lists are stored as packed arrays: JSON takes ~1.5 s to write and read
# back half a million tokens with their log-probs, packed arrays ~0.1 s.
PACKED = {"tokens": "i", "loss_mask": "i", "rollout_log_probs": "d", "old_log_probs": "d",
          "ref_log_probs": "d", "advantages": "d", "returns": "d", "values": "d"}
HEADER = struct.Struct("<I")  # byte length of the JSON part


def sample_record(sample: Sample) -> dict[str, Any]:
    """``Sample.to_dict()`` without its deep copy (json.dumps copies anyway; asdict is slow on long lists)."""
    record = {name: getattr(sample, name) for name in SAMPLE_FIELDS}
    record["status"] = SampleStatus(sample.status).value
    record["multimodal_train_inputs"] = None  # tensors derived from multimodal_inputs (Sample says so)
    return record


def encode_group(group: list[Sample]) -> bytes:
    """JSON of the samples with their per-token lists moved to packed little-endian arrays after it."""
    records, arrays = [], []
    for sample in group:
        record = sample_record(sample)
        packed = {}
        for name, code in PACKED.items():
            try:
                values = array(code, record[name])
            except (TypeError, OverflowError):  # unusual contents stay in the JSON part
                continue
            if sys.byteorder == "big":
                values.byteswap()
            packed[name] = len(values)
            arrays.append(values.tobytes())
            del record[name]
        record["_packed"] = packed
        records.append(record)
    try:
        header = json.dumps(records, separators=(",", ":")).encode()
    except (TypeError, ValueError) as err:
        raise TypeError(f"group {group[0].group_index}: samples must hold JSON-serialisable labels and "
                        f"metadata to be stored ({err})") from None
    return HEADER.pack(len(header)) + header + b"".join(arrays)


def decode_group(payload: bytes) -> list[Sample]:
    (header_len,) = HEADER.unpack_from(payload)
    offset = HEADER.size + header_len
    samples = []
    for record in json.loads(payload[HEADER.size:offset]):
        for name, count in record.pop("_packed").items():
            values = array(PACKED[name])
            end = offset + count * values.itemsize
            values.frombytes(payload[offset:end])
            if sys.byteorder == "big":
                values.byteswap()
            record[name], offset = values.tolist(), end
        record["status"] = SampleStatus(record["status"])
        samples.append(Sample(**record))  # Sample.from_dict's field check costs as much as the decode
    if offset != len(payload):
        raise ValueError(f"{len(payload) - offset} bytes left after the last sample")
    return samples


def group_min_version(group: list[Sample]) -> int:
    versions = [s.weight_version for s in group if s.response_length > 0]
    return min(versions) if versions else min(s.weight_version for s in group)


class GroupStore:
    """One table of groups plus a small key-value table (states, counters). ``path=None``: in memory."""

    def __init__(self, path: str | Path | None):
        self.path = Path(path) if path is not None else None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._conn = sqlite3.connect(str(self.path) if self.path else ":memory:", timeout=60,
                                         isolation_level=None, check_same_thread=False)
            self._conn.execute("PRAGMA auto_vacuum=INCREMENTAL")  # takes effect only on a new file
            if self.path is not None:
                self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=FULL")
            self._conn.execute("PRAGMA journal_size_limit=67108864")  # trim the WAL back to 64 MB after checkpoints
            self._conn.executescript(SCHEMA)
        except sqlite3.DatabaseError as err:
            raise StoreError(f"{self.path}: not a usable buffer file ({err}); move it away to start empty") from None
        self._lock = threading.RLock()

    @contextmanager
    def transaction(self) -> Iterator[None]:
        """All-or-nothing: committed (durably) on exit, rolled back on an exception."""
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                yield
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")

    def insert(self, groups: list[list[Sample]]) -> None:
        rows = []
        for group in groups:
            payload = encode_group(group)
            rows.append((int(is_partial(group)), group_min_version(group), len(group), zlib.crc32(payload), payload))
        self._conn.executemany(
            "INSERT INTO groups (partial, min_version, num_samples, crc, payload) VALUES (?, ?, ?, ?, ?)", rows)

    def replace(self, group_id: int, group: list[Sample]) -> None:
        payload = encode_group(group)
        self._conn.execute("UPDATE groups SET min_version = ?, num_samples = ?, crc = ?, payload = ? WHERE id = ?",
                           (group_min_version(group), len(group), zlib.crc32(payload), payload, group_id))

    def select(self, *, partial: bool | None = None, limit: int | None = None,
               min_version_below: int | None = None) -> list[StoredGroup]:
        """Groups in insertion order; ``partial`` None: both kinds."""
        where, args = [], []
        if partial is not None:
            where.append("partial = ?")
            args.append(int(partial))
        if min_version_below is not None:
            where.append("min_version < ?")
            args.append(min_version_below)
        sql = "SELECT id, crc, payload FROM groups"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY id"
        if limit is not None:
            sql += " LIMIT ?"
            args.append(limit)
        with self._lock:
            rows = self._conn.execute(sql, args).fetchall()
        return [StoredGroup(row_id, self._decode(row_id, crc, payload)) for row_id, crc, payload in rows]

    def _decode(self, row_id: int, crc: int, payload: bytes) -> list[Sample]:
        if zlib.crc32(payload) != crc:
            raise StoreError(f"{self.path}: group row {row_id} fails its checksum; the file is damaged")
        try:
            return decode_group(payload)
        except (TypeError, ValueError, KeyError, struct.error) as err:
            raise StoreError(f"{self.path}: group row {row_id} cannot be decoded ({err}); "
                             "was it written by another slime-rl version?") from None

    def delete(self, ids: list[int]) -> None:
        self._conn.executemany("DELETE FROM groups WHERE id = ?", [(i,) for i in ids])

    def delete_all(self) -> None:
        self._conn.execute("DELETE FROM groups")
        self._conn.execute("DELETE FROM meta")

    def count(self, *, partial: bool | None = None) -> int:
        with self._lock:
            if partial is None:
                return self._conn.execute("SELECT COUNT(*) FROM groups").fetchone()[0]
            return self._conn.execute("SELECT COUNT(*) FROM groups WHERE partial = ?", (int(partial),)).fetchone()[0]

    def get_meta(self, key: str) -> Any:
        with self._lock:
            row = self._conn.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else json.loads(row[0])

    def all_meta(self) -> dict[str, Any]:
        with self._lock:
            return {k: json.loads(v) for k, v in self._conn.execute("SELECT key, value FROM meta ORDER BY key")}

    def put_meta(self, key: str, value: Any) -> None:
        self._conn.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, json.dumps(value)))

    def maybe_compact(self) -> None:
        """Give free pages back to the file system once they are over half the file."""
        with self._lock:
            free = self._conn.execute("PRAGMA freelist_count").fetchone()[0]
            total = self._conn.execute("PRAGMA page_count").fetchone()[0]
            if free >= COMPACT_MIN_FREE_PAGES and 2 * free > total:
                self._conn.executescript("PRAGMA incremental_vacuum;")  # execute() would free one page only

    def compact(self) -> None:
        """Fold the WAL into the main file, truncate it, and rebuild the file without free pages."""
        with self._lock:
            self._conn.execute("VACUUM")
            if self.path is not None:
                self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    def file_bytes(self) -> int:
        if self.path is None:
            return 0
        wal = self.path.with_name(self.path.name + "-wal")
        return self.path.stat().st_size + (wal.stat().st_size if wal.exists() else 0)

    def close(self) -> None:
        with self._lock:
            self._conn.close()
