"""SGLangEngine end to end on CPU: launched from a config through the same code the GPU run
uses, with stand-in SGLang workers (a test double) behind the real sglang-router."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from slime_rl.core.config import Config
from slime_rl.core.contracts import SamplingParams
from slime_rl.core.infra.plugins import load_plugin
from slime_rl.rollout_sglang.client import GenerateError
from slime_rl.rollout_sglang.engine import SGLangEngine
from slime_rl.rollout_sglang.keys import bearer
from slime_rl.rollout_sglang.settings import SGLangSettings
from slime_rl.rollout_sglang.weights import ipc, server_api, verify
from slime_rl.rollout_sglang.weights.server_api import WeightSyncError
from slime_rl.rollout_sglang.weights.trainer_sender import SGLangWeightSender

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)


def make_config(tiny_model, standin_python, tmp_path, num_engines: int = 2, trainer: dict | None = None,
                **rollout) -> Config:
    """``rollout`` holds core's rollout keys and rollout.sglang's (SGLangSettings), ``engine_args`` its server_args."""
    server_args = {"standin_token_delay": 0.002, **rollout.pop("engine_args", {})}
    sglang = {key: rollout.pop(key) for key in list(rollout) if key in SGLangSettings.model_fields}
    return Config.model_validate({
        "model": {"path": str(tiny_model)},
        "trainer": trainer or {},
        "rollout": {"engine": "sglang", **rollout,
                    "sglang": {"engine_python": standin_python, "server_args": server_args, **sglang}},
        "cluster": {"device": "cpu", "colocate": True, "actor_num_gpus_per_node": 2, "rollout_num_gpus": num_engines,
                    "rollout_num_gpus_per_engine": 1},
        "logging": {"dir": str(tmp_path)},
    })


@pytest.fixture
def make_engine(tiny_model, standin_python, tmp_path):
    """A fresh engine per test, for tests that change its weights or kill its servers."""
    engines = []

    def make(num_engines: int = 2, **rollout) -> SGLangEngine:
        cfg = make_config(tiny_model, standin_python, tmp_path / f"run{len(engines)}", num_engines, **rollout)
        engines.append(SGLangEngine.from_config(cfg))
        return engines[-1]

    yield make
    for engine in engines:
        asyncio.run(engine.shutdown())


@pytest.fixture(scope="module")
def shared_engine(tiny_model, standin_python, tmp_path_factory):
    """Two engines on their initial weights, shared by the tests that leave them so."""
    engine = SGLangEngine.from_config(make_config(tiny_model, standin_python, tmp_path_factory.mktemp("shared"),
                                                  max_concurrency=3))
    yield engine
    asyncio.run(engine.shutdown())


def state(url: str) -> dict:
    return httpx.get(f"{url}/standin/state", timeout=10).json()


def events(url: str, *kinds: str) -> list[dict]:
    return [e for e in state(url)["events"] if e["kind"] in kinds]


def new_weights(tiny_model, scale: float) -> list[tuple[str, torch.Tensor]]:
    """The model's weights, changed (a trainer step's worth, in spirit)."""
    weights = load_file(str(tiny_model / "model.safetensors"))
    return [(name, (t.float() * scale + 0.01).to(t.dtype)) for name, t in sorted(weights.items())]


def test_entry_point_names_this_engine():
    assert load_plugin("slime_rl.rollout_engines", "sglang") is SGLangEngine


def test_generate_token_in_token_out_through_the_router(shared_engine):
    engine = shared_engine
    params = SamplingParams(temperature=1.0, max_new_tokens=10, ignore_eos=True)

    async def run():
        return await asyncio.gather(*(engine.generate([3, 4, 5, i], params, request_id=f"r{i}") for i in range(6)))

    outs = asyncio.run(run())
    for out in outs:
        assert len(out.token_ids) == 10 and len(out.log_probs) == 10
        assert out.finish_reason == "length" and out.weight_version == 0
        assert all(lp < 0 for lp in out.log_probs)
    per_engine = [len([e for e in events(url, "generate") if e["rid"].startswith("r")]) for url in engine.engine_urls]
    assert per_engine == [3, 3]  # round robin over both engines
    # rids on the wire are unique per call: "r1" never prefixes "r10" in SGLang's prefix-matched aborts
    wire = [e["rid"] for url in engine.engine_urls for e in events(url, "generate") if e["rid"].startswith("r")]
    assert {rid.split("#")[0] for rid in wire} == {f"r{i}" for i in range(6)} and len(set(wire)) == 6


def test_turns_of_one_session_go_to_one_engine_with_the_manual_policy(make_engine):
    """A request id ``<session>/<turn>`` is the router's routing key: under rollout.sglang.router_policy=manual every
    turn of an episode reaches the engine holding its prefix, and the cached tokens come back."""
    engine = make_engine(router_policy="manual")
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)

    async def episode(session: str) -> list[int | None]:
        ids, cached = [5, 6, 7], []
        for turn in range(3):
            out = await engine.generate(ids, params, request_id=f"{session}/{turn}")
            ids, cached = ids + out.token_ids + [9], cached + [out.cached_tokens]
        return cached

    async def episodes() -> list[list[int | None]]:
        return await asyncio.gather(*(episode(f"s{k}") for k in range(6)))

    cached = asyncio.run(episodes())
    for k in range(6):
        homes = {url for url in engine.engine_urls
                 if any(e["rid"].startswith(f"s{k}/") for e in events(url, "generate"))}
        assert len(homes) == 1, (k, homes)
    # later turns find all of the episode but the observation id appended since: 3 + 4 (+ 1 + 4) tokens
    assert all(c[1] >= 7 and c[2] >= 12 for c in cached), cached


def test_stop_token_and_greedy_determinism(shared_engine):
    engine = shared_engine
    first = asyncio.run(engine.generate([9, 8, 7], GREEDY))
    again = asyncio.run(engine.generate([9, 8, 7], GREEDY))
    assert first.token_ids == again.token_ids  # greedy is deterministic, whichever engine served it
    stop_at = first.token_ids[3]
    k = first.token_ids.index(stop_at)
    stopped = asyncio.run(engine.generate([9, 8, 7], SamplingParams(temperature=0.0, max_new_tokens=12,
                                                                    stop_token_ids=[stop_at], ignore_eos=True)))
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == first.token_ids[:k + 1] and stopped.log_probs == first.log_probs[:k + 1]


def test_stop_strings_to_a_server_without_its_tokenizer_name_the_fix(shared_engine):
    # rollout.stop is empty, so the launch skipped SGLang's tokenizer; a generate function asking for stop strings
    # is refused by the server with words that name what to change in the config
    with pytest.raises(GenerateError, match=r"skip_tokenizer_init.*list them in rollout\.stop"):
        asyncio.run(shared_engine.generate([9, 8, 7], SamplingParams(temperature=0.0, max_new_tokens=4, stop=["a"])))


def test_a_request_past_the_context_length_is_refused_with_sglangs_words(shared_engine):
    # SGLang 0.5.17 refuses (HTTP 400) a prompt plus max_new_tokens over the context (2048 for the tiny model)
    with pytest.raises(GenerateError, match=r"HTTP 400.*maximum context length of 2048 tokens.*2050 tokens"):
        asyncio.run(shared_engine.generate([9, 8], SamplingParams(max_new_tokens=2048)))


def test_abort_all_then_one(shared_engine):
    engine = shared_engine  # max_concurrency=3
    long = SamplingParams(max_new_tokens=2000, ignore_eos=True)  # ~4 s at 2 ms a token; 2 + 2000 fit 2048

    async def run():
        tasks = {rid: asyncio.create_task(engine.generate([1, 2], long, request_id=rid))
                 for rid in ("a", "b", "c", "queued")}  # at most 3 in flight: "queued" waits for a slot
        await asyncio.sleep(0.5)
        await engine.abort()
        everything = await asyncio.wait_for(asyncio.gather(*tasks.values()), 20)
        x = asyncio.create_task(engine.generate([3], long, request_id="x"))
        y = asyncio.create_task(engine.generate([4], long, request_id="y"))
        await asyncio.sleep(0.5)
        await engine.abort("x")
        one = await asyncio.wait_for(x, 20)
        still_running = not y.done()
        await engine.abort("y")
        await asyncio.wait_for(y, 20)
        return everything, one, still_running

    (a, b, c, queued), x, y_was_running = asyncio.run(run())
    for out in (a, b, c, x):
        assert out.finish_reason == "abort" and 0 < len(out.token_ids) < 2000
        assert len(out.log_probs) == len(out.token_ids)
    assert queued.finish_reason == "abort" and queued.token_ids == []
    assert y_was_running  # aborting "x" left "y" alone
    seen = [e["rid"] for url in engine.engine_urls for e in events(url, "generate")]
    assert not any(rid.startswith("queued") for rid in seen)  # aborted before it reached a server
    # the engine serves normally afterwards
    assert asyncio.run(engine.generate([1, 2], GREEDY)).finish_reason == "length"


@pytest.mark.parametrize("transport", ["tensor", "disk", "nccl"])
def test_weight_sync_changes_generations_and_reports_the_version(make_engine, tiny_model, transport):
    engine = make_engine(update_weight_transport=transport)
    engine.verify_weights = True
    before = asyncio.run(engine.generate([5, 6, 7], GREEDY))
    weights = new_weights(tiny_model, 2.0)
    buckets = [weights[:1], weights[1:]]  # two buckets

    async def sync():
        for i, bucket in enumerate(buckets):
            await engine.update_weights(bucket, version=1, last=i == len(buckets) - 1)

    asyncio.run(sync())
    after = asyncio.run(engine.generate([5, 6, 7], GREEDY))
    assert engine.weight_version == 1 and after.weight_version == 1
    assert after.token_ids != before.token_ids  # the engines really generate from the new weights
    for url in engine.engine_urls:
        engine_lm_head = torch.tensor(httpx.post(f"{url}/get_weights_by_name", json={"name": "lm_head.weight"},
                                                 headers=bearer(engine.keys.admin_key), timeout=10).json())
        assert torch.equal(engine_lm_head, dict(weights)["lm_head.weight"].float()[:100])
        kinds = [e["kind"] for e in state(url)["events"] if e["kind"] != "generate_body" and e["kind"] != "generate"]
        update = {"tensor": "update_weights_from_tensor", "disk": "update_weights_from_disk",
                  "nccl": "update_weights_from_distributed"}[transport]
        first_update = kinds.index(update)
        # no request was out, so no pause and no continue (the engine's gate held generation); the cache
        # flushed after the last transfer
        assert "pause_generation" not in kinds and "continue_generation" not in kinds
        last_update = len(kinds) - 1 - kinds[::-1].index(update)
        assert "flush_cache" in kinds[last_update:] and "flush_cache" not in kinds[:first_update]
        versions = [e.get("weight_version") for e in events(url, update)]
        assert versions[-1] == "1" and all(v is None for v in versions[:-1])  # the version comes with the last part
    if transport == "disk":
        folder = engine.work_dir / "weights" / "v1"
        assert (folder / "config.json").is_file() and (folder / "model.safetensors.index.json").is_file()


def test_weight_check_compares_checksums_and_names_what_differs(make_engine, tiny_model):
    """rollout.sglang.check_weight_update compares the engines' checksums (/weights_checker, which serves every
    model family; /get_weights_by_name refused Qwen2 on SGLang 0.5.17): a tensor that differs is named,
    and a sample the engine holds under none of its names fails rather than passes."""
    engine = make_engine(num_engines=1)
    weights = new_weights(tiny_model, 2.0)
    asyncio.run(engine.update_weights(weights, version=1, last=True))
    target = engine.targets()[0]
    sample = verify.check_sample(weights, every=True)
    assert "lm_head.weight" in sample and not any(".q_proj." in n or ".up_proj." in n for n in sample)
    assert dict(weights)["lm_head.weight"].shape[0] % verify.VOCAB_PADDING  # held padded by the engine, as SGLang's
    assert verify.check_weights(target, sample, timeout=30, step="check") == len(sample)
    wrong = dict(sample, **{"lm_head.weight": verify.tensor_checksum(dict(weights)["lm_head.weight"] + 1)})
    with pytest.raises(WeightSyncError, match="lm_head.weight"):
        verify.check_weights(target, wrong, timeout=30, step="check")
    with pytest.raises(WeightSyncError, match="none of the 1 sampled"):
        verify.check_weights(target, {"model.layers.0.self_attn.qkv_proj.weight": "0"}, timeout=30, step="check")
    # with tensor parallelism only the norms, which every TP rank holds whole, are compared
    sharded = verify.check_sample(weights, tp_size=2, every=True)
    assert sharded and all("norm" in n for n in sharded)


def test_the_weight_check_hashes_a_vocabulary_padded_as_sglang_holds_it():
    """SGLang pads an embedding's and the LM head's rows to a multiple of 64 with zeros (a tiny VL model's 1,029
    ids failed the check on the H100 before this); other tensors and whole multiples are hashed as they are."""
    embed = torch.randn(300, 8).to(torch.bfloat16)
    padded = torch.cat([embed, torch.zeros(20, 8, dtype=torch.bfloat16)])
    named = [("model.embed_tokens.weight", embed), ("model.norm.weight", embed[:, 0]), ("lm_head.weight", padded)]
    assert verify.check_sample(named, every=True) == {"model.embed_tokens.weight": verify.tensor_checksum(padded),
                                                      "model.norm.weight": verify.tensor_checksum(embed[:, 0]),
                                                      "lm_head.weight": verify.tensor_checksum(padded)}


def test_the_weight_check_samples_no_tensor_sglang_fuses_for_deepseek():
    """SGLang 0.5.17 loads DeepSeek's q_a_proj and kv_a_proj_with_mqa into one fused_qkv_a_proj_with_mqa: a bucket
    holding just that pair (the trainer never splits it) offers no sample, and kv_b_proj, which SGLang keeps under
    its name (deriving w_kc/w_vc from it), is sampled."""
    tensor = torch.ones(2, 2)
    pair = [(f"model.layers.0.self_attn.{m}.weight", tensor) for m in ("q_a_proj", "kv_a_proj_with_mqa")]
    assert verify.check_sample(pair, every=True) == {}
    kv_b = "model.layers.0.self_attn.kv_b_proj.weight"
    assert list(verify.check_sample([*pair, (kv_b, tensor)], every=True)) == [kv_b]


def test_sync_and_memory_calls_go_on_when_asyncio_default_executor_is_full(make_engine, tiny_model):
    """Hung user code in asyncio's default executor (a plain reward stuck in a thread) must not stall
    the engine's control calls: they block in threads of the engine's own."""
    engine = make_engine(num_engines=1)
    stuck = threading.Event()

    async def run():
        loop = asyncio.get_running_loop()
        # every default thread, and more queued; they give up after 120 s, so that a regression fails, not hangs
        hung = [loop.run_in_executor(None, stuck.wait, 120) for _ in range(64)]
        try:
            weights = new_weights(tiny_model, 2.0)
            await asyncio.wait_for(engine.update_weights(weights, version=1, last=True), 30)
            await asyncio.wait_for(engine.release_memory(), 30)
            await asyncio.wait_for(engine.resume_memory(), 30)
            return await asyncio.wait_for(engine.generate([5, 6, 7], GREEDY), 30)
        finally:
            stuck.set()
            await asyncio.gather(*hung)

    out = asyncio.run(run())
    assert engine.weight_version == 1 and out.weight_version == 1 and out.finish_reason == "length"


def generate_through_a_sync(engine, tiny_model, request_id: str):
    """The answer to an 800-token greedy request (~1.6 s) with a weight sync to version 1 landing 0.4 s into it."""
    params = SamplingParams(temperature=0.0, max_new_tokens=800, ignore_eos=True)

    async def run():
        task = asyncio.create_task(engine.generate([2, 3], params, request_id=request_id))
        await asyncio.sleep(0.4)
        await engine.update_weights(new_weights(tiny_model, 3.0), version=1, last=True)
        return await asyncio.wait_for(task, 20)

    return asyncio.run(run())


def test_a_request_in_flight_during_a_sync_continues_on_the_new_weights(make_engine, tiny_model):
    engine = make_engine(num_engines=1)
    out = generate_through_a_sync(engine, tiny_model, "long")
    # cut short by the pause, then continued: one answer, all 800 tokens, finished on version 1
    assert out.finish_reason == "length" and len(out.token_ids) == 800 and len(out.log_probs) == 800
    assert out.weight_version == 1
    segments = sorted((e for url in engine.engine_urls for e in events(url, "generate") if e["rid"].startswith("long#")),
                      key=lambda e: e["time"])
    assert len(segments) == 2
    made_before = segments[1]["input_len"] - 2  # the second segment's prompt carries the first one's tokens
    assert 0 < made_before < 800 and segments[1]["sampling_params"]["max_new_tokens"] == 800 - made_before
    # each token's version: the first segment's on version 0, the continuation's on version 1
    assert out.token_versions == [0] * made_before + [1] * (800 - made_before)


def test_a_request_held_in_place_through_a_sync_counts_its_tokens_as_the_older_version(make_engine, tiny_model):
    """cluster.async_mode=fully pauses in place: the request is not cut, and SGLang's answer carries only the
    version at its finish, so every token counts as the version the request started on (staleness
    over-counted rather than under-counted)."""
    engine = make_engine(num_engines=1)
    engine.pause_mode = "in_place"
    out = generate_through_a_sync(engine, tiny_model, "held")
    assert out.finish_reason == "length" and out.weight_version == 1 and out.token_versions == [0] * 800
    assert [e["mode"] for e in events(engine.engine_urls[0], "pause_generation")] == ["in_place"]
    assert len([e for e in events(engine.engine_urls[0], "generate") if e["rid"].startswith("held#")]) == 1


def test_a_request_that_reaches_a_server_as_a_sync_pauses_it_is_sent_again(make_engine, tiny_model):
    """The race of a sync with a request already on its way: it reaches the server after the pause, waits there,
    and pause(abort)'s abort-all marks it, so after continue SGLang 0.5.17 answers HTTP 499 'Request ... was
    aborted' (RequestAbortedError), never a response: the engine sends it again on the new weights."""
    engine = make_engine(num_engines=1)
    url = engine.engine_urls[0]
    params = SamplingParams(temperature=0.0, max_new_tokens=20, ignore_eos=True)

    async def run():
        server_api.pause_generation(engine.targets(), timeout=10, step="test", mode="in_place")  # the pause got there first
        task = asyncio.create_task(engine.generate([2, 3], params, request_id="late"))
        deadline = time.monotonic() + 30
        while not state(url)["running"] and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await engine.update_weights(new_weights(tiny_model, 3.0), version=1, last=True)
        return await asyncio.wait_for(task, 20)

    out = asyncio.run(run())
    assert out.finish_reason == "length" and len(out.token_ids) == 20 and out.weight_version == 1
    attempts = [e["rid"] for e in events(url, "generate") if e["rid"].startswith("late#")]
    assert len(attempts) == 2 and attempts[0] in state(url)["completed"]  # the first was answered 499


