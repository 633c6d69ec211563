"""Nothing that changes an engine answers without the run's keys: weight updates, memory release,
abort and pause sent straight to a server or through the real sglang-router are refused, while
the engine (which holds the keys) works. Stand-in servers (a test double) enforce SGLang
0.5.17's key rules; test_sglang_gpu.py checks the same against the real server."""

from __future__ import annotations

import asyncio
import base64
import os
import pickle
import stat
from pathlib import Path

import httpx
import psutil
import pytest
import torch
from safetensors.torch import load_file

from slime_rl.core.config import Config
from slime_rl.core.contracts import SamplingParams
from slime_rl.rollout_sglang.engine import SGLangEngine
from slime_rl.rollout_sglang.keys import ENV_ADMIN_KEY, ENV_API_KEY, EngineKeys, bearer
from slime_rl.rollout_sglang.server import ServerStartError, start_server, wait_healthy
from slime_rl.rollout_sglang.weights import server_api

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)


def make_config(tiny_model, standin_python, tmp_path, **rollout) -> Config:
    return Config.model_validate({
        "model": {"path": str(tiny_model)},
        "rollout": {"engine": "sglang", "sglang": {"engine_python": standin_python, **rollout}},
        "cluster": {"device": "cpu", "colocate": True, "actor_num_gpus_per_node": 1, "rollout_num_gpus": 1,
                    "rollout_num_gpus_per_engine": 1},
        "logging": {"dir": str(tmp_path)},
    })


def state(url: str) -> dict:
    return httpx.get(f"{url}/standin/state", timeout=10).json()


def stranger_bodies(model_dir: Path) -> dict[str, dict]:
    """What an attacker would send: its own weights (by file and by value), a memory release, an
    abort of everything, a pause, and a weight-update group it hosts."""
    zeros = [(n, torch.zeros_like(t)) for n, t in load_file(str(model_dir / "model.safetensors")).items()]
    payload = base64.b64encode(pickle.dumps(zeros)).decode()
    return {
        "/update_weights_from_disk": {"model_path": str(model_dir)},
        "/update_weights_from_tensor": {"serialized_named_tensors": [payload]},
        "/release_memory_occupation": {"tags": None},
        "/abort_request": {"abort_all": True},
        "/pause_generation": {"mode": "abort"},
        "/init_weights_update_group": {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1,
                                       "world_size": 2, "group_name": "evil", "backend": "gloo"},
    }


@pytest.fixture(scope="module")
def engine(tiny_model, standin_python, tmp_path_factory):
    cfg = make_config(tiny_model, standin_python, tmp_path_factory.mktemp("keys"),
                      server_args={"standin_token_delay": 0.002})
    engine = SGLangEngine.from_config(cfg)
    yield engine
    asyncio.run(engine.shutdown())


def test_weight_update_memory_release_and_abort_without_the_key_are_refused(engine, tiny_model):
    url = engine.engine_urls[0]
    fingerprint = state(url)["fingerprint"]
    api_only = bearer(engine.keys.api_key)  # what the router holds: not enough for admin endpoints
    for path, body in stranger_bodies(tiny_model).items():
        for headers in ({}, {"Authorization": "Bearer guess"}, api_only):
            resp = httpx.post(f"{url}{path}", json=body, headers=headers, timeout=10)
            assert resp.status_code == 401, (path, headers.keys(), resp.text)
    for path in ("/generate", "/server_info", "/model_info"):  # the api key guards these
        assert httpx.request("POST" if path == "/generate" else "GET", f"{url}{path}", timeout=10,
                             json={"input_ids": [1], "sampling_params": {"max_new_tokens": 1}}).status_code == 401
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200  # open, as in SGLang
    after = state(url)
    assert after["fingerprint"] == fingerprint and all(after["memory"].values()) and not after["paused"]
    refused = {e["path"] for e in after["events"] if e["kind"] == "refused"}
    assert set(stranger_bodies(tiny_model)) <= refused
    assert not [e for e in after["events"] if e["kind"].startswith(("update_weights", "release", "pause"))]


