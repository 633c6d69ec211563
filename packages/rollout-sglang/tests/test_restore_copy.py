"""The trainer-side copy a restarted SGLang server is restored from (weights/restore_copy.py)."""

from __future__ import annotations

import logging

import pytest
import torch
from safetensors.torch import load_file

from slime_rl.rollout_sglang.weights.restore_copy import RestoreCopy, version_folder, wait_for_version


def test_each_version_is_written_whole_and_replaces_the_one_before(tiny_model, tmp_path):
    copy = RestoreCopy(tmp_path / "weights", tiny_model)
    for version in (1, 2):
        bucket = [("a", torch.full((2, 3), float(version))), ("b", torch.arange(4.0) * version)]
        copy.add(bucket[:1], first=True)
        copy.add(bucket[1:], first=False)
        copy.finish(version)
        bucket[0][1].zero_()  # the trainer reuses its buffers: the copy was taken when pushed
    copy.writes.wait()
    folder = wait_for_version(tmp_path / "weights", 2, timeout=5)
    assert folder == version_folder(tmp_path / "weights", 2) and (folder / "config.json").is_file()
    tensors = {k: v for f in folder.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    assert torch.equal(tensors["a"], torch.full((2, 3), 2.0)) and torch.equal(tensors["b"], torch.arange(4.0) * 2)
    assert not version_folder(tmp_path / "weights", 1).exists()  # one copy on disk
    assert wait_for_version(tmp_path / "weights", 3, timeout=0.2) is None


def test_a_failed_write_is_logged_and_the_sync_goes_on(tiny_model, tmp_path, caplog):
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("")  # restore/ cannot be made under a file
    copy = RestoreCopy(blocked, tiny_model)
    copy.add([("a", torch.ones(2))], first=True)
    copy.finish(1)
    copy.writes.wait()
    assert copy.writes.error is not None
    with caplog.at_level(logging.WARNING):
        copy.add([("a", torch.ones(2))], first=True)  # the next sync: no exception
    assert "writing the restore copy of the weights" in caplog.text and copy.writes.error is None


@pytest.mark.gpu
def test_cuda_buckets_are_copied_as_pushed_while_the_trainer_goes_on(tiny_model, tmp_path):
    """CUDA buckets, copied to pinned host memory without blocking as they are pushed: the trainer's next
    kernels (an in-place update of the same tensors, a freed bucket's memory reused) must still leave the copy
    holding the pushed values."""
    copy = RestoreCopy(tmp_path / "weights", tiny_model)
    big = [(f"w{i}", torch.full((4096, 4096), float(i + 1), device="cuda")) for i in range(8)]  # 512 MiB
    copy.add(big[:4], first=True)
    scratch = torch.full((4096, 4096), -1.0, device="cuda")  # a bucket made and freed by the trainer
    copy.add([("scratch", scratch)], first=False)
    del scratch
    reused = torch.empty((4096, 4096), device="cuda").fill_(-2.0)  # may take the freed block
    copy.add(big[4:], first=False)
    copy.finish(1)
    for _, tensor in big:
        tensor.mul_(0)  # the optimizer step on the trainer's stream
    copy.writes.wait()
    tensors = load_file(str(next(version_folder(tmp_path / "weights", 1).glob("*.safetensors"))))
    assert all(torch.equal(tensors[f"w{i}"], torch.full((4096, 4096), float(i + 1))) for i in range(8))
    assert torch.equal(tensors["scratch"], torch.full((4096, 4096), -1.0))
    del reused