@pytest.mark.parametrize("in_flight", [False, True])
def test_trainer_side_sync_with_the_weight_sync_functions(make_engine, tiny_model, in_flight):
    """A trainer process pushes the buckets itself (its CUDA tensors never leave it): the engine holds
    generation before and lets it go after; the servers are paused (and continued) only when a request is
    out, which the synchronous loop's syncs never have."""
    engine = make_engine(num_engines=1)
    before = asyncio.run(engine.generate([5, 6], GREEDY))
    weights = new_weights(tiny_model, 0.5)
    params = SamplingParams(temperature=0.0, max_new_tokens=800, ignore_eos=True)  # ~1.6 s

    async def sync():
        task = asyncio.create_task(engine.generate([2, 3], params, request_id="long")) if in_flight else None
        await asyncio.sleep(0.4)
        targets = await engine.begin_weight_sync(1)
        waiting = asyncio.create_task(engine.generate([5, 6], GREEDY, request_id="during"))
        # ... these calls run in the trainer process, given `targets` ...
        ipc.push_tensor_bucket(targets, weights[:2], version=None, timeout=60, step="v1 bucket 0")
        ipc.push_tensor_bucket(targets, weights[2:], version=1, timeout=60, step="v1 bucket 1")
        await engine.end_weight_sync(1)
        return await asyncio.wait_for(waiting, 20), task and await asyncio.wait_for(task, 20)

    during, long = asyncio.run(sync())
    after = asyncio.run(engine.generate([5, 6], GREEDY))
    assert engine.weight_version == 1 and after.weight_version == 1 and after.token_ids != before.token_ids
    # a request made during the sync waited for it: it ran on the new weights
    assert during.weight_version == 1 and during.token_ids == after.token_ids
    kinds = [e["kind"] for e in state(engine.engine_urls[0])["events"]
             if e["kind"] not in ("generate", "generate_body")]
    pushes = ["update_weights_from_tensor", "update_weights_from_tensor", "flush_cache"]
    if in_flight:
        assert kinds[-5:] == ["pause_generation", *pushes, "continue_generation"]
        assert long.finish_reason == "length" and long.weight_version == 1
    else:
        assert kinds[-3:] == pushes and "pause_generation" not in kinds and "continue_generation" not in kinds