def test_the_router_refuses_strangers_and_has_no_weight_or_memory_endpoints(engine, tiny_model):
    router, url = engine.router.url, engine.engine_urls[0]
    fingerprint = state(url)["fingerprint"]
    for path, body in stranger_bodies(tiny_model).items():
        for headers in ({}, bearer(engine.keys.router_key)):  # sglang-router 0.3.2 does not forward them
            assert httpx.post(f"{router}{path}", json=body, headers=headers, timeout=10).status_code == 404
    generate = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}
    assert httpx.post(f"{router}/generate", json=generate, timeout=10).status_code == 401
    assert httpx.post(f"{router}/generate", json=generate, headers=bearer(engine.keys.api_key),
                      timeout=10).status_code == 401  # the servers' key is not the router's
    # its control plane: no registering a worker of one's own, no listing, no cache flush
    assert httpx.post(f"{router}/workers", json={"url": "http://127.0.0.1:9"}, timeout=10).status_code == 401
    assert httpx.get(f"{router}/workers", timeout=10).status_code == 401
    assert httpx.post(f"{router}/flush_cache", timeout=10).status_code == 401
    assert [w["url"] for w in engine.router.workers()] == engine.engine_urls
    assert state(url)["fingerprint"] == fingerprint


def test_the_engine_with_the_run_keys_works_end_to_end(engine, tiny_model):
    url = engine.engine_urls[0]
    before = asyncio.run(engine.generate([5, 6, 7], GREEDY))
    assert len(before.token_ids) == 6
    weights = [(n, (t.float() * 0.5 + 0.01).to(t.dtype))
               for n, t in sorted(load_file(str(tiny_model / "model.safetensors")).items())]
    asyncio.run(engine.update_weights(weights, version=1, last=True))
    after = asyncio.run(engine.generate([5, 6, 7], GREEDY))
    assert after.weight_version == 1 and after.token_ids != before.token_ids
    asyncio.run(engine.release_memory())
    assert not any(state(url)["memory"].values())
    asyncio.run(engine.resume_memory())

    async def abort_one():
        long = SamplingParams(max_new_tokens=2000, ignore_eos=True)  # 2 + 2000 fit the context of 2048
        task = asyncio.create_task(engine.generate([1, 2], long, request_id="to-abort"))
        while not state(url)["running"]:
            await asyncio.sleep(0.02)
        await engine.abort("to-abort")
        return await task

    aborted = asyncio.run(abort_one())
    assert aborted.finish_reason == "abort" and len(aborted.token_ids) < 2000
    kinds = [e["kind"] for e in state(url)["events"]]
    assert {"update_weights_from_tensor", "release_memory_occupation", "resume_memory_occupation",
            "abort_request"} <= set(kinds)
    assert "refused" not in kinds[kinds.index("update_weights_from_tensor"):]  # our calls all carried the key


def test_keys_never_show_in_the_process_table_and_logs_are_private(engine):
    keys = engine.keys
    secrets = [keys.api_key, keys.admin_key, keys.router_key]
    assert len(set(secrets)) == 3 and all(s and len(s) > 40 for s in secrets)
    pids = [s.process.pid for s in engine.servers] + [engine.router.process.pid]
    for pid in pids:
        for proc in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
            cmdline = " ".join(proc.cmdline())
            assert not any(s in cmdline for s in secrets), cmdline
    for log in (engine.work_dir / "logs").iterdir():
        assert stat.S_IMODE(log.stat().st_mode) == 0o600, log
    assert all(s.key_file is None for s in engine.servers)  # the key file is gone once a server is up
    assert "sk" not in repr(keys) and keys.admin_key not in repr(engine.targets()[0])


def test_weight_update_group_store_listens_on_loopback_only(engine, tiny_model):
    """The rendezvous of an NCCL/gloo sync binds the address the run chose, not every interface
    (a plain torch TCPStore listens on *:PORT)."""
    weights = [(n, t * 2) for n, t in sorted(load_file(str(tiny_model / "model.safetensors")).items())]
    engine.transport = "nccl"  # gloo on CPU tensors, through the same group code
    try:
        asyncio.run(engine.update_weights(weights, version=2, last=True))
        port = [e for e in state(engine.engine_urls[0])["events"] if e["kind"] == "init_weights_update_group"][-1]
        port = port["master_port"]
        listening = [c.laddr.ip for c in psutil.net_connections("tcp") if c.status == "LISTEN" and c.laddr.port == port]
        assert listening == ["127.0.0.1"]
        mine = [c.laddr.ip for c in psutil.Process(os.getpid()).net_connections("tcp") if c.status == "LISTEN"]
        assert mine and all(ip.startswith("127.") for ip in mine), mine
    finally:
        engine.transport = "auto"
        engine.weights.pusher.drop_group(engine.targets())


