"""offload.py: storages leave and come back while every tensor object, view and autograd hook stays."""

from __future__ import annotations

import torch

from slime_rl.trainer_megatron.offload import offload_storages, onload_storages


def test_round_trip_keeps_contents_views_and_grad_accumulator_hooks():
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 4)
    buffer = torch.zeros(8 * 4 + 4)  # like Megatron's grad buffer: main_grad views into one tensor
    main_grads = {layer.weight: buffer[:32].view(4, 8), layer.bias: buffer[32:]}
    fired = []
    accumulators = []  # Megatron DDP keeps its grad accumulators alive the same way

    def hook_for(param):
        def hook(*_):
            main_grads[param].add_(param.grad)
            fired.append(param)
            param.grad = None
        return hook

    for param in layer.parameters():
        acc = param.expand_as(param).grad_fn.next_functions[0][0]
        acc.register_hook(hook_for(param))
        accumulators.append(acc)
    weights = {n: p.detach().clone() for n, p in layer.named_parameters()}
    x = torch.randn(3, 8)
    layer(x).sum().backward()
    expected_grads = buffer.clone()

    moved = offload_storages(list(layer.parameters()))
    dropped = offload_storages(list(main_grads.values()), keep=False)
    assert len(dropped) == 1  # two views, one storage
    assert all(p.untyped_storage().nbytes() == 0 for p in layer.parameters())
    assert buffer.untyped_storage().nbytes() == 0
    onload_storages(moved + dropped)

    for name, param in layer.named_parameters():
        assert torch.equal(param.detach(), weights[name])
    assert torch.equal(buffer, torch.zeros_like(buffer))  # dropped contents come back as zeros
    fired.clear()
    layer(x).sum().backward()
    assert len(fired) == 2  # the hooks still run after the round trip
    assert torch.equal(buffer, expected_grads)


def test_nothing_to_move_is_a_no_op():
    empty = torch.empty(0)
    assert offload_storages([empty]) == []
    onload_storages([])
