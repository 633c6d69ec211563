"""RolloutBatch carries each sample's vision inputs (Sample.multimodal_train_inputs) through select and shard, so
every data-parallel shard and optimizer step hands the trainer its own samples' images."""

from __future__ import annotations

import torch

from slime_rl.core.batch import RolloutBatch
from slime_rl.core.sample import Sample


def _sample(i: int, length: int, images: int) -> Sample:
    inputs = None
    if images:
        inputs = {"pixel_values": torch.full((4 * images, 3), float(i)), "image_grid_thw": [[1, 2, 2]] * images}
    return Sample(index=i, group_index=i, tokens=list(range(length)), response_length=2, loss_mask=[1, 1],
                  rollout_log_probs=[0.0, 0.0], reward=0.0, multimodal_train_inputs=inputs)


def test_images_follow_their_samples_through_shard_and_steps():
    samples = [_sample(i, 5 + i, images=i % 3) for i in range(6)]
    batch = RolloutBatch.from_samples(samples)
    assert batch.images[0] is None and torch.equal(batch.images[2]["image_grid_thw"], torch.tensor([[1, 2, 2]] * 2))
    for shard in batch.shard(2, samples_per_step=3):
        for part, _, _ in shard.optimizer_steps():
            for sample_id, images in zip(part.sample_ids.tolist(), part.images, strict=True):
                expected = samples[sample_id].multimodal_train_inputs
                assert (images is None) == (expected is None)
                if images is not None:
                    assert torch.equal(images["pixel_values"], expected["pixel_values"])


def test_text_only_batches_carry_no_images():
    batch = RolloutBatch.from_samples([_sample(i, 6, images=0) for i in range(3)])
    assert batch.images is None and batch.select([2, 0]).images is None
