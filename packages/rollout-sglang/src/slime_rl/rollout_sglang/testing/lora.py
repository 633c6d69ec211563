"""TEST DOUBLE (CPU tests only): SGLang 0.5.17's run-time LoRA, for the stand-in server (server.py).

The endpoints and shapes of sglang/srt/entrypoints/http_server.py and managers/io_struct.py:

- ``POST /load_lora_adapter`` ``{lora_name, lora_path, pinned}``: a PEFT folder (adapter_config.json,
  adapter_model.safetensors);
- ``POST /load_lora_adapter_from_tensors`` ``{lora_name, config_dict, serialized_named_tensors (one per TP
  rank), load_format, pinned, ...}``: the tensors as ``/update_weights_from_tensor`` takes them;
- ``POST /unload_lora_adapter`` ``{lora_name}``;

each answering LoRAUpdateOutput ``{success, error_message, loaded_adapters: {name: path}}``, HTTP 200 or
400. ``/generate``'s ``lora_path`` names a loaded adapter; ``/v1/models`` lists them. The checks are
SGLang's (``--enable-lora`` set; the name not loaded yet; rank within ``--max-lora-rank``; target modules
within ``--lora-target-modules``) plus one stricter: every tensor must be a PEFT name of a base weight
with the shapes A ``[r, in]`` and B ``[out, r]``. An adapter changes what the stand-in generates (its
tensors' hash joins the weights' fingerprint). Unloading unregisters the name at once (new requests
naming it fail, as SGLang's cannot reload an adapter that came as tensors) and then waits for the
requests still using it, as SGLang's ``wait_for_unload`` does.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import io
import json
import pickle
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from aiohttp import web
from safetensors.torch import load_file

# SGLang's memory pool compares target modules by their fused names (lora/utils.py get_normalized_target_modules)
_FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
          "up_proj": "gate_up_proj"}
_PEFT = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<which>[AB])\.weight$")


def add_flags(p: argparse.ArgumentParser) -> None:
    """SGLang's LoRA flags (server_args.py)."""
    p.add_argument("--enable-lora", action="store_true")
    p.add_argument("--max-lora-rank", type=int, default=None)
    p.add_argument("--lora-target-modules", nargs="*", default=None)
    p.add_argument("--max-loras-per-batch", type=int, default=8)
    p.add_argument("--max-loaded-loras", type=int, default=None)
    p.add_argument("--lora-backend", default="csgmv")


def decode_tensor_payload(payload: str, load_format: str | None) -> list[tuple[str, torch.Tensor]]:
    """One TP rank's ``serialized_named_tensors`` entry (base64 of a pickle; CPU tensors by value):
    a flattened bucket or a list of (name, tensor)."""
    data = pickle.load(io.BytesIO(base64.b64decode(payload, validate=True)))
    if load_format == "flattened_bucket":
        flat = data["flattened_tensor"]
        return [(m.name, flat[m.start_idx:m.end_idx].view(m.dtype).reshape(m.shape)) for m in data["metadata"]]
    return list(data.items()) if isinstance(data, dict) else list(data)


class LoraError(ValueError):
    pass


@dataclass
class Adapter:
    name: str
    path: str  # "__tensor__" for one loaded from tensors, as SGLang records it
    fingerprint: int


