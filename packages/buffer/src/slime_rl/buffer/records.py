"""Random access to the records of a prompt file, without loading the file.

JSONL: one streaming scan builds the byte offset of every line (8 bytes a line);
a record is read with one seek. Parquet: rows are read by row group, only the
columns asked for. Both answer ``read(ids)`` with one item per id: the record as
a dict, ``None`` for a blank line, or a :class:`DataError` for a bad one, so the
caller decides whether to raise or skip.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from slime_rl.core.run.data import DataError

SCAN_CHUNK_BYTES = 8 << 20  # bounds the scan's transient memory


# Deeper records are bad data: json parses up to ~1,000 levels, but copying, storing and pickling
# a sample recurse further (RecursionError mid-run). Tool schemas and chat messages need ~10.
MAX_NESTING = 100
SKIP_HINT = "fix the line or set data.skip_bad_lines=true"


def check_file(path: str | Path) -> Path:
    path = Path(path)
    if not path.exists():
        raise DataError(str(path), "file does not exist; set data.prompt_data to a JSONL or Parquet file of prompts")
    if not path.is_file():
        raise DataError(str(path), "is not a file; set data.prompt_data to a JSONL or Parquet file of prompts")
    return path


def scan_line_starts(path: Path) -> np.ndarray:
    """Byte offsets of every line start, plus the file size as a final sentinel (uint64).

    Streams the file in chunks, so memory is the offsets plus one chunk.
    """
    starts = [np.zeros(1, dtype=np.uint64)]
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(SCAN_CHUNK_BYTES):
            newlines = np.flatnonzero(np.frombuffer(chunk, dtype=np.uint8) == 0x0A)
            starts.append((newlines + (size + 1)).astype(np.uint64))
            size += len(chunk)
    offsets = np.concatenate(starts)
    if offsets[-1] != size:  # the last line has no trailing newline
        offsets = np.append(offsets, np.uint64(size))
    return offsets


def parse_jsonl_line(raw: bytes, where: Callable[[int], str], i: int) -> dict[str, Any] | DataError | None:
    """Line ``i`` of a JSONL file: the record, None for a blank line, or why it is bad (``where(i)``
    names it; called only then, to keep a pass over a large file cheap)."""
    if not raw.strip():
        return None
    try:
        # Decoding here, not in json.loads(bytes), halves the time of a pass (json sniffs the encoding in Python).
        text = raw.decode("utf-8").removeprefix("\ufeff")  # a BOM, which editors put before line 1
        record = json.loads(text)
    except RecursionError:
        return DataError(where(i), f"nested too deeply to parse (more than {MAX_NESTING} levels); {SKIP_HINT}")
    except ValueError as err:  # JSONDecodeError, not UTF-8, an integer of more than 4,300 digits
        reason = err.msg if isinstance(err, json.JSONDecodeError) else (
            "not UTF-8" if isinstance(err, UnicodeDecodeError) else str(err))
        return DataError(where(i), f"malformed JSON ({reason}); {SKIP_HINT}")
    if not isinstance(record, dict):
        return DataError(where(i), f"expected a JSON object per line, got {type(record).__name__}; {SKIP_HINT}")
    # Counting brackets is cheap and bounds the depth; only a line with many (also inside strings) is walked.
    if raw.count(b"[") + raw.count(b"{") > MAX_NESTING and nesting_depth(record) > MAX_NESTING:
        return DataError(where(i), f"nested more than {MAX_NESTING} levels deep; {SKIP_HINT}")
    # A \\ud800-\\udfff escape outside a pair decodes to a lone surrogate: not text (tokenizers raise TypeError).
    if (b"\\ud" in raw or b"\\uD" in raw) and not _is_text(record):
        return DataError(where(i), f"holds a lone UTF-16 surrogate escape (\\ud800-\\udfff outside a pair), which "
                                   f"is not text; {SKIP_HINT}")
    return record


def _is_text(record: dict[str, Any]) -> bool:
    try:
        json.dumps(record, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def nesting_depth(value: Any) -> int:
    """Levels of lists and dicts in ``value`` (a flat dict is 1), without recursing."""
    depth, stack = 0, [(value, 1)]
    while stack:
        node, level = stack.pop()
        if isinstance(node, dict | list):
            depth = max(depth, level)
            stack.extend((child, level + 1) for child in (node.values() if isinstance(node, dict) else node))
    return depth


class JsonlRecords:
    """A JSONL file as an array of records, addressed by 0-based line id."""

    def __init__(self, path: str | Path):
        self.path = check_file(path)
        self.offsets = scan_line_starts(self.path)  # len(self) + 1 entries
        self.file_size = int(self.offsets[-1])
        lengths = np.diff(self.offsets)
        self.num_nonblank = int(np.count_nonzero(lengths > 1))  # a blank line is just "\n"
        self._file = open(self.path, "rb")  # noqa: SIM115 - kept open for random reads, closed in close()

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def where(self, i: int) -> str:
        return f"{self.path}:{i + 1}"

    def read(self, ids: list[int]) -> list[dict[str, Any] | DataError | None]:
        size = os.fstat(self._file.fileno()).st_size
        if size != self.file_size:  # rewritten in place: the line offsets no longer hold
            raise DataError(str(self.path), f"changed while the run was reading it ({self.file_size} bytes at the "
                                            f"start, {size} now); restore it, or start a new run with the new file")
        out: list[dict[str, Any] | DataError | None] = []
        for i in ids:
            start, end = int(self.offsets[i]), int(self.offsets[i + 1])
            self._file.seek(start)
            raw = self._file.read(end - start)
            out.append(parse_jsonl_line(raw, self.where, i))
        return out

    def scan(self) -> Iterator[tuple[int, dict[str, Any] | DataError | None]]:
        """(line id, what `read` gives) for every line in file order, read sequentially."""
        with open(self.path, "rb") as f:
            for i, raw in enumerate(f):  # binary mode splits on b"\n" alone, as the offsets do
                yield i, parse_jsonl_line(raw, self.where, i)

    def close(self) -> None:
        self._file.close()


class ParquetRecords:
    """A Parquet file as an array of rows; reads only the row groups and columns needed."""

    def __init__(self, path: str | Path, columns: list[str]):
        import pyarrow.parquet as pq

        self.path = check_file(path)
        try:
            self._file = pq.ParquetFile(self.path)
        except Exception as err:  # pyarrow raises ArrowInvalid and friends
            raise DataError(str(self.path), f"cannot read as Parquet ({err}); give a JSONL or Parquet file") from None
        names = set(self._file.schema_arrow.names)
        self.columns = [c for c in columns if c in names]
        self.all_columns = sorted(names)
        meta = self._file.metadata
        self.file_size = os.path.getsize(self.path)
        sizes = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
        self.group_starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
        self.num_nonblank = int(self.group_starts[-1])

    def __len__(self) -> int:
        return int(self.group_starts[-1])

    def where(self, i: int) -> str:
        return f"{self.path}:row {i}"

    def read(self, ids: list[int]) -> list[dict[str, Any] | DataError | None]:
        import pyarrow as pa

        groups = np.searchsorted(self.group_starts, ids, side="right") - 1
        rows: dict[int, dict[str, Any]] = {}
        for g in np.unique(groups):
            wanted = [i for i, gi in zip(ids, groups, strict=True) if gi == g]
            local = pa.array([i - int(self.group_starts[g]) for i in wanted], type=pa.int64())
            table = self._file.read_row_group(int(g), columns=self.columns, use_threads=False).take(local)
            rows.update(zip(wanted, table.to_pylist(), strict=True))
        return [rows[i] for i in ids]

    def scan(self, batch_rows: int = 65536) -> Iterator[tuple[int, dict[str, Any] | DataError | None]]:
        """(row id, row) for every row in file order, a batch at a time."""
        i = 0
        for batch in self._file.iter_batches(batch_size=batch_rows, columns=self.columns, use_threads=False):
            for row in batch.to_pylist():
                yield i, row
                i += 1

    def close(self) -> None:
        self._file.close()


def open_records(path: str | Path, fmt: str | None, columns: list[str]) -> JsonlRecords | ParquetRecords:
    """``fmt`` None: by suffix (.parquet/.pq is Parquet, anything else JSONL)."""
    if fmt is None:
        fmt = "parquet" if Path(path).suffix.lower() in (".parquet", ".pq") else "jsonl"
    if fmt == "parquet":
        return ParquetRecords(path, columns)
    if fmt == "jsonl":
        return JsonlRecords(path)
    raise DataError("data.source", f"unknown prompt file format {fmt!r}; use jsonl or parquet")
