"""The `RolloutEngine` conformance suite: whether an engine keeps the contract the training loop relies on.

A backend's own test calls `check_conformance` with a `Backend`: a factory for a fresh engine, a few
prompts, two sets of HF-named weights and (to check log-probs) a reference forward pass::

    from slime_rl.core.testing.conformance import Backend, check_conformance, transformers_reference

    def test_my_engine_keeps_the_contract(tmp_path):
        model = ...                                    # the weights the engine starts from
        check_conformance(Backend(
            make_engine=lambda: MyEngine(...),         # a fresh engine on ``initial_weights``
            prompts=[[1, 5, 9], [2, 7, 7, 3]],
            initial_weights=list(model.state_dict().items()),
            new_weights=list(other_model.state_dict().items()),  # must change the greedy responses
            decode=tokenizer.decode,
            reference=transformers_reference(copy_of_model),
        ))

It raises `ConformanceError` (an AssertionError) naming every guarantee that failed, and returns a
`ConformanceReport` (passed, failed, not checked and why) otherwise. One engine serves every check, in
order; the engine's claimed `RolloutEngine.capabilities` say which optional guarantees are checked
(``Backend.capabilities`` narrows or widens that). docs/backends.md describes each guarantee.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from slime_rl.core.contracts import GenerateOutput, NamedTensors, RolloutEngine, SamplingParams
from slime_rl.core.testing.reference import Reference, transformers_reference

__all__ = ["Backend", "ConformanceError", "ConformanceReport", "Reference", "check_conformance", "run_conformance",
           "transformers_reference"]



ROUND_TRIP = "token-in/token-out round trip"
LOG_PROBS = "log-probs under the requested temperature"
STOP_TOKENS = "stop token ids end the response"
STOP_STRINGS = "stop strings end the response"
LENGTH = "max_new_tokens and truncation status"
RESUME = "a partial response resumes where it stopped"
N_SAMPLES = "n samples per prompt are independent draws"
CONCURRENCY = "concurrent requests: none lost, duplicated or mixed up"
ABORT = "abort keeps the partial response"
WEIGHTS = "a weight update applies, with its version"
MID_REQUEST = "a weight update mid-request loses nothing"
PAUSE = "pause and continue hold requests in place"
MEMORY = "release and resume memory keep the engine correct"
ROUTED = "routed experts of every token fed"
ADAPTERS = "adapter-only syncs serve base + LoRA, each replacing the last"
SHUTDOWN = "shutdown is safe twice"

#: Optional capability (`RolloutEngine.capabilities`) -> the guarantee the suite checks for it.
CAPABILITIES = {"pause": PAUSE, "release_memory": MEMORY, "routed_experts": ROUTED, "adapters": ADAPTERS}


class ConformanceError(AssertionError):
    """One or more guarantees failed; the message names each and says what was seen."""


@dataclass
class Backend:
    """What the suite needs to know about an engine under test."""

    make_engine: Callable[[], RolloutEngine | Awaitable[RolloutEngine]]  # fresh, on initial_weights, version 0
    prompts: list[list[int]]  # at least two prompts of valid token ids, a few tokens each
    initial_weights: NamedTensors  # HF names, full tensors: what the engine starts with
    new_weights: NamedTensors  # the same names; must change the greedy response of prompts[0]
    decode: Callable[[list[int]], str]  # the model's tokenizer's decode (for stop strings)
    reference: Reference | None = None  # None: log-prob agreement is not checked
    capabilities: frozenset[str] | None = None  # None: what the engine's class claims
    logprob_tolerance: float = 1e-4  # max |engine - reference| per token
    # with "adapters": LoRA pairs under PEFT names (core/lora.py) that change prompts[0]'s greedy response, and the
    # engine's scaling (alpha / rank): what an adapter-only sync (rollout.lora_sync: adapter) sends
    adapters: NamedTensors | None = None
    adapter_scaling: float | None = None
    long_new_tokens: int = 1000  # a response that takes a while: aborted, paused, updated mid-way
    timeout_s: float = 300.0  # per check


@dataclass
class ConformanceReport:
    passed: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)  # guarantee -> what went wrong
    not_checked: dict[str, str] = field(default_factory=dict)  # guarantee -> why not
    figures: dict[str, float] = field(default_factory=dict)  # worst log-prob gap, tokens before an abort, ...

    def fail(self, guarantee: str, why: str) -> None:
        self.not_checked.pop(guarantee, None)
        self.failed[guarantee] = why

    def describe(self) -> str:
        lines = [f"PASS  {g}" for g in self.passed] + [f"FAIL  {g}: {why}" for g, why in self.failed.items()]
        lines += [f"SKIP  {g}: {why}" for g, why in self.not_checked.items()]
        return "\n".join(lines)


class _Broken(Exception):
    """A check's own failure (its message says what was seen)."""


