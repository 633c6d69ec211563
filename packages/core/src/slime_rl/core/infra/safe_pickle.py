"""Reading the pickles of a torch distributed checkpoint without running code from them.

torch.distributed.checkpoint (Megatron's ``torch_dist`` format) keeps its index in
``.metadata``, a plain pickle, and every non-tensor item (Megatron's ShardedObjects:
the trainer's RNG state, and on megatron-core 0.19 the common state) as a
``torch.save`` blob that its load planner reads back with
``torch.load(weights_only=False)``; megatron-core 0.16 also reads ``common.pt``. A
pickle can run any code when loaded, and checkpoints are passed around.

`check_dcp_folder` reads each of them first: the index with an unpickler that knows
only the classes such an index holds, every byte item and ``.pt`` file with torch's
weights-only unpickler (tensors and plain containers). A folder where anything asks
for more is refused, so what torch and Megatron unpickle afterwards is plain data.
Tensor items torch reads weights-only itself; `refusals_named` gives its refusal our
message (torch's own advises turning the check off).
"""

from __future__ import annotations

import contextlib
import io
import pickle
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from slime_rl.core.config import CheckpointError

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
# What torch's FileSystemWriter and Megatron's planner put in ``.metadata`` (seen with torch 2.13 and
# megatron-core 0.16.1 and 0.19.2): the index dataclasses, sizes, dtypes, layouts and the path it
# was saved to. Constructing any of them runs no code from the file.
_METADATA_GLOBALS = {
    *((_DCP_METADATA, name) for name in ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                                         "TensorStorageMetadata", "ChunkStorageMetadata", "BytesStorageMetadata",
                                         "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    *((module, name) for module in ("pathlib", "pathlib._local") for name in ("PosixPath", "PurePosixPath")),
}
_REFUSED = re.compile(r"GLOBAL ([\w.]+)")  # "Unsupported global: GLOBAL x", "unsupported GLOBAL x whose module"
_UNTRUSTED = ("; nothing from it was loaded. The checkpoint was not written by slime-rl or was altered"
              " after it was written: resume from a checkpoint you trust")


class _Refused(Exception):
    def __init__(self, name: str):
        self.name = name


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        allowed = (module, name) in _METADATA_GLOBALS or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))
        if not allowed:
            raise _Refused(f"{module}.{name}")
        return super().find_class(module, name)

    def persistent_load(self, pid: Any) -> Any:
        raise _Refused("a persistent id")


def load_dcp_metadata(path: Path) -> Any:
    """The ``torch.distributed.checkpoint.Metadata`` in ``path``, unpickled with only its own classes."""
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        with path.open("rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except _Refused as refused:
        raise CheckpointError(str(path), f"refused: unpickling it would call {refused.name}, which a checkpoint"
                              f" index never holds{_UNTRUSTED}") from None
    except Exception as err:  # a damaged pickle: nothing of it ran, only the classes above were made
        raise CheckpointError(str(path), f"is damaged: not a checkpoint index ({type(err).__name__}); resume from"
                              " another checkpoint") from None
    if not (isinstance(metadata, Metadata) and isinstance(metadata.state_dict_metadata, dict)
            and isinstance(metadata.storage_data, dict)):
        raise CheckpointError(str(path), f"is damaged: holds a {type(metadata).__name__}, not a checkpoint index")
    return metadata


def load_plain(source: Path | io.BytesIO, where: str) -> Any:
    """``torch.load`` with the weights-only unpickler; CheckpointError naming ``where`` if it refuses."""
    try:
        return torch.load(source, map_location="cpu", weights_only=True)
    except Exception as err:  # UnpicklingError when refused, RuntimeError/EOFError when damaged
        raise _refusal(err, where) or CheckpointError(
            where, f"is damaged ({type(err).__name__}); resume from another checkpoint") from None


@contextlib.contextmanager
def refusals_named(where: str) -> Iterator[None]:
    """Around a loader that reads tensor items with torch's weights-only unpickler (torch's
    FileSystemReader does; `check_dcp_folder` leaves those items to it): a refusal becomes a
    CheckpointError naming ``where``, without torch's advice to turn the check off."""
    try:
        yield
    except BaseException as err:  # torch's CheckpointException, which wraps each rank's, is a BaseException
        refused = _refusal(err, where)
        if refused is None:
            raise
        raise refused from None


def _refusal(err: BaseException, where: str) -> CheckpointError | None:
    """The CheckpointError for torch's weights-only unpickler refusing something, else None.
    torch's own message is dropped: it suggests turning the check off."""
    text = str(err)
    if not (isinstance(err, pickle.UnpicklingError) or "weights_only" in text or "Weights only load failed" in text):
        return None
    refused = _REFUSED.search(text)
    what = (f"unpickling it would call {refused.group(1)}, which a checkpoint never needs" if refused
            else "it holds more than tensors and plain data")
    return CheckpointError(where, f"refused: {what}{_UNTRUSTED}")


def check_dcp_folder(folder: Path) -> None:
    """Read every pickle of the torch distributed checkpoint in ``folder`` safely (see the module
    docstring); CheckpointError naming the file (and item) that asks for more than plain data."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    folder = Path(folder)
    for metadata_file in sorted({folder / ".metadata", *folder.glob("*.metadata")}):  # also per-rank ones
        metadata = load_dcp_metadata(metadata_file)
        byte_items: dict[str, list[tuple[str, Any]]] = {}
        for index, info in metadata.storage_data.items():
            rel = Path(getattr(info, "relative_path", ""))
            if rel.name != str(rel) or rel.name in ("", ".", ".."):  # DCP reads the files this names
                raise CheckpointError(str(metadata_file), f"points outside its folder ({str(rel)[:60]!r}){_UNTRUSTED}")
            if isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
                if getattr(info, "transform_descriptors", None):  # compressed: not what slime-rl writes
                    raise CheckpointError(f"{folder / rel} (item {index.fqn})",
                                          f"uses storage transforms {info.transform_descriptors}{_UNTRUSTED}")
                byte_items.setdefault(rel.name, []).append((index.fqn, info))
        for name, items in byte_items.items():
            if not (folder / name).is_file():
                raise CheckpointError(str(folder / name), "is missing from the checkpoint; resume from another one")
            with (folder / name).open("rb") as f:
                for fqn, info in items:
                    f.seek(info.offset)
                    blob = f.read(info.length)
                    where = f"{folder / name} (item {fqn})"
                    if len(blob) != info.length:
                        raise CheckpointError(where, "is damaged: the file is shorter than its index says")
                    load_plain(io.BytesIO(blob), where)
    for pt_file in sorted(folder.glob("*.pt")):
        load_plain(pt_file, str(pt_file))
