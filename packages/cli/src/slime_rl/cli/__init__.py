"""slime-rl cli."""
