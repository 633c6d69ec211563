"""The independent forward pass the conformance suite checks an engine's log-probs against."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from slime_rl.core.contracts import NamedTensors

if TYPE_CHECKING:
    from transformers import PreTrainedModel

#: ``reference(weights, input_ids, response_ids, temperature)``: the log-prob of each response token under
#: ``log_softmax(logits / temperature)`` (temperature 0: 1) of a forward pass over ``weights``.
Reference = Callable[[NamedTensors, list[int], list[int], float], Sequence[float]]


def transformers_reference(model: PreTrainedModel) -> Reference:
    """A `Reference` over a transformers causal LM: it loads the named tensors it is given (when they are not
    the ones it holds) and runs one forward over prompt + response, no cache, no padding. Give it a model of
    its own, not the engine's."""
    import torch

    held: list[int | None] = [None]

    def reference(weights: NamedTensors, input_ids: list[int], response: list[int], temperature: float) -> list[float]:
        if held[0] != id(weights):
            params = model.state_dict(keep_vars=True)
            with torch.no_grad():
                for name, tensor in weights:
                    params[name].copy_(tensor)
            held[0] = id(weights)
        device = next(model.parameters()).device
        with torch.no_grad():
            logits = model(torch.tensor([input_ids + response], device=device)).logits[0, len(input_ids) - 1:-1]
        scaled = logits.float() / (temperature if temperature > 0 else 1.0)
        picked = torch.tensor(response, device=device)[:, None]
        return torch.log_softmax(scaled, dim=-1).gather(1, picked)[:, 0].tolist()

    return reference
