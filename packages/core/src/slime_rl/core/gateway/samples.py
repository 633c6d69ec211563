"""An episode's recorded calls as training samples.

``per_call``: one sample per call, its prompt ids as the engine got them and its sampled ids (loss mask 1).
``trajectory``: one sample per chain of calls (each call's prompt extends the one before it: recording.py),
the first call's prompt as the prompt; each call's sampled ids with loss mask 1 and the engine's log-probs,
the ids between them (tool results, the template's turn markers, new user text) with loss mask 0. An
episode whose history branched or was not matched has several chains: the chain through the last call
comes first, and a call another sample already trains on is context (mask 0) in the next, so no sampled
token is trained twice. Every trained id is an id the engine sampled, with the log-prob it reported.
"""

from __future__ import annotations

import copy
from typing import Any

from slime_rl.core.gateway.recording import Episode, RecordedCall
from slime_rl.core.sample import Sample, SampleStatus

SAMPLE_MODES = ("trajectory", "per_call")
_STATUS = {"stop": SampleStatus.COMPLETED, "length": SampleStatus.TRUNCATED, "abort": SampleStatus.ABORTED}


def episode_metadata(episode: Episode) -> dict[str, Any]:
    """What the rollout metrics read (turns, tool calls) and the gateway's history accounting."""
    counts = episode.counts()
    return {"turns": len(episode.calls), "tool_calls": sum(len(c.reply.tool_calls) for c in episode.calls
                                                           if c.reply is not None),
            "tool_errors": 0, "gateway_calls": len(episode.calls),
            **{f"gateway_history_{kind}": n for kind, n in counts.items()},
            "gateway_sampling_overridden": episode.sampling_overridden,
            # the gateway's own work over the episode's calls (its event loop's time, engine and waits left out),
            # its CPU time, and the collector's pauses inside it (own_time.py)
            "gateway_overhead_s": sum(c.own_s for c in episode.calls),
            "gateway_overhead_cpu_s": sum(c.own_cpu_s for c in episode.calls),
            "gateway_overhead_gc_s": sum(c.own_gc_s for c in episode.calls)}


def sampled_calls(episode: Episode) -> list[RecordedCall]:
    """The calls the engine answered (not those it refused: a prompt too long for the model)."""
    return [c for c in episode.calls if c.finish_reason != "refused"]


def _base(sample: Sample, prompt_ids: list[int]) -> Sample:
    out = copy.deepcopy(sample).reset_to_prompt()
    out.tokens = list(prompt_ids)
    return out


def per_call_samples(sample: Sample, episode: Episode) -> list[Sample]:
    out = []
    for call in sampled_calls(episode):
        s = _base(sample, call.prompt_ids)
        s.weight_version = min(call.token_versions, default=call.weight_version)
        s.append_response(call.token_ids, call.log_probs, trained=True, versions=call.token_versions)
        s.status = _STATUS.get(call.finish_reason, SampleStatus.TRUNCATED)
        s.metadata["gateway_call"] = call.index
        _count_cache(s, [call])
        out.append(s)
    return out


def chains(episode: Episode) -> list[list[RecordedCall]]:
    """Root-to-leaf chains of calls, the one through the last call first, then by their last call, newest first."""
    has_child = {c.parent for c in episode.calls}
    leaves = [c for c in reversed(sampled_calls(episode)) if c.index not in has_child]
    out = []
    for leaf in leaves:
        chain, call = [], leaf
        while call is not None:
            chain.append(call)
            call = episode.calls[call.parent] if call.parent is not None else None
        out.append(chain[::-1])
    return out


def trajectory_samples(sample: Sample, episode: Episode) -> list[Sample]:
    out, trained = [], set()
    for chain in chains(episode):
        while chain and not chain[-1].token_ids:  # a last call that sampled nothing (its budget was spent) adds
            chain = chain[:-1]  # only context after the model's last token: the trajectory ends before it
        if not chain or all(c.index in trained or not c.token_ids for c in chain):
            continue  # nothing of it left to train on that another sample does not hold
        s = _base(sample, chain[0].prompt_ids)
        s.weight_version = min(chain[0].token_versions, default=chain[0].weight_version)
        for k, call in enumerate(chain):
            if k:
                context = call.prompt_ids[len(chain[k - 1].end_ids):]
                if call.prompt_ids[:len(chain[k - 1].end_ids)] != chain[k - 1].end_ids:
                    raise AssertionError(f"call {call.index} does not extend call {chain[k - 1].index}")
                s.append_response(context, None, trained=False)
            fresh = call.index not in trained
            s.append_response(call.token_ids, call.log_probs if fresh else None, trained=fresh,
                              versions=call.token_versions)
            trained.add(call.index)
        s.status = _STATUS.get(chain[-1].finish_reason, SampleStatus.TRUNCATED)
        s.metadata["gateway_calls_in_trajectory"] = [c.index for c in chain]
        _count_cache(s, chain)
        out.append(s)
    return out


def _count_cache(sample: Sample, calls: list[RecordedCall]) -> None:
    reported = [c for c in calls if c.cached_tokens is not None]
    if reported:
        sample.metadata["prompt_tokens"] = sum(len(c.prompt_ids) for c in reported)
        sample.metadata["cached_tokens"] = sum(c.cached_tokens for c in reported)


def episode_samples(sample: Sample, episode: Episode, mode: str) -> list[Sample]:
    if mode not in SAMPLE_MODES:
        raise ValueError(f"rollout.gateway.samples: {mode!r}; use one of {', '.join(SAMPLE_MODES)}")
    samples = trajectory_samples(sample, episode) if mode == "trajectory" else per_call_samples(sample, episode)
    meta = episode_metadata(episode)
    for s in samples:
        s.metadata.update(meta)
    return samples
