"""What the gateway records per episode, and how a request's history becomes token ids.

Every call is recorded with the exact ids the engine was given and the ids it sampled (with their
log-probs and policy versions). When an agent sends earlier turns back, the request's history is matched
against the record: if its messages up to an assistant turn are a recorded call's request followed by
the very message the gateway returned for that call, the prompt is that call's prompt ids followed by
its SAMPLED ids (never the text re-tokenised), and only the messages after it are new text, rendered
by the chat template and tokenised with their contents as plain text (special-token strings in them stay
characters). The new call then extends the earlier one (``parent``): a chain of calls is one trajectory.

A history the record cannot resolve (the agent rewrote an assistant message, or dropped the turns that
led to it) is never guessed: the whole conversation is tokenised afresh, the call starts a new chain,
and the episode counts a ``mismatch``. A history that extends a call another call already extended (the
agent dropped or rewrote what came after that point) is ``branched``: resolved, and counted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from slime_rl.core.agent.template import (
    ShapeCache,
    TurnTemplate,
    encode_plain,
    plain_content_ids,
    render,
)
from slime_rl.core.gateway.messages import GatewayError, Message, same_turn

HISTORY_KINDS = ("first", "matched", "branched", "mismatch")


@dataclass
class RecordedCall:
    """One model call of an episode, as the engine saw and answered it."""

    index: int
    kind: str  # "chat" or "completion"
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)
    weight_version: int = 0
    finish_reason: str = ""
    parent: int | None = None  # the call this one's prompt extends (its prompt + sampled ids come first)
    history: str = "first"  # HISTORY_KINDS: how the request's history was resolved
    cached_tokens: int | None = None
    engine_s: float = 0.0  # seconds in engine.generate
    handler_s: float = 0.0  # seconds from the request's arrival to its response (engine and loop waits in it)
    own_s: float = 0.0  # the gateway's own work on the call: checks, history match, tokenising, parsing, response
    # the same work's CPU time on the gateway's thread: own_s less the time the thread waited for a core or the
    # GIL (other processes and threads running; a loaded host stretches own_s, not this)
    own_cpu_s: float = 0.0
    own_gc_s: float = 0.0  # the collector's pauses that fell inside own_s (in this process, whatever triggered them)
    # what a later request is matched against
    messages: tuple[Message, ...] = ()
    tools_key: str = ""
    reply: Message | None = None
    prompt_text: str = ""  # completions: the prompt and the returned text
    reply_text: str = ""

    @property
    def end_ids(self) -> list[int]:
        """The trajectory through this call: its prompt and what it sampled."""
        return self.prompt_ids + self.token_ids


@dataclass
class Episode:
    """One agent run's calls; its id names its base URL, its key opens nothing else."""

    id: str
    key: str
    calls: list[RecordedCall] = field(default_factory=list)
    call_names: dict[str, str] = field(default_factory=dict)  # tool-call id -> function name, for tool messages
    closed: bool = False  # the episode is over (finished, or aborted): calls are refused
    aborted: bool = False
    sampling_overridden: int = 0  # calls whose temperature / top_p the run's settings replaced
    params: Any = None  # the SamplingParams every call samples with (the run's or the eval's)

    def counts(self) -> dict[str, int]:
        return {kind: sum(c.history == kind for c in self.calls) for kind in HISTORY_KINDS}

    def children(self, index: int) -> int:
        return sum(c.parent == index for c in self.calls)


class ChatPrompts:
    """Token ids of chat requests, against an episode's record (one tokenizer and chat template)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.template = TurnTemplate.from_tokenizer(tokenizer)
        self.shapes = ShapeCache()  # first prompts' marked renderings, by shape and tools
        self._special_texts = [t for t in (tokenizer.convert_ids_to_tokens(sorted(self.template.specials)) or [])
                               if t]

    def check_plain(self, text: str, param: str) -> None:
        """Text the template puts in as its own (tool schemas, tool-call arguments) must hold no special token."""
        found = next((t for t in self._special_texts if t in text), None)
        if found is not None:
            raise GatewayError(f"{param}: holds the special token {found!r}, which the gateway never tokenises from"
                               " a request; remove it", param=param)

    def chat_prompt(self, episode: Episode, messages: list[Message],
                    tools: list[dict[str, Any]] | None) -> tuple[list[int], int | None, str]:
        """(prompt ids, parent call, history kind) for a chat request."""
        tools_key = json.dumps(tools, sort_keys=True) if tools else ""
        if tools:
            self.check_plain(tools_key, "tools")
        for k, m in enumerate(messages):
            for name, args in m.tool_calls:
                self.check_plain(name + args, f"messages[{k}].tool_calls")
        parent = self._matching_call(episode, messages, tools_key)
        if parent is not None:
            rest = messages[len(parent.messages) + 1:]
            ended = bool(parent.token_ids) and parent.token_ids[-1] in self.template.end_of_turn_ids
            new = self.template.observation_ids([m.for_template(episode.call_names) for m in rest],
                                                ended_on_end_of_turn=ended)
            kind = "branched" if episode.children(parent.index) else "matched"
            return parent.end_ids + new, parent.index, kind
        kind = "mismatch" if any(m.role == "assistant" for m in messages) else "first"
        as_template = [m.for_template(episode.call_names) for m in messages]
        ids = plain_content_ids(self.tokenizer, lambda ms: render(self.tokenizer, ms, add_generation_prompt=True,
                                                                  tools=tools), as_template,
                                shapes=self.shapes, shape_key=tools_key, specials=self.template.specials)
        return ids, None, kind

    @staticmethod
    def _matching_call(episode: Episode, messages: list[Message], tools_key: str) -> RecordedCall | None:
        """The recorded call whose request and reply begin ``messages`` (the longest such; the latest on a tie)."""
        # longest first, latest first on a tie: an agent extending its last call matches at the first comparison
        # (comparing against every call was quadratic in an episode's turns)
        candidates = [call for call in episode.calls if call.kind == "chat" and call.reply is not None
                      and call.tools_key == tools_key and len(messages) > len(call.messages)]
        for call in sorted(candidates, key=lambda c: (len(c.messages), c.index), reverse=True):
            n = len(call.messages)
            if tuple(messages[:n]) == call.messages and same_turn(messages[n], call.reply):
                return call
        return None

    def completion_prompt(self, episode: Episode, prompt: str | list[int]) -> tuple[list[int], int | None, str]:
        """(prompt ids, parent call, history kind) for a completions request: token ids as given, or text
        whose start is a recorded call's prompt and returned text (then its ids, and the rest as plain text)."""
        best = None
        for call in episode.calls:
            if call.kind != "completion":
                continue
            if isinstance(prompt, list):
                hit = len(prompt) >= len(call.end_ids) and prompt[:len(call.end_ids)] == call.end_ids
            else:
                hit = bool(call.prompt_text) and prompt.startswith(call.prompt_text + call.reply_text)
            if hit and (best is None or len(call.end_ids) >= len(best.end_ids)):
                best = call
        specials = self.template.specials
        if best is None:
            ids = list(prompt) if isinstance(prompt, list) else encode_plain(self.tokenizer, prompt, specials=specials)
            return ids, None, "first"
        if isinstance(prompt, list):
            rest = prompt[len(best.end_ids):]
        else:
            tail = prompt[len(best.prompt_text) + len(best.reply_text):]
            rest = encode_plain(self.tokenizer, tail, specials=specials) if tail else []
        kind = "branched" if episode.children(best.index) else "matched"
        return best.end_ids + rest, best.index, kind
