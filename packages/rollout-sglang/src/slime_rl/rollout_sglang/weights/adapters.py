"""LoRA adapters into SGLang servers (SGLang 0.5.17; docs/lora-sglang.md has the endpoints' arguments).

With ``trainer.lora.rank > 0`` and ``rollout.lora_sync: adapter`` (`slime_rl.core.algorithms.lora.syncs_adapters`)
the servers start with ``--enable-lora`` and a weight sync moves the adapters only, under PEFT's names;
each version is loaded as its own adapter, named `slime_rl.core.algorithms.lora.adapter_name`:

- ``tensor``: ``/load_lora_adapter_from_tensors`` with the tensors as one flattened bucket per TP rank,
  CUDA tensors as CUDA-IPC handles (no copy), CPU tensors by value (the same payload as
  ``/update_weights_from_tensor``, `ipc.serialize_bucket`);
- ``nccl``: SGLang has no broadcast path for adapters, so the tensors go by value through the same
  endpoint (an adapter is megabytes; a host copy is cheap);
- ``disk``: a PEFT folder (``adapter_config.json`` + ``adapter_model.safetensors``) loaded with
  ``/load_lora_adapter``.

Every version is also written as a PEFT folder (`adapter_folder`), which a restarted server loads
(`load_adapter_from_folder`); after a tensor or NCCL load it is written in the background (`FolderWriter`).
Plain blocking functions, like the transports'.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import torch

from slime_rl.core.algorithms.lora import LoraSpec, adapter_name, hf_name, peft_adapter_config
from slime_rl.core.config import ConfigError
from slime_rl.core.contracts import NamedTensors
from slime_rl.rollout_sglang.server import engine_args_to_flags
from slime_rl.rollout_sglang.weights.background_write import BackgroundWrite
from slime_rl.rollout_sglang.weights.buckets import flatten_bucket
from slime_rl.rollout_sglang.weights.ipc import serialize_bucket
from slime_rl.rollout_sglang.weights.server_api import Target, WeightSyncError, post

logger = logging.getLogger(__name__)

# SGLang 0.5.17's --lora-target-modules choices that slime-rl's trainer.lora.target_modules can name
# (sglang/srt/utils/common.py SUPPORTED_LORA_TARGET_MODULES holds these and more).
SGLANG_LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora_engine_args(spec: LoraSpec, versions: int = 2) -> dict[str, Any]:
    """The SGLang flags that let a server load ``spec``'s adapters at run time. A batch may mix the base
    model (requests before the first sync) and ``versions`` adapters: the current one and those older
    requests still decode under (SGLang holds a request back while its adapter finds no slot)."""
    unsupported = [m for m in spec.target_modules if m not in SGLANG_LORA_MODULES]
    if unsupported:
        raise ConfigError("trainer.lora.target_modules", f"SGLang 0.5.17 serves no LoRA on {unsupported}; use "
                          f"{', '.join(SGLANG_LORA_MODULES)} or rollout.lora_sync=merged")
    # No --max-loaded-loras: SGLang would evict the least recently used adapter itself, and one loaded from
    # tensors cannot be loaded back; the engine unloads each version once its last request is done.
    return {"enable_lora": True, "max_lora_rank": spec.rank, "lora_target_modules": list(spec.target_modules),
            "max_loras_per_batch": 1 + versions}


# SGLang fuses these projections and may name a target by its fused module (lora/utils.py).
_FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
          "up_proj": "gate_up_proj"}


def check_attached_server(name: str, server_info: dict[str, Any], spec: LoraSpec) -> None:
    """A server someone else started (``rollout.sglang.engine_urls``) must serve ``spec``'s adapters: LoRA on, the
    rank within its ``--max-lora-rank``, the modules within its ``--lora-target-modules`` (its
    ``/server_info``)."""
    modules = server_info.get("lora_target_modules") or []
    modules = {modules} if isinstance(modules, str) else set(modules)
    served = {_FUSED.get(m, m) for m in modules}  # what SGLang's memory pool holds buffers for
    missing = [m for m in spec.target_modules if "all" not in served and _FUSED.get(m, m) not in served]
    problems = []
    if not server_info.get("enable_lora"):
        problems.append("it runs without --enable-lora")
    elif (server_info.get("max_lora_rank") or 0) < spec.rank:
        problems.append(f"its --max-lora-rank {server_info.get('max_lora_rank')} is below trainer.lora.rank {spec.rank}")
    if server_info.get("enable_lora") and missing:
        problems.append(f"its --lora-target-modules {sorted(modules)} lack {missing}")
    if problems:
        flags = " ".join(engine_args_to_flags(lora_engine_args(spec)))
        raise ConfigError("rollout.sglang.engine_urls", f"{name} cannot load this run's LoRA adapters: "
                          f"{'; '.join(problems)}. Start it with {flags}, or set rollout.lora_sync=merged")


def check_adapter_tensors(named_tensors: NamedTensors, *, version: int) -> None:
    """An adapter sync carries PEFT LoRA names only (`slime_rl.core.algorithms.lora.peft_name`); a full weight here
    means the trainer and the engine disagree about ``rollout.lora_sync``."""
    for name, _ in named_tensors:
        try:
            hf_name(name)
        except ValueError:
            raise WeightSyncError(
                f"weight sync v{version}: {name!r} is not a LoRA adapter tensor, but the engine loads adapters "
                "(trainer.lora.rank > 0, rollout.lora_sync=adapter): the trainer must yield only "
                "base_model.model.<module>.lora_A|B.weight tensors (or set rollout.lora_sync=merged)") from None


def adapter_folder(work_dir: str | Path, version: int) -> Path:
    """Where version ``version``'s PEFT folder is written (by the engine or by the trainer's sender)."""
    return Path(work_dir) / "adapters" / f"v{version}"


def save_adapter_folder(named_tensors: NamedTensors, folder: str | Path, spec: LoraSpec,
                        base_model: str) -> Path:
    """A PEFT adapter folder, as transformers/PEFT and SGLang's ``/load_lora_adapter`` read it."""
    from safetensors.torch import save_file

    folder = Path(folder)
    partial = folder.with_name(folder.name + ".partial")  # a reader never sees half a folder
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    save_file({n: t.detach().to("cpu").contiguous() for n, t in named_tensors},
              str(partial / "adapter_model.safetensors"))
    (partial / "adapter_config.json").write_text(json.dumps(peft_adapter_config(spec, base_model), indent=1))
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)
    return folder


