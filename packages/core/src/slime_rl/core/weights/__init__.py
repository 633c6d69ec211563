"""How the trainer's weights reach the engines: the route chosen once per run, and named tensors between processes."""
