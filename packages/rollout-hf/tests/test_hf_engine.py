"""HFEngine against transformers itself: log-prob parity, sampling controls, batching, abort, weight sync."""

from __future__ import annotations

import asyncio

import pytest
import torch

from slime_rl.core.config import Config
from slime_rl.core.contracts import SamplingParams
from slime_rl.rollout_hf.engine import HFEngine
from slime_rl.rollout_hf.settings import HFSettings

PROMPTS = [
    "Question: What is 3 + 4?\nAnswer:",
    "def forward(self, x):",
    "The sum of 12 and",
    "Question: What is 31 + 8?\nAnswer: 39. The sum of",
    "x",
]


def encode(tokenizer, texts: list[str]) -> list[list[int]]:
    return [tokenizer(t).input_ids for t in texts]


def reference_log_probs(model, prompt: list[int], response: list[int], temperature: float):
    """transformers over prompt + response in one forward, no cache and no padding: what the trainer scores."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1].float()
    scale = temperature if temperature > 0 else 1.0
    log_probs = torch.log_softmax(logits / scale, dim=-1).gather(1, torch.tensor(response)[:, None])[:, 0]
    return log_probs, logits


async def generate_all(engine, prompts, params_list, ids=None):
    ids = ids or [None] * len(prompts)
    return await asyncio.gather(*[engine.generate(p, sp, rid) for p, sp, rid in zip(prompts, params_list, ids, strict=True)])


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.3])
def test_log_probs_match_a_full_forward(arch, temperature, tokenizer, make_model):
    model = make_model(arch, len(tokenizer))
    engine = HFEngine(model, tokenizer)
    prompts = encode(tokenizer, PROMPTS) * 2  # repeated prompts go through the shared-prefill path
    params = [SamplingParams(temperature=temperature, top_p=0.9, top_k=50, max_new_tokens=12, seed=i, ignore_eos=True)
              for i in range(len(prompts))]
    outputs = asyncio.run(generate_all(engine, prompts, params))
    worst = 0.0
    for prompt, out in zip(prompts, outputs, strict=True):
        assert len(out.token_ids) == len(out.log_probs) == 12
        expected, logits = reference_log_probs(model, prompt, out.token_ids, temperature)
        worst = max(worst, (expected - torch.tensor(out.log_probs)).abs().max().item())
        if temperature == 0:
            assert out.token_ids == logits.argmax(-1).tolist()
    assert worst <= 1e-4
    # The distributions are far from uniform (log 1/384 = -5.95), so a wrong position or mask shows.
    assert max(max(o.log_probs) for o in outputs) > -3.0


def test_log_probs_are_before_top_k_filtering(tokenizer, make_model):
    """With top_k=1 the draw is the argmax, yet the reported log-prob is the unfiltered one (< 0)."""
    model = make_model("llama", len(tokenizer))
    engine = HFEngine(model, tokenizer)
    prompt = encode(tokenizer, PROMPTS[:1])[0]
    out = asyncio.run(engine.generate(prompt, SamplingParams(temperature=1.0, top_k=1, max_new_tokens=6, ignore_eos=True)))
    expected, logits = reference_log_probs(model, prompt, out.token_ids, 1.0)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert torch.allclose(torch.tensor(out.log_probs), expected, atol=1e-4)
    assert max(out.log_probs) < -1e-3


@pytest.mark.parametrize(("top_k", "top_p"), [(3, 1.0), (-1, 0.5), (5, 0.3)])
def test_top_k_and_top_p_restrict_what_is_sampled(top_k, top_p, tokenizer, make_model):
    model = make_model("llama", len(tokenizer))
    engine = HFEngine(model, tokenizer)
    prompt = encode(tokenizer, PROMPTS[:1])[0]
    params = [SamplingParams(temperature=1.5, top_k=top_k, top_p=top_p, max_new_tokens=10, seed=s, ignore_eos=True)
              for s in range(16)]
    outputs = asyncio.run(generate_all(engine, [prompt] * 16, params))
    for out in outputs:
        _, logits = reference_log_probs(model, prompt, out.token_ids, 1.5)
        probs = torch.softmax(logits / 1.5, dim=-1)
        for position, token in enumerate(out.token_ids):
            rank = int((probs[position] > probs[position, token]).sum())
            assert top_k <= 0 or rank < top_k
            kept = probs[position].sort(descending=True).values[: top_k if top_k > 0 else None]
            mass_before = float((kept[:rank] / kept.sum()).sum())
            assert mass_before <= top_p + 1e-6
    assert len({tuple(o.token_ids) for o in outputs}) > 1  # still sampling, not greedy


def test_greedy_is_deterministic_and_seeded_sampling_reproducible(tokenizer, make_model):
    engine = HFEngine(make_model("llama", len(tokenizer)), tokenizer)
    prompt = encode(tokenizer, PROMPTS[:1])[0]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)
    first, second = (asyncio.run(engine.generate(prompt, greedy)) for _ in range(2))
    assert first.token_ids == second.token_ids and first.log_probs == second.log_probs

    def sample(seed):
        return asyncio.run(engine.generate(prompt, SamplingParams(max_new_tokens=10, seed=seed, ignore_eos=True)))

    assert sample(7).token_ids == sample(7).token_ids
    assert len({tuple(sample(s).token_ids) for s in range(6)}) > 1  # different seeds explore


def test_a_seeded_request_does_not_depend_on_its_batch(tokenizer, make_model):
    engine = HFEngine(make_model("llama", len(tokenizer)), tokenizer)
    prompts = encode(tokenizer, PROMPTS)
    params = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=10, seed=123, ignore_eos=True)
    alone = asyncio.run(engine.generate(prompts[1], params))
    others = [SamplingParams(max_new_tokens=4, seed=i) for i in range(len(prompts))]
    others[1] = params
    in_batch = asyncio.run(generate_all(engine, prompts, others))[1]
    assert in_batch.token_ids == alone.token_ids


def test_many_concurrent_requests_equal_one_by_one(tokenizer, make_model):
    engine = HFEngine(make_model("qwen2", len(tokenizer)), tokenizer, max_batch_size=8)  # 13 requests: 2 batches
    prompts = encode(tokenizer, PROMPTS) * 2 + encode(tokenizer, ["Answer: 7", "is", "def"])
    params = [SamplingParams(temperature=0.0, max_new_tokens=3 + i % 5) for i in range(len(prompts))]
    batched = asyncio.run(generate_all(engine, prompts, params))
    one_by_one = [asyncio.run(engine.generate(p, sp)) for p, sp in zip(prompts, params, strict=True)]
    for b, s in zip(batched, one_by_one, strict=True):
        assert b.token_ids == s.token_ids and b.finish_reason == s.finish_reason
        assert max(abs(x - y) for x, y in zip(b.log_probs, s.log_probs, strict=True)) <= 1e-4


def test_max_new_tokens_ends_with_length(tokenizer, make_model):
    engine = HFEngine(make_model("llama", len(tokenizer)), tokenizer)
    prompt = encode(tokenizer, PROMPTS[:1])[0]
    out = asyncio.run(engine.generate(prompt, SamplingParams(max_new_tokens=5, ignore_eos=True, seed=0)))
    assert (len(out.token_ids), len(out.log_probs), out.finish_reason) == (5, 5, "length")
    empty = asyncio.run(engine.generate(prompt, SamplingParams(max_new_tokens=0)))
    assert (empty.token_ids, empty.finish_reason) == ([], "length")


def first_new_token_position(tokens: list[int], start: int) -> int:
    """A position whose token did not occur before it, so stopping on it stops exactly there."""
    return next(j for j in range(start, len(tokens)) if tokens[j] not in tokens[:j])


def test_stop_token_ids_and_eos_keep_the_stop_token(tokenizer, make_model):
    model = make_model("llama", len(tokenizer))
    prompt = encode(tokenizer, PROMPTS[:1])[0]
    free = asyncio.run(HFEngine(model, tokenizer, eos_token_ids=[]).generate(
        prompt, SamplingParams(temperature=0.0, max_new_tokens=20)))
    j = first_new_token_position(free.token_ids, 3)
    stop_token = free.token_ids[j]

    engine = HFEngine(model, tokenizer, eos_token_ids=[])
    out = asyncio.run(engine.generate(prompt, SamplingParams(temperature=0.0, max_new_tokens=20, stop_token_ids=[stop_token])))
    assert out.token_ids == free.token_ids[: j + 1] and out.finish_reason == "stop"

    eos_engine = HFEngine(model, tokenizer, eos_token_ids=[stop_token])
    out = asyncio.run(eos_engine.generate(prompt, SamplingParams(temperature=0.0, max_new_tokens=20)))
    assert out.token_ids == free.token_ids[: j + 1] and out.finish_reason == "stop"
    out = asyncio.run(eos_engine.generate(prompt, SamplingParams(temperature=0.0, max_new_tokens=20, ignore_eos=True)))
    assert out.token_ids == free.token_ids and out.finish_reason == "length"


def test_the_models_eos_is_a_stop_token(tokenizer, make_model):
    eos = tokenizer.convert_tokens_to_ids("<eos>")
    engine = HFEngine(make_model("llama", len(tokenizer), eos_token_id=eos), tokenizer)
    assert engine.eos_token_ids == {eos}
    with torch.no_grad():  # make eos the model's favourite token
        engine.model.lm_head.bias = None
        engine.model.lm_head.weight[eos] = engine.model.lm_head.weight.sum(0) * 10
    prompt = encode(tokenizer, PROMPTS[:1])[0]
    out = asyncio.run(engine.generate(prompt, SamplingParams(temperature=0.0, max_new_tokens=20)))
    assert out.token_ids[-1] == eos and out.finish_reason == "stop"


def test_stop_strings_end_the_response_with_the_match_kept(tokenizer, make_model):
    model = make_model("llama", len(tokenizer), seed=3)
    engine = HFEngine(model, tokenizer, eos_token_ids=[])
    prompt = encode(tokenizer, PROMPTS[:1])[0]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=24)
    free = asyncio.run(engine.generate(prompt, greedy))
    text = tokenizer.decode(free.token_ids)
    # A stop string that straddles token boundaries: 3 characters from the middle of the response.
    ascii_starts = [i for i in range(len(text) // 3, len(text) - 3) if text[i : i + 3].isascii()]
    stop = text[ascii_starts[0] : ascii_starts[0] + 3]
    k = next(k for k in range(1, len(free.token_ids) + 1) if stop in tokenizer.decode(free.token_ids[:k]))

    out = asyncio.run(engine.generate(prompt, SamplingParams(temperature=0.0, max_new_tokens=24, stop=["@@@", stop])))
    assert out.finish_reason == "stop"
    assert out.token_ids == free.token_ids[:k]
    assert stop in tokenizer.decode(out.token_ids) and stop not in tokenizer.decode(out.token_ids[:-1])


async def wait_until_decoding(engine, request_id: str, num_tokens: int) -> None:
    """Poll the engine's in-flight table until the request has made ``num_tokens`` tokens."""
    while True:
        req = engine._in_flight.get(request_id)
        if req is not None and len(req.token_ids) >= num_tokens:
            return
        await asyncio.sleep(0.002)