@pytest.mark.parametrize("transport", ["tensor", "disk", "nccl"])
def test_the_trainers_sender_pushes_by_the_engines_transports(tiny_model, standin_python, tmp_path, transport):
    """SGLangWeightSender (in a trainer rank) and the engine push through the one BucketPusher: every
    transport lands, the version is reported with the last bucket, a disk sync goes where the engine
    looks for it (a restore after a memory release reloads it from there), the NCCL group is made once."""
    cfg = make_config(tiny_model, standin_python, tmp_path, num_engines=1, update_weight_transport=transport,
                      check_weight_update=True)
    engine = SGLangEngine.from_config(cfg)
    sender = SGLangWeightSender(cfg, rank=0)
    url = engine.engine_urls[0]
    try:
        async def sync(version: int, weights) -> None:
            targets = await engine.begin_weight_sync(version, transport=transport)
            # ... this runs in trainer rank 0, given `targets` ...
            sender.send(iter([weights[:1], weights[1:]]), targets, version=version, transport=transport)
            await engine.end_weight_sync(version)

        before = asyncio.run(engine.generate([5, 6, 7], GREEDY))
        asyncio.run(sync(1, new_weights(tiny_model, 2.0)))
        asyncio.run(sync(2, new_weights(tiny_model, 0.5)))
        after = asyncio.run(engine.generate([5, 6, 7], GREEDY))
        assert engine.weight_version == 2 and after.weight_version == 2 and after.token_ids != before.token_ids
        update = {"tensor": "update_weights_from_tensor", "disk": "update_weights_from_disk",
                  "nccl": "update_weights_from_distributed"}[transport]
        versions = [e.get("weight_version") for e in events(url, update)]
        assert versions == ([None, "1", None, "2"] if transport != "disk" else ["1", "2"])
        assert len(events(url, "init_weights_update_group")) == (1 if transport == "nccl" else 0)
        if transport == "disk":
            weights_dir = engine.work_dir / "weights"
            assert [e["model_path"] for e in events(url, update)] == [str(weights_dir / "v1"), str(weights_dir / "v2")]
            assert not (weights_dir / "v1").exists()  # the previous version's folder goes once the next is in
            asyncio.run(engine.release_memory())
            asyncio.run(engine.resume_memory())  # no CPU backup: the weights must be loaded again before generating
            again = asyncio.run(engine.generate([5, 6, 7], GREEDY))
            assert events(url, update)[-1]["model_path"] == str(weights_dir / "v2")
            assert again.token_ids == after.token_ids and again.weight_version == 2
    finally:
        sender.pusher.drop_group(sender.pusher.group_targets)
        asyncio.run(engine.shutdown())


