"""RL math: advantage estimators, policy/KL/entropy losses and their registries, staleness, dynamic-sampling filters,
LoRA specs."""