def test_abort_one_request_mid_generation(tokenizer, make_model):
    engine = HFEngine(make_model("llama", len(tokenizer)), tokenizer)
    prompt = encode(tokenizer, PROMPTS[:1])[0]

    async def main():
        long = asyncio.create_task(engine.generate(prompt, SamplingParams(max_new_tokens=3000, ignore_eos=True, seed=1), "long"))
        short = asyncio.create_task(engine.generate(prompt, SamplingParams(max_new_tokens=3000, ignore_eos=True, seed=2), "other"))
        await wait_until_decoding(engine, "long", 5)
        await engine.abort("long")
        aborted = await long
        assert not short.done()
        await engine.abort("other")
        return aborted, await short

    aborted, other = asyncio.run(main())
    assert aborted.finish_reason == "abort" and other.finish_reason == "abort"
    assert 5 <= len(aborted.token_ids) < 3000 and len(aborted.log_probs) == len(aborted.token_ids)
    assert len(other.token_ids) >= len(aborted.token_ids)
    # The tokens so far are real samples: their log-probs still match the model.
    expected, _ = reference_log_probs(engine.model, prompt, aborted.token_ids, 1.0)
    assert torch.allclose(torch.tensor(aborted.log_probs), expected, atol=1e-4)
    # The engine keeps serving.
    after = asyncio.run(engine.generate(prompt, SamplingParams(max_new_tokens=3, ignore_eos=True)))
    assert after.finish_reason == "length"


