"""The real sglang-router in front of stand-in SGLang workers, driven by slime-rl's router
helpers and generate client."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from slime_rl.core.contracts import SamplingParams
from slime_rl.rollout_sglang.client import GenerateClient, GenerateError, build_payload, parse_response
from slime_rl.rollout_sglang.router import launch_router
from slime_rl.rollout_sglang.server import start_server, wait_healthy


@pytest.fixture(scope="module")
def workers(tiny_model, standin_python, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("workers")
    servers = [start_server(i, str(tiny_model), log_dir=log_dir, python=standin_python,
                            engine_args={"standin_token_delay": 0.002}) for i in range(2)]
    try:
        for server in servers:
            wait_healthy(server, timeout=120)
        yield servers
    finally:
        for server in servers:
            server.process.stop()


@pytest.fixture
def router(tmp_path):
    router = launch_router(tmp_path, policy="round_robin")
    try:
        yield router
    finally:
        router.stop()


def state(url: str) -> dict:
    return httpx.get(f"{url}/standin/state", timeout=10).json()


def served(url: str, rids: list[str]) -> list[str]:
    return [r for r in state(url)["completed"] if r in rids]


def test_registration_round_robin_and_removal(router, workers):
    a, b = workers
    router.add_worker(a.url)
    router.add_worker(b.url)
    router.wait_ready(2)
    assert {w["url"] for w in router.workers()} == {a.url, b.url}
    client = GenerateClient(router.url, max_concurrency=4)
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)

    async def run(prefix: str, n: int) -> list[str]:
        outs = await asyncio.gather(*(client.generate([1, 2, 3], params, f"{prefix}{i}") for i in range(n)))
        assert all(len(o.token_ids) == 4 for o in outs)
        return [f"{prefix}{i}.0" for i in range(n)]

    rids = asyncio.run(run("rr", 4))
    assert len(served(a.url, rids)) == 2 and len(served(b.url, rids)) == 2  # round robin

    router.remove_worker(b.url)
    assert [w["url"] for w in router.workers()] == [a.url]
    rids = asyncio.run(run("after-remove", 4))
    assert len(served(a.url, rids)) == 4 and served(b.url, rids) == []
    router.remove_worker(b.url)  # removing twice is a no-op


def test_sampling_fields_reach_the_worker_and_the_answer_is_parsed(router, workers):
    a, _ = workers
    router.add_worker(a.url)
    router.wait_ready(1)
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=6, stop=["zzz"],
                            stop_token_ids=[7], ignore_eos=True, seed=11)
    out = asyncio.run(GenerateClient(router.url).generate([4, 5, 6], params, "fields"))
    seen = [e["body"] for e in state(a.url)["events"] if e["kind"] == "generate_body" and e["body"].get("rid") == "fields.0"]
    assert len(seen) == 1
    body = seen[0]
    assert body["return_logprob"] is True and body["logprob_start_len"] == -1
    assert body["sampling_params"] == {"temperature": 0.7, "top_p": 0.9, "top_k": 20, "max_new_tokens": 6,
                                       "stop": ["zzz"], "stop_token_ids": [7], "ignore_eos": True,
                                       "sampling_seed": 11, "skip_special_tokens": False, "no_stop_trim": True}
    # What the worker answers for the same request, straight from it, parsed the same way.
    direct = httpx.post(f"{a.url}/generate", json=build_payload([4, 5, 6], params, "direct"), timeout=30).json()
    assert direct["meta_info"]["output_token_logprobs"][0][1] == direct["output_ids"][0]
    expected = parse_response(direct, default_version=0)
    assert out.token_ids == expected.token_ids and out.log_probs == expected.log_probs
    assert len(out.token_ids) == len(out.log_probs) and out.finish_reason in ("stop", "length")


def test_parse_response_reads_sglang_shapes():
    body = {"output_ids": [5, 9], "meta_info": {
        "id": "x", "finish_reason": {"type": "stop", "matched": 9}, "weight_version": "3",
        "output_token_logprobs": [[-0.5, 5, None], [-1.25, 9, None]], "cached_tokens": 12}}
    out = parse_response(body, default_version=0)
    assert (out.token_ids, out.log_probs, out.finish_reason, out.weight_version) == ([5, 9], [-0.5, -1.25], "stop", 3)
    assert out.cached_tokens == 12  # the prefix-cache hits the rollout metrics report
    # an abort from SGLang's waiting queue has no log-probs and no prompt_tokens
    aborted = parse_response({"output_ids": [], "meta_info": {"id": "y", "weight_version": "default",
                                                              "finish_reason": {"type": "abort"}}}, default_version=2)
    assert (aborted.token_ids, aborted.finish_reason, aborted.weight_version) == ([], "abort", 2)
    assert aborted.cached_tokens is None  # not reported: no hit rate from it
    with pytest.raises(GenerateError, match="2 output ids but 1 log-probs"):
        parse_response({"output_ids": [1, 2], "meta_info": {"finish_reason": {"type": "length"},
                                                            "output_token_logprobs": [[-1.0, 1, None]]}},
                       default_version=0)


def test_client_retries_until_a_worker_joins(router, workers):
    """No worker: the router answers 503; the request is retried and served once one registers."""
    client = GenerateClient(router.url, retry_timeout=60)

    async def run():
        task = asyncio.create_task(client.generate([1, 2], SamplingParams(max_new_tokens=3, ignore_eos=True), "late"))
        await asyncio.sleep(1.0)
        assert not task.done()
        await asyncio.to_thread(router.add_worker, workers[0].url)
        return await asyncio.wait_for(task, 30)

    out = asyncio.run(run())
    assert len(out.token_ids) == 3
    assert client.retries > 0
    assert [r for r in state(workers[0].url)["completed"] if r.startswith("late.")] != []


def test_client_gives_up_after_its_retry_window(router):
    client = GenerateClient(router.url, retry_timeout=1.0)
    with pytest.raises(GenerateError, match=r"request lonely: gave up after \d+ attempts over 1 s through the router at "
                                            r"http://127.0.0.1:\d+; last: HTTP 503"):
        asyncio.run(client.generate([1], SamplingParams(max_new_tokens=2), "lonely"))


def test_transient_failures_have_a_bound_of_their_own_unless_an_engine_is_restarting(router):
    """The router answers 503 every time: with no engine restarting, the request gives up after
    max_retries + 1 attempts, long before the (engine-restart sized) retry_timeout; while the engine says
    one is restarting, the attempts do not count and the request waits, up to retry_timeout."""
    client = GenerateClient(router.url, retry_timeout=600, max_retries=3)
    started = time.monotonic()
    with pytest.raises(GenerateError, match=r"request flaky: gave up after 4 attempts through the router at "
                                            r"http://127.0.0.1:\d+ \(4 failed while no engine was restarting; "
                                            r"rollout.sglang.generate_max_retries=3\); last: HTTP 503"):
        asyncio.run(client.generate([1], SamplingParams(max_new_tokens=2), "flaky"))
    assert time.monotonic() - started < 10 and client.retries == 3

    waiting = GenerateClient(router.url, retry_timeout=3.0, max_retries=1, recovering=lambda: True)
    with pytest.raises(GenerateError, match=r"over 3 s through the router"):
        asyncio.run(waiting.generate([1], SamplingParams(max_new_tokens=2), "patient"))
    assert waiting.retries >= 4  # backoff 0.05, 0.1, 0.2, 0.4, 0.8 s: five tries fit in 3 s


def test_per_request_timeout(router, workers):
    router.add_worker(workers[0].url)
    router.wait_ready(1)
    client = GenerateClient(router.url, request_timeout=0.5)
    long = SamplingParams(max_new_tokens=2000, ignore_eos=True)  # 2000 tokens x 2 ms > 0.5 s
    with pytest.raises(GenerateError, match=r"request slow: no answer from the router at http://127.0.0.1:\d+ within 0.5 s"):
        asyncio.run(client.generate([1], long, "slow"))
    httpx.post(f"{workers[0].url}/abort_request", json={"rid": "slow"}, timeout=10)


def test_routed_experts_are_asked_for_and_decoded():
    """Routing replay: the engine field is in the payload only when asked for, and SGLang's base64
    int32 ``[tokens fed, layers, top-k]`` (or plain lists) come back as nested lists."""
    import base64

    import numpy as np

    assert "return_routed_experts" not in build_payload([1, 2], SamplingParams(), "r")
    assert build_payload([1, 2], SamplingParams(return_routed_experts=True), "r")["return_routed_experts"] is True
    routed = np.arange(3 * 2 * 4, dtype="<i4").reshape(3, 2, 4) % 8  # 2 prompt + 2 new - 1 tokens fed
    meta = {"finish_reason": {"type": "length"}, "output_token_logprobs": [[-1.0, 5, None], [-2.0, 6, None]],
            "routed_experts": base64.b64encode(routed.tobytes()).decode("ascii")}
    out = parse_response({"output_ids": [5, 6], "meta_info": meta}, default_version=0, routed_shape=(2, 4))
    assert out.routed_experts == routed.tolist()
    listed = parse_response({"output_ids": [5, 6], "meta_info": {**meta, "routed_experts": routed.tolist()}},
                            default_version=0, routed_shape=(2, 4))
    assert listed.routed_experts == routed.tolist()
    assert parse_response({"output_ids": [5, 6], "meta_info": meta}, default_version=0).routed_experts is None
    with pytest.raises(GenerateError, match="do not fill"):
        parse_response({"output_ids": [5, 6], "meta_info": meta}, default_version=0, routed_shape=(5, 4))


def _episodes(client: GenerateClient, first_token: int, routing: bool) -> tuple[list[list[str]], float]:
    """8 three-turn episodes at once (each turn's input: the last input, its answer and an 'observation'), through
    the router; the rids of each episode's turns, and the share of input tokens served from a prefix cache."""
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    totals = {"input": 0, "cached": 0}

    async def episode(e: int) -> list[str]:
        ids, rids = [first_token, e + 1] + list(range(10, 60)), []
        for turn in range(3):
            rid = f"ep{first_token}-{e}-{turn}"
            out = await client.generate(ids, params, rid, routing_key=f"ep{first_token}-{e}" if routing else None)
            totals["input"] += len(ids)
            totals["cached"] += out.cached_tokens
            rids.append(f"{rid}.0")
            ids = ids + out.token_ids + [7, 8, 9, 10 + turn]
        return rids

    async def run() -> list[list[str]]:
        return await asyncio.gather(*(episode(e) for e in range(8)))

    rids = asyncio.run(run())
    return rids, totals["cached"] / totals["input"]


def test_routing_key_keeps_an_episode_on_one_worker_and_its_prefix_cache(workers, tmp_path):
    """Session affinity: with the router's manual policy, every turn carrying one routing key reaches the same
    worker; the stand-in workers report cached tokens as SGLang does (the longest prefix they served), so the
    hit rate with affinity beats round robin on the same kind of episodes."""
    rates = {}
    for policy, routing, first in (("manual", True, 1), ("round_robin", False, 2)):
        router = launch_router(tmp_path / policy, policy=policy)
        try:
            for w in workers:
                router.add_worker(w.url)
            router.wait_ready(2)
            rids, rates[policy] = _episodes(GenerateClient(router.url, max_concurrency=16), first, routing)
        finally:
            router.stop()
        if policy == "manual":
            for episode in rids:
                homes = {w.url for w in workers if served(w.url, episode)}
                assert len(homes) == 1 and all(len(served(h, episode)) == 3 for h in homes), episode
    print(f"prefix-cache hit rate, 8 episodes x 3 turns over 2 stand-in workers: manual policy with routing keys "
          f"{rates['manual']:.2f}, round robin {rates['round_robin']:.2f}")
    assert rates["manual"] > rates["round_robin"]


def test_the_stand_in_refuses_what_sglang_refuses(workers):
    """testing/checks.py: SGLang 0.5.17's checks before it runs a request (docs/standin-fidelity.md)."""
    url = workers[0].url

    def answer(sampling: dict, input_ids: list[int] = [1, 2]) -> httpx.Response:  # noqa: B006 (read only)
        return httpx.post(f"{url}/generate", json={"input_ids": input_ids, "sampling_params": sampling}, timeout=30)

    assert answer({"max_new_tokens": 2}).status_code == 200
    too_long = answer({"max_new_tokens": 2047})  # 2 + 2047 > the tiny model's 2048
    assert too_long.status_code == 400 and "maximum context length of 2048 tokens" in too_long.text
    assert answer({"max_new_tokens": 2, "top_k": 0}).status_code == 400
    assert answer({"max_new_tokens": 2, "top_p": 0.0}).status_code == 400
    assert answer({"max_new_tokens": 2, "no_such_param": 1}).status_code == 500  # SamplingParams(**kw): TypeError
