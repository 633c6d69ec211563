"""Advantages and returns on the trainer ranks equal what the driver computed before Loop v2.

golden_advantages.json holds the output of commit 25e3bc4's `compute_advantages` over samples
(fixtures/make_golden_advantages.py wrote it). Here the same samples become a `RolloutBatch`,
whole (DP=1) or split into two data-parallel shards whose group statistics and whitening are
summed across the two ranks (DP=2, one thread per rank), and must agree to 1e-6.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch

from slime_rl.core.algorithms.advantages import compute_advantages
from slime_rl.core.batch import RolloutBatch
from slime_rl.core.config import AlgorithmConfig
from slime_rl.core.sample import Sample

GOLDEN = json.loads((Path(__file__).parent / "fixtures" / "golden_advantages.json").read_text())
CASES = GOLDEN["cases"]


def _batch(case: dict) -> RolloutBatch:
    rows = GOLDEN["samples"]
    samples = [Sample(index=r["index"], group_index=r["group_index"], tokens=[1, 2, *range(3, 3 + r["response_length"])],
                      response_length=r["response_length"], loss_mask=r["loss_mask"], reward=r["reward"],
                      rollout_log_probs=r["rollout_log_probs"]) for r in rows]
    batch = RolloutBatch.from_samples(samples)
    algo = AlgorithmConfig(advantage_estimator=case["estimator"], **case["algorithm"])
    if algo.kl_coef != 0:
        batch.old_log_probs = torch.tensor([x for r in rows for x in r["old_log_probs"]], dtype=torch.float32)
        batch.ref_log_probs = torch.tensor([x for r in rows for x in r["ref_log_probs"]], dtype=torch.float32)
    if case["estimator"] == "ppo":
        batch.values = torch.tensor([x for r in rows for x in r["values"]], dtype=torch.float32)
    return batch


class TwoRanks:
    """``sum_over_dp`` for two threads: each call waits for the other rank's tensor and returns the sum."""

    def __init__(self):
        self.barrier = threading.Barrier(2)
        self.parts: list[torch.Tensor | None] = [None, None]

    def for_rank(self, rank: int):
        def sum_over_dp(tensor: torch.Tensor) -> torch.Tensor:
            self.parts[rank] = tensor.clone()
            self.barrier.wait()
            total = self.parts[0] + self.parts[1]
            self.barrier.wait()  # both have read before either writes its next tensor
            return total
        return sum_over_dp


def _expected(case: dict, batch: RolloutBatch, key: str) -> torch.Tensor:
    return torch.tensor([x for row in case[key] for x in row], dtype=torch.float64)[
        _rows_tokens(batch)]


def _rows_tokens(batch: RolloutBatch) -> torch.Tensor:
    """The whole step's response-token indices of ``batch``'s samples, in its order."""
    lengths = torch.tensor([r["response_length"] for r in GOLDEN["samples"]])
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    return torch.cat([torch.arange(starts[p], starts[p + 1]) for p in batch.positions.tolist()])


def _id(case: dict) -> str:
    return case["estimator"] + "".join(f"-{k}={v}" for k, v in case["algorithm"].items())


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_one_rank_equals_golden(case):
    batch = _batch(case)
    algo = AlgorithmConfig(advantage_estimator=case["estimator"], **case["algorithm"])
    compute_advantages(batch, algo, n_samples_per_prompt=case["n_samples_per_prompt"])
    torch.testing.assert_close(batch.advantages.double(), _expected(case, batch, "advantages"), rtol=0, atol=1e-6)
    if case["returns"] is not None:
        torch.testing.assert_close(batch.returns.double(), _expected(case, batch, "returns"), rtol=0, atol=1e-6)


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_two_ranks_equal_golden(case):
    """Split by tokens, so groups straddle the two shards: the statistics must still span the step."""
    algo = AlgorithmConfig(advantage_estimator=case["estimator"], **case["algorithm"])
    shards = _batch(case).shard(2, samples_per_step=len(GOLDEN["samples"]))
    straddling = set(shards[0].group_ids.tolist()) & set(shards[1].group_ids.tolist())
    assert straddling, "the split should cut at least one group in two"
    ranks = TwoRanks()
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            compute_advantages(shards[rank], algo, n_samples_per_prompt=case["n_samples_per_prompt"],
                               sum_over_dp=ranks.for_rank(rank))
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)
            ranks.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    for shard in shards:
        torch.testing.assert_close(shard.advantages.double(), _expected(case, shard, "advantages"), rtol=0, atol=1e-6)
        if case["returns"] is not None:
            torch.testing.assert_close(shard.returns.double(), _expected(case, shard, "returns"), rtol=0, atol=1e-6)


def test_a_group_out_of_order_is_named():
    case = CASES[0]
    batch = _batch(case)
    batch.group_ids[1] = 3  # sample 1 claims another prompt's group
    with pytest.raises(ValueError, match="should form one group"):
        compute_advantages(batch, AlgorithmConfig(), n_samples_per_prompt=4)