def test_sync_errors_name_the_engine_and_the_step(make_engine, tiny_model):
    engine = make_engine(num_engines=1)
    bad = [("model.no_such_layer.weight", torch.zeros(3))]
    with pytest.raises(WeightSyncError, match=r"sglang engine 0 \(http://127.0.0.1:\d+\): weight sync v1 bucket 0 "
                                              r"\(tensor\): /update_weights_from_tensor .*unknown parameter"):
        asyncio.run(engine.update_weights(bad, version=1, last=True))
    assert engine.weight_version == 0
    # a failed sync holds generation until a complete one arrives
    asyncio.run(engine.update_weights(new_weights(tiny_model, 1.5), version=1, last=True))
    assert asyncio.run(engine.generate([1], GREEDY)).weight_version == 1


def test_release_and_resume_memory(make_engine):
    engine = make_engine(num_engines=1)

    async def run():
        await engine.release_memory()
        for url in engine.engine_urls:
            assert state(url)["memory"] == {"weights": False, "kv_cache": False, "cuda_graph": False}
        task = asyncio.create_task(engine.generate([4, 4], GREEDY, request_id="held"))
        dropped = asyncio.create_task(engine.generate([4, 5], GREEDY, request_id="dropped"))
        await asyncio.sleep(0.5)
        assert not task.done() and not dropped.done()  # held while the memory is released
        await engine.abort("dropped")  # an aborted request does not wait for the memory
        gone = await asyncio.wait_for(dropped, 5)
        assert gone.finish_reason == "abort" and gone.token_ids == []
        await engine.resume_memory()
        return await asyncio.wait_for(task, 20)

    out = asyncio.run(run())
    assert out.finish_reason == "length" and len(out.token_ids) == 12
    for url in engine.engine_urls:
        assert state(url)["memory"] == {"weights": True, "kv_cache": True, "cuda_graph": True}
        kinds = [e["kind"] for e in state(url)["events"]]
        assert kinds.index("flush_cache") < kinds.index("release_memory_occupation")
        # released weights are garbage without a CPU backup: the current version was loaded again
        assert kinds.index("resume_memory_occupation") < kinds.index("update_weights_from_disk")

    # Only the KV cache: resume() takes back just that, and the weights need no reload.
    url = engine.engine_urls[0]
    reloads = len(events(url, "update_weights_from_disk"))
    asyncio.run(engine.release_memory(["kv_cache"]))
    assert state(url)["memory"] == {"weights": True, "kv_cache": False, "cuda_graph": True}
    asyncio.run(engine.resume_memory())
    assert events(url, "resume_memory_occupation")[-1]["tags"] == ["kv_cache"]
    assert asyncio.run(engine.generate([4, 4], GREEDY)).token_ids == out.token_ids
    assert len(events(url, "update_weights_from_disk")) == reloads


