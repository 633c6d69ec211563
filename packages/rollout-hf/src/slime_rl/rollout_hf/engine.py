"""`HFEngine`: a RolloutEngine over a transformers causal LM, in this process, on CPU or CUDA.

How generation runs:

- Concurrent ``generate`` calls queue up; a background asyncio task takes up to
  ``max_batch_size`` of them as one batch. Requests that arrive while a batch is
  decoding wait for the next batch (no joining mid-batch: a DynamicCache cannot
  take new rows of a different length cheaply, and RL rollouts arrive in waves).
- A batch is left-padded with an attention mask and per-row position ids.
  Identical prompts (n samples of one prompt) are prefilled once and their KV
  cache is repeated, so a GRPO group costs one prompt's prefill.
- The decode loop feeds one token per row with the cache; a row that finishes
  (stop, length or abort) is dropped from the batch and its future resolved at once.
- The model runs in one worker thread, so the event loop stays free to queue
  requests and take aborts between decode steps; weight updates go through the
  same thread and so land between decode steps, never inside a forward. With
  ``rollout.lora_sync: adapter`` a sync brings LoRA adapters, added to their
  projections' outputs (lora.py).

Sampling follows SGLang: logits / temperature, then top-k, then top-p, then a
draw from each request's own generator (seeded by ``SamplingParams.seed``, else
from the engine's seed), so a request's tokens do not depend on what else is in
its batch. Temperature 0 is greedy. The reported log-prob of each token is
``log_softmax(logits / T)`` (``T = 1`` for greedy) BEFORE top-k/top-p filtering:
the distribution the trainer scores.

Stops: eos (unless ``ignore_eos``) and ``stop_token_ids`` end a response with
that token kept in it; a stop string ends it once the decoded response contains
it, and the tokens that completed the match stay in the response (SGLang's
``output_ids`` keep them too; the engine returns tokens, never trimmed text).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import random
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, DynamicCache, PreTrainedModel

from slime_rl.core.algorithms.lora import lora_spec, syncs_adapters
from slime_rl.core.config.device import resolve_device
from slime_rl.core.config.dtype import model_dtype
from slime_rl.core.contracts import FinishReason, GenerateOutput, NamedTensors, RolloutEngine, SamplingParams
from slime_rl.rollout_hf.lora import AdapterSync
from slime_rl.rollout_hf.moe import RouterRecorder, routed_experts, weight_target
from slime_rl.rollout_hf.settings import HFSettings, hf_settings
from slime_rl.rollout_hf.vision import VisionInputs, is_vision_language
from slime_rl.rollout_hf.vision import load_model as load_vl_model

if TYPE_CHECKING:
    from slime_rl.core.config import Config

@dataclass
class _Request:
    request_id: str
    input_ids: list[int]
    params: SamplingParams
    future: asyncio.Future
    generator: torch.Generator
    token_ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)  # the weight version that sampled each token
    finish_reason: FinishReason | None = None
    aborted: bool = False  # set from the event loop, read by the worker between steps
    routed: list[torch.Tensor] = field(default_factory=list)  # MoE: [tokens, layers, top-k] per forward
    images: tuple[str, ...] = ()  # vision-language models: one image reference per run of pads (vision.py)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``model.dtype`` as the engine loads the model: core's one rule for every backend (config/dtype.py)."""
    return getattr(torch, model_dtype(dtype, device.type))


