"""Where the trainer runs: CUDA, or the CPU with megatron-core's CUDA-only call sites redirected.

megatron-core assumes a GPU in a handful of places (``torch.cuda.current_device()``,
``torch.zeros(..., device="cuda")``, a CUDA RNG tracker, a clip-grad assert on
``torch.cuda.FloatTensor``). On the CPU we hand those Megatron modules a ``torch``
whose CUDA device means the CPU, install an RNG tracker over the CPU generator and
swap the one clip function that asserts CUDA tensors. The model code is the same on
both devices; only this module knows the difference.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import functools
import importlib
import os
import types

import torch

from slime_rl.core.config import device as core_device
from slime_rl.core.config.device import Device
from slime_rl.core.infra.distributed import init_process_group

# The Megatron modules that create tensors on "cuda" or call torch.cuda.* on the
# training path we use (GPTModel, DDP, optimizer, schedules, p2p, checkpointing).
_CUDA_MODULES = (
    "megatron.core.utils",
    "megatron.core.parallel_state",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.finalize_model_grads",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.models.common.language_module.language_module",
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.utils",
    "megatron.core.transformer.attention",
    "megatron.core.transformer.dot_product_attention",
    "megatron.core.transformer.module",
    "megatron.core.transformer.transformer_layer",
    "megatron.core.transformer.moe.experts",
    "megatron.core.transformer.moe.moe_layer",
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.transformer.moe.router",
    "megatron.core.transformer.moe.shared_experts",
    "megatron.core.transformer.moe.token_dispatcher",
    "megatron.core.dist_checkpointing.exchange_utils",
    "megatron.core.dist_checkpointing.strategies.torch",
    "megatron.core.dist_checkpointing.strategies.fully_parallel",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
)

_CPU = torch.device("cpu")
_redirected = False


def resolve_device(setting: str) -> Device:
    """``cluster.device`` -> the device this rank trains on (`slime_rl.core.config.device`'s rule; cuda must be here)."""
    return core_device.resolve_device(setting, here=True)


def _to_cpu_device(device):
    if device is None:
        return None
    if isinstance(device, int) or (isinstance(device, str) and device.startswith("cuda")):
        return _CPU
    if isinstance(device, torch.device) and device.type == "cuda":
        return _CPU
    return device


def _redirect_factory(fn):
    def factory(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        kwargs.pop("pin_memory", None)  # pinning needs a CUDA runtime
        return fn(*args, **kwargs)

    return factory


class _CpuCuda(types.SimpleNamespace):
    """``torch.cuda`` as Megatron sees it on the CPU: the current device is the CPU."""

    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device():
        return _CPU

    @staticmethod
    def synchronize(*args, **kwargs):
        return None

    @staticmethod
    def empty_cache():
        return None

    @staticmethod
    def device_count():
        return 0

    @staticmethod
    def stream(*args, **kwargs):
        return contextlib.nullcontext()

    @staticmethod
    def current_stream(*args, **kwargs):
        return None

    @staticmethod
    def Stream(*args, **kwargs):  # noqa: N802 - torch.cuda's name
        return _NoStream()


class _NoStream:
    """A CUDA stream on the CPU (the MoE alltoall dispatcher's device-to-host stream): work is synchronous."""

    def wait_stream(self, *args, **kwargs):
        return None

    def record_event(self, *args, **kwargs):
        return types.SimpleNamespace(synchronize=lambda: None, wait=lambda *a, **k: None)


def _make_cpu_torch() -> types.ModuleType:
    """A stand-in for the ``torch`` module: everything is torch's, except that CUDA means CPU."""
    proxy = types.ModuleType("torch")
    proxy.__dict__.update({k: v for k, v in vars(torch).items() if not k.startswith("__")})
    proxy.cuda = _CpuCuda()
    for name in ("tensor", "zeros", "ones", "empty", "full", "arange", "zeros_like", "ones_like", "empty_like", "randn"):
        setattr(proxy, name, _redirect_factory(getattr(torch, name)))
    return proxy


def _clip_grad_by_total_norm_cpu(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """megatron's clip_grad_by_total_norm_fp32 without its assert on CUDA tensors."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0:
        for param in parameters:
            grad = getattr(param, attr, None)
            if grad is not None:
                grad.detach().mul_(clip_coeff)


def redirect_megatron_to_cpu() -> None:
    """Point megatron-core's CUDA-only call sites at the CPU. Idempotent; call before building the model."""
    global _redirected
    if _redirected:
        return
    cpu_torch = _make_cpu_torch()
    for name in _CUDA_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:  # a module another megatron-core version does not have
            continue
        if getattr(module, "torch", None) is torch:
            module.torch = cpu_torch
    from megatron.core.optimizer import clip_grads, optimizer

    clip_grads.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_cpu
    optimizer.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_cpu
    _keep_tied_embedding_sync_on_cpu()
    _let_mixed_precision_optimizer_wrap_cpu_params()
    _install_cpu_rng_tracker()
    _keep_freed_memory_mapped()
    _give_moe_dispatcher_host_splits()
    _reduce_scatter_over_gloo()
    _redirected = True


def _reduce_scatter_over_gloo() -> None:
    """gloo has no reduce-scatter and gathers only equal sizes; expert tensor parallelism (ETP > 1)
    uses both in the MoE dispatcher. On the CPU: an all-reduce and this rank's slice, and an
    all-gather of padded pieces cut back to their sizes."""
    from megatron.core.tensor_parallel import mappings

    def reduce_scatter(input_, group, input_split_sizes=None, use_global_buffer=False):
        world = group.size()
        if world == 1:
            return input_
        total = input_.contiguous().clone()
        torch.distributed.all_reduce(total, group=group)
        sizes = input_split_sizes or [input_.shape[0] // world] * world
        return torch.split(total, list(sizes), dim=0)[group.rank()].contiguous()

    gather = mappings._gather_along_first_dim

    def gather_uneven(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return gather(input_, group, None, use_global_buffer)
        sizes = list(output_split_sizes)
        padded = input_.new_zeros(max(sizes), *input_.shape[1:])
        padded[: input_.shape[0]] = input_
        pieces = [torch.empty_like(padded) for _ in sizes]
        torch.distributed.all_gather(pieces, padded.contiguous(), group=group)
        return torch.cat([piece[:n] for piece, n in zip(pieces, sizes, strict=True)])

    mappings._reduce_scatter_along_first_dim = reduce_scatter
    mappings._gather_along_first_dim = gather_uneven


def _give_moe_dispatcher_host_splits() -> None:
    """The MoE alltoall dispatcher turns its split sizes into numpy arrays only when it moves them
    off a GPU; on the CPU they stay tensors, which ``all_to_all_single`` refuses. Convert CPU
    tensors the same way."""
    try:
        from megatron.core.transformer.moe import moe_utils, token_dispatcher
    except ImportError:
        return
    original = moe_utils.maybe_move_tensor_to_cpu

    def to_host(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and tensor.device.type == "cpu":
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    moe_utils.maybe_move_tensor_to_cpu = to_host
    token_dispatcher.maybe_move_tensor_to_cpu = to_host


def _keep_freed_memory_mapped() -> None:
    """glibc hands large blocks back to the OS on free, so every step page-faults its
    logits and gradient buffers in again (~140k faults per step for SmolLM2-135M). Raising the
    mmap/trim thresholds keeps them in the heap for reuse."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 1 << 30)
    libc.mallopt(m_trim_threshold, 1 << 30)


@contextlib.contextmanager
def _tensor_cuda_is_identity():
    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    try:
        yield
    finally:
        torch.Tensor.cuda = original


def _keep_tied_embedding_sync_on_cpu() -> None:
    """With PP and tied embeddings, Megatron moves the shared weight with ``.cuda()`` before
    syncing the first and last stages' copies; on the CPU that move is a no-op."""
    from megatron.core.models.common.language_module.language_module import LanguageModule

    setup = LanguageModule.setup_embeddings_and_output_layer

    def setup_on_cpu(self, *args, **kwargs):
        with _tensor_cuda_is_identity():
            return setup(self, *args, **kwargs)

    LanguageModule.setup_embeddings_and_output_layer = setup_on_cpu


@contextlib.contextmanager
def _cpu_tensors_report_cuda_types():
    original = torch.Tensor.type

    def type_as_cuda(self, *args, **kwargs):
        if args or kwargs:
            return original(self, *args, **kwargs)
        name = original(self)
        return name.replace("torch.", "torch.cuda.", 1) if self.device.type == "cpu" else name

    torch.Tensor.type = type_as_cuda
    try:
        yield
    finally:
        torch.Tensor.type = original


def _let_mixed_precision_optimizer_wrap_cpu_params() -> None:
    """bf16 training, and the distributed optimizer (trainer.megatron.use_distributed_optimizer) in any
    dtype: Megatron sorts the parameters by ``param.type()`` against the CUDA type names; on the CPU
    the same sort by the CPU names."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    for cls in (Float16OptimizerWithFloat16Params, DistributedOptimizer):
        cls.__init__ = _with_cuda_type_names(cls.__init__)
    gather = DistributedOptimizer.get_parameter_state_dp_zero

    @functools.wraps(gather)
    def gather_on_cpu(self, *args, **kwargs):  # a checkpoint's gather moves each piece with .cuda()
        with _tensor_cuda_is_identity():
            return gather(self, *args, **kwargs)

    DistributedOptimizer.get_parameter_state_dp_zero = gather_on_cpu


def _with_cuda_type_names(init):
    @functools.wraps(init)
    def init_on_cpu(self, *args, **kwargs):
        with _cpu_tensors_report_cuda_types():
            init(self, *args, **kwargs)

    return init_on_cpu


def _install_cpu_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random as mpu_random

    class CpuRNGStatesTracker(mpu_random.CudaRNGStatesTracker):
        """Megatron's named RNG streams over the CPU generator (dropout stays reproducible)."""

        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self.seeds_.add(seed)
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name=mpu_random._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            outer = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outer)

    mpu_random._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
    mpu_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    # Activation recomputation saves and restores "the CUDA generator": here that is the CPU's.
    mpu_random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mpu_random._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)


def init_distributed(device: Device, timeout_minutes: int = 30) -> None:
    """torch.distributed from the torchrun/Ray environment (gloo on CPU, nccl on CUDA)."""
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE") if k not in os.environ]
    if missing and not torch.distributed.is_initialized():
        raise RuntimeError(
            f"environment: {', '.join(missing)} not set; start the trainer under torchrun or the Ray launcher"
        )
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        # Rollout engines (SGLang, vLLM) run NCCL with cuMem off; a weight-update group whose sides
        # disagree hangs at its first broadcast, and NCCL reads this once, at the first communicator.
        os.environ.setdefault("NCCL_CUMEM_ENABLE", "0")
    if not torch.distributed.is_initialized():  # the store and gloo on MASTER_ADDR only, not every interface
        init_process_group("nccl" if device == "cuda" else "gloo", datetime.timedelta(minutes=timeout_minutes))


def current_device(device: Device) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else _CPU


@functools.cache
def compiled(fn):
    """``fn`` through torch.compile with dynamic shapes (chunk and batch sizes vary), built once."""
    return torch.compile(fn, dynamic=True)