@pytest.fixture
def keyed_server(tiny_model, standin_python, tmp_path, monkeypatch):
    """A stand-in server started with its own keys, healthy, and neither key in this process's environment:
    (the server, its keys)."""
    keys = EngineKeys.generate()
    server = start_server(0, str(tiny_model), log_dir=tmp_path, python=standin_python, keys=keys)
    try:
        wait_healthy(server, 120)
        monkeypatch.delenv(ENV_API_KEY, raising=False)
        monkeypatch.delenv(ENV_ADMIN_KEY, raising=False)
        yield server, keys
    finally:
        server.process.stop()


def test_attached_servers_take_their_keys_from_the_environment(keyed_server, tmp_path, monkeypatch):
    server, keys = keyed_server
    with pytest.raises(ServerStartError, match=f"refused our key .*set {ENV_API_KEY}"):
        SGLangEngine.attach([server.url], work_dir=tmp_path / "a", health_interval=0)
    monkeypatch.setenv(ENV_API_KEY, keys.api_key)
    monkeypatch.setenv(ENV_ADMIN_KEY, keys.admin_key)
    engine = SGLangEngine.attach([server.url], work_dir=tmp_path / "b", health_interval=0)
    try:
        assert len(asyncio.run(engine.generate([1, 2], GREEDY)).token_ids) == 6
        asyncio.run(engine.release_memory())
        asyncio.run(engine.resume_memory())
        assert engine.router.key not in (keys.api_key, keys.admin_key)  # its own router, its own key
    finally:
        asyncio.run(engine.shutdown())


def test_attached_servers_take_their_keys_from_the_configs_secrets(keyed_server, tiny_model, standin_python,
                                                                    tmp_path, monkeypatch):
    """rollout.sglang.api_key / admin_api_key: Secrets (config/secrets.py), an env:NAME reference or inline;
    the config as saved or printed holds neither key."""
    server, keys = keyed_server
    monkeypatch.setenv("TEST_ENGINE_KEY_34", keys.api_key)
    cfg = make_config(tiny_model, standin_python, tmp_path, engine_urls=[server.url],
                      api_key="env:TEST_ENGINE_KEY_34", admin_api_key=keys.admin_key)
    saved = cfg.to_yaml()
    assert keys.api_key not in saved and keys.admin_key not in saved and "env:TEST_ENGINE_KEY_34" in saved
    engine = SGLangEngine.from_config(Config.model_validate(cfg.to_dict(reveal_secrets=True)))
    try:
        assert len(asyncio.run(engine.generate([1, 2], GREEDY)).token_ids) == 6
        asyncio.run(engine.release_memory())  # an admin endpoint: the admin key went through
        asyncio.run(engine.resume_memory())
    finally:
        asyncio.run(engine.shutdown())


@pytest.mark.parametrize("engine_args, field", [({"tokenizer_worker_num": 2}, "tokenizer_worker_num"),
                                                ({"grpc_port": 30100}, "grpc_port"),
                                                ({"api_key": "mine"}, "api_key")])
def test_engine_args_that_would_open_or_override_the_keys_are_refused(engine_args, field, tiny_model, tmp_path):
    with pytest.raises(ValueError, match=f"rollout.sglang.server_args.{field}: "):
        start_server(0, str(tiny_model), log_dir=tmp_path, engine_args=engine_args, keys=EngineKeys.generate())


def test_a_target_without_the_admin_key_is_told_so(engine):
    stranger = server_api.Target("sglang engine 0", engine.engine_urls[0])
    with pytest.raises(server_api.WeightSyncError, match="release memory: /release_memory_occupation answered HTTP 401"):
        server_api.release_memory([stranger], None, timeout=10)