def test_abort_all_returns_running_and_queued_requests(tokenizer, make_model):
    engine = HFEngine(make_model("llama", len(tokenizer)), tokenizer, max_batch_size=1)
    prompt = encode(tokenizer, PROMPTS[:1])[0]

    async def main():
        params = SamplingParams(max_new_tokens=3000, ignore_eos=True)
        running = asyncio.create_task(engine.generate(prompt, params, "running"))
        queued = asyncio.create_task(engine.generate(prompt, params, "queued"))
        await wait_until_decoding(engine, "running", 2)
        await engine.abort()
        return await running, await queued

    running, queued = asyncio.run(main())
    assert running.finish_reason == queued.finish_reason == "abort"
    assert len(running.token_ids) >= 2 and queued.token_ids == [] and queued.log_probs == []


def test_shutdown_returns_running_requests_as_aborted(tokenizer, make_model):
    engine = HFEngine(make_model("llama", len(tokenizer)), tokenizer)
    prompt = encode(tokenizer, PROMPTS[:1])[0]

    async def main():
        running = asyncio.create_task(engine.generate(prompt, SamplingParams(max_new_tokens=3000, ignore_eos=True), "r"))
        await wait_until_decoding(engine, "r", 2)
        await engine.shutdown()
        return await running

    out = asyncio.run(main())
    assert out.finish_reason == "abort" and len(out.token_ids) == len(out.log_probs) >= 2


