"""The dtype a CPU run trains in when its config says auto: the CPU's flags where they settle it,
a calibration of the model's matmuls where they do not; never over an explicit model.dtype, and
the checkpoint's on a resume."""

from __future__ import annotations

import json

import pytest

from slime_rl.core.config import dtype as model_dtypes
from slime_rl.core.config import load_config
from slime_rl.core.config.cpu import CpuInfo, MatmulShape, choose_cpu_dtype, cpu_info, time_matmuls

SAPPHIRE_RAPIDS = "processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\nflags\t\t: fpu avx2 fma avx512f avx512_bf16 amx_bf16 amx_tile amx_int8\n"
EPYC = "processor\t: 0\nmodel name\t: AMD EPYC 9654\nflags\t\t: fpu avx2 fma avx512f avx512_bf16\n"
SKYLAKE = "processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Gold 6148\nflags\t\t: fpu avx2 fma avx512f\n"
GRAVITON = "processor\t: 0\nBogoMIPS\t: 2100.00\nFeatures\t: fp asimd bf16 sve\n"


def never_timed(shape):
    raise AssertionError("the flags settle this CPU; no calibration expected")


def timed(fp32: float, bf16: float):
    return lambda shape: {"float32": fp32, "bfloat16": bf16}


@pytest.mark.parametrize("text,model,flag", [
    (SAPPHIRE_RAPIDS, "Intel(R) Xeon(R) Platinum 8480+", "amx_bf16"), (EPYC, "AMD EPYC 9654", "avx512_bf16"),
    (SKYLAKE, "Intel(R) Xeon(R) Gold 6148", "avx512f"), (GRAVITON, None, "bf16"),
])
def test_proc_cpuinfo_gives_the_model_and_flags(text, model, flag, tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text(text)
    info = cpu_info(path)
    assert model is None or info.model == model
    assert flag in info.features
    assert model is None or model in info.describe()


def test_amx_means_bf16_and_no_bf16_instructions_mean_fp32_without_timing():
    amx = CpuInfo("x", "x86_64", frozenset({"avx2", "avx512_bf16", "amx_bf16"}))
    assert choose_cpu_dtype(amx, timer=never_timed).dtype == "bfloat16"
    for flags in ({"avx2", "avx512f"}, set()):
        assert choose_cpu_dtype(CpuInfo("x", "x86_64", frozenset(flags)), timer=never_timed).dtype == "float32"


@pytest.mark.parametrize("flags", [{"avx2", "avx512_bf16"}, {"asimd", "bf16"}])
@pytest.mark.parametrize("fp32,bf16,expected", [(7.5, 4.0, "bfloat16"), (5.0, 5.2, "float32"), (1.2, 1.0, "float32")])
def test_bf16_instructions_without_amx_are_calibrated(flags, fp32, bf16, expected):
    choice = choose_cpu_dtype(CpuInfo("x", "x86_64", frozenset(flags)), timer=timed(fp32, bf16))
    assert choice.dtype == expected and f"{fp32 / bf16:.2f}x" in choice.reason


def test_the_calibration_times_both_dtypes_quickly():
    seconds = time_matmuls(MatmulShape(hidden=64, intermediate=128, rows=32), tries=2)
    assert set(seconds) == {"float32", "bfloat16"} and all(0 < s < 5 for s in seconds.values())


def test_the_calibration_uses_the_models_shape(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 896, "intermediate_size": 4864}))
    assert MatmulShape.of_model(tmp_path) == MatmulShape(hidden=896, intermediate=4864)
    assert MatmulShape.of_model(tmp_path / "missing") == MatmulShape()


def cpu_config(*overrides: str):
    return load_config(None, ["model.path=builtin:smollm2-135m-instruct", "cluster.device=cpu", *overrides],
                       check=False)


@pytest.mark.parametrize("flags,expected", [({"avx2", "amx_bf16"}, "bfloat16"), ({"avx2"}, "float32")])
def test_auto_follows_the_cpu(flags, expected, monkeypatch):
    monkeypatch.setattr(model_dtypes, "cpu_info", lambda: CpuInfo("test CPU", "x86_64", frozenset(flags)))
    cfg = cpu_config()
    note = model_dtypes.resolve_model_dtype(cfg, None)
    assert cfg.model.dtype == expected
    assert note.startswith(f"model.dtype=auto -> {expected} on test CPU")


@pytest.mark.parametrize("explicit", ["float32", "bfloat16"])
def test_an_explicit_dtype_always_wins(explicit, monkeypatch):
    for flags in ({"amx_bf16"}, set()):
        monkeypatch.setattr(model_dtypes, "cpu_info", lambda flags=flags: CpuInfo("test CPU", "x86_64", frozenset(flags)))
        cfg = cpu_config(f"model.dtype={explicit}")
        assert model_dtypes.resolve_model_dtype(cfg, None) is None and cfg.model.dtype == explicit
        other = "float32" if explicit == "bfloat16" else "bfloat16"
        assert model_dtypes.resolve_model_dtype(cfg, {"model_dtype": other}) is None and cfg.model.dtype == explicit


def test_a_resume_keeps_the_checkpoints_dtype_on_another_cpu(monkeypatch):
    monkeypatch.setattr(model_dtypes, "cpu_info", lambda: CpuInfo("test CPU", "x86_64", frozenset({"avx2"})))
    cfg = cpu_config()
    assert "as the checkpoint" in model_dtypes.resolve_model_dtype(cfg, {"step": 4, "model_dtype": "bfloat16"})
    assert cfg.model.dtype == "bfloat16"
    cfg = cpu_config()  # a checkpoint from before auto chose by CPU: auto meant fp32 there
    assert "as the checkpoint" in model_dtypes.resolve_model_dtype(cfg, {"step": 4}) and cfg.model.dtype == "float32"


def test_a_gpu_run_resolves_auto_to_bf16_without_looking_at_the_cpu(monkeypatch):
    monkeypatch.setattr(model_dtypes, "cpu_info", lambda: pytest.fail("a GPU run needs no CPU flags"))
    cfg = cpu_config("cluster.device=cuda")
    assert "bfloat16 on the GPU" in model_dtypes.resolve_model_dtype(cfg, None) and cfg.model.dtype == "bfloat16"
    cfg = cpu_config("cluster.device=cuda")  # a GPU checkpoint from before the driver resolved auto
    assert "as the checkpoint" in model_dtypes.resolve_model_dtype(cfg, {"step": 4, "model_dtype": "auto"})
    assert cfg.model.dtype == "bfloat16"
