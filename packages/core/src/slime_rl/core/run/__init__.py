"""A run: the training loop, its Ray actors, rollout orchestration, checkpoints, the run folder and metrics."""