def _expect(ok: bool, message: str) -> None:
    if not ok:
        raise _Broken(message)


GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
ATTEMPTS = 4  # tries at catching a long request under way before the suite gives up on the timing


class _Suite:
    def __init__(self, backend: Backend, engine: RolloutEngine, capabilities: frozenset[str]):
        self.b = backend
        self.engine = engine
        self.capabilities = capabilities
        self.report = ConformanceReport()
        self.version = 0  # what the engine must report
        self.weights = _cloned(backend.initial_weights)  # what it must be serving
        self.initial = self.weights
        self.new = _cloned(backend.new_weights)
        self.greedy0: list[GenerateOutput] = []  # greedy responses to the prompts on the initial weights
        self.long_s = 0.0  # one greedy response of long_new_tokens, alone, timed
        self.wait_s = 0.0  # how long after its start a long request is well under way (learned as the checks go)

    # ------------------------------------------------------------------ helpers

    async def gen(self, input_ids: list[int], params: SamplingParams, request_id: str | None = None
                  ) -> GenerateOutput:
        out = await self.engine.generate(list(input_ids), params, request_id)
        _well_formed(out, params)
        return out

    def check_log_probs(self, input_ids: list[int], out: GenerateOutput, temperature: float, what: str) -> float:
        """The worst |engine - reference| over ``out``'s tokens; fails above the tolerance."""
        ref = list(self.b.reference(self.weights, list(input_ids), list(out.token_ids), temperature))
        _expect(len(ref) == len(out.token_ids), f"the reference gave {len(ref)} log-probs for "
                f"{len(out.token_ids)} tokens")
        gaps = [abs(a - b) for a, b in zip(out.log_probs, ref, strict=True)]
        worst = max(gaps, default=0.0)
        if worst > self.b.logprob_tolerance:
            i = gaps.index(worst)
            raise _Broken(f"{what}: token {i} log-prob {out.log_probs[i]:.5f}, the reference forward at "
                          f"temperature {temperature:g} gives {ref[i]:.5f} (|diff| {worst:.3g} > tolerance "
                          f"{self.b.logprob_tolerance:g})")
        return worst

    async def update(self, weights: NamedTensors, *, buckets: int = 2, serving: NamedTensors | None = None) -> None:
        """Send ``weights`` as the next version in ``buckets`` buckets; the reported version moves at the last.
        ``serving``: the full weights the engine serves after it (adapters: base + LoRA), else ``weights``."""
        version = self.version + 1
        size = max(1, math.ceil(len(weights) / buckets))
        parts = [weights[i:i + size] for i in range(0, len(weights), size)]
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            await self.engine.update_weights(part, version=version, last=last)
            if not last:
                _expect(self.engine.weight_version == self.version,
                        f"weight_version is {self.engine.weight_version} after a bucket with last=False; the "
                        f"version moves to {version} only with the last bucket")
        _expect(self.engine.weight_version == version,
                f"weight_version is {self.engine.weight_version} after the last bucket of version {version}")
        self.version, self.weights = version, serving or weights

    async def under_way(self, requests: dict[str, list[int]]) -> list[asyncio.Task]:
        """Start greedy requests (id -> prompt) of ``long_new_tokens`` together and return once they are well
        under way (``wait_s`` later). When one finishes first (the machine got faster), they are aborted and
        started again with a shorter wait: timing is the suite's problem, not the engine's."""
        params = SamplingParams(temperature=0.0, max_new_tokens=self.b.long_new_tokens, ignore_eos=True)
        for _ in range(ATTEMPTS):
            tasks = [asyncio.ensure_future(self.gen(prompt, params, rid)) for rid, prompt in requests.items()]
            await asyncio.sleep(self.wait_s)
            if not any(t.done() for t in tasks):
                return tasks
            await self.engine.abort()
            for t in await asyncio.gather(*tasks, return_exceptions=True):
                if isinstance(t, Exception):
                    raise t
            self.wait_s /= 4
        raise _Broken(f"requests of {self.b.long_new_tokens} tokens kept finishing within {4 * self.wait_s:.3f} s; "
                      "give Backend.long_new_tokens a larger value")

    def same_greedy(self, input_ids: list[int], got: list[int], expected: list[int], what: str) -> None:
        """Greedy tokens computed along another path (a prefill instead of decode steps) must be the same,
        except at a near-tie: where they first differ, the reference scores both tokens within the tolerance
        (bf16 kernels may break a tie either way); after it the contexts differ, so nothing more is compared."""
        if got == expected:
            return
        i = next((j for j, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b), min(len(got), len(expected)))
        if self.b.reference is not None and i < min(len(got), len(expected)):
            context = list(input_ids) + expected[:i]
            scores = [self.b.reference(self.weights, context, [token], 0.0)[0] for token in (got[i], expected[i])]
            if abs(scores[0] - scores[1]) <= self.b.logprob_tolerance:
                return
        raise _Broken(f"{what}: {got} where the uninterrupted greedy response goes on {expected}")

    # ------------------------------------------------------------------ the checks

    async def round_trip(self) -> None:
        _expect(self.engine.weight_version == 0, f"a fresh engine reports weight_version "
                f"{self.engine.weight_version}; it starts at 0")
        _expect(await self.engine.health() is True, "health() is not True on a fresh engine")
        self.greedy0 = [await self.gen(p, GREEDY) for p in self.b.prompts]
        for prompt, out in zip(self.b.prompts, self.greedy0, strict=True):
            _expect(out.finish_reason == "length" and len(out.token_ids) == GREEDY.max_new_tokens,
                    f"greedy, ignore_eos, max_new_tokens=12 gave {len(out.token_ids)} tokens and finish_reason "
                    f"{out.finish_reason!r}; expected 12 and 'length'")
            _expect(out.weight_version == 0, f"a response on the initial weights reports version {out.weight_version}")
            again = await self.gen(prompt, GREEDY)
            _expect(again.token_ids == out.token_ids, f"greedy is not deterministic: {out.token_ids} then "
                    f"{again.token_ids}")
        start = time.perf_counter()
        await self.gen(self.b.prompts[0], replace(GREEDY, max_new_tokens=self.b.long_new_tokens))
        self.long_s = time.perf_counter() - start
        self.wait_s = 0.3 * self.long_s
        self.report.figures["seconds_per_long_response"] = self.long_s

    async def log_probs(self) -> None:
        worst = 0.0
        for temperature in (0.7, 1.0, 1.3, 0.0):
            params = SamplingParams(temperature=temperature, max_new_tokens=12, ignore_eos=True)
            outs = await asyncio.gather(*(self.gen(p, params) for p in self.b.prompts))
            for prompt, out in zip(self.b.prompts, outs, strict=True):
                worst = max(worst, self.check_log_probs(prompt, out, temperature, f"temperature {temperature:g}"))
        self.report.figures["max_logprob_diff"] = worst

    async def stop_tokens(self) -> None:
        for prompt in self.b.prompts:  # without ignore_eos: SGLang's ignore_eos turns stop_token_ids off too
            free = await self.gen(prompt, SamplingParams(temperature=0.0, max_new_tokens=12))
            picks = [k for k, t in enumerate(free.token_ids) if k >= 2 and t not in free.token_ids[:k]]
            if free.finish_reason == "stop":  # the model's eos ended it: keep that token out of the picks
                picks = [k for k in picks if k < len(free.token_ids) - 1]
            if picks:
                k = picks[0]
                stop = free.token_ids[k]
                out = await self.gen(prompt, SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=[stop]))
                _expect(out.finish_reason == "stop" and out.token_ids == free.token_ids[:k + 1],
                        f"stop_token_ids=[{stop}] (first sampled at position {k} of {free.token_ids}) gave "
                        f"{out.token_ids} with finish_reason {out.finish_reason!r}; expected the response up to "
                        f"and including that token, and 'stop'")
                return
        raise _Broken("no prompt's greedy response had a token to stop on; give longer or more prompts")

    async def stop_strings(self) -> None:
        for prompt, ref in zip(self.b.prompts, self.greedy0, strict=True):
            text = self.b.decode(ref.token_ids)
            for k in range(3, len(ref.token_ids)):
                piece = self.b.decode(ref.token_ids[k:k + 1]).strip()
                if piece and "\ufffd" not in piece and piece not in self.b.decode(ref.token_ids[:k]) and piece in text:
                    out = await self.gen(prompt, replace(GREEDY, stop=[piece]))
                    got = self.b.decode(out.token_ids)
                    _expect(out.finish_reason == "stop", f"stop=[{piece!r}] gave finish_reason "
                            f"{out.finish_reason!r} on {text!r}")
                    _expect(out.token_ids == ref.token_ids[:len(out.token_ids)],
                            f"stop=[{piece!r}] changed the tokens: {out.token_ids} vs {ref.token_ids}")
                    _expect(piece in got and piece not in self.b.decode(out.token_ids[:-1]),
                            f"stop=[{piece!r}]: the response {got!r} must end with the token that completes the "
                            f"stop string (kept in the response, token-in/token-out)")
                    return
        raise _Broken("no greedy response held a token whose text could serve as a stop string; give other prompts")

    async def length(self) -> None:
        out = await self.gen(self.b.prompts[1], SamplingParams(temperature=1.0, max_new_tokens=5, ignore_eos=True))
        _expect(len(out.token_ids) == 5 and out.finish_reason == "length",
                f"max_new_tokens=5 with ignore_eos gave {len(out.token_ids)} tokens, finish_reason "
                f"{out.finish_reason!r}; expected 5 and 'length'")
        out = await self.gen(self.b.prompts[1], SamplingParams(temperature=1.0, max_new_tokens=3))
        _expect(out.finish_reason == "stop" if len(out.token_ids) < 3 else out.finish_reason in ("length", "stop"),
                f"{len(out.token_ids)} of max_new_tokens=3 tokens with finish_reason {out.finish_reason!r}: a "
                f"response cut by the limit says 'length', one ended early by eos says 'stop'")

    async def resume(self) -> None:
        for prompt, ref in zip(self.b.prompts, self.greedy0, strict=True):
            for k in (1, 5, 11):
                partial = prompt + ref.token_ids[:k]
                out = await self.gen(partial, replace(GREEDY, max_new_tokens=12 - k))
                self.same_greedy(partial, out.token_ids, ref.token_ids[k:],
                                 f"prompt + the first {k} response tokens continued as")
        if self.b.reference is not None:  # a sampled continuation is scored over prompt + partial response
            params = SamplingParams(temperature=0.7, max_new_tokens=8, ignore_eos=True)
            partial = self.b.prompts[0] + self.greedy0[0].token_ids[:4]
            self.check_log_probs(partial, await self.gen(partial, params), 0.7, "a resumed response")

    async def n_samples(self) -> None:
        n, params = 8, SamplingParams(temperature=1.0, max_new_tokens=12, ignore_eos=True)
        prompt = self.b.prompts[0]
        outs = await asyncio.gather(*(self.gen(prompt, params) for _ in range(n)))
        distinct = {tuple(o.token_ids) for o in outs}
        _expect(len(distinct) > 1, f"{n} samples of one prompt at temperature 1 (no seed) are all "
                f"{outs[0].token_ids}: each request must draw its own sample")
        if self.b.reference is not None:
            for out in outs:
                self.check_log_probs(prompt, out, 1.0, "one of n samples")
        self.report.figures["distinct_of_8_samples"] = len(distinct)

    async def concurrency(self) -> None:
        requests = [(self.b.prompts[i % len(self.b.prompts)] + [t for t in self.b.prompts[(i + 1) % 2][:1 + i % 3]],
                     4 + i % 9) for i in range(32)]
        params = [replace(GREEDY, max_new_tokens=m) for _, m in requests]
        outs = await asyncio.gather(*(self.gen(p, sp, f"conformance-c{i}")
                                      for i, ((p, _), sp) in enumerate(zip(requests, params, strict=True))))
        for i, ((prompt, m), out) in enumerate(zip(requests, outs, strict=True)):
            _expect(len(out.token_ids) == m, f"request {i} asked {m} tokens and got {len(out.token_ids)}")
            if self.b.reference is not None:  # batch-variant engines (bf16 GPUs) may pick another near-tie
                self.check_log_probs(prompt, out, 0.0, f"concurrent request {i}")
            else:
                alone = await self.gen(prompt, params[i])
                _expect(out.token_ids == alone.token_ids, f"request {i} got {out.token_ids} among 32 concurrent "
                        f"ones and {alone.token_ids} alone")
        first = asyncio.ensure_future(self.gen(self.b.prompts[0], replace(
            GREEDY, max_new_tokens=self.b.long_new_tokens), "conformance-dup"))
        await asyncio.sleep(0.05)
        try:
            await self.engine.generate(self.b.prompts[1], GREEDY, "conformance-dup")
            raise _Broken("a second request with the id of one in flight was accepted; refuse it (ValueError)")
        except ValueError:
            pass
        finally:
            await self.engine.abort("conformance-dup")
            await first

    async def abort(self) -> None:
        prompt = self.b.prompts[0]
        for attempt in range(ATTEMPTS):
            (task,) = await self.under_way({"conformance-abort": prompt})
            waited = self.wait_s
            await self.engine.abort("conformance-abort")
            out = await asyncio.wait_for(task, 60)
            if out.token_ids or attempt == ATTEMPTS - 1:
                break
            self.wait_s = min(2 * self.wait_s, 0.5 * self.long_s)  # no token yet: a slow start, or a lost response
        _expect(out.finish_reason == "abort", f"an aborted request returned finish_reason {out.finish_reason!r}")
        _expect(len(out.token_ids) > 0, f"an aborted request that had been generating for {waited:.2f} s (a "
                f"response of {self.b.long_new_tokens} takes {self.long_s:.2f} s) returned no tokens, "
                f"{ATTEMPTS} times: the partial response must come back")
        self.report.figures["tokens_before_abort"] = len(out.token_ids)
        ref = await self.gen(prompt, replace(GREEDY, max_new_tokens=len(out.token_ids)))
        _expect(out.token_ids == ref.token_ids, "the aborted request's tokens are not the start of its "
                f"greedy response: {out.token_ids[:8]}... vs {ref.token_ids[:8]}...")
        if self.b.reference is not None:
            self.check_log_probs(prompt, out, 0.0, "an aborted response")
        # abort(None) stops every request; aborting an unknown id is a no-op; the engine serves on
        tasks = await self.under_way({f"conformance-abort-all-{i}": p for i, p in enumerate(self.b.prompts[:2])})
        await self.engine.abort()
        outs = await asyncio.wait_for(asyncio.gather(*tasks), 60)
        _expect(all(o.finish_reason == "abort" and o.token_ids for o in outs),
                f"abort() returned {[(o.finish_reason, len(o.token_ids)) for o in outs]}; expected every running "
                f"request back as 'abort' with its tokens")
        await self.engine.abort("conformance-no-such-request")
        after = await self.gen(prompt, GREEDY)
        _expect(after.token_ids == self.greedy0[0].token_ids, "after aborts, greedy generation changed")

    async def weights(self) -> None:
        prompt = self.b.prompts[0]
        await self.update(self.new)
        out = await self.gen(prompt, GREEDY)
        _expect(out.weight_version == self.version, f"a response after the update to version {self.version} "
                f"reports version {out.weight_version}")
        _expect(out.token_ids != self.greedy0[0].token_ids, f"after update_weights (version {self.version}) the "
                "greedy response is unchanged: the new weights were not applied (or Backend.new_weights does not "
                "change prompts[0]'s greedy response)")
        if self.b.reference is not None:
            self.check_log_probs(prompt, out, 0.0, f"after the update to version {self.version}")
        await self.update(self.initial, buckets=3)
        back = await self.gen(prompt, GREEDY)
        _expect(back.token_ids == self.greedy0[0].token_ids and back.weight_version == self.version,
                f"after updating back to the initial weights (version {self.version}) the greedy response is "
                f"{back.token_ids} (version {back.weight_version}), not {self.greedy0[0].token_ids}: not every "
                "bucket applied")

    async def mid_request(self) -> None:
        (task,) = await self.under_way({"conformance-mid": self.b.prompts[0]})
        old = self.version
        await self.update(self.new, buckets=1)
        out = await asyncio.wait_for(task, self.b.timeout_s)
        _expect(out.finish_reason == "length" and len(out.token_ids) == self.b.long_new_tokens,
                f"a request running through a weight update returned {len(out.token_ids)} of "
                f"{self.b.long_new_tokens} tokens with finish_reason {out.finish_reason!r}; it must finish whole")
        _expect(out.weight_version == self.version, f"it finished after the update but reports version "
                f"{out.weight_version}, not {self.version}")
        if out.token_versions is not None:
            v = out.token_versions
            _expect(len(v) == len(out.token_ids) and v == sorted(v) and v[0] >= old and v[-1] == self.version,
                    f"token_versions must give each token's version, non-decreasing from {old} to {self.version}; "
                    f"got {sorted(set(v))} over {len(v)} entries")
        await self.update(self.initial, buckets=1)

    async def pause_refused(self) -> None:
        """An engine that does not claim 'pause' must say so: the loop then aborts and resumes instead."""
        _expect(await self.engine.pause_generation() is False,
                "pause_generation() returned True but the engine does not claim 'pause'")

    async def pause(self) -> None:
        n = self.b.long_new_tokens
        (held,) = await self.under_way({"conformance-held": self.b.prompts[0]})
        _expect(await self.engine.pause_generation() is True, "pause_generation() did not return True")
        queued = asyncio.ensure_future(self.gen(self.b.prompts[1], GREEDY, "conformance-queued"))
        await asyncio.sleep(self.wait_s)
        _expect(not held.done() and not queued.done(), "requests finished while generation was paused")
        await self.update(self.new, buckets=1)
        await self.engine.continue_generation()
        out, new = await asyncio.wait_for(asyncio.gather(held, queued), self.b.timeout_s)
        _expect(out.finish_reason == "length" and len(out.token_ids) == n,
                f"a held request came back with {len(out.token_ids)} of {n} tokens, finish_reason "
                f"{out.finish_reason!r}: a pause holds requests, it does not abort them")
        _expect(out.weight_version == new.weight_version == self.version,
                f"requests finished after the update report versions {out.weight_version}, {new.weight_version}")
        if out.token_versions is not None:
            _expect(out.token_versions[-1] == self.version, "the held request's last tokens do not carry the new "
                    "version in token_versions")
        await self.update(self.initial, buckets=1)

    async def memory(self) -> None:
        await self.update(self.new)
        before = await self.gen(self.b.prompts[0], GREEDY)
        await self.engine.release_memory()
        await self.engine.resume_memory()
        after = await self.gen(self.b.prompts[0], GREEDY)
        _expect(after.token_ids == before.token_ids and after.weight_version == self.version,
                f"after release_memory and resume_memory the greedy response is {after.token_ids} (version "
                f"{after.weight_version}), before it was {before.token_ids} (version {self.version})")
        # the colocated loop's order: the weights back, a sync into them, then the rest (KV cache, graphs)
        await self.engine.release_memory()
        await self.engine.resume_memory(["weights"])
        await self.update(self.initial)
        await self.engine.resume_memory()
        synced = await self.gen(self.b.prompts[0], GREEDY)
        _expect(synced.token_ids == self.greedy0[0].token_ids and synced.weight_version == self.version,
                f"release, resume_memory(['weights']), a sync of version {self.version}, resume_memory(): the "
                f"greedy response is {synced.token_ids} (version {synced.weight_version}), not the synced "
                f"weights' {self.greedy0[0].token_ids}")

    async def routed(self) -> None:
        prompt = self.b.prompts[0]
        out = await self.gen(prompt, replace(GREEDY, return_routed_experts=True))
        experts = out.routed_experts
        fed = len(prompt) + len(out.token_ids) - 1
        _expect(experts is not None and len(experts) == fed,
                f"return_routed_experts gave {None if experts is None else len(experts)} entries; expected one per "
                f"token fed ({fed}: prompt + response - 1)")
        shapes = {(len(layers), *(len(k) for k in layers)) for layers in experts}
        _expect(len(shapes) == 1 and all(isinstance(e, int) and e >= 0 for t in experts for layer in t for e in layer),
                f"routed experts must be [tokens][layers][top-k] non-negative ints; saw shapes {sorted(shapes)[:3]}")
        plain = await self.gen(prompt, GREEDY)
        _expect(plain.routed_experts is None, "routed experts came back without return_routed_experts")

    async def adapters(self) -> None:
        """Adapter sets one, two (B negated), one again, each in three buckets (a pair may straddle two): each
        changes the greedy response, matches the reference over base + scaling * B A, and one again gives
        exactly its first response (the adapters replace each other, never add up)."""
        from slime_rl.core.algorithms.lora import hf_name, merged

        base, scaling = self.weights, float(self.b.adapter_scaling)

        def served(adapters: NamedTensors) -> NamedTensors:
            pairs: dict[str, dict[str, Any]] = {}
            for name, tensor in adapters:
                weight_name, which = hf_name(name)
                pairs.setdefault(weight_name, {})[which] = tensor
            return [(n, merged(w, pairs[n]["A"], pairs[n]["B"], scaling) if n in pairs else w) for n, w in base]

        one = _cloned(self.b.adapters)
        two = [(n, -t if ".lora_B." in n else t) for n, t in one]
        responses = []
        for label, adapters in (("one", one), ("two", two), ("one again", one)):
            await self.update(adapters, buckets=3, serving=served(adapters))
            out = await self.gen(self.b.prompts[0], GREEDY)
            _expect(out.weight_version == self.version, f"after adapter set {label} (version {self.version}) a "
                    f"response reports version {out.weight_version}")
            if self.b.reference is not None:
                self.check_log_probs(self.b.prompts[0], out, 0.0, f"adapter set {label}")
            responses.append(out.token_ids)
        _expect(responses[0] != self.greedy0[0].token_ids, "adapter set one left the greedy response unchanged: "
                "the adapters were not applied (or Backend.adapters are too small to change prompts[0]'s)")
        _expect(responses[1] != responses[0], "adapter set two (set one with B negated) gave set one's response: "
                "it did not replace set one")
        _expect(responses[2] == responses[0], f"adapter set one again gave {responses[2]}, not {responses[0]}: "
                "adapters must replace the ones served, not add to them")

    async def shutdown(self) -> None:
        await self.engine.shutdown()
        await self.engine.shutdown()


