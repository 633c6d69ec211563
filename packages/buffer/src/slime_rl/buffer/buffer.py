"""`SampleBuffer`: a durable, group-aware buffer between rollout and training.

It holds two kinds of groups, told apart by sample status:
- finished groups (every sample completed, truncated or failed), which
  ``take()`` hands to the trainer, oldest first or as a buffer filter chooses;
- partial groups (some sample pending or aborted: a rollout cut short), which
  ``take(partial=True)`` hands back to the rollout side to resume, with the
  tokens generated so far and the weight version they came from.

With ``max_staleness`` and a ``current_version``, a sample is stale when
``current_version - sample.weight_version > max_staleness``. Policy ``"drop"``
deletes stale finished samples for good (and restarts stale partial ones from
their prompt); ``"downweight"`` and ``"mask"`` hand them out with
``metadata["loss_weight"] = (max_staleness + 1) / (staleness + 1)``, and the rollout worker
weighs or masks their stale tokens (core/staleness.py).

Every ``add`` is committed to SQLite before it returns (see store.py).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from slime_rl.buffer.store import UNFINISHED, GroupStore, is_partial
from slime_rl.core.algorithms.filters import BUFFER_FILTERS
from slime_rl.core.contracts import Buffer, BufferFilter
from slime_rl.core.infra.plugins import load_function
from slime_rl.core.sample import Sample

if TYPE_CHECKING:
    from slime_rl.core.config import Config

logger = logging.getLogger(__name__)

StalenessPolicy = Literal["drop", "mask", "downweight"]
DB_FILE = "buffer.sqlite"
DB_SUFFIXES = (".sqlite", ".sqlite3", ".db")
STATS = ("added_groups", "taken_groups", "dropped_stale_samples", "restarted_stale_samples")


class SampleBuffer(Buffer):
    """See the module docstring. ``path``: a directory (holding ``buffer.sqlite``),
    a ``.sqlite``/``.db`` file, or None for a buffer in memory only."""

    def __init__(
        self,
        path: str | Path | None = None,
        *,
        max_staleness: int | None = None,
        staleness_policy: StalenessPolicy = "drop",
        filter: str | BufferFilter | None = None,
        partial_rollout: bool = True,
    ):
        if staleness_policy not in ("drop", "mask", "downweight"):
            raise ValueError(f"staleness_policy: {staleness_policy!r} is not one of drop, mask, downweight")
        if max_staleness is not None and max_staleness < 0:
            raise ValueError(f"max_staleness: must be >= 0, got {max_staleness}")
        self.db_path = _db_path(path)
        self.max_staleness = max_staleness
        self.staleness_policy = staleness_policy
        self.filter_spec = filter
        self.filter: BufferFilter | None = (
            load_function(filter, BUFFER_FILTERS, what="buffer filter") if isinstance(filter, str) else filter)
        self.partial_rollout = partial_rollout
        self.store = GroupStore(self.db_path)
        held = len(self)
        if held:
            logger.info("%s: resumed with %d groups (%d partial)", self.db_path, held, self.num_partial)

    @classmethod
    def from_config(cls, cfg: Config, directory: str | Path | None = None) -> SampleBuffer:
        """``directory`` None: in memory (nothing survives the process)."""
        r = cfg.rollout
        return cls(
            directory,
            max_staleness=r.max_staleness,
            staleness_policy=r.staleness_policy,
            filter=r.buffer_filter,
            partial_rollout=r.partial_rollout,
        )

    # ---------------------------------------------------------------- contract

    def add(self, groups: list[list[Sample]], *, states: dict[str, dict[str, Any]] | None = None) -> None:
        """Store groups durably: when this returns they survive a SIGKILL.

        ``states`` (e.g. ``{"data_source": source.state_dict()}``) are committed in
        the same transaction, so the stored position never disagrees with the groups.
        """
        for group in groups:
            if not group or not all(isinstance(s, Sample) for s in group):
                raise TypeError("add() takes a list of groups, each a non-empty list of Sample")
        if not self.partial_rollout:  # without partial rollout, a cut-short sample starts over
            for group in groups:
                for s in group:
                    if s.status in UNFINISHED and s.response_length:
                        s.reset_to_prompt()
        with self.store.transaction():
            self.store.insert(groups)
            self._bump(added_groups=len(groups))
            for name, state in (states or {}).items():
                self.store.put_meta(f"state:{name}", state)

    def take(self, num_groups: int, *, current_version: int | None = None, partial: bool = False) -> list[list[Sample]]:
        """Remove and return up to ``num_groups`` finished groups (``partial=True``: partial groups)."""
        if num_groups <= 0:
            return []
        dropping = self.staleness_policy == "drop" and self.max_staleness is not None and current_version is not None
        with self.store.transaction():
            if dropping and not partial:
                self._drop_stale_finished(current_version - self.max_staleness)
            # Without a filter, FIFO needs only the first rows; a filter sees every candidate.
            candidates = self.store.select(partial=partial, limit=None if self.filter else num_groups)
            chosen = self._choose(candidates, num_groups)
            self.store.delete([c.id for c in chosen])
            self._bump(taken_groups=len(chosen))
            groups = [c.samples for c in chosen]
            if partial and dropping:
                self._bump(restarted_stale_samples=self._restart_stale(groups, current_version))
        if current_version is not None and not partial:
            self._annotate_staleness(groups, current_version)
        self.store.maybe_compact()
        return groups

    def __len__(self) -> int:
        return self.store.count()

    def state_dict(self) -> dict[str, Any]:
        """A full snapshot (groups, stored states, counters), for checkpoints."""
        with self.store.transaction():  # one consistent view
            groups = [[s.to_dict() for s in g.samples] for g in self.store.select()]
            meta = self.store.all_meta()
        return {"format": 1, "groups": groups, "meta": meta}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace everything held with a snapshot from :meth:`state_dict`."""
        if state.get("format") != 1:
            raise ValueError(f"buffer state format {state.get('format')!r} is not 1; was it saved by SampleBuffer?")
        groups = [[Sample.from_dict(d) for d in g] for g in state["groups"]]
        with self.store.transaction():
            self.store.delete_all()
            self.store.insert(groups)
            for key, value in state["meta"].items():
                self.store.put_meta(key, value)

    # ---------------------------------------------------------------- more

    @property
    def num_partial(self) -> int:
        return self.store.count(partial=True)

    @property
    def num_finished(self) -> int:
        return self.store.count(partial=False)

    @property
    def stats(self) -> dict[str, int]:
        """Counters since the buffer file was created: added/taken groups, dropped/restarted stale samples."""
        saved = self.store.get_meta("stats") or {}
        return {k: saved.get(k, 0) for k in STATS}

    def put_state(self, name: str, state: dict[str, Any]) -> None:
        """Store a component's state (say the data source's) durably, by name."""
        with self.store.transaction():
            self.store.put_meta(f"state:{name}", state)

    def get_state(self, name: str) -> dict[str, Any] | None:
        return self.store.get_meta(f"state:{name}")

    def compact(self) -> None:
        """Shrink the file to what it holds (also done incrementally by take)."""
        self.store.compact()

    def close(self) -> None:
        self.store.close()

    def __enter__(self) -> SampleBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        """Pickles as its settings (for Ray): the other process opens the same file."""
        if self.db_path is None:
            raise TypeError("an in-memory SampleBuffer cannot be sent to another process; give it a path")
        return {"path": self.db_path, "max_staleness": self.max_staleness,
                "staleness_policy": self.staleness_policy, "filter": self.filter_spec,
                "partial_rollout": self.partial_rollout}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state.pop("path"), **state)

    # ---------------------------------------------------------------- internals

    def _choose(self, candidates: list, num_groups: int) -> list:
        if self.filter is None:
            return candidates[:num_groups]
        picks = list(self.filter([c.samples for c in candidates], num_groups))
        if len(set(picks)) != len(picks) or len(picks) > num_groups or any(
                not isinstance(p, int) or not 0 <= p < len(candidates) for p in picks):
            raise ValueError(f"buffer filter {self.filter_spec!r} must return at most {num_groups} distinct "
                             f"positions in 0..{len(candidates) - 1}, got {picks[:10]}")
        return [candidates[p] for p in picks]

    def _drop_stale_finished(self, oldest_fresh_version: int) -> None:
        """Delete every finished sample with weight_version < oldest_fresh_version."""
        dropped = 0
        for g in self.store.select(partial=False, min_version_below=oldest_fresh_version):
            fresh = [s for s in g.samples if s.weight_version >= oldest_fresh_version]
            dropped += len(g.samples) - len(fresh)
            if fresh:
                self.store.replace(g.id, fresh)
            else:
                self.store.delete([g.id])
        if dropped:
            logger.info("buffer: dropped %d samples older than version %d (max_staleness=%d)",
                        dropped, oldest_fresh_version, self.max_staleness)
            self._bump(dropped_stale_samples=dropped)

    def _restart_stale(self, groups: list[list[Sample]], current_version: int) -> int:
        restarted = 0
        for group in groups:
            for s in group:
                if s.response_length and current_version - s.weight_version > self.max_staleness:
                    s.reset_to_prompt(current_version)
                    restarted += 1
        return restarted

    def _annotate_staleness(self, groups: list[list[Sample]], current_version: int) -> None:
        for group in groups:
            for s in group:
                staleness = current_version - s.weight_version
                s.metadata["staleness"] = staleness
                if self.max_staleness is not None and staleness > self.max_staleness:  # downweight policy
                    s.metadata["loss_weight"] = (self.max_staleness + 1) / (staleness + 1)

    def _bump(self, **deltas: int) -> None:
        """Add to the persistent counters (inside the caller's transaction)."""
        stats = self.store.get_meta("stats") or {}
        for key, delta in deltas.items():
            stats[key] = stats.get(key, 0) + delta
        self.store.put_meta("stats", stats)


def _db_path(path: str | Path | None) -> Path | None:
    if path is None:
        return None
    path = Path(path)
    return path if path.suffix in DB_SUFFIXES else path / DB_FILE


__all__ = ["SampleBuffer", "is_partial"]
