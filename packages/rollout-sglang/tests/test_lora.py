"""LoRA adapter syncs into SGLang (issue 20) on CPU: `SGLangEngine` launched from a config with
``trainer.lora``, stand-in SGLang workers (a test double with SGLang 0.5.17's LoRA endpoints,
testing/lora.py) behind the real sglang-router, and the real client code: launch flags, one adapter
per version on every server, requests naming the current adapter, old adapters unloaded only after
their last request, failures naming the server and the adapter, restarts reloading the adapter."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time

import httpx
import pytest
import torch
from safetensors.torch import load_file
from test_engine import events, make_config, state

from slime_rl.core.algorithms.lora import adapter_name, peft_name
from slime_rl.core.config import ConfigError
from slime_rl.core.contracts import SamplingParams
from slime_rl.rollout_sglang import launch as fleet
from slime_rl.rollout_sglang.engine import SGLangEngine
from slime_rl.rollout_sglang.keys import bearer
from slime_rl.rollout_sglang.weights.adapters import adapter_folder
from slime_rl.rollout_sglang.weights.server_api import WeightSyncError
from slime_rl.rollout_sglang.weights.trainer_sender import SGLangWeightSender

RANK = 4
LORA = {"lora": {"rank": RANK, "alpha": 8.0}}
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_new_tokens=400, ignore_eos=True)  # ~1 s at 2 ms a token


def adapter(tiny_model, seed: int, rank: int = RANK) -> list[tuple[str, torch.Tensor]]:
    """A trainer's adapter bucket: PEFT-named A [rank, in] and B [out, rank] for every projection (bf16)."""
    gen = torch.Generator().manual_seed(seed)
    tensors = []
    for name, w in sorted(load_file(str(tiny_model / "model.safetensors")).items()):
        if name.endswith("_proj.weight"):
            tensors.append((peft_name(name, "A"), torch.randn(rank, w.shape[1], generator=gen).to(torch.bfloat16)))
            tensors.append((peft_name(name, "B"), torch.randn(w.shape[0], rank, generator=gen).to(torch.bfloat16)))
    return tensors


def served_adapters(engine: SGLangEngine, url: str) -> set[str]:
    cards = httpx.get(f"{url}/v1/models", headers=bearer(engine.keys.api_key), timeout=10).json()["data"]
    return {c["id"] for c in cards[1:]}  # the base model comes first


def loras_named(url: str) -> list[str | None]:
    return [e["lora"] for e in events(url, "generate")]


@pytest.fixture
def lora_engine(tiny_model, standin_python, tmp_path):
    engines = []

    def make(num_engines: int = 2, **rollout) -> SGLangEngine:
        cfg = make_config(tiny_model, standin_python, tmp_path / f"run{len(engines)}", num_engines, trainer=LORA,
                          **rollout)
        engines.append(SGLangEngine.from_config(cfg))
        return engines[-1]

    yield make
    for engine in engines:
        asyncio.run(engine.shutdown())


def test_launch_flags_come_from_the_lora_spec(tiny_model, standin_python, tmp_path):
    cfg = make_config(tiny_model, standin_python, tmp_path, trainer={"lora": {"rank": 8,
                                                                               "target_modules": ["q_proj", "v_proj"]}})
    args = fleet.engine_args(cfg)
    assert {k: args[k] for k in ("enable_lora", "max_lora_rank", "lora_target_modules", "max_loras_per_batch")} == \
        {"enable_lora": True, "max_lora_rank": 8, "lora_target_modules": ["q_proj", "v_proj"], "max_loras_per_batch": 3}
    assert "max_loaded_loras" not in args  # SGLang's own eviction would drop adapters still in use
    merged = make_config(tiny_model, standin_python, tmp_path, trainer=LORA, lora_sync="merged")
    assert not any("lora" in k for k in fleet.engine_args(merged))  # merged: full weights, no LoRA in SGLang
    stale = make_config(tiny_model, standin_python, tmp_path, trainer=LORA, max_staleness=3)
    assert fleet.engine_args(stale)["max_loras_per_batch"] == 5  # the base, the current version and 3 older
    user = make_config(tiny_model, standin_python, tmp_path, trainer=LORA, engine_args={"max_loras_per_batch": 6})
    assert fleet.engine_args(user)["max_loras_per_batch"] == 6  # the user's engine_args win


