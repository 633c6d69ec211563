"""A throwaway installed distribution for tests of entry points: the ``.dist-info`` folder pip would write,
found by ``importlib.metadata`` once its folder is on ``sys.path`` (or ``PYTHONPATH`` for a subprocess)."""

from __future__ import annotations

from pathlib import Path


def write_distribution(folder: Path, name: str, version: str, entry_points: dict[str, dict[str, str]]) -> Path:
    """``<name>-<version>.dist-info`` in ``folder`` registering ``{group: {entry name: "module:attr"}}``."""
    info = folder / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    sections = [f"[{group}]\n" + "".join(f"{entry} = {target}\n" for entry, target in targets.items())
                for group, targets in entry_points.items()]
    (info / "entry_points.txt").write_text("\n".join(sections))
    return info
