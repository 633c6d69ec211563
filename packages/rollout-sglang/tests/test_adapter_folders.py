"""The PEFT folder of each synced adapter, which only a restarted server reads, is written in the background
(adapters.FolderWriter): the sync does not wait for the disk, the folder holds the adapter as it was synced,
and a restart waits for it (adapter_roster.AdapterRoster.reload)."""

from __future__ import annotations

import logging
import threading

import pytest
import torch
from safetensors.torch import load_file

from slime_rl.core.algorithms.lora import LoraSpec
from slime_rl.rollout_sglang.weights import adapters
from slime_rl.rollout_sglang.weights.adapter_roster import AdapterRoster
from slime_rl.rollout_sglang.weights.server_api import Target, WeightSyncError

SPEC = LoraSpec(2, 4.0, 0.0, ("q_proj",))
NAMES = ("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
         "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight")


def trainer_adapter(device: str = "cpu") -> list[tuple[str, torch.Tensor]]:
    return [(NAMES[0], torch.ones(2, 8, device=device)), (NAMES[1], torch.full((8, 2), 3.0, device=device))]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_sync_does_not_wait_for_the_folder_which_holds_the_synced_values(tmp_path, monkeypatch, device):
    """The background write moves the adapter to the host too: the snapshot taken at the sync (a device
    copy, on CUDA) is what it writes, not the tensors the trainer changes next."""
    disk = threading.Event()
    save = adapters.save_adapter_folder
    monkeypatch.setattr(adapters, "save_adapter_folder", lambda *a: (disk.wait(10), save(*a)))
    on_host = adapters._on_host
    monkeypatch.setattr(adapters, "_on_host", lambda *a: (disk.wait(10), on_host(*a))[1])
    writer, folder = adapters.FolderWriter(), tmp_path / "adapters" / "v1"
    named = trainer_adapter(device)
    writer.write(named, folder, SPEC, "base")  # returns while the disk is held
    assert not folder.exists()
    for _, tensor in named:
        tensor.zero_()  # the trainer's next step changes its tensors in place
    disk.set()
    writer.wait()
    saved = load_file(str(folder / "adapter_model.safetensors"))
    assert torch.equal(saved[NAMES[0]], torch.ones(2, 8)) and torch.equal(saved[NAMES[1]], torch.full((8, 2), 3.0))
    assert (folder / "adapter_config.json").is_file()


def test_a_failed_write_is_logged_by_the_next_sync_which_goes_on(tmp_path, caplog):
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    writer = adapters.FolderWriter()
    writer.write(trainer_adapter(), blocked / "v1", SPEC, "base")  # no folder can be made under a file
    writer.wait()
    assert writer.error is not None
    with caplog.at_level(logging.WARNING):
        writer.write(trainer_adapter(), tmp_path / "v2", SPEC, "base")
    writer.wait()
    assert "writing an adapter folder failed" in caplog.text and writer.error is None
    assert (tmp_path / "v2" / "adapter_model.safetensors").is_file()


def test_a_restart_waits_for_the_folder_and_names_the_adapter_when_it_never_comes(tmp_path, monkeypatch):
    roster = AdapterRoster(SPEC, tmp_path)
    roster.switch(1)
    loads: list[str] = []
    monkeypatch.setattr(adapters, "load_adapter_from_folder",
                        lambda target, name, folder, **kw: loads.append(f"{name} {folder.is_dir()}"))
    target = Target(url="http://127.0.0.1:1", name="sglang engine 0")
    with pytest.raises(WeightSyncError, match=r"folder of adapter slime-v1 .* was not written within 0 s"):
        roster.reload(target, roster.loaded(), timeout=0.2)
    writer = threading.Timer(0.3, adapters.save_adapter_folder,
                             args=(trainer_adapter(), adapters.adapter_folder(tmp_path, 1), SPEC, "base"))
    writer.start()
    roster.reload(target, roster.loaded(), timeout=10)  # the folder lands while it waits
    assert loads == ["slime-v1 True"]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_folder_keeps_each_tensors_dtype(tmp_path, device):
    """CUDA adapters of one dtype go to the host in one transfer; mixed dtypes must not be promoted by it."""
    writer = adapters.FolderWriter()
    named = [(NAMES[0], torch.ones(2, 8, dtype=torch.bfloat16, device=device)),
             (NAMES[1], torch.full((8, 2), 3.0, device=device))]
    writer.write(named, tmp_path / "v1", SPEC, "base")
    writer.wait()
    saved = load_file(str(tmp_path / "v1" / "adapter_model.safetensors"))
    assert (saved[NAMES[0]].dtype, saved[NAMES[1]].dtype) == (torch.bfloat16, torch.float32)