@pytest.mark.slow
def test_a_killed_engine_is_replaced_and_nothing_is_lost_or_doubled(make_engine, tiny_model):
    engine = make_engine()
    engine.health_interval = 0.3
    asyncio.run(engine.update_weights(new_weights(tiny_model, 2.5), version=1, last=True))
    victim = engine.servers[1]
    params = SamplingParams(temperature=0.0, max_new_tokens=300, ignore_eos=True)  # ~0.6 s each

    async def run():
        tasks = [asyncio.create_task(engine.generate([7, i], params, request_id=f"k{i}")) for i in range(16)]
        await asyncio.sleep(0.3)
        os.killpg(victim.process.pid, signal.SIGKILL)
        outs = await asyncio.wait_for(asyncio.gather(*tasks), 60)
        deadline = time.monotonic() + 60
        while engine.restarts < 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        return outs, await engine.health()

    outs, healthy = asyncio.run(run())
    assert len(outs) == 16
    for out in outs:
        assert out.finish_reason == "length" and len(out.token_ids) == 300 and out.weight_version == 1
    assert engine.restarts == 1 and healthy
    assert engine.stats()["engine/restarts"] == 1.0  # what the step metrics show
    fresh = engine.servers[1]
    assert fresh.url != victim.url and fresh.process.alive()
    assert {w["url"] for w in engine.router.workers()} == {engine.servers[0].url, fresh.url}
    # the replacement runs the current weights, not the ones it started with
    assert state(fresh.url)["weight_version"] == "1"
    assert state(fresh.url)["fingerprint"] == state(engine.servers[0].url)["fingerprint"]
    # and serves requests again
    async def again():
        return await asyncio.gather(*(engine.generate([1, i], GREEDY, request_id=f"after{i}") for i in range(4)))

    asyncio.run(again())
    assert any(e["rid"].startswith("after") for e in events(fresh.url, "generate"))