def _check_loaded(answer: Any, target: Target, name: str, step: str) -> None:
    """SGLang answers ``{"success", "error_message", "loaded_adapters"}`` (HTTP 400 on failure, which
    `server_api.post` already raised on); a 200 without the adapter listed is a failure too."""
    loaded = answer.get("loaded_adapters") if isinstance(answer, dict) else None
    if not isinstance(loaded, dict) or name not in loaded:
        raise WeightSyncError(f"{target.name}: {step}: adapter {name} is not among the loaded adapters "
                                 f"after the load: {str(answer)[:300]}")


def load_adapter_from_tensors(target: Target, name: str, named_tensors: NamedTensors, spec: LoraSpec, *,
                              base_model: str, timeout: float, step: str) -> None:
    """Load adapter ``name`` into one server from tensors (CUDA: IPC handles, kept alive by the caller
    until this returns; CPU: by value). One payload per TP rank; each rank takes its own shard."""
    payloads = [serialize_bucket(named_tensors) for _ in range(target.tp_size)]
    body = {"lora_name": name, "config_dict": peft_adapter_config(spec, base_model),
            "serialized_named_tensors": payloads, "load_format": "flattened_bucket"}
    answer = post(target, "/load_lora_adapter_from_tensors", body, timeout=timeout,
                     step=f"{step}: load adapter {name}", api_key=True)
    _check_loaded(answer, target, name, step)
    if torch.cuda.is_available():
        torch.cuda.ipc_collect()  # the server copied the adapter: release the shared blocks