def test_update_weights_changes_outputs_and_bumps_the_version(tokenizer, make_model):
    engine = HFEngine(make_model("llama", len(tokenizer), seed=0), tokenizer)
    other = make_model("llama", len(tokenizer), seed=1)
    other_engine = HFEngine(other, tokenizer)
    prompt = encode(tokenizer, PROMPTS[:1])[0]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    before = asyncio.run(engine.generate(prompt, greedy))
    target = asyncio.run(other_engine.generate(prompt, greedy))
    assert before.token_ids != target.token_ids and before.weight_version == 0

    named = list(other.state_dict().items())
    half = len(named) // 2
    asyncio.run(engine.update_weights(named[:half], version=1, last=False))
    assert engine.weight_version == 0  # not before the last bucket
    asyncio.run(engine.update_weights(named[half:], version=1, last=True))
    assert engine.weight_version == 1
    after = asyncio.run(engine.generate(prompt, greedy))
    assert after.token_ids == target.token_ids and after.log_probs == pytest.approx(target.log_probs, abs=1e-5)
    assert after.weight_version == 1


def test_update_weights_refuses_unknown_names_and_copies_nothing(tokenizer, make_model):
    engine = HFEngine(make_model("llama", len(tokenizer)), tokenizer)
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    good = ("model.norm.weight", torch.zeros(64))
    with pytest.raises(ValueError, match=r"unknown weight name 'model.layers.9.mlp.up_proj.weight'"):
        asyncio.run(engine.update_weights([good, ("model.layers.9.mlp.up_proj.weight", torch.zeros(128, 64))],
                                          version=1, last=True))
    with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \(3,\)"):
        asyncio.run(engine.update_weights([("model.norm.weight", torch.zeros(3))], version=1, last=True))
    assert engine.weight_version == 0
    assert all(torch.equal(before[k], v) for k, v in engine.model.state_dict().items())


def test_cancelled_callers_free_their_rows(tokenizer, make_model):
    engine = HFEngine(make_model("llama", len(tokenizer)), tokenizer)
    prompt = encode(tokenizer, PROMPTS[:1])[0]

    async def main():
        task = asyncio.create_task(engine.generate(prompt, SamplingParams(max_new_tokens=3000, ignore_eos=True), "c"))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        out = await engine.generate(prompt, SamplingParams(max_new_tokens=2, ignore_eos=True))
        return out

    assert asyncio.run(main()).finish_reason == "length"
    assert engine._in_flight == {}


def test_bad_requests_get_clear_errors(tokenizer, make_model):
    engine = HFEngine(make_model("llama", len(tokenizer)))  # no tokenizer
    with pytest.raises(ValueError, match="input_ids: token id 99999 is outside"):
        asyncio.run(engine.generate([1, 99999], SamplingParams()))
    with pytest.raises(ValueError, match="input_ids: empty prompt"):
        asyncio.run(engine.generate([], SamplingParams()))
    with pytest.raises(ValueError, match="SamplingParams.stop: stop strings need a tokenizer"):
        asyncio.run(engine.generate([1, 2], SamplingParams(stop=["\n"])))
    with pytest.raises(ValueError, match="SamplingParams.top_p"):
        asyncio.run(engine.generate([1, 2], SamplingParams(top_p=0.0)))