def test_each_version_is_an_adapter_and_the_old_one_goes_after_its_last_request(lora_engine, tiny_model):
    """Driver path (CPU tensors by value): v1, then v2 while v1's long requests are still decoding. No
    pause; v1's requests finish on v1; requests sent after the sync name slime-v2; slime-v1 is unloaded
    from both servers only after its last request came back."""
    engine = lora_engine()
    base = asyncio.run(engine.generate([5, 6, 7], GREEDY))
    asyncio.run(engine.update_weights(adapter(tiny_model, 1)[:6], version=1, last=False))
    asyncio.run(engine.update_weights(adapter(tiny_model, 1)[6:], version=1, last=True))
    v1 = asyncio.run(engine.generate([5, 6, 7], GREEDY))

    async def overlap():
        long = [asyncio.create_task(engine.generate([9, i], LONG, request_id=f"long{i}")) for i in range(4)]
        await asyncio.sleep(0.3)
        await engine.update_weights(adapter(tiny_model, 2), version=2, last=True)
        synced_at = time.time()
        short = await engine.generate([5, 6, 7], GREEDY)
        assert not any(t.done() for t in long)  # the sync did not wait for them, nor cut them
        outs = await asyncio.gather(*long)
        while engine.weights.unloads:  # the unload runs once the last v1 request is back
            await asyncio.sleep(0.05)
        return synced_at, short, outs

    synced_at, v2, long_outs = asyncio.run(overlap())
    assert (base.weight_version, v1.weight_version, v2.weight_version) == (0, 1, 2)
    assert len({tuple(base.token_ids), tuple(v1.token_ids), tuple(v2.token_ids)}) == 3  # each adapter counts
    assert all(o.weight_version == 1 and o.finish_reason == "length" and len(o.token_ids) == 400 for o in long_outs)
    for url in engine.engine_urls:
        seen = [e["kind"] for e in state(url)["events"]]
        assert "pause_generation" not in seen and "update_weights_from_tensor" not in seen
        loads = events(url, "load_lora_adapter")
        assert [(e["lora_name"], e["lora_path"], e["success"]) for e in loads] == \
            [("slime-v1", "__tensor__", True), ("slime-v2", "__tensor__", True)]
        unloads = events(url, "unload_lora_adapter")
        assert [(e["lora_name"], e["in_use"]) for e in unloads] == [("slime-v1", 0)]
        v1_ends = [e["time"] for e in events(url, "generate_end") if e["lora"] == "slime-v1"]
        assert v1_ends and max(v1_ends) <= unloads[0]["time"]  # after its last request, not at the sync
        assert loads[1]["time"] < max(v1_ends)  # v2 came in while v1 was still decoding
        after_sync = [e["lora"] for e in events(url, "generate") if e["time"] > synced_at]
        assert set(after_sync) <= {"slime-v2"}
        assert served_adapters(engine, url) == {"slime-v2"}
    assert set(loras_named(engine.engine_urls[0]) + loras_named(engine.engine_urls[1])) == \
        {None, "slime-v1", "slime-v2"}
    assert not adapter_folder(engine.work_dir, 1).exists() and adapter_folder(engine.work_dir, 2).is_dir()


@pytest.mark.parametrize("transport", ["tensor", "disk", "nccl"])
def test_the_trainers_sender_loads_adapters_by_each_transport(tiny_model, standin_python, tmp_path, transport):
    """Trainer-ranks path: `SGLangWeightSender` (trainer rank 0) loads each version as an adapter between
    the engine's begin and end of the sync; tensor and nccl go through /load_lora_adapter_from_tensors
    (SGLang has no broadcast path for adapters), disk through /load_lora_adapter from the PEFT folder."""
    cfg = make_config(tiny_model, standin_python, tmp_path, num_engines=1, trainer=LORA,
                      update_weight_transport=transport)
    engine = SGLangEngine.from_config(cfg)
    sender = SGLangWeightSender(cfg, rank=0)
    url = engine.engine_urls[0]
    try:
        async def sync(version: int) -> None:
            tensors = adapter(tiny_model, version)
            targets = await engine.begin_weight_sync(version, transport=transport)
            sender.send(iter([tensors[:5], tensors[5:]]), targets, version=version, transport=transport)
            await engine.end_weight_sync(version)

        outs = []
        for version in (1, 2):
            asyncio.run(sync(version))
            outs.append(asyncio.run(engine.generate([5, 6, 7], GREEDY)))
        assert [o.weight_version for o in outs] == [1, 2] and outs[0].token_ids != outs[1].token_ids
        paths = [e["lora_path"] for e in events(url, "load_lora_adapter")]
        folders = [str(adapter_folder(engine.work_dir, v)) for v in (1, 2)]
        assert paths == (folders if transport == "disk" else ["__tensor__", "__tensor__"])
        assert loras_named(url) == ["slime-v1", "slime-v2"]
        assert [e["lora_name"] for e in events(url, "unload_lora_adapter")] == ["slime-v1"]
        assert not events(url, "init_weights_update_group", "update_weights_from_distributed")
    finally:
        asyncio.run(engine.shutdown())