_CHECKS: list[tuple[str, Callable[[_Suite], Awaitable[None]]]] = [
    (ROUND_TRIP, _Suite.round_trip), (LOG_PROBS, _Suite.log_probs), (STOP_TOKENS, _Suite.stop_tokens),
    (STOP_STRINGS, _Suite.stop_strings), (LENGTH, _Suite.length), (RESUME, _Suite.resume),
    (N_SAMPLES, _Suite.n_samples), (CONCURRENCY, _Suite.concurrency), (ABORT, _Suite.abort),
    (WEIGHTS, _Suite.weights), (MID_REQUEST, _Suite.mid_request), (PAUSE, _Suite.pause),
    (MEMORY, _Suite.memory), (ROUTED, _Suite.routed), (ADAPTERS, _Suite.adapters), (SHUTDOWN, _Suite.shutdown),
]


def _cloned(weights: NamedTensors) -> NamedTensors:
    # An engine may load into tensors that share storage with what it was given: keep the suite's own copies.
    return [(name, tensor.detach().clone()) for name, tensor in weights]


def _well_formed(out: GenerateOutput, params: SamplingParams) -> None:
    _expect(isinstance(out, GenerateOutput), f"generate returned {type(out).__name__}, not GenerateOutput")
    _expect(all(isinstance(t, int) and t >= 0 for t in out.token_ids), f"token_ids must be ints: {out.token_ids[:8]}")
    _expect(len(out.log_probs) == len(out.token_ids), f"{len(out.log_probs)} log-probs for {len(out.token_ids)} tokens")
    _expect(all(isinstance(lp, float) and math.isfinite(lp) and lp <= 1e-4 for lp in out.log_probs),
            f"log-probs must be finite floats <= 0: {out.log_probs[:8]}")
    _expect(out.finish_reason in ("stop", "length", "abort"), f"finish_reason {out.finish_reason!r}")
    _expect(len(out.token_ids) <= params.max_new_tokens, f"{len(out.token_ids)} tokens > max_new_tokens "
            f"{params.max_new_tokens}")
    _expect(isinstance(out.weight_version, int), f"weight_version {out.weight_version!r} is not an int")


