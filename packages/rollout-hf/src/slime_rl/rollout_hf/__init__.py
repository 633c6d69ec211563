"""slime-rl rollout-hf."""
