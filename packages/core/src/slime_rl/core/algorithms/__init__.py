"""RL math: advantage estimators, policy/KL/entropy losses, staleness, dynamic-sampling filters, LoRA specs."""
