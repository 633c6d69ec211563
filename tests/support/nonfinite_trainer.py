"""A trainer plugin for the end-to-end tests: the real MegatronTrainer, whose second train_step gets
nan advantages (what a broken reward or advantage estimator hands it), loaded by module:attr in Ray."""

from __future__ import annotations

import torch

from slime_rl.trainer_megatron.trainer import MegatronTrainer


class NanAdvantagesAtStepTwo(MegatronTrainer):
    calls = 0

    def train_step(self, batch):
        self.calls += 1
        if self.calls == 2:
            batch.advantages = torch.full_like(batch.advantages, float("nan"))
        metrics = super().train_step(batch)
        # what the test checks afterwards: no nan reached the weights the engines get next
        metrics["weights_finite"] = float(all(bool(torch.isfinite(p).all()) for p in self.model.parameters()))
        return metrics