def test_device_comes_from_core_device(tmp_path, tokenizer, make_model, monkeypatch):
    """cluster.device goes through slime_rl.core.config.device: auto follows torch, a typo names the field."""
    model = make_model("qwen2", len(tokenizer))
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    with pytest.raises(ValueError, match="cluster.device: 'gpu' is not one of auto, cuda, cpu"):
        HFEngine.from_pretrained(tmp_path / "model", device="gpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="cluster.device: cuda requested but torch sees no GPU"):
        HFEngine.from_pretrained(tmp_path / "model", device="cuda")
    engine = HFEngine.from_pretrained(tmp_path / "model", device="auto", num_threads=1)
    assert engine.device.type == "cpu" and engine.model.dtype == torch.float32
    asyncio.run(engine.shutdown())


def test_from_config_loads_an_hf_folder_and_shuts_down(tmp_path, tokenizer, make_model):
    model = make_model("qwen2", len(tokenizer))
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    tree = {"model": {"path": str(tmp_path / "model")}, "cluster": {"device": "cpu"},
            "rollout": {"engine": "hf", "hf": {"max_batch_size": 4, "seed": 5, "num_threads": 1}}}
    engine = HFEngine.from_config(Config.model_validate(tree))
    assert engine.max_batch_size == 4 and engine.num_threads == 1 and engine.model.dtype == torch.float32 and engine.device.type == "cpu"
    prompt = encode(tokenizer, PROMPTS[:1])[0]
    out = asyncio.run(engine.generate(prompt, SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)))
    expected, _ = reference_log_probs(model, prompt, out.token_ids, 0.0)
    assert torch.allclose(torch.tensor(out.log_probs), expected, atol=1e-4)
    assert asyncio.run(engine.health())
    asyncio.run(engine.shutdown())
    asyncio.run(engine.shutdown())  # twice is fine
    assert not asyncio.run(engine.health())
    with pytest.raises(RuntimeError, match="shut down"):
        asyncio.run(engine.generate(prompt, SamplingParams()))

    # rollout.hf is HFSettings, checked with the config (it was a hand check of rollout.engine_args here)
    tree["rollout"]["hf"] = {"max_batch": 4}
    with pytest.raises(ValueError, match=r"rollout.hf.max_batch: unknown key; did you mean `rollout.hf.max_batch_size`"):
        Config.model_validate(tree)
    tree["rollout"]["hf"] = {"max_batch_size": 0}
    with pytest.raises(ValueError, match=r"rollout.hf.max_batch_size: "):
        Config.model_validate(tree)


def test_the_entry_point_names_the_engine():
    from slime_rl.core.infra.plugins import load_plugin

    assert load_plugin("slime_rl.rollout_engines", "hf") is HFEngine
    # and its settings entry point the model the class declares (the config loader reads that one)
    assert load_plugin("slime_rl.rollout_engines.settings", "hf") is HFEngine.settings is HFSettings


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_generation_matches_a_full_forward(tokenizer, make_model):
    model = make_model("llama", len(tokenizer)).cuda()
    engine = HFEngine(model, tokenizer)
    prompts = encode(tokenizer, PROMPTS)
    params = [SamplingParams(temperature=0.8, max_new_tokens=16, seed=i, ignore_eos=True) for i in range(len(prompts))]
    outputs = asyncio.run(generate_all(engine, prompts, params))
    for prompt, out in zip(prompts, outputs, strict=True):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + out.token_ids], device="cuda")).logits[0, len(prompt) - 1 : -1]
        expected = torch.log_softmax(logits.float() / 0.8, -1).gather(1, torch.tensor(out.token_ids, device="cuda")[:, None])
        assert (expected[:, 0].cpu() - torch.tensor(out.log_probs)).abs().max().item() <= 1e-3
    asyncio.run(engine.release_memory())
    assert next(model.parameters()).device.type == "cpu"
    asyncio.run(engine.resume_memory())
    assert next(model.parameters()).device.type == "cuda"


