"""The reference policy (KL term, ``compute_log_probs(model='ref')``): a host copy of its weights,
swapped into the training model for a reference pass and swapped back after. One model in
accelerator memory, not two."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from slime_rl.core.config import Config
from slime_rl.trainer_megatron import convert
from slime_rl.trainer_megatron.model import HFModelShape


class ReferenceWeights:
    """Host-held weights of the reference policy, parameter by parameter (this rank's shards), and the
    routers' expert-bias buffers."""

    def __init__(self, model: torch.nn.Module, weights: dict[str, torch.Tensor]):
        self.model, self.weights = model, weights
        self._spare: dict[str, torch.Tensor] = {}  # second pinned buffers for GPU swaps, made on the first

    @classmethod
    def snapshot(cls, model: torch.nn.Module) -> ReferenceWeights:
        """The model's current weights, copied to the host."""
        return cls(model, {name: _host_copy(p.detach()) for name, p in convert.checkpoint_tensors(model)})

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """Run with the reference weights in the model (and the actor's back after)."""
        self._swap()
        try:
            yield
        finally:
            self._swap()

    @torch.no_grad()
    def _swap(self) -> None:
        """Exchange the model's weights with the host-held ones (the reference, or the actor's)."""
        copied = False
        # the routers' correction bias too (GLM): a reference checkpoint may route differently
        for name, param in convert.checkpoint_tensors(self.model):
            held = self.weights[name]
            # Same dtype only: a dtype change would give the parameter a new grad accumulator and
            # silently detach Megatron's DDP gradient hook from it.
            assert held.dtype == param.dtype and held.shape == param.shape, name
            if not param.is_cuda:  # host memory already: exchange storage, no copy
                param.data, self.weights[name] = held, param.data
                continue
            spare = self._spare.get(name)
            if spare is None:
                spare = self._spare[name] = torch.empty(held.shape, dtype=held.dtype, pin_memory=True)
            spare.copy_(param.data, non_blocking=True)
            param.data.copy_(held, non_blocking=True)
            self.weights[name], self._spare[name] = spare, held
            copied = True
        if copied:  # the non-blocking copies land before the weights are read or the buffers reused
            torch.cuda.synchronize()


def load_policy_and_reference(model: torch.nn.Module, cfg: Config, shape: HFModelShape, *,
                              role: str) -> ReferenceWeights | None:
    """The HF weights (model.path) into ``model``; returns the reference weights (model.ref_path, else
    the initial ones) when a KL term or an explicit reference asks for them."""
    algo = cfg.algorithm
    needs_ref = role == "actor" and (algo.use_kl_loss or algo.kl_coef != 0 or cfg.model.ref_path is not None)
    ref = None
    if needs_ref and cfg.model.ref_path not in (None, cfg.model.path):
        convert.load_hf(model, cfg.model.ref_path, shape)
        ref = ReferenceWeights.snapshot(model)
    if role == "critic" and cfg.model.critic_path not in (None, cfg.model.path):
        load_critic(model, cfg.model.critic_path, shape)
        return None
    convert.load_hf(model, cfg.model.path, shape)
    if needs_ref and ref is None:
        ref = ReferenceWeights.snapshot(model)
    return ref


def load_critic(model: torch.nn.Module, folder: str, shape: HFModelShape) -> None:
    """model.critic_path: the critic's trunk from an HF causal-LM folder (a saved policy, or an earlier run's
    critic exported as one); its value head from the folder's ``score.weight`` (``[1, hidden]``, a one-label
    scalar head) when it has one, else the zero head it was built with."""
    convert.load_hf(model, folder, shape)
    reader = convert.SafetensorsFolder(folder)
    head = getattr(model, "value_head", None)
    if head is not None and "score.weight" in reader:
        weight = reader.get("score.weight")
        if tuple(weight.shape) != tuple(head.weight.shape):
            raise ValueError(f"model.critic_path: {folder}'s score.weight is {tuple(weight.shape)}, the critic's value"
                             f" head {tuple(head.weight.shape)}; give a one-label scalar head of the model's width")
        head.weight.data.copy_(weight)


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """A host copy of ``t``, in pinned memory when ``t`` is on the GPU (fast transfers back)."""
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
    out.copy_(t)
    return out