def test_the_restart_bound_comes_from_the_config_and_the_counters_reach_the_metrics(make_engine):
    engine = make_engine(num_engines=1, max_engine_restarts=5)
    assert engine.max_recovery_attempts == 5 and engine.pause_mode == "abort"  # in_place only when fully async
    assert engine.stats() == {"engine/restarts": 0.0, "engine/request_retries": 0.0}


def test_attach_to_running_servers(shared_engine, tiny_model, standin_python, tmp_path, monkeypatch):
    launched = shared_engine
    monkeypatch.setenv("SLIME_RL_ENGINE_API_KEY", launched.keys.api_key)  # attached servers' keys: keys.py
    monkeypatch.setenv("SLIME_RL_ENGINE_ADMIN_API_KEY", launched.keys.admin_key)
    cfg = make_config(tiny_model, standin_python, tmp_path / "attached", engine_urls=launched.engine_urls)
    attached = SGLangEngine.from_config(cfg)
    try:
        assert attached.engine_urls == launched.engine_urls and attached.router.url != launched.router.url
        assert all(s.process is None for s in attached.servers)
        out = asyncio.run(attached.generate([1, 2, 3], GREEDY))
        assert len(out.token_ids) == 12
    finally:
        asyncio.run(attached.shutdown())
    for server in launched.servers:  # shutting down an attached engine leaves the servers running
        assert server.process.alive()


