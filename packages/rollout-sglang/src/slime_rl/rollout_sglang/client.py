"""The async HTTP client over the router's ``/generate``: token ids in, token ids and
log-probs out, with bounded concurrency, per-request timeouts and retries when a
connection drops or the router has no live worker (an engine died or is restarting).

The router rebuilds the body from its own schema and silently drops unknown fields
(notes/sglang-router.md), so the payload holds only fields it passes on; requests that ask for
the routed experts (MoE routing replay) go to an engine directly (`SGLangEngine`).

Generation goes through aiohttp, not httpx (which the control calls use): httpx's connection
pool costs O(connections x waiting requests) per event, and with 256 requests in flight it
fed an H200 only ~50 requests a second (docs/gpu-results.md, benchmarks/rollout_throughput.py).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import json
import logging
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from slime_rl.core.contracts import GenerateOutput, SamplingParams
from slime_rl.rollout_sglang.vision import check_prompt_tokens

logger = logging.getLogger(__name__)

# sglang-router 0.3.2's header for session affinity: with `--policy manual` every request carrying the same key
# goes to the same worker (a new key is assigned by --assignment-mode), so a multi-turn episode's turns reuse
# the prefix cache of the worker that served its first turn. Other policies ignore it.
ROUTING_KEY_HEADER = "x-smg-routing-key"

# SGLang 0.5.17's answer to a request aborted before it reached its scheduler (RequestAbortedError, e.g. one
# waiting at a pause when pause_generation(abort) aborts all): "Request <rid> was aborted", no tokens, no meta_info.
# sglang-router 0.3.2 passes it on as is.
ABORTED_STATUS = 499

# Router answers worth retrying: no worker alive or reachable right now (500
# call_upstream_request_error, 502/504 from a dying upstream, 503 no_available_workers).
_RETRY_STATUS = {500, 502, 503, 504}


class GenerateError(RuntimeError):
    pass


def build_payload(input_ids: list[int], params: SamplingParams, rid: str, lora_path: str | None = None,
                  image_data: list[str] | None = None) -> dict[str, Any]:
    """An SGLang ``/generate`` body. ``logprob_start_len=-1``: log-probs of the new tokens only.
    ``lora_path``: the name of a loaded LoRA adapter to generate with (SGLang resolves it by name).
    ``image_data``: the images of a vision-language prompt, one per image pad in ``input_ids`` (vision.py)."""
    sampling: dict[str, Any] = {
        "max_new_tokens": params.max_new_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "ignore_eos": params.ignore_eos,
        # Token-in/token-out: keep special tokens and stop strings in the ids the trainer scores.
        "skip_special_tokens": False,
        "no_stop_trim": True,
    }
    if params.stop:
        sampling["stop"] = list(params.stop)
    if params.stop_token_ids:
        sampling["stop_token_ids"] = list(params.stop_token_ids)
    if params.seed is not None:
        sampling["sampling_seed"] = params.seed
    payload = {"input_ids": list(input_ids), "sampling_params": sampling, "return_logprob": True,
               "logprob_start_len": -1, "rid": rid}
    if params.return_routed_experts:  # an engine field: sglang-router 0.3.2 drops it (send to an engine)
        payload["return_routed_experts"] = True
    if lora_path is not None:
        payload["lora_path"] = lora_path
    if image_data:
        payload["image_data"] = list(image_data)
    return payload


@functools.cache
def served_routing_shape(model_path: str | Path) -> tuple[int, int]:
    """(layers, top-k) of a served MoE model, from its config.json: the shape routed experts decode to."""
    config = json.loads((Path(model_path) / "config.json").read_text())
    config = config.get("text_config", config)
    if "num_experts_per_tok" not in config:
        raise ValueError(f"algorithm.routing_replay: rollout needs a mixture-of-experts model; {model_path}"
                         " has no num_experts_per_tok in config.json (set routing_replay to off)")
    return int(config["num_hidden_layers"]), int(config["num_experts_per_tok"])


def decode_routed_experts(value: Any, routed_shape: tuple[int, int]) -> list[list[list[int]]]:
    """SGLang's ``meta_info.routed_experts`` -> ``[tokens fed][layers][top-k]``: base64 of int32
    (little-endian) ``[prompt + new - 1, layers, top-k]`` as SGLang encodes it, or the same as nested lists."""
    layers, k = routed_shape
    if isinstance(value, str):
        flat = np.frombuffer(base64.b64decode(value), dtype="<i4")
    else:
        flat = np.asarray(value, dtype=np.int64).reshape(-1)
    if flat.size % (layers * k):
        raise GenerateError(f"routed_experts: {flat.size} expert ids do not fill [tokens, {layers} layers, top-{k}]")
    return flat.reshape(-1, layers, k).tolist()


def parse_response(body: dict[str, Any], *, default_version: int,
                   routed_shape: tuple[int, int] | None = None) -> GenerateOutput:
    """SGLang's answer -> `GenerateOutput`. ``meta_info.output_token_logprobs`` is
    ``[[logprob, token_id, text_or_null], ...]``, one per new token; ``finish_reason`` is
    ``{"type": "stop" | "length" | "abort", ...}``."""
    meta = body.get("meta_info") or {}
    ids = [int(t) for t in body.get("output_ids") or []]
    entries = meta.get("output_token_logprobs") or []
    finish = (meta.get("finish_reason") or {}).get("type", "length")
    if finish not in ("stop", "length", "abort"):
        raise GenerateError(f"request {meta.get('id')}: unknown finish_reason {meta.get('finish_reason')!r}")
    if len(entries) != len(ids):
        if finish != "abort":
            raise GenerateError(f"request {meta.get('id')}: {len(ids)} output ids but {len(entries)} log-probs "
                                "(was the request sent with return_logprob?)")
        n = min(len(ids), len(entries))  # an abort can land between a token and its log-prob
        ids, entries = ids[:n], entries[:n]
    log_probs = [float(e[0]) for e in entries]
    if any(int(e[1]) != t for e, t in zip(entries, ids, strict=True)):
        raise GenerateError(f"request {meta.get('id')}: output_token_logprobs ids differ from output_ids")
    version = meta.get("weight_version")
    try:
        version = int(version)
    except (TypeError, ValueError):
        version = default_version  # "default": the weights the server started with
    routed = None
    if routed_shape is not None and meta.get("routed_experts") is not None:
        routed = decode_routed_experts(meta["routed_experts"], routed_shape)
    cached = meta.get("cached_tokens")  # input tokens the server took from its prefix cache
    return GenerateOutput(token_ids=ids, log_probs=log_probs, finish_reason=finish, weight_version=version,
                          routed_experts=routed, cached_tokens=int(cached) if isinstance(cached, int) else None)


class GenerateClient:
    """One connection pool to the router, at most ``max_concurrency`` requests in flight."""

    def __init__(self, router_url: str, *, max_concurrency: int = 512, request_timeout: float = 3600.0,
                 retry_timeout: float = 900.0, max_retries: int = 20, api_key: str | None = None,
                 recovering: Callable[[], bool] | None = None):
        self.router_url = router_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}  # the router's --api-key
        self.request_timeout = request_timeout  # one generation, start to end
        self.retry_timeout = retry_timeout  # how long to keep retrying a request no worker can take
        # Failed attempts of one request retried while no engine is being restarted (rollout.sglang.generate_max_retries):
        # a transient router error gives up after these; while ``recovering()`` says an engine is coming back,
        # attempts wait for it instead, up to retry_timeout.
        self.max_retries = max_retries
        self.recovering = recovering
        self._max_concurrency = max_concurrency
        self._session: aiohttp.ClientSession | None = None
        self._semaphore: asyncio.Semaphore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.retries = 0  # attempts beyond the first, over the client's life (a metric)

    def _bind(self) -> tuple[aiohttp.ClientSession, asyncio.Semaphore]:
        """The pool and the semaphore of the running event loop (made on first use in each loop)."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            if self._session is not None:
                _abandon(self._session)
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self._max_concurrency), headers=self._headers,
                timeout=aiohttp.ClientTimeout(total=self.request_timeout, connect=10.0))
            self._semaphore = asyncio.Semaphore(self._max_concurrency)
            self._loop = loop
        return self._session, self._semaphore

    async def generate(self, input_ids: list[int], params: SamplingParams, rid_prefix: str, *,
                       default_version: int = 0, should_stop: Callable[[], bool] | None = None,
                       routed_shape: tuple[int, int] | None = None, routing_key: str | None = None,
                       lora_path: str | None = None, image_data: list[str] | None = None,
                       expect_prompt_tokens: int | None = None,
                       on_attempt: Callable[[str], None] | None = None) -> GenerateOutput:
        """POST one request; on a dropped connection or a 5xx from the router, retry with a
        fresh rid (``{rid_prefix}.{attempt}``), at most ``max_retries`` failures while no engine is
        restarting and never past ``retry_timeout``. ``on_attempt(rid)`` hears each attempt's rid
        before it is sent: SGLang 0.5.17 aborts only a request whose rid it is given exactly.
        ``should_stop()`` true when a slot frees up or before a retry: an empty abort result.
        ``routing_key``: requests with the same key go to the same worker (router policy ``manual``).
        ``lora_path``: the LoRA adapter to generate with, ``image_data`` the prompt's images (`build_payload`);
        ``expect_prompt_tokens``: the length SGLang's expansion of the images must give (vision.py)."""
        session, semaphore = self._bind()
        deadline = time.monotonic() + self.retry_timeout
        attempt, backoff, counted = 0, 0.05, 0  # counted: failures while no engine was being restarted
        headers = {ROUTING_KEY_HEADER: routing_key} if routing_key else None
        async with semaphore:
            while True:
                if should_stop is not None and should_stop():
                    return GenerateOutput([], [], "abort", default_version)
                payload = build_payload(input_ids, params, f"{rid_prefix}.{attempt}", lora_path, image_data)
                if on_attempt is not None:
                    on_attempt(payload["rid"])
                try:
                    async with session.post(f"{self.router_url}/generate", json=payload, headers=headers) as resp:
                        if resp.status == 200:
                            body = await resp.json()
                            if expect_prompt_tokens is not None and (why := check_prompt_tokens(body, expect_prompt_tokens)):
                                raise GenerateError(f"request {rid_prefix}: {why}")
                            return parse_response(body, default_version=default_version, routed_shape=routed_shape)
                        if resp.status == ABORTED_STATUS:  # aborted before it reached SGLang's scheduler
                            return GenerateOutput([], [], "abort", default_version)
                        text = await resp.text()
                except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as err:  # incl. connect timeouts
                    problem = f"{type(err).__name__}: {err}"
                except TimeoutError:
                    raise GenerateError(f"request {rid_prefix}: no answer from the router at {self.router_url} "
                                        f"within {self.request_timeout:g} s") from None
                else:
                    if resp.status not in _RETRY_STATUS:
                        raise GenerateError(f"request {rid_prefix}: the router answered HTTP {resp.status}: "
                                            f"{text[:500]}{_fix_for(text)}")
                    problem = f"HTTP {resp.status}: {text[:200]}"
                if self.recovering is None or not self.recovering():
                    counted += 1
                if counted > self.max_retries:
                    raise GenerateError(f"request {rid_prefix}: gave up after {attempt + 1} attempts through the "
                                        f"router at {self.router_url} ({counted} failed while no engine was "
                                        f"restarting; rollout.sglang.generate_max_retries={self.max_retries}); last: {problem}")
                if time.monotonic() + backoff > deadline:
                    raise GenerateError(f"request {rid_prefix}: gave up after {attempt + 1} attempts over "
                                        f"{self.retry_timeout:g} s through the router at {self.router_url}; "
                                        f"last: {problem}")
                logger.info("request %s attempt %d failed (%s); retrying", rid_prefix, attempt, problem)
                await asyncio.sleep(backoff * (1 + random.random() * 0.2))
                backoff = min(backoff * 2, 2.0)
                attempt += 1
                self.retries += 1

    async def aclose(self) -> None:
        if self._session is not None:
            if self._loop is asyncio.get_running_loop():
                await self._session.close()
            else:
                _abandon(self._session)
        self._session = self._semaphore = self._loop = None


def _fix_for(refusal: str) -> str:
    """What the user changes for a refusal they can fix in the config."""
    if "skip_tokenizer_init" in refusal:  # stop strings sent to a server started without its tokenizer
        return ("; stop strings need SGLang's tokenizer: list them in rollout.stop (the launch then keeps it) "
                "or set rollout.sglang.server_args.skip_tokenizer_init: false")
    return ""


def _abandon(session: aiohttp.ClientSession) -> None:
    """Drop a session whose event loop has ended (callers may use one ``asyncio.run`` per call):
    it cannot be closed the normal way, so detach it and close what sockets can be closed."""
    connector = session.connector
    session.detach()
    if connector is not None:
        with contextlib.suppress(Exception):
            connector._close()  # the synchronous part of close(); the awaitable needs the dead loop