def load_adapter_from_folder(target: Target, name: str, folder: str | Path, *, timeout: float,
                             step: str) -> None:
    """Load adapter ``name`` into one server from a PEFT folder it can read."""
    answer = post(target, "/load_lora_adapter", {"lora_name": name, "lora_path": str(folder)},
                     timeout=timeout, step=f"{step}: load adapter {name} from {folder}")
    _check_loaded(answer, target, name, step)


def unload_adapter(target: Target, name: str, *, timeout: float, step: str) -> None:
    """Unload adapter ``name`` from one server (SGLang waits for its own requests that use it)."""
    post(target, "/unload_lora_adapter", {"lora_name": name}, timeout=timeout,
            step=f"{step}: unload adapter {name}")


def push_adapter(transport: str, targets: list[Target], named_tensors: NamedTensors, spec: LoraSpec, *,
                 version: int, folder: Path, base_model: str, timeout: float, writer: FolderWriter) -> None:
    """Version ``version``'s whole adapter into every server under `adapter_name` by ``transport`` (see
    the module docstring); then ``writer`` writes it to ``folder`` (the copy a restarted server is given),
    or before, for ``disk``, which loads from that folder."""
    check_adapter_tensors(named_tensors, version=version)
    name, step = adapter_name(version), f"weight sync v{version} ({transport}, adapter)"
    if transport == "nccl":
        named_tensors = [(n, t.detach().to("cpu")) for n, t in named_tensors]
    elif transport not in ("tensor", "disk"):
        raise ValueError(f"rollout.update_weight_transport: unknown transport {transport!r}; "
                         "use one of auto, tensor, nccl, disk")
    if transport == "disk":  # the servers load the folder: written first, in this thread
        writer.wait()
        save_adapter_folder(named_tensors, folder, spec, base_model)
    loaded: list[Target] = []
    try:
        for target in targets:
            if transport == "disk":
                load_adapter_from_folder(target, name, folder, timeout=timeout, step=step)
            else:
                load_adapter_from_tensors(target, name, named_tensors, spec, base_model=base_model,
                                          timeout=timeout, step=step)
            loaded.append(target)
    except BaseException:
        # the servers that took it give it back; the current adapter stays on all of them
        for target in loaded:
            try:
                unload_adapter(target, name, timeout=min(timeout, 30.0), step=f"{step}: clean-up")
            except WeightSyncError as err:
                logger.warning("%s", err)
        shutil.rmtree(folder, ignore_errors=True)
        raise
    if transport != "disk":
        writer.write(named_tensors, folder, spec, base_model)


class FolderWriter(BackgroundWrite):
    """Each version's PEFT folder (`save_adapter_folder`), written in the background from a snapshot taken
    now (the trainer's next step changes its own tensors)."""

    def __init__(self) -> None:
        super().__init__("an adapter folder", "a server restarted now cannot load that adapter until the next "
                                              "sync writes one")

    def write(self, named_tensors: NamedTensors, folder: Path, spec: LoraSpec, base_model: str) -> None:
        snapshot = _snapshot(named_tensors)
        self.start(lambda: save_adapter_folder(_on_host(*snapshot), folder, spec, base_model),
                   name=f"adapter-folder-{folder.name}")


def _snapshot(named_tensors: NamedTensors) -> tuple[torch.Tensor | None, list[Any]]:
    """One copy of all the tensors on their device (an adapter is hundreds of small tensors), in the bucket
    layout of `buckets.flatten_bucket`: bytes of any dtype. A CUDA copy is queued on the current stream
    before anything the trainer does next, so the transfer to the host can wait for the background thread."""
    return flatten_bucket(named_tensors) if named_tensors else (None, [])


def _on_host(flat: torch.Tensor | None, metadata: list[Any]) -> NamedTensors:
    """The snapshot moved to the host (one transfer) and cut back into separate tensors."""
    host = flat.to("cpu") if flat is not None else None
    return [(m.name, host[m.start_idx:m.end_idx].clone().view(m.dtype).view(m.shape)) for m in metadata]