def test_routed_experts_go_straight_to_an_engine(tiny_model, standin_python, tmp_path):
    """Routing replay: sglang-router 0.3.2 drops ``return_routed_experts``, so such requests go to an
    engine directly (the same one for the same request id) and its base64 answer becomes
    ``[prompt + new - 1][layers][top-k]``; other requests still go through the router."""
    import json
    import shutil

    moe = tmp_path / "tiny-moe"
    shutil.copytree(tiny_model, moe)  # the stand-in's routing reads only config.json's MoE fields
    config = json.loads((moe / "config.json").read_text())
    config.update(num_hidden_layers=3, n_routed_experts=8, num_experts_per_tok=2)  # GLM-4.5's name (Qwen's: conformance)
    (moe / "config.json").write_text(json.dumps(config))
    cfg = make_config(moe, standin_python, tmp_path / "run", engine_args={"enable_return_routed_experts": True})
    engine = SGLangEngine.from_config(cfg)
    try:
        routed = SamplingParams(temperature=1.0, max_new_tokens=5, ignore_eos=True, return_routed_experts=True)
        prompt = [3, 4, 5, 6]
        out = asyncio.run(engine.generate(prompt, routed, request_id="moe-1"))
        fed = prompt + out.token_ids[:-1]
        expected = [[[(t + layer + j) % 8 for j in range(2)] for layer in range(3)] for t in fed]
        assert out.routed_experts == expected
        plain = asyncio.run(engine.generate(prompt, SamplingParams(max_new_tokens=5), request_id="plain-1"))
        assert plain.routed_experts is None
        bodies = {url: [e["body"] for e in events(url, "generate_body")] for url in engine.engine_urls}
        asked = [url for url, seen in bodies.items() if any(b.get("return_routed_experts") for b in seen)]
        assert len(asked) == 1  # straight to one engine: through the router the field would be gone
    finally:
        asyncio.run(engine.shutdown())


