# ruff: noqa: E402  (the first log line is printed before the slow imports)
"""TEST DOUBLE: a stand-in for an SGLang 0.5.17 HTTP server, for CPU tests only.

SGLang needs a GPU, so CPU tests put this process behind the real sglang-router. It answers the endpoints
slime-rl uses with SGLang's request and response shapes (sglang/srt/entrypoints/http_server.py and
managers/io_struct.py of 0.5.17), but its "model" is a deterministic function: the next token is a hash of the
context and of the loaded weights, so a weight update visibly changes what it generates. Weights are real
tensors (loaded from the model folder's safetensors, replaced by the update endpoints, read back by
/get_weights_by_name and checksummed by /weights_checker); the NCCL path joins a real torch.distributed group
(gloo on CPU).

Run as ``python server.py --model-path DIR --host H --port P [SGLang flags]``; unknown SGLang flags are
accepted and reported in /server_info like SGLang does. ``--config FILE.yaml`` is merged into the flags as
SGLang does. ``--api-key`` and ``--admin-api-key`` are enforced with SGLang's rules (`auth_decision`, a copy
of ``srt/utils/auth.py``'s ``decide_request_auth`` with the endpoint levels of
``srt/entrypoints/http_server.py``). Stand-in-only flags start with ``--standin-``. ``GET /standin/state``
reports what the server saw (requests, weight updates, pauses, flushes) so tests can check it.
"""

from __future__ import annotations

import sys

print(f"[standin-sglang] starting: {' '.join(sys.argv[1:])}", flush=True)  # before the slow imports, like SGLang's first log lines

import argparse
import asyncio
import base64
import hashlib
import json
import secrets
import time
from pathlib import Path

import torch
from aiohttp import web
from safetensors.torch import load_file
from tokenizers import Tokenizer

from slime_rl.rollout_sglang.testing import fp8
from slime_rl.rollout_sglang.testing.auth import ADMIN_OPTIONAL, auth_decision, auth_middleware  # noqa: F401 (re-exported)
from slime_rl.rollout_sglang.testing.checks import context_length, request_error
from slime_rl.rollout_sglang.testing.custom_loader import (
    UncaughtInScheduler,
    load_tensor_payload,
    scheduler_crash,
)
from slime_rl.rollout_sglang.testing.gate import ModelGate, RequestAborted
from slime_rl.rollout_sglang.testing.lora import LoraError, LoraRegistry, add_flags
from slime_rl.rollout_sglang.testing.nccl import join_group, receive_broadcast
from slime_rl.rollout_sglang.testing.vision import request_ids, with_text_fields


