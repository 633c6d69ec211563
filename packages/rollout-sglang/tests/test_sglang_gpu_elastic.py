"""GPU acceptance of issue 42 with real SGLang 0.5.17 on one GPU (stages `elastic-delta-tensor`,
`elastic-delta-disk`, `elastic-pool` of scripts/gpu/run.sh, one call each):

- delta syncs through the custom weight loader into two servers on the GPU, 20 versions by value and by disk,
  one server restarted at version 8 and one joining at 13; SGLang's /weights_checker compares every
  parameter it holds whole with the trainer's after every sync;
- elastic engines: an `EnginePool` of SGLang engines on the one GPU (each its own server and router, each
  with the memory fraction left to it), an engine added while requests run and the first removed while
  requests run on it: no request lost or cut short, rollout tokens/s before and after printed.

    python -m pytest packages/rollout-sglang/tests/test_sglang_gpu_elastic.py -m gpu -s
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from delta_versions import next_version
from test_sglang_gpu import ENGINE_ARGS, gpu_config, hf_weights, make_tiny_llama  # noqa: E402

from slime_rl.core.contracts import SamplingParams
from slime_rl.core.run.engine_pool import EnginePool
from slime_rl.rollout_sglang.engine import SGLangEngine
from slime_rl.rollout_sglang.server import start_server, wait_healthy
from slime_rl.rollout_sglang.weights import verify
from slime_rl.rollout_sglang.weights.delta_loader import LOADER
from slime_rl.rollout_sglang.weights.delta_push import DeltaPusher
from slime_rl.rollout_sglang.weights.server_api import Target

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]
ARGS = {**ENGINE_ARGS, "mem_fraction_static": 0.1, "max_total_tokens": 2**18}


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def _server(index, model, tmp_path):
    server = start_server(index, str(model), log_dir=tmp_path / f"s{index}",
                          engine_args={**ARGS, "custom_weight_loader": [LOADER]})
    wait_healthy(server, 600)
    return server


@pytest.mark.parametrize("transport", ["tensor", "disk"])
def test_delta_syncs_into_real_sglang_are_bit_exact_through_a_restart_and_a_late_joiner(transport, tiny_llama,
                                                                                        tmp_path):
    weights = dict(hf_weights(tiny_llama, "cpu"))
    servers = [_server(0, tiny_llama, tmp_path), _server(1, tiny_llama, tmp_path)]
    pusher = DeltaPusher(weights_dir=tmp_path / "weights", timeout=120, bucket_bytes=2**20)
    gen = torch.Generator().manual_seed(0)
    try:
        for version in range(1, 21):
            next_version(weights, gen)
            if version == 8:
                servers[1].process.stop()
                servers[1] = _server(1, tiny_llama, tmp_path)
            if version == 13:
                servers.append(_server(2, tiny_llama, tmp_path))
            targets = [Target(f"server {s.index}", s.url) for s in servers]
            started = time.perf_counter()
            pusher.send(targets, iter([list(weights.items())]), version=version, transport=transport)
            seconds = time.perf_counter() - started
            expected = verify.check_sample(list(weights.items()), every=True)
            compared = [verify.check_weights(t, expected, timeout=60, step=f"v{version}") for t in targets]
            s = pusher.last
            print(f"v{version} {transport}: delta={s.delta} changed={s.changed / s.numel:.2%} "
                  f"moved={s.bytes_moved / 1e6:.2f} MB of {s.full_bytes / 1e6:.2f} MB, {seconds:.2f} s, "
                  f"checked {compared} tensors, full pushes so far {pusher.full_pushes}")
            assert all(c == len(expected) for c in compared)
        assert pusher.full_pushes == 2
    finally:
        for server in servers:
            server.process.stop()


def test_an_engine_joins_and_one_leaves_while_requests_run(tiny_llama, tmp_path):
    cfg = gpu_config(tiny_llama, tmp_path / "run", engine_args=ARGS)
    pool = EnginePool(lambda: SGLangEngine.from_config(cfg), SGLangEngine.from_config(cfg), max_engines=3)
    params = SamplingParams(temperature=1.0, max_new_tokens=256, ignore_eos=True)
    windows: list[tuple[str, float]] = []
    finished: list = []  # every request's output, in the order they end

    async def window(label: str, seconds: float) -> None:
        start, done_before = time.perf_counter(), sum(len(o.token_ids) for o in finished)
        await asyncio.sleep(seconds)
        windows.append((label, (sum(len(o.token_ids) for o in finished) - done_before)
                        / (time.perf_counter() - start)))

    async def main():
        # a steady load of 128 requests until the last window ends: the tiny model finishes a fixed batch of
        # requests (2,000 x 256 tokens) in under a minute, sooner than a second SGLang server starts on an H100
        stop = asyncio.Event()

        async def client(k: int) -> None:
            while not stop.is_set():
                finished.append(await pool.generate([1, 17 + k % 200, 230, 41, 512, 9], params))
                k += 128

        clients = [asyncio.create_task(client(k)) for k in range(128)]
        await window("1 engine", 20)
        await pool.add_engines(1)
        await window("2 engines", 20)
        moved = await pool.remove_engine("engine-0")
        await window("1 engine (after removing engine-0)", 20)
        stop.set()
        await asyncio.gather(*clients)
        return moved

    try:
        moved = asyncio.run(main())
    finally:
        asyncio.run(pool.shutdown())
    for label, rate in windows:
        print(f"rollout tokens/s, {label}: {rate:.0f}")
    print(f"requests moved by the removal: {moved}; requests finished: {len(finished)}")
    assert all(rate > 0 for _, rate in windows)
    assert moved >= 1 and all(len(o.token_ids) == 256 and o.finish_reason == "length" for o in finished)