class HFEngine(RolloutEngine):
    """Batched token-in/token-out generation over ``model`` (a transformers causal LM)."""

    # release_memory on CPU has nothing to free and keeps the engine correct; an instance drops routed_experts
    # over a dense model and adapters when built without lora_scaling
    capabilities = frozenset({"pause", "release_memory", "routed_experts", "adapters"})
    settings = HFSettings  # rollout.hf (settings.py, also the entry point the config loader reads)

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: Any = None,  # only needed for stop strings (anything with .decode(ids))
        *,
        max_batch_size: int = 256,
        seed: int = 0,
        gather_window_s: float = 0.002,  # after the first request, wait this long for the rest of a wave
        eos_token_ids: list[int] | None = None,  # default: the model's and the tokenizer's eos
        num_threads: int | None = None,  # torch threads for generation; None: the calling thread's setting
        lora_scaling: float | None = None,  # adapter-only weight syncs (lora.py): alpha / rank; None: full weights
    ):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.gather_window_s = gather_window_s
        self.num_threads = num_threads
        self.eos_token_ids = frozenset(eos_token_ids if eos_token_ids is not None else _eos_ids(model, tokenizer))
        self.vocab_size = model.get_input_embeddings().num_embeddings
        self.max_positions = getattr(model.config.get_text_config(), "max_position_embeddings", None)
        forward_args = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in forward_args else "past_key_values"  # renamed in transformers 5.x
        self._has_logits_to_keep = "logits_to_keep" in forward_args
        self.router_recorder = RouterRecorder.for_model(self.model)  # MoE models: routed experts on request
        self.vision = VisionInputs.for_model(self.model, getattr(model, "name_or_path", None) or None)
        self.accepts_images = self.vision is not None  # the prompts' images (vision.py, docs/vlm.md)
        self.sample = self.vision.sampler(_sample) if self.vision is not None else _sample  # no vision tokens
        self.adapters = AdapterSync(self.model, lora_scaling)
        # what this instance can do: no experts to report for a dense model, no adapters unless built for them
        self.capabilities = type(self).capabilities - {name for name, lacking in (
            ("routed_experts", self.router_recorder is None), ("adapters", lora_scaling is None)) if lacking}
        self._seeds = random.Random(seed)  # seeds for requests that bring none
        self._version = 0
        self._pending: list[_Request] = []
        self._in_flight: dict[str, _Request] = {}
        self._wake: asyncio.Event | None = None
        self._batcher: asyncio.Task | None = None
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="hf-engine")
        self._released = False
        self._closed = False
        self._paused = False  # pause_generation: no prefill or decode step starts until continue_generation
        self._unpaused: asyncio.Event | None = None

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        tokenizer_path: str | Path | None = None,
        dtype: str = "auto",
        device: str = "auto",
        **engine_kwargs: Any,
    ) -> HFEngine:
        """Load an HF folder. dtype ``auto`` (not resolved by a run): fp32 on CPU, bf16 on CUDA."""
        path = Path(path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model.path: {path} is not an HF model folder (no config.json)")
        dev = torch.device(resolve_device(device, here=True))
        vl = is_vision_language(AutoConfig.from_pretrained(path))
        model = (load_vl_model if vl else AutoModelForCausalLM.from_pretrained)(path, dtype=resolve_dtype(dtype, dev))
        model = model.to(dev)
        return cls(model, _load_tokenizer(Path(tokenizer_path or path)), **engine_kwargs)

    @classmethod
    def from_config(cls, cfg: Config) -> HFEngine:
        """Reads model.path / tokenizer_path / dtype, cluster.device, rollout.max_concurrency
        (the default batch cap), trainer.seed (the default seed) and rollout.hf (settings.py)."""
        settings = hf_settings(cfg)
        args: dict[str, Any] = {
            "max_batch_size": settings.max_batch_size or cfg.rollout.max_concurrency,
            "seed": cfg.trainer.seed if settings.seed is None else settings.seed,
            "gather_window_s": settings.gather_window_s, "num_threads": settings.num_threads}
        if syncs_adapters(cfg):
            args["lora_scaling"] = lora_spec(cfg).scaling
        return cls.from_pretrained(
            cfg.model.path, tokenizer_path=cfg.model.tokenizer_path, dtype=cfg.model.dtype,
            device=cfg.cluster.device, **args,
        )

    @classmethod
    def serve_role(cls, cfg: Config, name: str, **where: Any) -> Any:
        """``roles.<name>`` served by transformers in this process (role_server.py): a `RoleService`."""
        from slime_rl.rollout_hf.role_server import HFRoleServer

        return HFRoleServer.start(cfg, name, **where)

    # ------------------------------------------------------------------ the contract

    @property
    def weight_version(self) -> int:
        return self._version

    async def generate(
        self, input_ids: list[int], params: SamplingParams, request_id: str | None = None,
        images: list[str] | None = None,
    ) -> GenerateOutput:
        self._check_usable()
        self._check_request(input_ids, params)
        if images and self.vision is None:
            raise ValueError("images: this engine's model has no vision tower; serve a vision-language model")
        if self.vision is not None:
            self.vision.check(input_ids, images or [])
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._in_flight:
            raise ValueError(f"request_id {request_id!r} is already in flight")
        if params.max_new_tokens <= 0:
            return GenerateOutput([], [], "length", self._version)
        loop = asyncio.get_running_loop()
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        generator = torch.Generator(device=self.device).manual_seed(seed)
        req = _Request(request_id, list(input_ids), params, loop.create_future(), generator, images=tuple(images or ()))
        self._in_flight[request_id] = req
        self._pending.append(req)
        self._ensure_batcher(loop)
        self._wake.set()
        try:
            return await req.future
        except asyncio.CancelledError:  # the caller gave up: free its row
            req.aborted = True
            if req in self._pending:
                self._pending.remove(req)
                self._in_flight.pop(request_id, None)
            raise

    async def abort(self, request_id: str | None = None) -> None:
        """Queued requests return at once; running ones after the current decode step."""
        targets = list(self._in_flight.values()) if request_id is None else [self._in_flight.get(request_id)]
        for req in targets:
            if req is None:
                continue  # already finished
            req.aborted = True
            if req in self._pending:
                self._pending.remove(req)
                req.finish_reason = "abort"
                self._resolve(req)

    async def pause_generation(self) -> bool:
        """Hold every batch between decode steps (SGLang's ``in_place`` pause): rows keep their KV cache
        and continue with the new weights after `continue_generation`, without a re-prefill. The step
        running now finishes first (weight loads queue behind it in the one worker thread)."""
        self._paused = True
        if self._unpaused is not None:
            self._unpaused.clear()
        return True

    async def continue_generation(self) -> None:
        self._paused = False
        if self._unpaused is not None:
            self._unpaused.set()

    async def _wait_unpaused(self) -> None:
        if self._paused and self._unpaused is not None:
            await self._unpaused.wait()

    async def update_weights(self, named_tensors: NamedTensors, *, version: int, last: bool) -> None:
        """Copy HF-named tensors into the model in place. Every name must be one of the
        model's (tied aliases such as lm_head.weight included); the bucket is checked whole
        before anything is copied. LoRA adapters (PEFT names) replace the ones served (lora.py)."""
        self._check_usable()
        await self._in_worker(lambda: self._load_weights(named_tensors), grad_mode=torch.no_grad)
        if last:
            self.adapters.finish()
            self._version = version

    def current_weight(self, name: str) -> torch.Tensor:
        """The parameter served under HF name ``name`` (tied aliases too): a delta sync's base."""
        target = weight_target(name, self.model.state_dict(keep_vars=True))
        if target is None:
            raise KeyError(f"update_weights: unknown weight name {name!r}")
        return target.detach()

    async def release_memory(self) -> None:
        """On CUDA, move the weights to host memory and empty the cache allocator; on CPU a no-op.
        Call it with no request in flight (the colocated loop does: it releases after rollout)."""
        if self.device.type == "cuda":
            await self._in_worker(lambda: (self.model.to("cpu"), torch.cuda.empty_cache()))
            self._released = True

    async def resume_memory(self, tags: list[str] | None = None) -> None:
        """The weights back on the GPU (all this engine releases: ``tags`` other than "weights" are no-ops)."""
        if self._released and (tags is None or "weights" in tags):
            await self._in_worker(lambda: self.model.to("cuda"))
            self._released = False

    async def health(self) -> bool:
        crashed = self._batcher is not None and self._batcher.done() and not self._batcher.cancelled()
        return not self._closed and not crashed

    async def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self.continue_generation()  # a paused batch must run to its abort
        running = [r.future for r in self._in_flight.values()]
        await self.abort()
        batcher = self._batcher
        if batcher is not None and not batcher.done() and batcher.get_loop() is asyncio.get_running_loop():
            if running:  # aborted rows return after the current decode step
                await asyncio.wait(running)
            batcher.cancel()
            try:
                await batcher
            except asyncio.CancelledError:
                pass
        self._worker.shutdown(wait=True)
        self.model = None

    # ------------------------------------------------------------------ batching

    def _check_usable(self) -> None:
        if self._closed:
            raise RuntimeError("the hf engine is shut down")
        if self._released:
            raise RuntimeError("the hf engine's memory is released; call resume_memory() first")

    def _check_request(self, input_ids: list[int], params: SamplingParams) -> None:
        if not input_ids:
            raise ValueError("input_ids: empty prompt; give at least one token id")
        bad = next((t for t in input_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"input_ids: token id {bad} is outside the model's vocabulary of {self.vocab_size}")
        if self.max_positions is not None and len(input_ids) >= self.max_positions:
            raise ValueError(f"input_ids: {len(input_ids)} prompt tokens leave no room in the model's context "
                             f"of {self.max_positions}")
        if params.temperature < 0:
            raise ValueError(f"SamplingParams.temperature: {params.temperature} < 0 (0 means greedy)")
        if not 0 < params.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p: {params.top_p} is outside (0, 1]")
        if params.stop and self.tokenizer is None:
            raise ValueError("SamplingParams.stop: stop strings need a tokenizer; build the engine with one")

    def _ensure_batcher(self, loop: asyncio.AbstractEventLoop) -> None:
        # One batcher per event loop: tests and scripts may call asyncio.run more than once.
        if self._batcher is None or self._batcher.done() or self._batcher.get_loop() is not loop:
            self._wake = asyncio.Event()
            self._unpaused = asyncio.Event()
            if not self._paused:
                self._unpaused.set()
            self._batcher = loop.create_task(self._batch_loop(), name="hf-engine-batcher")

    async def _batch_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._pending:
                await self._gather_wave()
                batch, self._pending = self._pending[: self.max_batch_size], self._pending[self.max_batch_size:]
                await self._run_batch(batch)

    async def _gather_wave(self) -> None:
        """Let the requests of one wave (n samples of a few prompts) all queue before starting."""
        while len(self._pending) < self.max_batch_size:
            seen = len(self._pending)
            await asyncio.sleep(self.gather_window_s)
            if len(self._pending) == seen:
                return

    async def _run_batch(self, requests: list[_Request]) -> None:
        batch = _DecodeBatch(self, requests)
        try:
            await self._wait_unpaused()
            await self._in_worker(batch.prefill)
            while batch.rows:
                await self._wait_unpaused()
                for req in await self._in_worker(batch.step):
                    self._resolve(req)
        except asyncio.CancelledError:  # shutdown: whatever is left returns as aborted
            for req in requests:
                req.finish_reason = req.finish_reason or "abort"
                self._resolve(req)
            raise
        except Exception as err:  # a failed forward fails this batch only
            for req in requests:
                if not req.future.done():
                    req.future.set_exception(err)
                self._in_flight.pop(req.request_id, None)

    def _resolve(self, req: _Request) -> None:
        self._in_flight.pop(req.request_id, None)
        if not req.future.done():
            routed = torch.cat(req.routed).tolist() if req.routed and req.params.return_routed_experts else None
            output = GenerateOutput(list(req.token_ids), list(req.log_probs), req.finish_reason, self._version,
                                    routed_experts=routed, token_versions=list(req.token_versions))
            req.future.set_result(output)

    async def _in_worker(self, fn, grad_mode=torch.inference_mode):
        # torch's thread count is per thread: carry the caller's setting into the worker.
        num_threads = self.num_threads or torch.get_num_threads()

        def call():
            if torch.get_num_threads() != num_threads:
                torch.set_num_threads(num_threads)
            with grad_mode():
                return fn()

        return await asyncio.get_running_loop().run_in_executor(self._worker, call)

    def _load_weights(self, named_tensors: NamedTensors) -> None:
        params = self.model.state_dict(keep_vars=True)
        named_tensors, adapters = AdapterSync.split(named_tensors)
        self.adapters.check(adapters)
        targets = {name: weight_target(name, params) for name, _ in named_tensors}
        unknown = [name for name, target in targets.items() if target is None]
        if unknown:
            more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
            raise ValueError(f"update_weights: unknown weight name {unknown[0]!r}{more}; the model's names look "
                             f"like {next(iter(params))!r}")
        for name, tensor in named_tensors:
            if tuple(tensor.shape) != tuple(targets[name].shape):
                raise ValueError(f"update_weights: {name!r} has shape {tuple(tensor.shape)}, the model's is "
                                 f"{tuple(targets[name].shape)}")
        for name, tensor in named_tensors:
            targets[name].copy_(tensor)
        self.adapters.apply(adapters)


class _DecodeBatch:
    """The state of one batch between decode steps. Its methods run in the engine's worker thread."""

    def __init__(self, engine: HFEngine, requests: list[_Request]):
        self.engine = engine
        self.model = engine.model
        self.device = engine.device
        self.rows = list(requests)  # requests still decoding, in cache row order
        self.cache = DynamicCache(config=self.model.config)
        self.logits: torch.Tensor | None = None  # [rows, vocab] fp32: the next token's logits
        self.attention_mask: torch.Tensor | None = None  # [rows, columns]; 0 on left padding
        self.routed: torch.Tensor | None = None  # MoE: the last forward's [rows, seq, layers, k] experts
        self.next_position: torch.Tensor | None = None  # [rows]
        self.rope_deltas: torch.Tensor | None = None  # [rows] vision-language models' mRoPE offset (vision.py)
        self.logits_version = engine._version  # the weight version that computed ``logits``

    def _forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, last_only: bool, **extra) -> torch.Tensor:
        kwargs = {self.engine._cache_kw: self.cache, "use_cache": True}
        if last_only and self.engine._has_logits_to_keep:
            kwargs["logits_to_keep"] = 1  # the lm_head over the prompt would be wasted work
        self.logits_version = self.engine._version  # set by the event loop only while no forward runs
        recorder = self.engine.router_recorder
        routing = recorder is not None and any(r.params.return_routed_experts for r in self.rows)
        with recorder.recording() if routing else contextlib.nullcontext():
            out = self.model(input_ids=input_ids, attention_mask=self.attention_mask, position_ids=position_ids,
                             **kwargs, **extra)
        if routing:
            self.routed = routed_experts(recorder.take(), self.model.config, input_ids.shape)
        return out.logits[:, -1, :].float()

    def prefill(self) -> None:
        if not self.rows:
            return
        # n samples of one prompt share its prefill: run the distinct prompts, then repeat their cache rows.
        distinct: dict[tuple[int, ...], int] = {}
        row_to_prompt = [distinct.setdefault((tuple(r.input_ids), r.images), len(distinct)) for r in self.rows]
        prompts, images = [ids for ids, _ in distinct], [refs for _, refs in distinct]
        width = max(len(p) for p in prompts)
        input_ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros(len(prompts), width, dtype=torch.long)
        for i, prompt in enumerate(prompts):
            input_ids[i, width - len(prompt):] = torch.tensor(prompt)
            mask[i, width - len(prompt):] = 1
        self.attention_mask = mask.to(self.device)
        positions = (self.attention_mask.cumsum(-1) - 1).clamp(min=0)
        self.rope_deltas, extra = torch.zeros(len(prompts), dtype=torch.long, device=self.device), {}
        if self.engine.vision is not None:
            positions, self.rope_deltas, extra = self.engine.vision.prefill(input_ids.to(self.device),
                                                                             self.attention_mask, images)
        self.routed = None
        self.logits = self._forward(input_ids.to(self.device), positions, last_only=True, **extra)
        if self.routed is not None:  # [prompts, width, layers, k]: each prompt's own (unpadded) positions
            for req, p in zip(self.rows, row_to_prompt, strict=True):
                req.routed.append(self.routed[p, width - len(req.input_ids):])
        if len(prompts) < len(self.rows):
            index = torch.tensor(row_to_prompt, device=self.device)
            self.cache.batch_select_indices(index)
            self.logits = self.logits[index]
            self.attention_mask = self.attention_mask[index]
            self.rope_deltas = self.rope_deltas[index]
        self.next_position = self.attention_mask.sum(-1)

    def step(self) -> list[_Request]:
        """Sample one token per row, drop the rows that finished, feed the rest. Returns the finished requests."""
        aborted = [r.aborted for r in self.rows]  # one snapshot: abort() may flip flags while this runs
        live = [i for i, was_aborted in enumerate(aborted) if not was_aborted]
        finished, keep, kept_tokens = [], [], []
        tokens, log_probs = self.engine.sample(self.logits[live], [self.rows[i] for i in live]) if live else ([], [])
        for i, token, log_prob in zip(live, _tolist(tokens), _tolist(log_probs), strict=True):
            req = self.rows[i]
            req.token_ids.append(token)
            req.log_probs.append(log_prob)
            req.token_versions.append(self.logits_version)
            req.finish_reason = self._finish_reason(req, token)
            if req.finish_reason is None:
                keep.append(i)
                kept_tokens.append(token)
        for req, was_aborted in zip(self.rows, aborted, strict=True):
            if was_aborted:  # aborted while the previous step ran: no token sampled for it now
                req.finish_reason = "abort"
            if req.finish_reason is not None:
                finished.append(req)
        if len(keep) < len(self.rows):
            self._select_rows(keep)
        if self.rows:
            self.attention_mask = torch.cat([self.attention_mask, self.attention_mask.new_ones(len(keep), 1)], dim=1)
            new_tokens = torch.tensor(kept_tokens, device=self.device)[:, None]
            self.routed = None
            self.logits = self._forward(new_tokens, (self.next_position + self.rope_deltas)[:, None], last_only=False)
            if self.routed is not None:
                for req, routed in zip(self.rows, self.routed, strict=True):
                    req.routed.append(routed)
            self.next_position = self.next_position + 1
        return finished

    def _select_rows(self, keep: list[int]) -> None:
        self.rows = [self.rows[i] for i in keep]
        if not keep:
            return
        index = torch.tensor(keep, device=self.device)
        self.cache.batch_select_indices(index)
        self.attention_mask = self.attention_mask[index]
        self.next_position = self.next_position[index]
        self.rope_deltas = self.rope_deltas[index]

    def _finish_reason(self, req: _Request, token: int) -> FinishReason | None:
        params = req.params
        if (token in self.engine.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids:
            return "stop"
        if params.stop and _ends_with_stop(self.engine.tokenizer, req.token_ids, params.stop):
            return "stop"
        if len(req.token_ids) >= params.max_new_tokens:
            return "length"
        max_positions = self.engine.max_positions
        if max_positions is not None and len(req.input_ids) + len(req.token_ids) >= max_positions:
            return "length"
        return None


def _tolist(values: torch.Tensor | list) -> list:
    return values.tolist() if isinstance(values, torch.Tensor) else values


def _ends_with_stop(tokenizer: Any, token_ids: list[int], stops: list[str]) -> bool:
    """Whether the decoded response now contains a stop string. Checked every step, so only the
    tail can hold a new match; a character may span up to 4 byte-level tokens, hence the window."""
    window = 4 * max(len(s) for s in stops) + 1
    tail = tokenizer.decode(token_ids[-window:])
    return any(s in tail for s in stops)


def _sample(logits: torch.Tensor, requests: list[_Request]) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row and its log-prob under log_softmax(logits / T) (T = 1 when greedy), unfiltered."""
    device = logits.device
    temperature = torch.tensor([r.params.temperature for r in requests], device=device, dtype=logits.dtype)
    greedy = temperature == 0
    scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
    log_probs = torch.log_softmax(scaled, dim=-1)
    tokens = logits.argmax(dim=-1)
    sampled = [i for i, r in enumerate(requests) if r.params.temperature > 0]
    if sampled:
        rows = [requests[i] for i in sampled]
        probs = _filtered_probs(scaled[sampled], log_probs[sampled], rows)
        # Inverse-CDF draw with one uniform per row from that request's own generator.
        uniform = torch.cat([torch.rand(1, generator=r.generator, device=device) for r in rows])
        cdf = probs.cumsum(dim=-1)
        picks = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None], right=True)[:, 0]
        tokens[sampled] = picks.clamp(max=logits.shape[-1] - 1)
    return tokens, log_probs.gather(1, tokens[:, None])[:, 0]


def _filtered_probs(scaled: torch.Tensor, log_probs: torch.Tensor, requests: list[_Request]) -> torch.Tensor:
    """The sampling distribution after top-k, then top-p (renormalised), as SGLang applies them."""
    top_k = [r.params.top_k for r in requests]
    top_p = [r.params.top_p for r in requests]
    vocab = scaled.shape[-1]
    if all(k <= 0 or k >= vocab for k in top_k) and all(p >= 1.0 for p in top_p):
        return log_probs.exp()
    device = scaled.device
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=device)[None, :]
    k = torch.tensor([kk if kk > 0 else vocab for kk in top_k], device=device)
    drop = rank >= k[:, None]
    sorted_probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop |= mass_before > torch.tensor(top_p, device=device, dtype=scaled.dtype)[:, None]  # keeps the top token
    sorted_probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    return torch.zeros_like(sorted_probs).scatter_(1, order, sorted_probs)


def _eos_ids(model: PreTrainedModel, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    for source in (model.config, getattr(model, "generation_config", None), tokenizer):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))
    return ids


def _load_tokenizer(path: Path) -> Any:
    """The folder's tokenizer, or None when it has none (then stop strings are refused)."""
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    return AutoTokenizer.from_pretrained(path)
