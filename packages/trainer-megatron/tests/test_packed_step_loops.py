"""No per-sequence loop in a packed micro-batch's update: the operators a train step and a log-prob pass
run are the same for 4 sequences as for 32 of the same tokens. On a GPU each operator is a kernel launch;
a loop over sequences is what made a step of 128 short samples launch-bound (issue 35: 14x slower than
transformers). Views are left out of the count: they launch nothing."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from megatron_testlib import make_hf_model, to_batch, trainer_for
from torch.utils._python_dispatch import TorchDispatchMode

from slime_rl.core.sample import Sample

VOCAB = 256
TOKENS = 192  # per step, however many sequences share them
PACKED = ["trainer.micro_batch_size=64", "trainer.max_tokens_per_gpu=1024"]  # one packed micro-batch


class CountOperators(TorchDispatchMode):
    """Counts the ATen operators run inside it, views left out."""

    def __init__(self):
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_hf_model(tmp_path_factory.mktemp("policy") / "m", "qwen2", tie=True, vocab=VOCAB)


def samples_of(count: int) -> list[Sample]:
    """``count`` sequences of TOKENS // count tokens, half of each the response, advantages of both signs."""
    length = TOKENS // count
    g = torch.Generator().manual_seed(count)
    out = []
    for i in range(count):
        r = length // 2
        out.append(Sample(index=i, group_index=i // 4, tokens=torch.randint(0, VOCAB, (length,), generator=g).tolist(),
                          response_length=r, loss_mask=[1] * r, rollout_log_probs=[-1.0] * r, reward=1.0,
                          advantages=[0.5 if i % 2 else -0.5] * r))
    return out


def operators_of_an_update(trainer, count: int) -> Counter[str]:
    batch = to_batch(samples_of(count))
    batch.old_log_probs = trainer.compute_log_probs(batch)
    trainer.train_step(batch)  # the optimizer's states exist from here on, as in every later step
    with CountOperators() as counting:
        trainer.train_step(batch)
        trainer.compute_log_probs(batch)
    return counting.counts


def grown(few: Counter[str], many: Counter[str]) -> dict[str, tuple[int, int]]:
    return {op: (few[op], many[op]) for op in few | many if few[op] != many[op]}


@pytest.mark.parametrize("overrides", [
    [],
    # the sequence-level paths: GSPO's ratio, per-sequence means, entropy, a sequence-level correction
    ["algorithm.policy_loss=gspo", "algorithm.loss_agg=seq-mean-token-mean", "algorithm.entropy_coef=0.01",
     "algorithm.rollout_correction=seq-mask-tis"],
], ids=["ppo", "sequence-level"])
def test_a_packed_update_runs_the_same_operators_for_4_sequences_as_for_32(model_dir, overrides):
    trainer = trainer_for(model_dir, PACKED + overrides)
    few, many = operators_of_an_update(trainer, 4), operators_of_an_update(trainer, 32)
    assert sum(few.values()) > 500  # the whole update was counted
    assert grown(few, many) == {}


def test_the_count_sees_a_loop_over_sequences(model_dir):
    """The per-sequence attention kernel (kept for comparison) is such a loop: one SDPA per sequence per layer."""
    trainer = trainer_for(model_dir, PACKED + ["trainer.megatron.packed_attention=per_sequence"])
    changed = grown(operators_of_an_update(trainer, 4), operators_of_an_update(trainer, 32))
    layers = 2
    assert changed["aten._scaled_dot_product_flash_attention_for_cpu.default"] == (2 * layers * 4, 2 * layers * 32)
