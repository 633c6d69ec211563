"""Split a file into pieces that each fit one GPU call, and join them back, checked by sha256.

A GPU call carries at most 64 MiB and the bundles already fill two calls, so the SmolLM2 GGUF (98 MB) travels in
pieces, one folder per call (scripts/gpu/pack_smollm2.sh). Standard library only: the join runs on the GPU machine.

    python3 scripts/gpu/smol_pieces.py split FILE --piece-mb 40 --out .gpu --prefix smol --manifest M.json
    python3 scripts/gpu/smol_pieces.py join M.json --search /tmp/smol-pieces .gpu/smol-3 --to /tmp/x.gguf
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

CHUNK = 1 << 20


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


def split(source: Path, out: Path, prefix: str, piece_bytes: int) -> dict:
    """Write ``source`` as pieces ``out/<prefix>-<k>/<name>.part-<k>`` (k from 1), each at most ``piece_bytes``;
    returns the manifest (the whole file's and each piece's sha256) that join checks."""
    if piece_bytes <= 0:
        raise ValueError(f"--piece-mb: a piece must hold at least one byte, got {piece_bytes} bytes")
    size = source.stat().st_size
    pieces = []
    with open(source, "rb") as f:
        k = 0
        while data := f.read(piece_bytes):
            k += 1
            folder = out / f"{prefix}-{k}"
            folder.mkdir(parents=True, exist_ok=True)
            for stale in folder.glob(f"{source.name}.part-*"):  # an earlier pack with other piece sizes
                stale.unlink()
            piece = folder / f"{source.name}.part-{k}"
            piece.write_bytes(data)
            pieces.append({"name": piece.name, "folder": folder.name, "bytes": len(data),
                           "sha256": hashlib.sha256(data).hexdigest()})
    return {"file": source.name, "bytes": size, "sha256": sha256_of(source), "pieces": pieces}


def join(manifest: dict, search: list[Path], target: Path) -> Path:
    """Find every piece of ``manifest`` in the ``search`` folders, check each, write them in order to ``target``
    and check the whole file's sha256; a missing or damaged piece is an error naming it and where it was looked for."""
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".joining")
    with open(partial, "wb") as out:
        for piece in manifest["pieces"]:
            found = [d / piece["name"] for d in search if (d / piece["name"]).is_file()]
            if not found:
                partial.unlink()
                raise FileNotFoundError(f"piece {piece['name']} (carried as {piece['folder']}) is in none of "
                                        f"{', '.join(map(str, search))}: stash it with the call that carries it")
            data = found[0].read_bytes()
            if hashlib.sha256(data).hexdigest() != piece["sha256"]:
                partial.unlink()
                raise ValueError(f"{found[0]}: sha256 differs from the manifest's; carry {piece['folder']} again")
            out.write(data)
    digest = sha256_of(partial)
    if digest != manifest["sha256"]:
        partial.unlink()
        raise ValueError(f"{target}: joined sha256 {digest} != manifest {manifest['sha256']}")
    partial.rename(target)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("split")
    s.add_argument("source", type=Path)
    s.add_argument("--piece-mb", type=float, default=40.0, help="at most this many MB (10^6 bytes) a piece")
    s.add_argument("--out", type=Path, required=True, help="the pieces go to OUT/PREFIX-1, OUT/PREFIX-2, ...")
    s.add_argument("--prefix", default="smol")
    s.add_argument("--manifest", type=Path, required=True)
    j = sub.add_parser("join")
    j.add_argument("manifest", type=Path)
    j.add_argument("--search", type=Path, nargs="+", required=True, help="folders holding pieces")
    j.add_argument("--to", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.command == "split":
        manifest = split(args.source, args.out, args.prefix, int(args.piece_mb * 1e6))
        args.manifest.parent.mkdir(parents=True, exist_ok=True)
        args.manifest.write_text(json.dumps(manifest, indent=1) + "\n")
        for piece in manifest["pieces"]:
            print(f"{args.out / piece['folder'] / piece['name']}  {piece['bytes'] / 1e6:.1f} MB")
        print(f"{manifest['file']}: {manifest['bytes']} bytes, sha256 {manifest['sha256']}")
    else:
        try:
            target = join(json.loads(args.manifest.read_text()), args.search, args.to)
        except (OSError, ValueError) as err:
            print(f"error: {err}", file=sys.stderr)
            return 1
        print(f"joined {target} (sha256 checked)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
