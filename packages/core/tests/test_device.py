"""cluster.device resolved in one place (core.device) for the plan, the trainer and the engines."""

import pytest
import torch

from slime_rl.core.config.device import resolve_device


def test_auto_follows_torch_and_explicit_settings_are_kept():
    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu") == resolve_device("cpu", here=True) == "cpu"
    assert resolve_device("cuda") == "cuda"  # a plan for a GPU cluster, printed anywhere


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_cuda_for_a_process_without_a_gpu_names_the_field():
    with pytest.raises(RuntimeError, match="cluster.device: cuda requested but torch sees no GPU"):
        resolve_device("cuda", here=True)


def test_an_unknown_setting_names_the_field_and_the_choices():
    with pytest.raises(ValueError, match="cluster.device: 'gpu' is not one of auto, cuda, cpu"):
        resolve_device("gpu")


def test_every_user_of_cluster_device_goes_through_it(monkeypatch):
    """The plan, the HF engine and the Megatron trainer all answer as core.device does."""
    from slime_rl.core.config import load_config
    from slime_rl.core.config.placement import plan_placement

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert plan_placement(load_config(None, [], check=False)).device == "cuda"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert plan_placement(load_config(None, [], check=False)).device == "cpu"
    trainer_device = pytest.importorskip("slime_rl.trainer_megatron.device")
    assert trainer_device.resolve_device("auto") == "cpu"
    with pytest.raises(RuntimeError, match="cluster.device: cuda requested"):
        trainer_device.resolve_device("cuda")
