"""slime-rl buffer."""
