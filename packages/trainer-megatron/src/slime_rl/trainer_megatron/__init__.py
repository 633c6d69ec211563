"""slime-rl trainer-megatron."""