@pytest.mark.slow
def test_a_server_killed_during_a_trainer_side_sync_is_left_out_and_restored_after(tiny_model, standin_python, tmp_path):
    """The trainer's sender pushes version 2; the server dies while loading it. The sender leaves it out, the
    engine ends the sync on the servers left, and the monitor restarts it with version 2 from the copy the
    sender wrote (restore_copy.py): a server that died after a trainer-side sync used to have no copy to
    come back with."""
    cfg = make_config(tiny_model, standin_python, tmp_path, num_engines=1,
                      engine_args={"standin_update_delay": 0.5})
    engine = SGLangEngine.from_config(cfg)
    engine.health_interval = 0.3
    sender = SGLangWeightSender(cfg, rank=0)
    victim = engine.servers[0]

    def kill_once_loading(version: str) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if any(e["weight_version"] == version for e in events(victim.url, "update_weights_from_tensor")):
                os.killpg(victim.process.pid, signal.SIGKILL)
                return
            time.sleep(0.05)

    async def run():
        for version, scale in ((1, 2.0), (2, 0.5)):
            targets = await engine.begin_weight_sync(version, transport="tensor")
            killer = threading.Thread(target=kill_once_loading, args=("2",)) if version == 2 else None
            if killer is not None:
                killer.start()
            await asyncio.to_thread(sender.send, iter([new_weights(tiny_model, scale)]), targets, version=version,
                                    transport="tensor")
            await asyncio.wait_for(engine.end_weight_sync(version), 30)
        deadline = time.monotonic() + 60
        while engine.restarts < 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        return await asyncio.wait_for(engine.generate([5, 6, 7], GREEDY), 60)

    try:
        out = asyncio.run(run())
        assert engine.restarts == 1 and engine.weight_version == 2 and out.weight_version == 2
        fresh = engine.servers[0]
        assert fresh.url != victim.url and state(fresh.url)["weight_version"] == "2"
        restored = events(fresh.url, "update_weights_from_disk")
        assert [Path(e["model_path"]).name for e in restored] == ["v2"]  # weights/restore/v2
    finally:
        sender.restore.writes.wait()
        asyncio.run(engine.shutdown())