class LoraRegistry:
    """The adapters one stand-in server holds, and the requests using each."""

    def __init__(self, args: argparse.Namespace, weights: dict[str, torch.Tensor], tp_size: int, record):
        self.args, self.weights, self.tp_size, self.record = args, weights, tp_size, record
        self.adapters: dict[str, Adapter] = {}
        self.in_use: Counter[str] = Counter()
        self.drained = asyncio.Condition()

    # ------------------------------------------------------------------ generation side

    def resolve(self, name: str | None) -> int | None:
        """The fingerprint of the adapter a request names (None: the base). SGLang's _validate_and_resolve_lora."""
        if name is None:
            return None
        if not self.args.enable_lora:
            raise LoraError(f"LoRA adapter '{name}' was requested, but LoRA is not enabled. Please launch the server "
                            "with --enable-lora flag and preload adapters using --lora-paths or /load_lora_adapter "
                            "endpoint.")
        if name not in self.adapters:
            raise LoraError(f"Got LoRA adapter that has never been loaded: {name}\n"
                            f"All loaded adapters: {list(self.adapters)}.")
        self.in_use[name] += 1
        return self.adapters[name].fingerprint

    async def release(self, name: str | None) -> None:
        if name is None:
            return
        self.in_use[name] -= 1
        async with self.drained:
            self.drained.notify_all()

    # ------------------------------------------------------------------ loading

    def _check(self, name: str, config: dict, tensors: list[tuple[str, torch.Tensor]]) -> int:
        """SGLang's validate_new_adapter, and the tensors against the base weights; the adapter's fingerprint."""
        if not self.args.enable_lora:
            raise LoraError("LoRA is not enabled. Please set `--enable-lora` to enable LoRA.")
        if name in self.adapters:
            raise LoraError(f"Failed to load LoRA adapter {name} because it is already loaded")
        rank, modules = int(config["r"]), set(config["target_modules"])
        allowed = set(self.args.lora_target_modules or [])
        fits = "all" in allowed or {_FUSED.get(m, m) for m in modules} <= {_FUSED.get(m, m) for m in allowed}
        if rank > (self.args.max_lora_rank or 0) or not fits:
            raise LoraError(f"LoRA adapter {name} with rank {rank} is incompatible with the current LoRA memory pool "
                            "configuration. Please ensure that the LoRA adapter's rank is within the configured "
                            "`--max-lora-rank` and that the target modules are included in `--lora-target-modules`.")
        digest = hashlib.sha256()
        for tensor_name, tensor in sorted(tensors, key=lambda item: item[0]):
            match = _PEFT.match(tensor_name)
            base = self.weights.get(f"{match['module']}.weight") if match else None
            if base is None or match["module"].rsplit(".", 1)[-1] not in modules:
                raise LoraError(f"{tensor_name}: not a LoRA weight of a target module of this model")
            want = (rank, base.shape[1]) if match["which"] == "A" else (base.shape[0], rank)
            if tuple(tensor.shape) != want:
                raise LoraError(f"{tensor_name}: shape {tuple(tensor.shape)}, expected {want}")
            digest.update(tensor_name.encode())
            digest.update(tensor.detach().float().contiguous().numpy().tobytes())
        if not tensors:
            raise LoraError(f"LoRA adapter {name} has no weights")
        return int.from_bytes(digest.digest()[:8], "little")

    def _answer(self, error: str | None) -> web.Response:
        loaded = {a.name: a.path for a in self.adapters.values()}
        return web.json_response({"success": error is None, "error_message": error or "", "loaded_adapters": loaded},
                                 status=200 if error is None else 400)

    def _load(self, name: str, path: str, config: dict, tensors: list[tuple[str, torch.Tensor]]) -> web.Response:
        try:
            self.adapters[name] = Adapter(name, path, self._check(name, config, tensors))
        except (LoraError, KeyError, TypeError, ValueError) as err:
            self.record("load_lora_adapter", lora_name=name, lora_path=path, success=False, error=str(err))
            return self._answer(str(err))
        self.record("load_lora_adapter", lora_name=name, lora_path=path, success=True, num_tensors=len(tensors))
        return self._answer(None)

    async def handle_load_from_tensors(self, request: web.Request) -> web.Response:
        body = await request.json()
        name, payloads = body["lora_name"], body["serialized_named_tensors"]
        if len(payloads) != self.tp_size:
            return self._answer(f"{len(payloads)} payloads for tp_size {self.tp_size}")
        try:
            tensors = decode_tensor_payload(payloads[0], body.get("load_format"))
        except Exception as err:
            return self._answer(f"{type(err).__name__}: {err}")
        return self._load(name, "__tensor__", body["config_dict"], tensors)

    async def handle_load(self, request: web.Request) -> web.Response:
        body = await request.json()
        name, path = body["lora_name"], Path(body["lora_path"])
        try:
            config = json.loads((path / "adapter_config.json").read_text())
            tensors = list(load_file(str(path / "adapter_model.safetensors")).items())
        except (OSError, ValueError) as err:
            self.record("load_lora_adapter", lora_name=name, lora_path=str(path), success=False, error=str(err))
            return self._answer(f"Failed to load LoRA adapter {name} from {path}: {err}")
        return self._load(name, str(path), config, tensors)

    async def handle_unload(self, request: web.Request) -> web.Response:
        name = (await request.json())["lora_name"]
        if name not in self.adapters:
            self.record("unload_lora_adapter", lora_name=name, success=False)
            return self._answer(f"LoRA adapter {name} is not loaded")
        del self.adapters[name]  # new requests naming it fail from now on
        self.record("unload_lora_adapter", lora_name=name, success=True, in_use=self.in_use[name])
        async with self.drained:
            await self.drained.wait_for(lambda: self.in_use[name] <= 0)
        return self._answer(None)

    def model_cards(self) -> list[dict]:
        """The adapters as ``/v1/models`` lists them after the base model."""
        return [{"id": a.name, "object": "model", "root": a.path, "parent": self.args.model_path}
                for a in self.adapters.values()]
