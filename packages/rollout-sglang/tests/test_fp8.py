"""rollout.precision=fp8 on the CPU (docs/fp8.md): the servers start from an FP8 copy of the model, every sync
pushes (weight, weight_scale_inv) pairs quantised by core's fp8.py through the same transports, the stand-in
server (testing/fp8.py) holds them as SGLang does, the equality check compares them as SGLang's checker
reports them, the restore copy keeps the FP8 format; and an engine refuses GPUs that cannot serve FP8."""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from slime_rl.core.config import Config, ConfigError
from slime_rl.core.contracts import SamplingParams
from slime_rl.core.testing import tiny_model_folder, train_tokenizer
from slime_rl.core.weights.fp8 import FP8_DTYPE, FP8Format, quantize_block
from slime_rl.rollout_sglang import fp8
from slime_rl.rollout_sglang.engine import SGLangEngine
from slime_rl.rollout_sglang.launch import engine_args
from slime_rl.rollout_sglang.weights import ipc, server_api, verify
from slime_rl.rollout_sglang.weights.restore_copy import version_folder
from slime_rl.rollout_sglang.weights.server_api import WeightSyncError
from slime_rl.rollout_sglang.weights.trainer_sender import SGLangWeightSender

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
Q_PROJ, O_PROJ = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.o_proj.weight"


@pytest.fixture(scope="module")
def model_64(tmp_path_factory):
    """A 1-layer bf16 Llama whose partitions (64, 64, 32, 128) take 32x32 FP8 blocks, not 128."""
    lines = ["the quick brown fox jumps over the lazy dog", "what is 1 + 2? the answer is 3"] * 20
    tok = train_tokenizer(lines, vocab_size=200, special_tokens=["<s>", "</s>", "<pad>"], bos_token="<s>",
                          eos_token="</s>", pad_token="<pad>")
    return tiny_model_folder(tmp_path_factory.mktemp("llama64"), "llama", tokenizer=tok, dtype=torch.bfloat16,
                             hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4, num_kv_heads=2)


def fp8_config(model, python, work, **rollout) -> Config:
    return Config.model_validate({
        "model": {"path": str(model)},
        "rollout": {"engine": "sglang", "precision": "fp8", **rollout,
                    "sglang": {"engine_python": python, "check_weight_update": True,
                               "server_args": {"standin_token_delay": 0.001}}},
        "cluster": {"device": "cpu", "colocate": True, "actor_num_gpus_per_node": 1, "rollout_num_gpus": 1,
                    "rollout_num_gpus_per_engine": 1},
        "logging": {"dir": str(work)},
    })


def trained(model, scale: float) -> list[tuple[str, torch.Tensor]]:
    """The model's bf16 weights after 'a step'."""
    weights = load_file(str(model / "model.safetensors"))
    return [(n, (t.float() * scale + 0.01).to(t.dtype)) for n, t in sorted(weights.items())]


def held(engine, name: str) -> torch.Tensor:
    """A parameter as the server holds it, exactly (FP8 and float32 values survive the JSON floats)."""
    values = server_api.post(engine.targets()[0], "/get_weights_by_name", {"name": name, "truncate_size": 10**6},
                             timeout=10, step="read back")
    return torch.tensor(values, dtype=torch.float64)


@pytest.mark.parametrize("path, transport", [("sender", "tensor"), ("sender", "disk"), ("sender", "nccl"),
                                             ("engine", "tensor")])  # the engine quantises, the pusher is the same