def test_a_failed_load_fails_the_sync_naming_the_server_and_the_adapter(lora_engine, tiny_model):
    """Engine 1 already holds an adapter named slime-v1 (an attached server's leftover, say): SGLang refuses
    the load there. The sync fails naming engine 1 and slime-v1; engine 0 gives its copy back; requests
    go on without an adapter (the base, version 0), and the next sync works."""
    engine = lora_engine()
    stale = engine.servers[1]
    folder = adapter_folder(engine.work_dir, 99)
    from slime_rl.rollout_sglang.weights.adapters import load_adapter_from_folder, save_adapter_folder

    save_adapter_folder(adapter(tiny_model, 7), folder, engine.roster.spec, str(tiny_model))
    load_adapter_from_folder(engine.targets()[1], adapter_name(1), folder, timeout=30, step="test set-up")
    with pytest.raises(WeightSyncError, match=re.escape(f"{stale.name}: weight sync v1 (tensor, adapter): load adapter "
                                                        "slime-v1: /load_lora_adapter_from_tensors answered HTTP 400")
                       + ".*already loaded"):
        asyncio.run(engine.update_weights(adapter(tiny_model, 1), version=1, last=True))
    assert engine.weight_version == 0
    first = engine.engine_urls[0]
    assert [(e["lora_name"], e["success"]) for e in events(first, "load_lora_adapter")] == [("slime-v1", True)]
    assert [e["lora_name"] for e in events(first, "unload_lora_adapter")] == ["slime-v1"]
    assert not adapter_folder(engine.work_dir, 1).exists()
    async def four():
        return await asyncio.wait_for(asyncio.gather(*(engine.generate([1, i], GREEDY) for i in range(4))), 30)

    outs = asyncio.run(four())
    assert all(o.weight_version == 0 for o in outs)
    assert set(loras_named(first) + loras_named(stale.url)) == {None}
    asyncio.run(engine.update_weights(adapter(tiny_model, 2), version=2, last=True))
    assert asyncio.run(engine.generate([1, 2], GREEDY)).weight_version == 2


def test_adapter_tensors_only(lora_engine, tiny_model):
    """A full weight in an adapter sync: the trainer and the engine disagree about rollout.lora_sync."""
    engine = lora_engine(num_engines=1)
    full = [("model.layers.0.self_attn.q_proj.weight", torch.zeros(8, 8))]
    with pytest.raises(WeightSyncError, match=r"weight sync v1: 'model.layers.0.self_attn.q_proj.weight' is not a "
                                              r"LoRA adapter tensor.*rollout.lora_sync=merged"):
        asyncio.run(engine.update_weights(full, version=1, last=True))
    asyncio.run(engine.update_weights(adapter(tiny_model, 1), version=1, last=True))  # the engine goes on
    assert asyncio.run(engine.generate([1], GREEDY)).weight_version == 1