def merge_config(argv: list[str]) -> list[str]:
    """SGLang's ``--config FILE.yaml``: its keys become flags placed before the command line's."""
    if "--config" not in argv:
        return argv
    import yaml

    i = argv.index("--config")
    config = yaml.safe_load(open(argv[i + 1])) or {}
    flags: list[str] = []
    for key, value in config.items():
        if value is True:
            flags.append(f"--{key}")
        elif value is not False:
            flags += [f"--{key}", str(value)]
    return flags + argv[:i] + argv[i + 2:]


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    argv = merge_config(argv)
    p = argparse.ArgumentParser()
    p.add_argument("--model-path", required=True)
    p.add_argument("--tokenizer-path", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--tp-size", "--tp", type=int, default=1)
    p.add_argument("--enable-memory-saver", action="store_true")
    p.add_argument("--context-length", type=int, default=None)
    p.add_argument("--api-key", default=None)
    p.add_argument("--admin-api-key", default=None)
    p.add_argument("--standin-startup-delay", type=float, default=0.0)  # /health answers 503 this long
    p.add_argument("--standin-never-healthy", action="store_true")  # /health always 503
    p.add_argument("--standin-crash-on-start", action="store_true")  # exit 1 after logging an error
    p.add_argument("--standin-token-delay", type=float, default=0.0)  # seconds per generated token
    p.add_argument("--standin-update-delay", type=float, default=0.0)  # seconds a weight update takes (inf: forever)
    p.add_argument("--enable-return-routed-experts", action="store_true")  # SGLang's flag (MoE models)
    p.add_argument("--skip-tokenizer-init", action="store_true")  # then stop strings are refused, as in SGLang
    add_flags(p)  # --enable-lora and the other LoRA flags (lora.py)
    return p.parse_known_args(argv)


# Events also written to the log (one JSON line each), for tests that read them after the run stopped the servers.
LOGGED_EVENTS = {"load_lora_adapter", "unload_lora_adapter"}


class StandinServer:
    def __init__(self, args: argparse.Namespace, extra_flags: list[str]):
        self.args = args
        self.extra_flags = extra_flags
        model_dir = Path(args.model_path)
        self.tokenizer = Tokenizer.from_file(str(Path(args.tokenizer_path or model_dir) / "tokenizer.json"))
        self.hf_config = with_text_fields(json.loads((model_dir / "config.json").read_text()))  # VL: text_config's too
        self.vocab_size = int(self.hf_config["vocab_size"])
        eos = self.hf_config.get("eos_token_id")  # a random model made from a bare config has none
        self.eos_token_id = int(eos) if eos is not None else None
        self.context_len = context_length(args.context_length, self.hf_config)
        self.scales_dropped = fp8.scales_dropped(self.hf_config)  # SGLang's own Llama loads no block-FP8 scale
        self.weights = fp8.as_loaded(self._load_folder(model_dir), scales_dropped=self.scales_dropped)
        self.weight_version = "default"
        self.started_at = time.time()
        self.gate = ModelGate()  # SGLang's pause and model-update lock (gate.py)
        self.memory = {"weights": True, "kv_cache": True, "cuda_graph": True}
        self.running: dict[str, asyncio.Event] = {}  # rid -> abort flag, from arrival (SGLang's rid_to_state)
        self.groups: dict[str, object] = {}
        self.events: list[dict] = []  # what happened, in order (test inspection)
        self.completed: list[str] = []  # rids answered (finished or aborted)
        self.prefix_cache: list[list[int]] = []  # sequences served, newest last: the stand-in's radix cache
        self.lora = LoraRegistry(args, self.weights, args.tp_size, self.record)  # run-time LoRA adapters

    # ------------------------------------------------------------------ model

    @staticmethod
    def _load_folder(path: Path) -> dict[str, torch.Tensor]:
        weights: dict[str, torch.Tensor] = {}
        for file in sorted(path.glob("*.safetensors")):
            weights.update(load_file(str(file)))
        return weights

    def fingerprint(self) -> int:
        digest = hashlib.sha256()
        for name in sorted(self.weights):
            digest.update(name.encode())
            digest.update(self.weights[name].float().contiguous().numpy().tobytes())
        return int.from_bytes(digest.digest()[:8], "little")

    def next_token(self, fingerprint: int, context: list[int], salt: int) -> tuple[int, float]:
        key = f"{fingerprint}:{salt}:{len(context)}:{context[-8:]}".encode()
        h = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
        token = h % self.vocab_size
        log_prob = -0.05 - (h >> 20) % 400 / 100.0  # in (-4.05, -0.05]
        return token, log_prob

    def cached_prefix(self, input_ids: list[int]) -> int:
        """The longest prefix of ``input_ids`` this server has seen (what SGLang's radix cache would reuse)."""
        best = 0
        for seq in self.prefix_cache:
            n = 0
            for a, b in zip(seq, input_ids, strict=False):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        return best

    def record(self, kind: str, **fields) -> None:
        self.events.append({"kind": kind, "time": time.time(), **fields})
        if kind in LOGGED_EVENTS or (kind == "generate" and fields.get("lora")):  # readable after shutdown
            print(f"[standin-sglang] event {json.dumps(self.events[-1])}", flush=True)

    # ------------------------------------------------------------------ generate

    def routed_experts(self, fed: list[int]) -> str:
        """SGLang's encoding: base64 of int32 ``[tokens fed, layers, top-k]``; a made-up routing that
        depends on each token and layer (expert (token + layer + j) % experts)."""

        import numpy as np

        layers, k = int(self.hf_config["num_hidden_layers"]), int(self.hf_config["num_experts_per_tok"])
        # transformers 5 saves Qwen3-MoE's num_experts as num_local_experts; GLM-4.5's is n_routed_experts
        experts = int(self.hf_config.get("num_experts") or self.hf_config.get("num_local_experts")
                      or self.hf_config["n_routed_experts"])
        ids = np.asarray(fed, dtype=np.int64)[:, None, None] + np.arange(layers)[None, :, None] + np.arange(k)
        return base64.b64encode((ids % experts).astype("<i4").tobytes()).decode("ascii")

    async def generate_one(self, input_ids: list[int], sp: dict, rid: str, return_logprob: bool,
                           logprob_start_len: int, routed: bool = False, lora: str | None = None,
                           lora_fingerprint: int | None = None) -> dict:
        """One request; ``lora``: the adapter it names, already counted in use (`LoraRegistry.resolve`)."""
        aborted = asyncio.Event()
        self.running[rid] = aborted
        started = time.time()
        self.record("generate", rid=rid, input_len=len(input_ids), sampling_params=sp, lora=lora)
        entered = False
        try:
            await self.gate.enter(rid, aborted)  # raises RequestAborted (HTTP 499) if aborted before it got in
            entered = True
            max_new = sp.get("max_new_tokens", 128)
            max_new = 128 if max_new is None else int(max_new)
            temperature = float(sp.get("temperature", 1.0) if sp.get("temperature") is not None else 1.0)
            # like SGLang: a seed makes a sampled response reproducible; without one each request draws its own
            seed = sp.get("sampling_seed")
            salt = 0 if temperature == 0 else int(seed) + 1 if seed is not None else secrets.randbits(62) + 2**62
            stop_ids = set(sp.get("stop_token_ids") or [])
            if not sp.get("ignore_eos") and self.eos_token_id is not None:
                stop_ids.add(self.eos_token_id)
            stops = sp.get("stop") or []
            stops = [stops] if isinstance(stops, str) else list(stops)
            out: list[int] = []
            lps: list[float] = []
            finish: dict = {"type": "length", "length": max_new}
            for _ in range(max_new):
                if self.args.standin_token_delay:
                    await asyncio.sleep(self.args.standin_token_delay)
                if aborted.is_set():
                    finish = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
                    break
                fingerprint = self.fingerprint() if lora_fingerprint is None else hash((self.fingerprint(), lora_fingerprint))
                token, lp = self.next_token(fingerprint, input_ids + out, salt)
                out.append(token)
                lps.append(lp)
                if token in stop_ids:
                    finish = {"type": "stop", "matched": token}
                    break
                if stops:
                    text = self.tokenizer.decode(out, skip_special_tokens=False)
                    matched = next((s for s in stops if s in text), None)
                    if matched is not None:
                        finish = {"type": "stop", "matched": matched}
                        break
        except RequestAborted:
            self.completed.append(rid)
            raise
        finally:
            self.running.pop(rid, None)
            if entered:
                await self.gate.leave(rid)
            await self.lora.release(lora)
        self.completed.append(rid)
        if lora is not None:  # when a request naming an adapter ended (tests order it before the unload)
            self.record("generate_end", rid=rid, lora=lora)
        if finish["type"] == "abort" and not out:  # still in the scheduler's waiting queue: SGLang's _handle_abort_req
            meta = {"id": rid, "finish_reason": {"type": "abort", "message": "Abort in waiting queue"},
                    "weight_version": self.weight_version, "e2e_latency": time.time() - started, "completion_tokens": 0}
            if return_logprob:
                meta.update(input_token_logprobs=[], output_token_logprobs=[])
            return {"text": "", "output_ids": [], "meta_info": meta}
        meta = {
            "id": rid,
            "finish_reason": finish,
            "prompt_tokens": len(input_ids),
            "weight_version": self.weight_version,
            "num_retractions": 0,
        }
        if routed and self.args.enable_return_routed_experts:
            meta["routed_experts"] = self.routed_experts(input_ids + out[:-1])
        if return_logprob:
            start = logprob_start_len if logprob_start_len is not None and logprob_start_len >= 0 else len(input_ids)
            meta["input_token_logprobs"] = [[None if i == 0 else -1.0, input_ids[i], None]
                                            for i in range(start, len(input_ids))]
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(lps, out, strict=True)]
            meta["output_token_logprobs_length"] = len(out)
        cached = self.cached_prefix(input_ids)
        self.prefix_cache = (self.prefix_cache + [input_ids + out])[-512:]
        meta.update(reasoning_tokens=0, completion_tokens=len(out), cached_tokens=cached,
                    e2e_latency=time.time() - started)
        return {"text": self.tokenizer.decode(out, skip_special_tokens=True), "output_ids": out, "meta_info": meta}

    async def handle_generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.record("generate_body", body={k: v for k, v in body.items() if k != "input_ids"})
        if not self.memory["weights"] or not self.memory["kv_cache"]:
            return _error("memory is released; call /resume_memory_occupation first")
        ids = request_ids(self, body)  # with image_data: pads expanded as SGLang's processor path does (vision.py)
        if ids is None:
            if body.get("text") is None:
                return _error("Either text, input_ids or input_embeds should be provided.")
            texts = body["text"] if isinstance(body["text"], list) else [body["text"]]
            batch = [self.tokenizer.encode(t).ids for t in texts]
            single = not isinstance(body["text"], list)
        else:
            single = not ids or not isinstance(ids[0], list)
            batch = [ids] if single else ids
        rids = body.get("rid")
        if rids is None:
            rids = [f"{time.time_ns()}-{i}" for i in range(len(batch))]
        elif isinstance(rids, str):
            rids = [rids] if single else [f"{rids}_{i}" for i in range(len(batch))]
        sps = body.get("sampling_params") or {}
        sps = sps if isinstance(sps, list) else [sps] * len(batch)
        if self.args.skip_tokenizer_init and any(sp.get("stop") for sp in sps):  # SGLang's words
            return _error(f"stop={sps[0].get('stop')} is unavailable when skip_tokenizer_init=True")
        for refusal in filter(None, (request_error(sp, len(x), self.context_len) for x, sp in zip(batch, sps, strict=True))):
            return _error(refusal[1], refusal[0])  # SGLang's checks before it runs a request (checks.py)
        loras = body.get("lora_path")
        loras = loras if isinstance(loras, list) else [loras] * len(batch)
        try:
            prints = [self.lora.resolve(name) for name in loras]
        except LoraError as err:  # SGLang answers 400 with the message
            return _error(str(err))
        try:
            outs = await asyncio.gather(*[
                self.generate_one(x, sp, rid, bool(body.get("return_logprob")), body.get("logprob_start_len", -1),
                                  bool(body.get("return_routed_experts")), lora, fp)
                for x, sp, rid, lora, fp in zip(batch, sps, rids, loras, prints, strict=True)
            ])
        except RequestAborted as err:  # SGLang's _create_error_response of a RequestAbortedError
            return _error(str(err), status=err.status)
        return web.json_response(outs[0] if single else outs)

    async def handle_abort(self, request: web.Request) -> web.Response:
        body = await request.json()
        rid, abort_all = body.get("rid") or "", bool(body.get("abort_all"))
        self.record("abort_request", rid=rid, abort_all=abort_all)
        if not abort_all and not rid:
            return web.Response(status=200)
        for running_rid, flag in list(self.running.items()):
            if abort_all or running_rid == rid:  # 0.5.17's TokenizerManager drops a rid it does not hold
                flag.set()
        return web.Response(status=200)

    # ------------------------------------------------------------------ info

    async def handle_health(self, request: web.Request) -> web.Response:
        if self.args.standin_never_healthy or time.time() - self.started_at < self.args.standin_startup_delay:
            return web.Response(status=503)
        return web.Response(status=200)

    def server_args(self) -> dict:
        return {"model_path": self.args.model_path, "tokenizer_path": self.args.tokenizer_path or self.args.model_path,
                "host": self.args.host, "port": self.args.port, "tp_size": self.args.tp_size, "dp_size": 1,
                "skip_tokenizer_init": self.args.skip_tokenizer_init,
                "enable_memory_saver": self.args.enable_memory_saver,
                # SGLang's /server_info returns its whole ServerArgs, both keys included.
                "api_key": self.args.api_key, "admin_api_key": self.args.admin_api_key,
                "enable_lora": self.args.enable_lora, "max_lora_rank": self.args.max_lora_rank,
                "lora_target_modules": self.args.lora_target_modules,
                "max_loras_per_batch": self.args.max_loras_per_batch,
                "standin_extra_flags": self.extra_flags}

    async def handle_server_info(self, request: web.Request) -> web.Response:
        return web.json_response({**self.server_args(), "version": "0.5.17", "internal_states": [{}],
                                  "max_total_num_tokens": 65536, "kv_events": None})

    async def handle_model_info(self, request: web.Request) -> web.Response:
        return web.json_response({
            "model_path": self.args.model_path,
            "tokenizer_path": self.args.tokenizer_path or self.args.model_path,
            "is_generation": True, "preferred_sampling_params": None, "weight_version": self.weight_version,
            "has_image_understanding": False, "has_audio_understanding": False,
            "model_type": self.hf_config.get("model_type"), "architectures": self.hf_config.get("architectures"),
        })

    async def handle_models(self, request: web.Request) -> web.Response:
        base = {"id": self.args.model_path, "object": "model", "root": self.args.model_path, "parent": None}
        return web.json_response({"object": "list", "data": [base, *self.lora.model_cards()]})

    async def handle_get_load(self, request: web.Request) -> web.Response:
        return web.json_response([{"dp_rank": 0, "num_reqs": len(self.running), "num_waiting_reqs": 0,
                                   "num_tokens": 0, "num_pending_tokens": 0, "ts_tic": time.perf_counter()}])

    async def handle_state(self, request: web.Request) -> web.Response:
        return web.json_response({"events": self.events, "completed": self.completed, "paused": self.gate.paused,
                                  "memory": self.memory, "weight_version": self.weight_version,
                                  "fingerprint": self.fingerprint(), "running": sorted(self.running), "in_model": sorted(self.gate.in_model)})

    # ------------------------------------------------------------------ control

    async def handle_flush_cache(self, request: web.Request) -> web.Response:
        # SGLang's Scheduler.flush_cache: only when fully idle; requests held by a pause (in_place, retract) count
        if self.gate.in_model:
            self.record("flush_cache", success=False)
            return web.Response(status=400, text="Flush cache failed.\n")
        self.record("flush_cache", success=True)
        self.prefix_cache.clear()
        return web.Response(status=200, text="Cache flushed.\nPlease check backend logs for more details. "
                            "(When there are running or waiting requests, the operation will not be performed.)\n")

    async def handle_pause(self, request: web.Request) -> web.Response:
        body = await _json_or_empty(request)
        mode = body.get("mode", "abort")
        self.record("pause_generation", mode=mode)
        await self.gate.set_paused(True)
        # abort: like SGLang's TokenizerManager.pause_generation, abort all (those waiting at the pause too: they
        # answer 499 after continue) until no request holds the model; in_place and retract hold them in the model
        while mode == "abort":
            for flag in self.running.values():
                flag.set()
            if not self.gate.in_model:
                break
            await asyncio.sleep(0.01)
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def handle_continue(self, request: web.Request) -> web.Response:
        self.record("continue_generation")
        await self.gate.set_paused(False)
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def handle_release(self, request: web.Request) -> web.Response:
        body = await _json_or_empty(request)
        tags = body.get("tags") or list(self.memory)
        self.record("release_memory_occupation", tags=tags)
        if self.gate.in_model:  # held in place, or running: the scheduler's assertion kills the server
            scheduler_crash("AssertionError: release_memory_occupation should be called only when server is idle.")
        for tag in tags:
            self.memory[tag] = False
        if "kv_cache" in tags:  # SGLang flushes the cache with the KV pool
            self.prefix_cache.clear()
        return web.json_response(None)

    async def handle_resume(self, request: web.Request) -> web.Response:
        body = await _json_or_empty(request)
        tags = body.get("tags") or list(self.memory)
        self.record("resume_memory_occupation", tags=tags)
        if any(self.memory[tag] for tag in tags):  # SGLang: offload_tags.remove(tag) raises in the scheduler
            scheduler_crash(f"KeyError: {[t for t in tags if self.memory[t]][0]!r}")
        for tag in tags:
            self.memory[tag] = True
        return web.json_response(None)

    # ------------------------------------------------------------------ weights

    async def _update(self, body: dict, work) -> web.Response:
        """SGLang's order around ``work()`` (one update endpoint's load): ``abort_all_requests``, the model-update
        lock unless paused (gate.py), --standin-update-delay (inf: it never answers), the load, then with
        ``flush_cache`` (default true) the scheduler's flush, which asserts that no request is held in the model."""
        if body.get("abort_all_requests"):
            for flag in self.running.values():
                flag.set()
        async with self.gate.weight_update():
            await asyncio.sleep(min(self.args.standin_update_delay, 1e9))
            response = await work()
            if response.status == 200 and body.get("flush_cache", True):
                if self.gate.in_model:
                    scheduler_crash("AssertionError: Cache flush failed after updating weights")
                self.prefix_cache.clear()
        return response

    def _apply(self, named: list[tuple[str, torch.Tensor]], version: str | None) -> None:
        for name, tensor in named:
            if self.scales_dropped and name.endswith(f".{fp8.SCALE_SUFFIX}"):
                continue  # renamed to a parameter the model does not have: SGLang skips it
            if name not in self.weights:
                raise KeyError(f"unknown parameter {name}")
            if tuple(tensor.shape) != tuple(self.weights[name].shape):
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} != {tuple(self.weights[name].shape)}")
            self.weights[name] = fp8.held(self.weights[name], tensor)  # in the parameter's dtype (testing/fp8.py)
        if version is not None:
            self.weight_version = version

    async def handle_update_from_tensor(self, request: web.Request) -> web.Response:
        body = await request.json()
        payloads = body["serialized_named_tensors"]
        self.record("update_weights_from_tensor", load_format=body.get("load_format"), num_payloads=len(payloads),
                    weight_version=body.get("weight_version"), flush_cache=body.get("flush_cache", True))

        async def load() -> web.Response:
            try:
                if len(payloads) != self.args.tp_size:
                    raise ValueError(f"{len(payloads)} payloads for tp_size {self.args.tp_size}")
                load_tensor_payload(self, payloads[0], body.get("load_format"), body.get("weight_version"))
            except UncaughtInScheduler as err:
                scheduler_crash(str(err))
            except Exception as err:  # SGLang answers 400 with success=false
                return web.json_response({"success": False, "message": f"{type(err).__name__}: {err}"}, status=400)
            return web.json_response({"success": True, "message": "Success"})

        return await self._update(body, load)

    async def handle_update_from_disk(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.record("update_weights_from_disk", model_path=body["model_path"], weight_version=body.get("weight_version"))

        async def load() -> web.Response:
            try:
                loaded = self._load_folder(Path(body["model_path"]))
                if not loaded:
                    raise FileNotFoundError(f"no *.safetensors in {body['model_path']}")
                self._apply(list(loaded.items()), body.get("weight_version"))
            except Exception as err:
                return web.json_response({"success": False, "message": f"Failed to update weights: {err}",
                                          "num_paused_requests": 0}, status=400)
            return web.json_response({"success": True, "message": "Succeeded to update model weights.",
                                      "num_paused_requests": 0})

        return await self._update(body, load)

    async def handle_init_group(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.record("init_weights_update_group", **body)
        try:
            group = await asyncio.to_thread(join_group, body)
        except Exception as err:
            return web.json_response({"success": False, "message": f"Failed to init group: {err}"}, status=400)
        self.groups[body.get("group_name", "weight_update_group")] = group
        return web.json_response({"success": True, "message": "Succeeded to initialize custom process group."})

    async def handle_destroy_group(self, request: web.Request) -> web.Response:
        body = await _json_or_empty(request)
        name = body.get("group_name", "weight_update_group")
        self.record("destroy_weights_update_group", group_name=name)
        group = self.groups.pop(name, None)
        if group is None:
            return web.json_response({"success": False, "message": f"no group {name}"}, status=400)
        torch.distributed.destroy_process_group(group)
        return web.json_response({"success": True, "message": "Succeeded to destroy custom process group."})

    async def handle_update_from_distributed(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.record("update_weights_from_distributed", names=body["names"], load_format=body.get("load_format"),
                    weight_version=body.get("weight_version"))

        async def load() -> web.Response:
            group = self.groups.get(body.get("group_name", "weight_update_group"))
            if group is None:
                return web.json_response({"success": False, "message": "Please call `init_weights_update_group` "
                                          "first."}, status=400)
            try:
                named = await asyncio.to_thread(receive_broadcast, group, body)
                self._apply(named, body.get("weight_version"))
            except Exception as err:
                return web.json_response({"success": False, "message": f"Failed to update parameter online: {err}"},
                                         status=400)
            return web.json_response({"success": True, "message": "Succeeded to update parameter online."})

        return await self._update(body, load)

    async def handle_get_weights(self, request: web.Request) -> web.Response:
        body = await _json_or_empty(request)
        name, truncate = body.get("name"), int(body.get("truncate_size", 100))
        if name not in self.weights:
            return _error("Get parameter by name failed")
        return web.json_response(self.weights[name].float().numpy().tolist()[:truncate])

    async def handle_weights_checker(self, request: web.Request) -> web.Response:
        """SGLang 0.5.17's ``/weights_checker`` with ``action: checksum`` (http_server.py, weight_checker.py):
        every parameter's checksum, one TP rank; on the CPU SGLang's hash is SHA-256's first 8 bytes."""
        body = await _json_or_empty(request)
        if body.get("action", "checksum") != "checksum":
            return _error(f"Unsupported action={body.get('action')!r}")
        checksums = fp8.weight_checksums(self.weights)  # FP8 (weight, scale) pairs hashed as SGLang does
        overall = hashlib.sha256()
        for name in sorted(checksums):
            overall.update(name.encode())
            overall.update(checksums[name].encode())
        parallelism = dict(tp_rank=0, tp_size=1, dp_rank=0, dp_size=1, pp_rank=0, pp_size=1, rank=0, size=1)
        rank = {"checksums": checksums, "per_gpu_checksum": overall.hexdigest(), "parallelism_info": parallelism}
        self.record("weights_checker")
        return web.json_response({"success": True, "message": "", "ranks": [rank],
                                  "per_engine_checksum": hashlib.sha256(rank["per_gpu_checksum"].encode()).hexdigest()})


async def _json_or_empty(request: web.Request) -> dict:
    raw = await request.read()
    return json.loads(raw) if raw.strip() else {}


def _error(message: str, status: int = 400) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


def build_app(server: StandinServer) -> web.Application:
    # Like SGLang, the key check is only there when a key is set.
    keyed = server.args.api_key or server.args.admin_api_key
    app = web.Application(client_max_size=1 << 30, middlewares=[auth_middleware(server)] if keyed else [])
    r = app.router
    for path in ("/health", "/health_generate"):
        r.add_get(path, server.handle_health)
    for path, handler in {"/server_info": server.handle_server_info, "/get_server_info": server.handle_server_info,
                          "/model_info": server.handle_model_info, "/get_model_info": server.handle_model_info,
                          "/get_load": server.handle_get_load, "/standin/state": server.handle_state,
                          "/v1/models": server.handle_models}.items():
        r.add_get(path, handler)
    r.add_route("POST", "/generate", server.handle_generate)
    r.add_route("PUT", "/generate", server.handle_generate)
    r.add_post("/abort_request", server.handle_abort)
    for path, handler in {"/flush_cache": server.handle_flush_cache,
                          "/release_memory_occupation": server.handle_release,
                          "/resume_memory_occupation": server.handle_resume,
                          "/get_weights_by_name": server.handle_get_weights,
                          "/weights_checker": server.handle_weights_checker}.items():
        r.add_get(path, handler)
        r.add_post(path, handler)
    for path, handler in {"/pause_generation": server.handle_pause, "/continue_generation": server.handle_continue,
                          "/update_weights_from_tensor": server.handle_update_from_tensor,
                          "/update_weights_from_disk": server.handle_update_from_disk,
                          "/init_weights_update_group": server.handle_init_group,
                          "/destroy_weights_update_group": server.handle_destroy_group,
                          "/update_weights_from_distributed": server.handle_update_from_distributed,
                          "/load_lora_adapter": server.lora.handle_load,
                          "/load_lora_adapter_from_tensors": server.lora.handle_load_from_tensors,
                          "/unload_lora_adapter": server.lora.handle_unload}.items():
        r.add_post(path, handler)
    return app


def main(argv: list[str]) -> None:
    torch.set_num_threads(1)
    args, extra = parse_args(argv)
    print(f"[standin-sglang] serving on {args.host}:{args.port} model={args.model_path} extra={extra}", flush=True)
    if args.standin_crash_on_start:
        print("RuntimeError: stand-in told to crash on start (--standin-crash-on-start)", flush=True)
        sys.exit(1)
    server = StandinServer(args, extra)
    web.run_app(build_app(server), host=args.host, port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main(sys.argv[1:])
