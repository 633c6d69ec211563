"""The agent gateway: OpenAI's ``/v1/chat/completions``, ``/v1/completions`` and ``/v1/models`` in front of a
`RolloutEngine`, token-in/token-out underneath, every call recorded (recording.py).

Each episode has its own base URL, ``<gateway>/episodes/<id>/v1``, and its own key (derived from the run's
key and the id, so an agent's key opens its own episode and no other); the server is a
`KeyedLoopbackServer` (loopback only, a key on every route). Requests of one episode share the routing
key ``<id>`` (request ids ``<id>/<call>``), so an engine with several servers keeps the episode on one.

The run's sampling settings (``rollout.temperature``, ``top_p``, ``top_k``) are what the engine samples
with, whatever the agent asks: the trainer scores tokens under them. ``max_tokens`` (or
``max_completion_tokens``) and ``stop`` are honoured within ``rollout.max_response_len``. A streamed
response (``stream: true``) is sent as server-sent events once the call has finished generating.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import json
import secrets
import time
from dataclasses import dataclass, replace
from typing import Any

from slime_rl.core.agent.tool_calls import split_tool_calls
from slime_rl.core.contracts import RolloutEngine, SamplingParams
from slime_rl.core.gateway.messages import GatewayError, parse_messages, parse_tools, reply_message
from slime_rl.core.gateway.own_time import GC_PAUSES, OwnTime
from slime_rl.core.gateway.recording import ChatPrompts, Episode, RecordedCall
from slime_rl.core.infra.keyed_server import KeyedLoopbackServer, derived_key, error_body, new_key

_FINISH = {"stop": "stop", "length": "length"}


@dataclass
class GatewaySettings:
    model: str = "policy"  # the one model name the gateway answers to
    tool_parser: str = "hermes"  # tool_calls.TOOL_PARSERS: the model family's format
    # The collector's pauses land inside the gateway's calls (its allocations trigger them): at start the
    # process's heap so far (modules, tokenizer, engine client) is frozen out of its scans, and a young
    # generation of 20,000 objects instead of 700 makes them rarer; together they took the gateway's mean time
    # a call from 0.40 to 0.19 ms on the CPU bench (benchmarks/gateway_overhead.py). As SGLang's freeze_gc and
    # --gc-threshold; None leaves Python's threshold.
    gc_freeze: bool = True
    gc_threshold: tuple[int, ...] | None = (20_000, 10, 10)


_GC_APPLIED: set[tuple] = set()  # each tuning once per process (a test process starts dozens of gateways)


def tune_gc(settings: GatewaySettings) -> None:
    """Apply ``settings``' collector tuning to this process."""
    if settings.gc_threshold is not None:
        gc.set_threshold(*settings.gc_threshold)
    if settings.gc_freeze:
        gc.collect()  # what is garbage now would never be collected once frozen
        gc.freeze()