def test_moe_weight_sync_takes_the_checkpoints_per_expert_names(tokenizer, make_model, tmp_path):
    """The trainer sends experts one by one (``mlp.experts.{e}.gate_proj.weight``, as checkpoints name
    them); transformers 5 holds them fused: after the sync the engine's model is the other model."""
    from safetensors.torch import load_file

    engine = HFEngine(make_model("qwen2_moe", len(tokenizer), seed=0), tokenizer)
    other = make_model("qwen2_moe", len(tokenizer), seed=1)
    other.save_pretrained(tmp_path)
    sent = sorted(load_file(tmp_path / "model.safetensors").items())
    assert any(".mlp.experts.5.up_proj.weight" in name for name, _ in sent)
    asyncio.run(engine.update_weights(sent, version=1, last=True))
    mine = engine.model.state_dict()
    assert all(torch.equal(t, mine[n]) for n, t in other.state_dict().items())


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "glm4_moe"])
def test_moe_returns_the_experts_of_every_token_fed(arch, tokenizer, make_model):
    """With return_routed_experts, each response carries [prompt + new - 1][layers][top-k]: what one
    transformers forward over the whole sequence routes (batched, left-padded prefill and cached decode
    included); without it, nothing. GLM-4.5's dense first layer reports zeros (as SGLang's buffer does), and
    its MoE layer the router's own choice (sigmoid + correction bias within the best group), which is not the
    top-k of its logits."""
    model = make_model(arch, len(tokenizer))
    engine = HFEngine(model, tokenizer)
    prompts = encode(tokenizer, PROMPTS[:3]) * 2
    params = [SamplingParams(temperature=1.0, max_new_tokens=6, seed=i, ignore_eos=True,
                             return_routed_experts=i != 5) for i in range(len(prompts))]
    outputs = asyncio.run(generate_all(engine, prompts, params))
    assert outputs[5].routed_experts is None
    gates = {i: layer.mlp.gate for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")}
    assert sorted(gates) == ([1] if arch == "glm4_moe" else [0, 1])
    differs_from_logits_topk = False
    for prompt, out in list(zip(prompts, outputs, strict=True))[:5]:
        fed = torch.tensor([prompt + out.token_ids[:-1]])
        seen: dict[int, tuple] = {}
        hooks = [g.register_forward_hook(lambda m, i, o, layer=layer, seen=seen: seen.__setitem__(layer, o))
                 for layer, g in gates.items()]
        with torch.no_grad():
            model(fed)
        for hook in hooks:
            hook.remove()
        got = torch.tensor(out.routed_experts)
        assert got.shape == (len(prompt) + 5, 2, 2)
        for layer in range(2):
            if layer not in gates:
                assert torch.equal(got[:, layer], torch.zeros_like(got[:, layer]))
                continue
            logits, _, indices = seen[layer]
            assert torch.equal(got[:, layer].sort(-1).values, indices.sort(-1).values.to(got.dtype))
            logits_topk = logits.float().topk(2, dim=-1).indices.sort(-1).values
            differs_from_logits_topk |= not torch.equal(got[:, layer].sort(-1).values, logits_topk.to(got.dtype))
    assert differs_from_logits_topk == (arch == "glm4_moe")


def test_pause_holds_requests_and_a_weight_update_lands_mid_response(tokenizer, make_model):
    """SGLang's in_place pause: running rows wait between decode steps, the weights change, and they go
    on without an abort; every token records the version that sampled it."""
    engine = HFEngine(make_model("llama", len(tokenizer), seed=0), tokenizer)
    new_weights = list(make_model("llama", len(tokenizer), seed=1).state_dict().items())
    prompt = encode(tokenizer, PROMPTS[:1])[0]

    async def main():
        task = asyncio.create_task(engine.generate(prompt, SamplingParams(max_new_tokens=40, ignore_eos=True), "r"))
        await wait_until_decoding(engine, "r", 5)
        assert await engine.pause_generation()
        await asyncio.sleep(0.05)  # the step running at the pause finishes; no other starts
        made = len(engine._in_flight["r"].token_ids)
        await asyncio.sleep(0.05)
        assert len(engine._in_flight["r"].token_ids) == made and not task.done()
        await engine.update_weights(new_weights, version=1, last=True)
        await engine.continue_generation()
        return made, await task

    made, out = asyncio.run(main())
    assert out.finish_reason == "length" and len(out.token_ids) == 40
    # The first token after the pause comes from logits the old weights computed before it: version 0 too.
    assert out.token_versions == [0] * (made + 1) + [1] * (40 - made - 1)
    assert out.weight_version == 1