def test_a_restarted_engine_gets_the_current_adapter_again(lora_engine, tiny_model):
    engine = lora_engine()
    engine.health_interval = 0.3
    asyncio.run(engine.update_weights(adapter(tiny_model, 1), version=1, last=True))
    asyncio.run(engine.update_weights(adapter(tiny_model, 2), version=2, last=True))
    victim = engine.servers[1]

    async def kill_and_wait():
        await engine.generate([3, 4], GREEDY)  # the health monitor runs in this event loop
        os.killpg(victim.process.pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while engine.restarts < 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        return await asyncio.gather(*(engine.generate([3, 4], GREEDY, request_id=f"r{i}") for i in range(8)))

    outs = asyncio.run(kill_and_wait())
    fresh = engine.servers[1]
    assert engine.restarts == 1 and fresh.url != victim.url
    assert [(e["lora_name"], e["lora_path"]) for e in events(fresh.url, "load_lora_adapter")] == \
        [("slime-v2", str(adapter_folder(engine.work_dir, 2)))]
    assert not events(fresh.url, "update_weights_from_disk")  # the base weights never changed
    assert all(o.weight_version == 2 for o in outs)
    for url in engine.engine_urls:  # round robin: both served some, naming slime-v2
        served = [e for e in events(url, "generate") if e["rid"].startswith("r")]
        assert served and {e["lora"] for e in served} == {"slime-v2"} and served_adapters(engine, url) == {"slime-v2"}
    assert len({tuple(o.token_ids) for o in outs}) == 1  # the same adapter on both: the same greedy tokens


def test_attaching_needs_servers_started_for_lora(lora_engine, tiny_model, standin_python, tmp_path, monkeypatch):
    """rollout.sglang.engine_urls: servers someone else started must have LoRA on with room for this run's adapters;
    otherwise a config error names the field, the server, what is missing and the flags to start it with."""
    launched = lora_engine(num_engines=1)
    monkeypatch.setenv("SLIME_RL_ENGINE_API_KEY", launched.keys.api_key)
    monkeypatch.setenv("SLIME_RL_ENGINE_ADMIN_API_KEY", launched.keys.admin_key)
    bigger = make_config(tiny_model, standin_python, tmp_path / "a", trainer={"lora": {"rank": 2 * RANK}},
                         engine_urls=launched.engine_urls)
    with pytest.raises(ConfigError, match=r"rollout.sglang.engine_urls.*sglang engine 0 .* its --max-lora-rank 4 is below "
                                          r"trainer.lora.rank 8\. Start it with --enable-lora --max-lora-rank 8 "
                                          r"--lora-target-modules q_proj k_proj v_proj o_proj gate_proj up_proj "
                                          r"down_proj --max-loras-per-batch 3"):
        SGLangEngine.from_config(bigger)
    attached = SGLangEngine.from_config(make_config(tiny_model, standin_python, tmp_path / "b", trainer=LORA,
                                                    engine_urls=launched.engine_urls))
    try:
        asyncio.run(attached.update_weights(adapter(tiny_model, 1), version=1, last=True))
        assert asyncio.run(attached.generate([1, 2], GREEDY)).weight_version == 1
        assert served_adapters(attached, attached.engine_urls[0]) == {"slime-v1"}
    finally:
        asyncio.run(attached.shutdown())


def test_attached_server_checks_read_sglangs_server_info():
    from slime_rl.core.algorithms.lora import LoraSpec
    from slime_rl.rollout_sglang.weights.adapters import check_attached_server

    spec = LoraSpec(8, 16.0, 0.0, ("q_proj", "v_proj", "down_proj"))
    check_attached_server("s", {"enable_lora": True, "max_lora_rank": 8, "lora_target_modules": ["all"]}, spec)
    # SGLang may list its fused modules: q/k/v are qkv_proj there
    check_attached_server("s", {"enable_lora": True, "max_lora_rank": 16,
                                "lora_target_modules": ["qkv_proj", "down_proj"]}, spec)
    with pytest.raises(ConfigError, match=r"s cannot load this run's LoRA adapters: it runs without --enable-lora"):
        check_attached_server("s", {"enable_lora": None}, spec)
    # as SGLang's memory pool: q_proj there means LoRA buffers for the fused qkv_proj, so v_proj fits
    with pytest.raises(ConfigError, match=r"its --lora-target-modules \['q_proj'\] lack \['down_proj'\]"):
        check_attached_server("s", {"enable_lora": True, "max_lora_rank": 8, "lora_target_modules": ["q_proj"]}, spec)


def test_a_memory_release_restores_the_base_and_keeps_the_adapter(lora_engine, tiny_model):
    """Colocated: released weights come back from the base model's folder (adapter syncs never change
    them), and requests go on naming the current adapter with the same tokens as before the release."""
    engine = lora_engine(num_engines=1)
    asyncio.run(engine.update_weights(adapter(tiny_model, 1), version=1, last=True))
    before = asyncio.run(engine.generate([2, 3], GREEDY))
    asyncio.run(engine.release_memory())
    asyncio.run(engine.resume_memory())
    after = asyncio.run(engine.generate([2, 3], GREEDY))
    url = engine.engine_urls[0]
    assert [e["model_path"] for e in events(url, "update_weights_from_disk")] == [str(tiny_model)]
    assert after.token_ids == before.token_ids and after.weight_version == 1
    assert loras_named(url) == ["slime-v1", "slime-v1"]