class Gateway:
    """One run's gateway over ``engine``; `start` it on the rollout's event loop."""

    def __init__(self, engine: RolloutEngine, tokenizer: Any, settings: GatewaySettings | None = None, *,
                 run_key: str | None = None):
        self.engine = engine
        self.tokenizer = tokenizer
        self.settings = settings or GatewaySettings()
        self.prompts = ChatPrompts(tokenizer)
        self.run_key = run_key or new_key()
        self.episodes: dict[str, Episode] = {}
        self._ids = itertools.count()
        self.server = KeyedLoopbackServer(
            [("POST", "/episodes/{episode}/v1/chat/completions", self._chat),
             ("POST", "/episodes/{episode}/v1/completions", self._completion),
             ("GET", "/episodes/{episode}/v1/models", self._models), ("GET", "/health", self._health)],
            key_for=self._key_for, open_paths=frozenset({"/health"}), name="the agent gateway")
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> str:
        """Serve on the running loop (again after a new loop: tests run asyncio.run more than once)."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            if self._loop is not None:  # the old loop is gone, and its server with it: only the socket is left
                if self.server._socket is not None:
                    self.server._socket.close()
                self.server._runner = self.server._socket = None
            await self.server.start()
            self._loop = loop
            GC_PAUSES.install()
            if (tuning := (self.settings.gc_freeze, self.settings.gc_threshold)) not in _GC_APPLIED:
                _GC_APPLIED.add(tuning)
                tune_gc(self.settings)
        return self.server.url

    async def stop(self) -> None:
        await self.server.stop()
        self._loop = None

    # ------------------------------------------------------------------ episodes

    def open_episode(self, params: SamplingParams) -> Episode:
        """A new episode sampled with ``params`` (the run's, or the eval's); ``params.max_new_tokens`` bounds each
        call and each trajectory's response (calls that extend each other)."""
        episode_id = f"e{next(self._ids)}-{secrets.token_hex(4)}"
        episode = Episode(episode_id, derived_key(self.run_key, episode_id), params=params)
        self.episodes[episode_id] = episode
        return episode

    def base_url(self, episode: Episode) -> str:
        return f"{self.server.url}/episodes/{episode.id}/v1"

    def close_episode(self, episode: Episode) -> Episode:
        episode.closed = True
        return self.episodes.pop(episode.id, episode)

    def _key_for(self, request: Any) -> str | None:
        episode = self.episodes.get(request.match_info.get("episode", ""))
        return episode.key if episode is not None else None

    # ------------------------------------------------------------------ routes

    async def _health(self, request: Any) -> Any:
        from aiohttp import web

        return web.json_response({"status": "ok"})

    async def _models(self, request: Any) -> Any:
        from aiohttp import web

        return web.json_response({"object": "list", "data": [
            {"id": self.settings.model, "object": "model", "created": 0, "owned_by": "slime-rl"}]})

    async def _chat(self, request: Any) -> Any:
        return await self._serve(request, "chat")

    async def _completion(self, request: Any) -> Any:
        return await self._serve(request, "completion")

    async def _serve(self, request: Any, kind: str) -> Any:
        from aiohttp import web

        start = time.perf_counter()
        episode = self.episodes[request.match_info["episode"]]  # the key check found it
        try:
            body = await _json_body(request)
            call, payload = await (self._chat_call(episode, body) if kind == "chat"
                                   else self._completion_call(episode, body))
        except GatewayError as err:
            return web.json_response(error_body(err.message, err.kind, err.code, err.param), status=err.status)
        if body.get("stream"):
            response = await _stream(request, payload, kind,
                                     bool((body.get("stream_options") or {}).get("include_usage")))
        else:
            response = web.json_response(payload)
        call.handler_s = time.perf_counter() - start  # with the waits for the engine and for the loop
        return response

    def _check_common(self, episode: Episode, body: dict[str, Any]) -> SamplingParams:
        if episode.closed:
            why = "the rollout aborted it (it restarts later)" if episode.aborted else "it has ended"
            raise GatewayError(f"episode {episode.id}: {why}; no more calls", status=410, code="episode_closed")
        if body.get("model") != self.settings.model:
            raise GatewayError(f"model: {body.get('model')!r} is not served here; use {self.settings.model!r}"
                               " (GET /v1/models lists it)", param="model", code="model_not_found")
        if body.get("n", 1) != 1:
            raise GatewayError("n: the gateway samples one choice per call; send n=1 (or leave it out)", param="n")
        cap = body.get("max_completion_tokens", body.get("max_tokens"))
        if cap is not None and (not isinstance(cap, int) or cap < 1):
            raise GatewayError(f"max_tokens: {cap!r}; a positive integer", param="max_tokens")
        stop = body.get("stop") or []
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise GatewayError("stop: a string or a list of non-empty strings", param="stop")
        run = episode.params
        if any(k in body and body[k] is not None and body[k] != getattr(run, k) for k in ("temperature", "top_p")):
            episode.sampling_overridden += 1
        limit = run.max_new_tokens if cap is None else min(cap, run.max_new_tokens)
        return replace(run, max_new_tokens=limit, stop=list(run.stop) + stop)

    def _budget(self, episode: Episode, params: SamplingParams, prompt: list[int], parent: int | None) -> int:
        """What is left of the trajectory's response budget (``max_response_len``) for this call."""
        root = parent
        while root is not None and episode.calls[root].parent is not None:
            root = episode.calls[root].parent
        used = len(prompt) - len(episode.calls[root].prompt_ids) if root is not None else 0
        return max(0, min(params.max_new_tokens, episode.params.max_new_tokens - used))

    async def _generate(self, episode: Episode, call: RecordedCall, params: SamplingParams) -> None:
        episode.calls.append(call)
        if params.max_new_tokens <= 0:
            call.finish_reason = "length"
            return
        start = time.perf_counter()
        try:
            out = await self.engine.generate(list(call.prompt_ids), params, request_id=f"{episode.id}/{call.index}")
        except ValueError as err:  # the engine refused the prompt: too long for the model, ids out of range
            call.finish_reason = "refused"  # kept in place (calls are found by index), never trained on
            raise GatewayError(f"the model cannot take this request: {err}", code="context_length_exceeded") from None
        call.engine_s = time.perf_counter() - start
        call.token_ids, call.log_probs = list(out.token_ids), list(out.log_probs)
        call.token_versions = (list(out.token_versions) if out.token_versions is not None
                               else [out.weight_version] * len(out.token_ids))
        call.weight_version, call.finish_reason, call.cached_tokens = out.weight_version, out.finish_reason, \
            out.cached_tokens
        if out.finish_reason == "abort":
            episode.aborted = episode.closed = True
            raise GatewayError(f"episode {episode.id}: the rollout aborted it (it had enough samples; it restarts"
                               " later)", status=410, code="episode_closed")

    def _text(self, call: RecordedCall, stops: list[str]) -> str:
        ids = call.token_ids
        if ids and ids[-1] in self.prompts.template.end_of_turn_ids:
            ids = ids[:-1]
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        for stop in stops:  # as OpenAI: the stop string is not part of the content
            if call.finish_reason == "stop" and stop in text:
                text = text[:text.index(stop)]
        return text

    async def _chat_call(self, episode: Episode, body: dict[str, Any]) -> tuple[RecordedCall, dict[str, Any]]:
        own = OwnTime()  # the gateway's own work: before and after the engine
        params = self._check_common(episode, body)
        messages = parse_messages(body)
        tools = parse_tools(body)
        prompt, parent, history = self.prompts.chat_prompt(episode, messages, tools)
        call = RecordedCall(len(episode.calls), "chat", prompt, parent=parent, history=history,
                            messages=tuple(messages), tools_key=json.dumps(tools, sort_keys=True) if tools else "")
        params = replace(params, max_new_tokens=self._budget(episode, params, prompt, parent))
        own.stop()
        await self._generate(episode, call, params)
        own.start()
        text = self._text(call, params.stop[len(episode.params.stop):])
        content, calls = split_tool_calls(text, self.settings.tool_parser) if tools else (text, [])
        readable = [c for c in calls if c.error is None]
        if len(readable) < len(calls):  # a call the model wrote but not in the format: the agent sees the text
            content, readable = text, []
        call.reply = reply_message(content, [(c.name, c.arguments) for c in readable])
        tool_calls = []
        for c in readable:
            call_id = f"call_{secrets.token_hex(6)}"
            episode.call_names[call_id] = c.name
            tool_calls.append({"id": call_id, "type": "function",
                               "function": {"name": c.name, "arguments": json.dumps(c.arguments)}})
        message: dict[str, Any] = {"role": "assistant", "content": content if content or not tool_calls else None}
        if tool_calls:
            message["tool_calls"] = tool_calls
        finish = "tool_calls" if tool_calls else _FINISH[call.finish_reason]
        call.own_s, call.own_cpu_s, call.own_gc_s = own.stop().totals()
        return call, {"id": f"chatcmpl-{episode.id}-{call.index}", "object": "chat.completion", "created": int(time.time()),
                "model": self.settings.model, "choices": [{"index": 0, "message": message, "finish_reason": finish,
                                                           "logprobs": None}],
                "usage": _usage(call)}

    async def _completion_call(self, episode: Episode, body: dict[str, Any]) -> tuple[RecordedCall, dict[str, Any]]:
        own = OwnTime()
        params = self._check_common(episode, body)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if not (isinstance(prompt, str) and prompt) and not (
                isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
            raise GatewayError("prompt: one non-empty string, or one list of token ids", param="prompt")
        ids, parent, history = self.prompts.completion_prompt(episode, prompt)
        call = RecordedCall(len(episode.calls), "completion", ids, parent=parent, history=history,
                            prompt_text=prompt if isinstance(prompt, str) else "")
        params = replace(params, max_new_tokens=self._budget(episode, params, ids, parent))
        own.stop()
        await self._generate(episode, call, params)
        own.start()
        call.reply_text = self._text(call, params.stop[len(episode.params.stop):]) if call.token_ids else ""
        call.own_s, call.own_cpu_s, call.own_gc_s = own.stop().totals()
        return call, {"id": f"cmpl-{episode.id}-{call.index}", "object": "text_completion", "created": int(time.time()),
                "model": self.settings.model, "choices": [{"index": 0, "text": call.reply_text, "logprobs": None,
                                                           "finish_reason": _FINISH[call.finish_reason]}],
                "usage": _usage(call)}


def _usage(call: RecordedCall) -> dict[str, int]:
    return {"prompt_tokens": len(call.prompt_ids), "completion_tokens": len(call.token_ids),
            "total_tokens": len(call.prompt_ids) + len(call.token_ids)}


async def _json_body(request: Any) -> dict[str, Any]:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError):
        raise GatewayError("the request body is not valid JSON; send an OpenAI request object") from None
    if not isinstance(body, dict):
        raise GatewayError(f"the request body is a JSON {type(body).__name__}; send an object")
    return body


