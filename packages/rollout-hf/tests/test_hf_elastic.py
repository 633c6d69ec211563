"""Elastic engines and delta syncs on hf engines (core/run/engine_pool.py, core/weights/delta.py): a removed
engine's requests finish on another one whole, a joiner serves only at the pool's version, and 20 delta
syncs leave every engine bit-equal to the trainer's weights across a restart and a late joiner."""

from __future__ import annotations

import asyncio

import torch

from slime_rl.core.contracts import SamplingParams
from slime_rl.core.run.engine_pool import EnginePool
from slime_rl.core.weights.delta import DeltaChainBroken, DeltaEncoder, bits, delta_base, engine_digests
from slime_rl.rollout_hf.engine import HFEngine


def _engines(tokenizer, make_model):
    def build() -> HFEngine:
        return HFEngine(make_model("llama", len(tokenizer)).to(torch.bfloat16), tokenizer)
    return build


def _trainer_weights(engine: HFEngine) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in engine.model.named_parameters()}


def _equal(engine: HFEngine, weights: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(bits(engine.current_weight(n)), bits(w)) for n, w in weights.items())


async def _sync(pool: EnginePool, encoder: DeltaEncoder, weights: dict[str, torch.Tensor], version: int) -> bool:
    """The rollout worker's and WeightSync's part of one sync; returns whether it went as a delta."""
    for attempt in (delta_base(pool), None):
        buckets = list(encoder.encode(iter([list(weights.items())]), version=version, engines_hold=attempt))
        try:
            await pool.pause_generation()
            for i, bucket in enumerate(buckets):
                await pool.update_weights(bucket, version=version, last=i == len(buckets) - 1)
            return encoder.last.delta
        except DeltaChainBroken:
            continue
        finally:
            await pool.continue_generation()
    raise AssertionError("a full sync cannot break the chain")


def test_a_removed_engine_moves_its_requests_and_a_joiner_serves(tokenizer, make_model):
    build = _engines(tokenizer, make_model)
    pool = EnginePool(build, build(), max_engines=3)
    prompt = tokenizer("Question: What is 3 + 4?\nAnswer:").input_ids

    async def main():
        assert await pool.add_engines(2) == ["engine-1", "engine-2"]
        assert [m.state for m in pool.members.values()] == ["serving"] * 3  # version 0: the model's own
        params = SamplingParams(max_new_tokens=60, ignore_eos=True, seed=3)
        running = [asyncio.create_task(pool.generate(prompt, params, f"g{i}")) for i in range(6)]
        while not pool.members["engine-1"].in_flight:
            await asyncio.sleep(0.01)
        moved = await pool.remove_engine("engine-1")
        outs = await asyncio.gather(*running)
        return moved, outs

    moved, outs = asyncio.run(main())
    assert moved >= 1 and pool.requests_moved == moved
    assert all(o.finish_reason == "length" and len(o.token_ids) == 60 == len(o.log_probs) for o in outs)
    assert list(pool.members) == ["engine-0", "engine-2"] and pool.stats()["engine/count"] == 2.0
    try:
        asyncio.run(pool.remove_engine("engine-9"))
    except KeyError as err:
        assert "engine-0, engine-2" in str(err)
    asyncio.run(pool.shutdown())


def test_delta_syncs_stay_bit_exact_through_a_restart_and_a_late_joiner(tokenizer, make_model):
    build = _engines(tokenizer, make_model)
    pool = EnginePool(build, build(), max_engines=3)
    weights = _trainer_weights(pool.members["engine-0"].engine)
    encoder = DeltaEncoder()
    gen = torch.Generator().manual_seed(0)
    kinds = []

    async def main():
        for version in range(1, 21):
            for name, w in weights.items():  # an optimizer step: a few elements move
                moved = torch.rand(w.numel(), generator=gen) < 0.05
                flat = bits(w).clone()
                flat[moved] += 1
                weights[name] = flat.view(w.dtype).reshape(w.shape)
            if version == 8:  # engine-0 restarts: back to the model's weights at version 0
                old = pool.members["engine-0"]
                await old.engine.shutdown()
                old.engine = build()
            if version == 13:
                await pool.add_engines(1)  # a late joiner, not serving until the next sync
                assert pool.members["engine-1"].state == "joining"
            kinds.append(await _sync(pool, encoder, weights, version))
            for member in pool.members.values():
                assert member.engine.weight_version == version and _equal(member.engine, weights), (version, member)
            assert all(m.state == "serving" for m in pool.members.values())

    asyncio.run(main())
    assert kinds[0] is False  # the encoder kept nothing yet
    assert kinds[7] is False and kinds[12] is False  # the restart and the joiner broke the chain: full
    assert sum(kinds) == 17 and encoder.last.bytes_moved < encoder.last.full_bytes
    names, want = encoder.kept_digest()
    assert set(engine_digests(pool, names).values()) == {want}  # what rollout.elastic.verify_weights compares
    old = pool.members["engine-1"].engine.current_weight(names[0])
    old.view(-1)[0] += 1  # one element off: that engine's digest differs
    assert engine_digests(pool, names)["engine-1"] != want == engine_digests(pool, names)["engine-0"]
    asyncio.run(pool.shutdown())
