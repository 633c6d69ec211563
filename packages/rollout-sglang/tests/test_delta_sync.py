"""Delta syncs into stand-in SGLang servers through the custom weight loader (weights/delta_loader.py, delta_push.py):
20 versions by each transport, a server restarted in the middle and one joining late, every server's weights
checked whole by /weights_checker after every sync; the loader's chain refuses what it cannot build on."""

from __future__ import annotations

import pytest
import torch
from delta_versions import next_version
from safetensors.torch import load_file

from slime_rl.core.weights.delta import DeltaChainBroken, header
from slime_rl.rollout_sglang.server import start_server, wait_healthy
from slime_rl.rollout_sglang.weights import verify
from slime_rl.rollout_sglang.weights.delta_loader import FULL, LOADER, _Kept, rebuild
from slime_rl.rollout_sglang.weights.delta_push import DeltaPusher, full_chunks
from slime_rl.rollout_sglang.weights.server_api import Target


def test_the_loader_builds_only_on_the_version_it_loaded():
    kept = _Kept()
    w = torch.zeros(8, dtype=torch.bfloat16)
    with pytest.raises(DeltaChainBroken, match="loaded nothing"):
        rebuild([header(3, 4), ("w#idx", torch.tensor([0], dtype=torch.int32)), ("w#val", w[:1] + 1)], kept)
    assert rebuild([header(FULL, 4), ("w", w)], kept)[0][0] == "w" and kept.version == 4
    new = rebuild([header(4, 5), ("w#idx", torch.tensor([2], dtype=torch.int32)), ("w#val", w[:1] + 1)], kept)
    assert new[0][1][2] == 1 and kept.version == 5
    with pytest.raises(DeltaChainBroken, match="version 5"):
        rebuild([header(4, 6), ("w#idx", torch.tensor([2], dtype=torch.int32)), ("w#val", w[:1])], kept)


def test_a_full_push_keeps_each_mla_q_a_proj_with_its_kv_a_proj():
    """A server behind the delta's base gets the kept copy re-cut into buckets; SGLang drops an MLA layer's
    q_a_proj and kv_a_proj_with_mqa unless both come in one load call, so no bucket ends between them, even where
    the size bound falls right on the q_a_proj (here: every tensor is 64 bytes, the bound 128)."""
    names = [f"model.layers.{i}.self_attn.{part}.weight" for i in range(3)
             for part in ("q_a_layernorm", "q_a_proj", "kv_a_proj_with_mqa", "kv_b_proj")]
    tensors = [(name, torch.zeros(16)) for name in names]
    chunks = full_chunks(tensors, bucket_bytes=128)
    assert [name for chunk in chunks for name, _ in chunk] == names  # every tensor once, in order
    assert all(sum(t.numel() * t.element_size() for _, t in chunk) >= 128 for chunk in chunks[:-1])
    for chunk in chunks:
        held = [name for name, _ in chunk]
        for name in held:
            if name.endswith("q_a_proj.weight"):
                assert name.replace("q_a_proj", "kv_a_proj_with_mqa") in held, held
    # other names are cut at the bound as before
    assert [len(c) for c in full_chunks([(f"w{i}", torch.zeros(16)) for i in range(5)], bucket_bytes=128)] == [2, 2, 1]


def _server(index, tiny_model, tmp_path, standin_python):
    server = start_server(index, str(tiny_model), log_dir=tmp_path / f"s{index}", python=standin_python,
                          engine_args={"custom_weight_loader": [LOADER]})
    wait_healthy(server, 120)
    return server


def _target(server) -> Target:
    return Target(f"server {server.index}", server.url)


@pytest.mark.slow  # starts 4 stand-in server processes, ~15 s on 2 cores
@pytest.mark.parametrize("transport", ["tensor", "disk"])
def test_twenty_delta_syncs_stay_bit_exact_through_a_restart_and_a_late_joiner(
        transport, tiny_model, standin_python, tmp_path):
    weights = {k: v for k, v in load_file(str(tiny_model / "model.safetensors")).items()}
    servers = [_server(0, tiny_model, tmp_path, standin_python), _server(1, tiny_model, tmp_path, standin_python)]
    pusher = DeltaPusher(weights_dir=tmp_path / "weights", timeout=60, bucket_bytes=256)
    gen = torch.Generator().manual_seed(0)
    try:
        for version in range(1, 21):
            next_version(weights, gen)
            if version == 8:  # server 1 restarts: a new process, nothing kept by its loader
                servers[1].process.stop()
                servers[1] = _server(1, tiny_model, tmp_path, standin_python)
            if version == 13:
                servers.append(_server(2, tiny_model, tmp_path, standin_python))
            targets = [_target(s) for s in servers]
            full_before = pusher.full_pushes
            buckets = [[(n, t)] for n, t in weights.items()]  # one tensor a bucket: several buckets a sync
            pusher.send(targets, iter(buckets), version=version, transport=transport)
            expected = verify.check_sample(list(weights.items()), every=True)
            for target in targets:
                assert verify.check_weights(target, expected, timeout=30, step=f"v{version}") == len(expected)
            assert pusher.full_pushes - full_before == (1 if version in (8, 13) else 0), version
            if version > 1:
                assert pusher.last.delta and pusher.last.bytes_moved < pusher.last.full_bytes
        # a delta the restarted or new server could not build on would have killed it, as it kills SGLang's scheduler
        assert all(s.process.alive() for s in servers)
    finally:
        for server in servers:
            server.process.stop()


def test_a_delta_onto_a_version_the_server_never_loaded_kills_it_as_it_kills_sglang(tiny_model, standin_python,
                                                                                     tmp_path):
    """SGLang 0.5.17 calls a custom loader unguarded (weight_updater.py): `DeltaChainBroken` ends the server,
    unanswered. The stand-in does the same, so the pusher's check of each server's version before a delta is
    what the CPU tests prove."""
    import base64
    import pickle

    from slime_rl.rollout_sglang.weights.server_api import WeightSyncError, post

    server = _server(0, tiny_model, tmp_path, standin_python)
    try:
        bucket = [header(3, 4), ("lm_head.weight#idx", torch.tensor([0], dtype=torch.int32)),
                  ("lm_head.weight#val", torch.ones(1))]
        payload = base64.b64encode(pickle.dumps(bucket)).decode("ascii")
        with pytest.raises(WeightSyncError, match="Server disconnected|RemoteProtocolError|ConnectError"):
            post(_target(server), "/update_weights_from_tensor",
                 {"serialized_named_tensors": [payload], "load_format": LOADER}, timeout=30, step="delta onto v3")
        server.process.popen.wait(timeout=30)
        assert not server.process.alive()
        assert "DeltaChainBroken" in server.process.log_tail()
    finally:
        server.process.stop()