async def _stream(request: Any, payload: dict[str, Any], kind: str, include_usage: bool) -> Any:
    """The finished response as OpenAI's server-sent events: chunks, then ``data: [DONE]``."""
    from aiohttp import web

    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    choice = payload["choices"][0]
    head = {k: payload[k] for k in ("id", "created", "model")}
    if kind == "chat":
        head["object"] = "chat.completion.chunk"
        message = choice["message"]
        deltas = [{"role": "assistant", "content": message["content"] or ""}]
        if message.get("tool_calls"):
            deltas.append({"tool_calls": [{"index": k, **c} for k, c in enumerate(message["tool_calls"])]})
        chunks = [{"index": 0, "delta": d, "finish_reason": None, "logprobs": None} for d in deltas]
        chunks.append({"index": 0, "delta": {}, "finish_reason": choice["finish_reason"], "logprobs": None})
    else:
        chunks = [{**choice, "finish_reason": None}, {**choice, "text": "", "finish_reason": choice["finish_reason"]}]
    for chunk in chunks:
        await response.write(f"data: {json.dumps({**head, 'choices': [chunk]})}\n\n".encode())
    if include_usage:
        await response.write(f"data: {json.dumps({**head, 'choices': [], 'usage': payload['usage']})}\n\n".encode())
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response
