"""The engine pool's count of moved requests (core/run/engine_pool.py): `slime-cli engines remove` and the
``engine/requests_moved`` metric report the same number, and a request that finished as its engine was asked to
drain is no move (it was counted as one, and a whole-run test saw the two disagree by one)."""

from __future__ import annotations

import asyncio

from slime_rl.core.contracts import GenerateOutput, RolloutEngine, SamplingParams
from slime_rl.core.run.engine_pool import EnginePool


class ScriptedEngine(RolloutEngine):
    """Requests wait until released; ``finish_first`` names those that end on their own just as the abort comes."""

    def __init__(self, finish_first: frozenset[str] = frozenset()):
        self.release = asyncio.Event()
        self.finish_first = finish_first
        self.aborted: set[str] = set()
        self.served: list[str] = []

    async def generate(self, input_ids, params, request_id=None, **images):
        self.served.append(request_id)
        await self.release.wait()
        pool_id = request_id.split(":", 1)[1]
        if request_id in self.aborted and pool_id not in self.finish_first:
            return GenerateOutput([7], [-0.5], "abort", 0)
        return GenerateOutput([7] * params.max_new_tokens, [-0.5] * params.max_new_tokens, "length", 0)

    async def abort(self, request_id=None):
        self.aborted.add(request_id)
        self.release.set()  # the engine answers every request it holds: aborted, or finished first

    async def update_weights(self, named_tensors, *, version, last):
        pass

    @property
    def weight_version(self) -> int:
        return 0


def test_a_request_that_finishes_before_the_abort_is_not_counted_as_moved():
    async def main():
        leaving = ScriptedEngine(finish_first=frozenset({"r1"}))
        staying = ScriptedEngine()
        staying.release.set()
        pool = EnginePool(lambda: staying, leaving)
        params = SamplingParams(max_new_tokens=4)
        running = [asyncio.create_task(pool.generate([1, 2], params, f"r{i}")) for i in range(3)]
        while len(pool.members["engine-0"].in_flight) < 3:
            await asyncio.sleep(0)
        await pool.add_engines(1)
        moved = await pool.remove_engine("engine-0")
        outs = await asyncio.gather(*running)
        return moved, pool, outs, staying

    moved, pool, outs, staying = asyncio.run(main())
    assert moved == 2 == pool.requests_moved == pool.stats()["engine/requests_moved"]
    assert sorted(staying.served) == ["engine-1:r0", "engine-1:r2"]  # r1 stayed: it had finished
    assert all(len(o.token_ids) == 4 and o.finish_reason == "length" for o in outs)  # each request whole
