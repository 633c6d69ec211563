"""``model.dtype`` reaches the Megatron trainer, the hf engine and SGLang's servers (``--dtype``) as one
dtype: what the driver resolved for the run, or, for a config nobody resolved, core's one rule
(config/dtype.py). An engine in another dtype than the trainer samples from another policy."""

from __future__ import annotations

import pytest
import torch

from slime_rl.core.config import ConfigError, load_config
from slime_rl.core.config import dtype as model_dtypes
from slime_rl.core.config.cpu import CpuInfo
from slime_rl.rollout_hf.engine import resolve_dtype as hf_engine_dtype
from slime_rl.rollout_sglang.launch import engine_args as sglang_engine_args
from slime_rl.trainer_megatron.trainer import torch_dtype as trainer_dtype


def config(device: str, dtype: str, *overrides: str):
    return load_config(None, [f"cluster.device={device}", f"model.dtype={dtype}", *overrides], check=False)


def dtypes_built(cfg) -> dict[str, str]:
    """The dtype each backend builds the model in, by name."""
    device = cfg.cluster.device
    return {
        "trainer": str(trainer_dtype(cfg.model.dtype, device)).removeprefix("torch."),
        "hf engine": str(hf_engine_dtype(cfg.model.dtype, torch.device(device))).removeprefix("torch."),
        "sglang --dtype": sglang_engine_args(cfg)["dtype"],
    }


@pytest.mark.parametrize(("device", "setting", "expected"), [
    ("cuda", "auto", "bfloat16"), ("cpu", "auto", "float32"),  # a backend built by hand: core's rule
    ("cuda", "float32", "float32"), ("cuda", "float16", "float16"), ("cpu", "bfloat16", "bfloat16"),
])
def test_the_backends_build_in_one_dtype(device, setting, expected):
    assert dtypes_built(config(device, setting)) == dict.fromkeys(["trainer", "hf engine", "sglang --dtype"],
                                                                  expected)


@pytest.mark.parametrize(("device", "flags", "expected"), [
    ("cuda", set(), "bfloat16"),
    ("cpu", {"amx_bf16"}, "bfloat16"),  # not the backends' float32 for an unresolved CPU config
    ("cpu", {"avx2"}, "float32"),
])
def test_the_backends_build_in_what_the_driver_resolved(device, flags, expected, monkeypatch):
    monkeypatch.setattr(model_dtypes, "cpu_info", lambda: CpuInfo("test CPU", "x86_64", frozenset(flags)))
    cfg = config(device, "auto")
    model_dtypes.resolve_model_dtype(cfg, None)
    assert cfg.model.dtype == expected
    assert set(dtypes_built(cfg).values()) == {expected}


def test_an_sglang_dtype_other_than_the_runs_is_refused_with_the_key():
    cfg = config("cuda", "bfloat16", "rollout.engine=sglang", "rollout.engine_args.dtype=float16")
    with pytest.raises(ConfigError, match=r"dtype: 'float16' is not the run's model.dtype.*set model.dtype instead"):
        sglang_engine_args(cfg)
    same = config("cuda", "auto", "rollout.engine=sglang", "rollout.engine_args.dtype=bfloat16")
    assert sglang_engine_args(same)["dtype"] == "bfloat16"
