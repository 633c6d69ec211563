"""GPU check (issue 17): a weight update lands while requests run, with SGLang 0.5.17's
``/pause_generation`` in mode ``in_place`` (what ``cluster.async_mode: fully`` uses), and the running
requests are neither aborted nor prefilled again.

In SGLang 0.5.17 (srt/managers/scheduler.py, ``pause_generation``) ``in_place`` only sets
``_engine_paused``: the event loop stops scheduling batches and keeps the running batch, its KV cache and
the waiting queue as they are; ``continue_generation`` clears the flag and decoding goes on. ``abort`` (the
default) aborts every request, and ``retract`` moves the running ones back to the waiting queue (their KV
is prefilled again on resume; ``meta_info.num_retractions`` counts it). The tokenizer manager applies a
weight update at once while paused (no wait for the model-update lock); a ``flush_cache`` fails while
requests are held in place, so the engine skips it then.

    python -m pytest packages/rollout-sglang/tests/test_sglang_gpu_pause.py -m gpu -s
"""

from __future__ import annotations

import asyncio
import math
import time

import pytest
import torch
from test_sglang_gpu import VOCAB, gpu_config, hf_weights, make_tiny_llama

from slime_rl.core.contracts import SamplingParams
from slime_rl.rollout_sglang import client as client_module
from slime_rl.rollout_sglang.engine import SGLangEngine

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]

LONG = SamplingParams(temperature=0.0, max_new_tokens=600, ignore_eos=True)
PROMPTS = [[1, 17 + i, 230, 41 + 3 * i, 512, 9] for i in range(8)]
UNIFORM = -math.log(VOCAB)  # the log-prob of every token once lm_head is zero


def test_pause_in_place_keeps_running_requests_through_a_weight_update(tmp_path, monkeypatch):
    model = make_tiny_llama(tmp_path / "model")
    engine = SGLangEngine.from_config(gpu_config(model, tmp_path / "run"))
    engine.pause_mode = "in_place"  # as from_config sets it under cluster.async_mode=fully
    answers: list[dict] = []  # every /generate answer's meta_info

    def parse_and_keep(body, **kwargs):
        answers.append(dict(body.get("meta_info") or {}))
        return parse(body, **kwargs)

    parse = client_module.parse_response
    monkeypatch.setattr(client_module, "parse_response", parse_and_keep)
    try:
        async def run():
            reference = await asyncio.gather(*(engine.generate(p, LONG) for p in PROMPTS))  # version 0 throughout
            answers.clear()
            running = [asyncio.create_task(engine.generate(p, LONG)) for p in PROMPTS]
            await asyncio.sleep(0.5)  # well inside the 600 tokens
            assert not any(t.done() for t in running), "the requests finished before the update; raise max_new_tokens"
            zero_head = [(n, torch.zeros_like(t) if n == "lm_head.weight" else t)
                         for n, t in hf_weights(model, "cuda:0")]
            started = time.perf_counter()
            await engine.update_weights(zero_head, version=1, last=True)  # pause in place, load, continue
            sync_s = time.perf_counter() - started
            return reference, await asyncio.gather(*running), sync_s

        reference, outs, sync_s = asyncio.run(run())
    finally:
        asyncio.run(engine.shutdown())
    splits = []
    for ref, out in zip(reference, outs, strict=True):
        assert out.finish_reason == "length" and len(out.token_ids) == LONG.max_new_tokens  # not aborted
        # tokens of version 0 (the reference's, its log-probs) up to the update, then version 1's (zero lm_head:
        # every log-prob uniform); one token computed before the pause may come out after it
        new = [abs(lp - UNIFORM) < 1e-3 for lp in out.log_probs]
        split = new.index(True) if any(new) else len(new)
        assert 0 < split < len(new), f"not both versions: first version-1 token at {split}"
        assert all(new[split:]), "a version-0 token after version-1 ones"
        assert out.token_ids[:split] == ref.token_ids[:split]
        assert out.weight_version == 1
        splits.append(split)
    # one request per prompt (none aborted and continued, which would prefill it again) and none retracted
    assert len(answers) == len(PROMPTS)
    assert all(a.get("num_retractions", 0) == 0 for a in answers), [a.get("num_retractions") for a in answers]
    assert all(str(a.get("weight_version")) == "1" for a in answers)
    print(f"\n(pause in place) {len(PROMPTS)} greedy requests x {LONG.max_new_tokens} tokens; weight update in "
          f"{sync_s:.2f} s while they ran; version-0 tokens per request {splits} then version 1; 1 /generate "
          f"each, num_retractions {[a.get('num_retractions') for a in answers]}, cached_tokens "
          f"{[a.get('cached_tokens') for a in answers]}")


def test_a_request_aborted_at_a_pause_answers_499_and_the_engine_sends_it_again(tmp_path):
    """SGLang 0.5.17 answers HTTP 499 'Request <rid> was aborted' (RequestAbortedError, tokenizer_manager.py)
    for a request aborted while it waits at a pause; a sync's pause(abort) aborts such a request, and the
    engine must send it again rather than fail (docs/standin-fidelity.md)."""
    import httpx

    from slime_rl.rollout_sglang.weights import server_api

    model = make_tiny_llama(tmp_path / "model")
    engine = SGLangEngine.from_config(gpu_config(model, tmp_path / "run"))
    target = engine.targets()[0]
    try:
        server_api.pause_generation([target], timeout=30, step="test", mode="in_place")
        body = {"input_ids": PROMPTS[0], "rid": "held-at-pause", "sampling_params": {"max_new_tokens": 4}}
        headers = {"Authorization": f"Bearer {engine.keys.api_key}"} if engine.keys.api_key else {}

        async def raw():
            async with httpx.AsyncClient(timeout=60) as http:
                answer = asyncio.create_task(http.post(f"{target.url}/generate", json=body, headers=headers))
                await asyncio.sleep(1.0)
                await http.post(f"{target.url}/abort_request", json={"rid": "held-at-pause"}, headers=target.headers)
                server_api.continue_generation([target], timeout=30, step="test")
                return await answer

        resp = asyncio.run(raw())
        assert resp.status_code == 499 and "was aborted" in resp.text, (resp.status_code, resp.text)

        async def race():
            server_api.pause_generation([target], timeout=30, step="test", mode="in_place")  # the pause got there first
            task = asyncio.create_task(engine.generate(PROMPTS[1], SamplingParams(temperature=0.0, max_new_tokens=20)))
            await asyncio.sleep(1.0)
            zero_head = [(n, torch.zeros_like(t) if n == "lm_head.weight" else t) for n, t in hf_weights(model, "cuda:0")]
            await engine.update_weights(zero_head, version=1, last=True)  # pause(abort) marks it: 499 after continue
            return await asyncio.wait_for(task, 120)

        out = asyncio.run(race())
        assert out.finish_reason == "length" and len(out.token_ids) == 20 and out.weight_version == 1
        print(f"\n(abort at a pause) raw answer HTTP {resp.status_code}: {resp.text[:100]}; the engine's request "
              f"came back whole on version {out.weight_version}")
    finally:
        asyncio.run(engine.shutdown())