def test_syncs_land_as_fp8_pairs_bit_for_bit(model_64, standin_python, tmp_path, transport, path):
    cfg = fp8_config(model_64, standin_python, tmp_path, update_weight_transport=transport)
    engine = SGLangEngine.from_config(cfg)
    sender = SGLangWeightSender(cfg, rank=0)
    server = engine.servers[0]
    try:
        served = fp8.served_folder(cfg)
        hf = json.loads((served / "config.json").read_text())
        assert hf["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                             "weight_block_size": [32, 32]}
        info = httpx.get(f"{server.url}/server_info", headers=server.headers, timeout=10).json()
        flags = info["standin_extra_flags"]
        assert info["model_path"] == str(served) and flags[flags.index("--fp8-gemm-backend") + 1] == "triton"
        assert held(engine, Q_PROJ).shape == (64, 64) and held(engine, f"{Q_PROJ}_scale_inv").shape == (2, 2)
        before = asyncio.run(engine.generate([5, 6, 7], GREEDY))

        async def sync(version: int, weights) -> None:
            if path == "engine":  # buckets in the rollout process: the engine quantises them
                engine.verify_weights = True
                await engine.update_weights(weights[:5], version=version, last=False)
                await engine.update_weights(weights[5:], version=version, last=True)
                return
            targets = await engine.begin_weight_sync(version, transport=transport)
            sender.send(iter([weights[:5], weights[5:]]), targets, version=version, transport=transport)
            await engine.end_weight_sync(version)

        new = trained(model_64, 1.7)
        asyncio.run(sync(1, new))  # check_weight_update / verify_weights: SGLang's checksums of the pairs agree
        q, scale = quantize_block(dict(new)[Q_PROJ], 32)
        assert torch.equal(held(engine, Q_PROJ), q.double())
        assert torch.equal(held(engine, f"{Q_PROJ}_scale_inv"), scale.double())
        norm = "model.layers.0.input_layernorm.weight"  # stays in the model's dtype
        assert torch.equal(held(engine, norm), dict(new)[norm].double())
        after = asyncio.run(engine.generate([5, 6, 7], GREEDY))
        assert after.weight_version == 1 and after.token_ids != before.token_ids
        if path == "engine":  # its own host copy of the sync, what a restarted server is restored from: FP8 too
            restore = engine.weights.restore_folder()
            with safe_open(str(next(restore.glob("*.safetensors"))), framework="pt") as f:
                assert f.get_tensor(Q_PROJ).dtype == FP8_DTYPE and f.get_tensor(norm).dtype == torch.bfloat16
            assert "quantization_config" in json.loads((restore / "config.json").read_text())
    finally:
        sender.restore.writes.wait()
        sender.pusher.drop_group(sender.pusher.group_targets)
        engine.weights.pusher.drop_group(engine.weights.pusher.group_targets)
        asyncio.run(engine.shutdown())


def test_the_check_catches_a_stale_scale_and_the_restore_copy_stays_fp8(model_64, standin_python, tmp_path):
    cfg = fp8_config(model_64, standin_python, tmp_path, update_weight_transport="tensor")
    engine = SGLangEngine.from_config(cfg)
    sender = SGLangWeightSender(cfg, rank=0)
    try:
        async def sync() -> list:
            targets = await engine.begin_weight_sync(1, transport="tensor")
            sender.send(iter([trained(model_64, 0.8)]), targets, version=1, transport="tensor")
            await engine.end_weight_sync(1)
            return targets

        targets = asyncio.run(sync())
        sender.restore.writes.wait()
        restore = version_folder(sender.pusher.weights_dir, 1)
        with safe_open(str(next(restore.glob("*.safetensors"))), framework="pt") as f:
            assert f.get_tensor(O_PROJ).dtype == FP8_DTYPE
            assert f.get_tensor(f"{O_PROJ}_scale_inv").dtype == torch.float32
            assert f.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16
        assert "quantization_config" in json.loads((restore / "config.json").read_text())
        q, scale = quantize_block(dict(trained(model_64, 0.8))[O_PROJ], 32)
        expected = verify.check_sample([(O_PROJ, q), (f"{O_PROJ}_scale_inv", scale)])
        assert verify.check_weights(targets[0], expected, timeout=10, step="check") == 1
        ipc.push_tensor_bucket(targets, [(f"{O_PROJ}_scale_inv", scale * 2)], version=None, timeout=10, step="stale")
        with pytest.raises(WeightSyncError, match=f"{O_PROJ} .*engine checksum"):
            verify.check_weights(targets[0], expected, timeout=10, step="check")
    finally:
        asyncio.run(engine.shutdown())


def test_without_our_model_package_a_llamas_scales_never_load_and_the_check_says_so(model_64, standin_python,
                                                                                      tmp_path, monkeypatch):
    """SGLang's own LlamaForCausalLM renames every ``weight_scale_inv`` to a name no block-FP8 layer has (the
    stand-in does as it does): a server of a Llama gets our model package (model_fixes.py) unless the user's
    environment names another, and then the sync's check fails on the first projection instead of serving
    weights of scale float32-min."""
    monkeypatch.setenv("SGLANG_EXTERNAL_MODEL_PACKAGE", "someone_elses.models")
    cfg = fp8_config(model_64, standin_python, tmp_path, update_weight_transport="tensor")
    engine = SGLangEngine.from_config(cfg)
    sender = SGLangWeightSender(cfg, rank=0)
    try:
        assert held(engine, f"{O_PROJ}_scale_inv").eq(torch.finfo(torch.float32).min).all()  # never loaded at start

        async def sync() -> None:
            targets = await engine.begin_weight_sync(1, transport="tensor")
            sender.send(iter([trained(model_64, 0.8)]), targets, version=1, transport="tensor")
            await engine.end_weight_sync(1)

        with pytest.raises(WeightSyncError, match=r"proj\.weight .*engine checksum"):
            asyncio.run(sync())
    finally:
        sender.restore.writes.wait()
        asyncio.run(engine.shutdown())


def test_server_flags_follow_the_models_blocks_and_the_kv_cache_option(model_64, tiny_model, tmp_path):
    args = engine_args(fp8_config(model_64, "python", tmp_path, kv_cache_dtype="fp8_e4m3"))
    assert args["kv_cache_dtype"] == "fp8_e4m3" and args["fp8_gemm_backend"] == "triton"  # 32x32 blocks
    cfg = fp8_config(model_64, "python", tmp_path)
    cfg.rollout.precision = "model"
    assert "kv_cache_dtype" not in engine_args(cfg) and "fp8_gemm_backend" not in engine_args(cfg)
    with pytest.raises(ConfigError, match="rollout.precision: no FP8 block edge .* divides"):
        fp8.fp8_format(tiny_model, 1)  # hidden size 8
    served = fp8.write_served_folder(model_64, tmp_path / "fp8-model", FP8Format("block", 32))
    with pytest.raises(ConfigError, match="rollout.precision: .*config.json is already quantised"):
        fp8.fp8_format(served, 1)  # an FP8 folder given as the model


def test_the_served_copy_is_made_once_and_again_when_the_model_changes(model_64, tmp_path):
    folder = tmp_path / "fp8-model"
    fp8.write_served_folder(model_64, folder, FP8Format("block", 32))
    made = (folder / fp8.STAMP).stat().st_mtime_ns
    assert (folder / "tokenizer.json").is_file()
    fp8.write_served_folder(model_64, folder, FP8Format("block", 32))
    assert (folder / fp8.STAMP).stat().st_mtime_ns == made
    fp8.write_served_folder(model_64, folder, FP8Format("block", 16))  # another format: made again
    assert json.loads((folder / "config.json").read_text())["quantization_config"]["weight_block_size"] == [16, 16]


H100, A100, B200 = ("NVIDIA H100 80GB HBM3", (9, 0)), ("NVIDIA A100-SXM4-80GB", (8, 0)), ("NVIDIA B200", (10, 0))


def test_an_engine_refuses_gpus_below_compute_capability_8_9(model_64, tmp_path, caplog):
    cfg = fp8_config(model_64, "python", tmp_path)
    fp8.check_gpus(cfg, [[0], [1]], query=lambda: {0: H100, 1: H100})
    with pytest.raises(ConfigError, match=r"rollout.precision: GPU 1 \(NVIDIA A100-SXM4-80GB\) has compute "
                                          r"capability 8.0; FP8 engines need 8.9 or above"):
        fp8.check_gpus(cfg, [[0], [1]], query=lambda: {0: H100, 1: A100})
    with pytest.raises(ConfigError, match="re-quantises FP8 block scales to UE8M0"):
        fp8.check_gpus(cfg, [[0]], query=lambda: {0: B200})
    cfg.rollout.precision, cfg.rollout.kv_cache_dtype = "model", "fp8_e4m3"
    fp8.check_gpus(cfg, [[0]], query=lambda: {0: B200})  # an FP8 KV cache has no re-laid scales
    with pytest.raises(ConfigError, match="rollout.kv_cache_dtype: GPU 0 .* compute capability 8.0"):
        fp8.check_gpus(cfg, [[0]], query=lambda: {0: A100})
    with caplog.at_level(logging.WARNING):
        fp8.check_gpus(cfg, [[0]], query=lambda: None)
    assert "were not checked" in caplog.text


def test_moe_experts_sync_in_fp8_the_router_in_bf16_and_routing_replay_goes_on(standin_python, tmp_path):
    """The Qwen3-MoE shape (issue 38, item 3): every expert's projections are FP8 pairs, the router gate stays
    bf16, and the engine still returns the experts each token went to."""
    model = tiny_model_folder(tmp_path / "moe", "qwen3_moe", dtype=torch.bfloat16, hidden_size=64, num_heads=4,
                              num_kv_heads=2, head_dim=16, intermediate_size=128, moe_intermediate_size=32,
                              num_experts=4, num_experts_per_tok=2, num_layers=1)
    cfg = fp8_config(model, standin_python, tmp_path / "run", update_weight_transport="tensor")
    cfg.algorithm.routing_replay = "rollout"
    engine = SGLangEngine.from_config(cfg)
    sender = SGLangWeightSender(cfg, rank=0)
    expert, router = "model.layers.0.mlp.experts.3.down_proj.weight", "model.layers.0.mlp.gate.weight"
    try:
        with safe_open(str(next(fp8.served_folder(cfg).glob("*.safetensors"))), framework="pt") as f:
            assert f.get_tensor(expert).dtype == FP8_DTYPE and f.get_tensor(router).dtype == torch.bfloat16

        async def sync() -> None:
            targets = await engine.begin_weight_sync(1, transport="tensor")
            sender.send(iter([trained(model, 1.3)]), targets, version=1, transport="tensor")
            await engine.end_weight_sync(1)

        asyncio.run(sync())
        q, scale = quantize_block(dict(trained(model, 1.3))[expert], 32)  # 64 x 32: 32x32 blocks
        assert torch.equal(held(engine, expert), q.double())
        assert torch.equal(held(engine, f"{expert}_scale_inv"), scale.double())
        assert torch.equal(held(engine, router), dict(trained(model, 1.3))[router].double())
        out = asyncio.run(engine.generate([5, 6, 7], SamplingParams(temperature=0.0, max_new_tokens=4,
                                                                    ignore_eos=True, return_routed_experts=True)))
        assert out.weight_version == 1 and out.routed_experts is not None and len(out.routed_experts) == 3 + 4 - 1
    finally:
        sender.restore.writes.wait()
        asyncio.run(engine.shutdown())


def test_with_lora_adapters_the_base_stays_fp8_and_the_adapters_go_in_bf16(model_64, standin_python, tmp_path):
    """rollout.lora_sync=adapter (issue 38, item 4): the servers start from the FP8 copy, a sync loads the
    adapters as they are (bf16) and leaves the FP8 base untouched."""
    from test_lora import adapter

    cfg = fp8_config(model_64, standin_python, tmp_path, update_weight_transport="tensor")
    cfg.trainer.lora.rank, cfg.trainer.lora.alpha = 4, 8.0
    engine = SGLangEngine.from_config(cfg)
    sender = SGLangWeightSender(cfg, rank=0)
    try:
        base = held(engine, Q_PROJ)
        tensors = adapter(model_64, 1)
        assert all(t.dtype == torch.bfloat16 for _, t in tensors)

        async def sync() -> None:
            targets = await engine.begin_weight_sync(1, transport="tensor")
            sender.send(iter([tensors]), targets, version=1, transport="tensor")
            await engine.end_weight_sync(1)

        asyncio.run(sync())
        out = asyncio.run(engine.generate([5, 6, 7], GREEDY))
        assert out.weight_version == 1 and torch.equal(held(engine, Q_PROJ), base)
        q, _ = quantize_block(load_file(str(model_64 / "model.safetensors"))[Q_PROJ], 32)
        assert torch.equal(base, q.double())  # the base the servers started from: the model, in FP8
    finally:
        asyncio.run(engine.shutdown())