def _claims(backend: Backend, engine: RolloutEngine) -> frozenset[str]:
    claimed = frozenset(engine.capabilities if backend.capabilities is None else backend.capabilities)
    unknown = sorted(claimed - set(CAPABILITIES))
    if unknown:
        raise ValueError(f"capabilities: {unknown[0]!r} is not one the suite knows ({', '.join(CAPABILITIES)})")
    if "adapters" in claimed and (not backend.adapters or backend.adapter_scaling is None):
        raise ValueError("capabilities: 'adapters' is claimed; give Backend.adapters (PEFT-named LoRA pairs) and "
                         "Backend.adapter_scaling, or leave the capability out")
    return claimed


async def run_conformance(backend: Backend) -> ConformanceReport:
    """Every guarantee against one fresh engine, in order; a failure is recorded and the next check runs."""
    _expect_prompts(backend)
    made = backend.make_engine()
    engine = await made if inspect.isawaitable(made) else made
    capabilities = _claims(backend, engine)
    suite = _Suite(backend, engine, capabilities)
    report = suite.report
    optional = {guarantee: cap for cap, guarantee in CAPABILITIES.items()}
    try:
        for guarantee, check in _CHECKS:
            if guarantee in optional and optional[guarantee] not in capabilities:
                report.not_checked[guarantee] = f"capability {optional[guarantee]!r} not claimed"
                if guarantee != PAUSE:
                    continue
                check = _Suite.pause_refused  # still checked: pause_generation must return False
            if backend.reference is None and guarantee == LOG_PROBS:
                report.not_checked[guarantee] = "no reference forward given (Backend.reference)"
                continue
            if not suite.greedy0 and guarantee != ROUND_TRIP and guarantee != SHUTDOWN:
                report.fail(guarantee, f"not run: {ROUND_TRIP} failed")
                continue
            try:
                await asyncio.wait_for(check(suite), backend.timeout_s)
                if guarantee not in report.not_checked:
                    report.passed.append(guarantee)
            except _Broken as err:
                report.fail(guarantee, str(err))
            except TimeoutError:
                report.fail(guarantee, f"did not finish in {backend.timeout_s:g} s (Backend.timeout_s)")
            except Exception as err:  # an engine that raises breaks the guarantee being checked
                report.fail(guarantee, f"raised {type(err).__name__}: {err}")
    finally:
        if SHUTDOWN not in report.passed:
            await _quiet_shutdown(engine)
    return report


async def _quiet_shutdown(engine: RolloutEngine) -> None:
    try:
        await engine.shutdown()
    except Exception:  # already reported, or the engine is broken: the report says so
        pass


def _expect_prompts(backend: Backend) -> None:
    if len(backend.prompts) < 2 or any(len(p) < 1 for p in backend.prompts):
        raise ValueError("Backend.prompts: give at least two non-empty prompts of token ids")


def check_conformance(backend: Backend) -> ConformanceReport:
    """`run_conformance` in a fresh event loop; raises `ConformanceError` naming every failed guarantee."""
    report = asyncio.run(run_conformance(backend))
    if report.failed:
        raise ConformanceError("the engine breaks the RolloutEngine contract:\n" + "\n".join(
            f"- {guarantee}: {why}" for guarantee, why in report.failed.items()) + "\n\nfull report:\n"
            + report.describe())
    return report
