"""slime-rl rollout-sglang."""
