"""A full disk during a save of several ranks: torch.distributed.checkpoint hands a rank's error to every rank
pickled, and pickling drops the OSError that torch's own error ("enforce fail ... unexpected pos") holds only in
its context, so the trainer's writer says "no space" on the rank that hit it, before the trip."""

from __future__ import annotations

import pickle
import warnings

import pytest
import torch
from torch.distributed.checkpoint import FileSystemWriter, save
from torch.distributed.checkpoint.api import CheckpointException

from slime_rl.core.run import disk_full
from slime_rl.core.testing.full_disk import DiskThatFills
from slime_rl.trainer_megatron.checkpointing import DiskFullNamingWriter


@pytest.mark.parametrize("writer,names_it", [(FileSystemWriter, False), (DiskFullNamingWriter, True)])
def test_no_space_reaches_the_other_ranks_only_from_the_trainers_writer(writer, names_it, tmp_path, monkeypatch):
    DiskThatFills(room=1000).patch(monkeypatch)
    folder = tmp_path / "step_000001"
    with pytest.raises(CheckpointException) as caught, warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        save({"weight": torch.ones(64 * 1024)}, no_dist=True,
             storage_writer=writer(str(folder), thread_count=1, single_file_per_rank=True))
    assert disk_full.no_space_in(caught.value)  # on the rank itself, torch's error still holds the OSError
    as_another_rank_gets_it = pickle.loads(pickle.dumps(caught.value.failures))
    errors = [error for error, _ in as_another_rank_gets_it.values()]
    assert any(disk_full.no_space_in(error) for error in errors) is names_it, errors
    if names_it:
        assert any(str(folder) in str(error) for error in errors), errors
