"""Infrastructure: Ray, sockets, torch.distributed, plugin loading, killable worker processes, host memory."""
