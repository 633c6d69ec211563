"""Whether a checkpoint folder holds every file it needs to load: checked by `checkpoint.commit` before
it writes ``meta.json`` (a save that lost a file is never committed: two runs sharing a save_dir once
committed a step without its ``.metadata`` index, because the other run had renamed it), and by
`checkpoint.verify` before a resume loads one (meta.json's checksums vouch only for the files it lists).

What a folder needs: each folder the run saved into (``needs``: the trainer's, the critic's); in
every torch distributed checkpoint (a folder with ``*.distcp`` shards) its ``.metadata`` index; and
every file that index names (each rank's shard)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path


def missing_files(folder: Path, needs: Iterable[str] = ()) -> list[str]:
    """What ``folder`` lacks of the above, as paths relative to it; [] when complete."""
    missing = [name for name in needs if not (folder / name).is_dir()]  # what is in it is the trainer's format
    for dcp in sorted({shard.parent for shard in folder.rglob("*.distcp")} | {m.parent for m in folder.rglob(".metadata")}):
        index = dcp / ".metadata"
        if not index.is_file():
            missing.append((index.relative_to(folder)).as_posix())
            continue
        missing += [(dcp / name).relative_to(folder).as_posix() for name in sorted(_indexed_files(index))
                    if not (dcp / name).is_file()]
    return missing


def _indexed_files(index: Path) -> set[str]:
    """The files a ``.metadata`` index reads its items from (read with `safe_pickle`: no code runs); none
    when it cannot be read so: whether it is safe and sound is `safe_pickle.check_dcp_folder`'s to say."""
    from slime_rl.core.config import CheckpointError
    from slime_rl.core.infra.safe_pickle import load_dcp_metadata  # torch: only where a checkpoint is

    try:
        metadata = load_dcp_metadata(index)
    except CheckpointError:
        return set()
    return {str(rel) for info in metadata.storage_data.values() if (rel := getattr(info, "relative_path", None))}
