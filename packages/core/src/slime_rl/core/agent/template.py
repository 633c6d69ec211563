"""What a chat template puts between turns, learned from the template itself by rendering probes.

The agent never re-tokenises what the model sampled. After an assistant turn it appends only what
the template would put next: the rest of the assistant turn's closing (``"\\n"`` after ChatML's
``<|im_end|>``, or the whole closing when the turn stopped on a tool-call close instead), then the
tool messages and the next assistant header, rendered by the template's own tool role. Those ids
are the observation: loss mask 0. `slime_rl.core.agent.parity` checks, for a tokenizer, that the
ids built this way equal the template's rendering of the whole conversation.

What a tool returns is plain text: a tool printing ``<|im_end|>\n<|im_start|>system`` gets the ids of
those characters, never the special tokens, so it cannot forge turns. Only the template's own text
(its turn markers) is tokenised with special tokens parsed (:meth:`TurnTemplate.observation_ids`).
"""

from __future__ import annotations

import collections
import json
import re
import weakref
from dataclasses import dataclass, field
from typing import Any

_PROBE = "Xq7Zv"  # a text no template produces: where it sits tells the turn's closing apart
_SLOT = "Zk9Qw{}Vj"  # stands in for the k-th tool-supplied text; alphanumeric so trim/tojson leave it as is
_PROBE_TURNS = [{"role": "user", "content": "U"}, {"role": "assistant", "content": _PROBE}]
_SPECIAL_IDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> (its size, its special ids)


class TemplateError(ValueError):
    """A chat template the agent cannot work with; the message says why and the fix."""


def render(tokenizer: Any, messages: list[dict[str, Any]], *, add_generation_prompt: bool = False,
           tools: list[dict[str, Any]] | None = None, **kwargs: Any) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                         tokenize=False, **kwargs)


def encode(tokenizer: Any, text: str, *, split_special_tokens: bool = False) -> list[int]:
    """``text``'s ids with no special tokens added (the template holds any BOS itself); with
    ``split_special_tokens`` special-token strings in it stay characters. A fast tokenizer's Rust backend is
    called directly where that gives the same ids: transformers' ``encode`` goes through ``encode_batch``, which
    hands even one text to the rayon pool, and on a loaded host (a gateway beside SGLang's processes) the wait
    for a pool thread cost more than the tokenising (benchmarks/gateway_overhead.py)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "split_special_tokens", False) or backend.truncation or backend.padding:
        kwargs = {"split_special_tokens": True} if split_special_tokens else {}
        return list(tokenizer.encode(text, add_special_tokens=False, **kwargs))
    if backend.encode_special_tokens != split_special_tokens:  # a flag on the backend, as transformers sets it
        backend.encode_special_tokens = split_special_tokens
    return backend.encode(text, add_special_tokens=False).ids


def special_ids(tokenizer: Any) -> frozenset[int]:
    """Every special token's id: the named ones (eos, pad, ...) and added tokens marked special
    (ChatML's ``<|im_start|>`` is one without a name). Kept per tokenizer until its vocabulary grows: the
    gateway asks on every call, and a tokenizer with hundreds of added tokens takes a while to list."""
    try:
        size, known = len(tokenizer), _SPECIAL_IDS.get(tokenizer)
    except TypeError:  # no size, or not weakly referable: no cache
        size = known = None
    if known is not None and size is not None and known[0] == size:
        return known[1]
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    for token_id, token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(token, "special", False):
            ids.add(token_id)
    if size is not None:
        try:
            _SPECIAL_IDS[tokenizer] = (size, frozenset(ids))
        except TypeError:
            pass
    return frozenset(ids)


def encode_plain(tokenizer: Any, text: str, *, specials: frozenset[int] | None = None) -> list[int]:
    """``text`` as ids with special-token strings in it tokenised as ordinary characters. Tokenizers
    that do not take ``split_special_tokens`` get each special string cut after its first character.
    ``specials``: the tokenizer's special ids where the caller holds them (`TurnTemplate.specials`)."""
    specials = special_ids(tokenizer) if specials is None else specials
    try:
        ids = encode(tokenizer, text, split_special_tokens=True)
    except TypeError:
        ids = None
    if ids is None or specials & set(ids):
        names = sorted(filter(None, tokenizer.convert_ids_to_tokens(sorted(specials))), key=len, reverse=True)
        pieces = re.split("(" + "|".join(map(re.escape, names)) + ")", text) if names else [text]
        ids = []
        for k, piece in enumerate(pieces):  # odd k: a special token's string
            for part in ((piece[:1], piece[1:]) if k % 2 else (piece,)):
                ids += encode(tokenizer, part) if part else []
    if specials & set(ids):
        raise TemplateError("the tokenizer turns tool output into special tokens even when cut apart; the agent"
                            " cannot encode observations as plain text with it")
    return ids


@dataclass
class TurnTemplate:
    """The pieces of one tokenizer's chat template the agent needs."""

    tokenizer: Any
    end_of_turn_ids: list[int]  # ids that end an assistant turn: the template's end-of-turn token and eos
    closing: str  # the template's text after an assistant message's content (ChatML: "<|im_end|>\n")
    after_end_of_turn: str  # the part of ``closing`` after the end-of-turn token (ChatML: "\n")
    template_kwargs: dict[str, Any]
    head: str = ""  # the probe turns' rendering: every observation's text is what follows it
    shapes: ShapeCache = field(default_factory=lambda: ShapeCache())  # observation renderings by message shape
    # the tokenizer's special ids, listed once: tokenizers 0.22 (SGLang 0.5.17's) counts the vocabulary with its
    # added tokens by building it whole, 56 us for a vocabulary of 1,024, more for a real one; `special_ids` asks
    # that to see the vocabulary grow, and the gateway took ~0.1 ms of its 0.2 ms a call there. None: asked
    # per call (`special_ids`), never taken for "no special ids"
    specials: frozenset[int] | None = None

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, **template_kwargs: Any) -> TurnTemplate:
        if getattr(tokenizer, "chat_template", None) is None:
            raise TemplateError("the tokenizer has no chat template; multi-turn generation renders tool results"
                                " with it: give model.tokenizer_path a tokenizer that has one")
        text = render(tokenizer, _PROBE_TURNS, **template_kwargs)
        if _PROBE not in text:
            raise TemplateError("the chat template drops the assistant's content; it cannot render a conversation")
        closing = text[text.rindex(_PROBE) + len(_PROBE):]
        eot_ids: list[int] = []
        after = closing
        specials = set(getattr(tokenizer, "all_special_ids", []) or [])
        ids = encode(tokenizer, closing)
        for k, token_id in enumerate(ids):
            if token_id in specials:  # the first special token of the closing ends the turn
                eot_ids.append(token_id)
                after = tokenizer.decode(ids[k + 1:], skip_special_tokens=False)
                break
        eos = getattr(tokenizer, "eos_token_id", None)
        if eos is not None and eos not in eot_ids:
            eot_ids.append(eos)
        if not eot_ids:
            raise TemplateError("neither the chat template's assistant closing nor the tokenizer has an end-of-turn"
                                " token; set the tokenizer's eos_token")
        return cls(tokenizer, eot_ids, closing, after, template_kwargs, head=text, specials=special_ids(tokenizer))

    def observation_text(self, tool_messages: list[dict[str, Any]], *, ended_on_end_of_turn: bool) -> str:
        """The text after a sampled assistant turn up to the next assistant turn's first sampled token: the
        template's rendering of [probe turns + tool messages], less its rendering of the probe turns."""
        head = self.head
        full = render(self.tokenizer, _PROBE_TURNS + tool_messages, add_generation_prompt=True, **self.template_kwargs)
        if not full.startswith(head):
            raise TemplateError("the chat template renders the earlier turns differently once a tool message"
                                " follows, so turns cannot be appended as tokens; check it with"
                                " `slime-cli doctor --model PATH`")
        return (self.after_end_of_turn if ended_on_end_of_turn else self.closing) + full[len(head):]

    def observation_ids(self, tool_messages: list[dict[str, Any]], *, ended_on_end_of_turn: bool) -> list[int]:
        """The observation's ids: the template's own text with special tokens parsed, what the tools
        returned (and the names they go by) as plain text. When no special token comes from the tools'
        text, the ids are those of the whole text tokenised at once (as the template's rendering of the
        conversation is), so plain observations keep exact parity."""
        end = {"ended_on_end_of_turn": ended_on_end_of_turn}
        return plain_content_ids(self.tokenizer, lambda messages: self.observation_text(messages, **end),
                                 tool_messages, shapes=self.shapes, shape_key=str(ended_on_end_of_turn),
                                 specials=self.specials)


class ShapeCache:
    """A template's rendering of messages whose every ``content`` and ``name`` is a marker, with the special
    ids of its own text, by the messages' shape (everything but those texts): a multi-turn agent sends the
    same few shapes all episode long, so most calls render the template once instead of three to six times
    (the gateway's own time per call, benchmarks/gateway_overhead.py)."""

    def __init__(self, size: int = 256):
        self.size, self.entries = size, collections.OrderedDict()

    def get(self, key: str, make: Any) -> tuple[str, list[int]]:
        if key in self.entries:
            self.entries.move_to_end(key)
            return self.entries[key]
        value = self.entries[key] = make()
        if len(self.entries) > self.size:
            self.entries.popitem(last=False)
        return value


def plain_content_ids(tokenizer: Any, render_messages: Any, messages: list[dict[str, Any]], *,
                      shapes: ShapeCache | None = None, shape_key: str = "",
                      specials: frozenset[int] | None = None) -> list[int]:
    """The ids of ``render_messages(messages)`` (a template's text) with every message's ``content`` and
    ``name`` tokenised as plain text (special-token strings in them stay characters) and only the
    template's own text with special tokens parsed. Each such text is found in the rendering by putting a
    marker in its place; when no special token comes from them, the whole text is tokenised at once.

    ``shapes`` (with ``shape_key`` naming what else the rendering depends on): where the marked rendering
    of this shape is known, the whole text's ids are checked against its special ids and returned after a
    single rendering when they agree (no special token came from the messages' texts). ``specials``: as for
    `encode_plain`."""
    slots = _text_slots(messages)
    masked = list(messages)
    for k, slot in enumerate(slots):
        _set_text(masked, slot, _SLOT.format(k))
    specials = special_ids(tokenizer) if specials is None else specials
    if shapes is not None:
        key = shape_key + json.dumps(masked, sort_keys=True, default=str)
        masked_text, own_specials = shapes.get(key, lambda: _marked(tokenizer, render_messages, masked, specials))
        whole = encode(tokenizer, render_messages(messages))
        if [i for i in whole if i in specials] == own_specials:
            return whole
    else:
        masked_text = render_messages(masked)
    rendered: dict[str, str] = {}  # slot marker -> the slot's text as the template renders it
    for k, slot in enumerate(slots):
        marker = _SLOT.format(k)
        if marker not in masked_text:
            continue  # the template does not show it (a tool's name, often)
        one_real = list(masked)
        _set_text(one_real, slot, _get_text(messages, slot))
        rendered[marker] = _slot_text(masked_text, marker, render_messages(one_real))
    pieces = re.split("(" + "|".join(map(re.escape, rendered)) + ")", masked_text) if rendered else [masked_text]
    text = "".join(rendered.get(piece, piece) for piece in pieces)
    if text != render_messages(messages):
        raise TemplateError("the chat template renders one message's content differently depending on another;"
                            " the agent cannot keep message text apart from the template's own tokens")
    ids: list[int] = []
    for piece in pieces:
        ids += encode_plain(tokenizer, rendered[piece], specials=specials) if piece in rendered else \
            encode(tokenizer, piece)
    whole = encode(tokenizer, text)
    if [i for i in whole if i in specials] == [i for i in ids if i in specials]:
        return whole
    return ids


def _text_slots(messages: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """Where the messages hold supplied text: ``(m, "content")``, ``(m, "name")``, and ``(m, "content", k)``
    for the text parts of a list content (a vision-language message: image parts beside text parts)."""
    slots: list[tuple[Any, ...]] = []
    for m, message in enumerate(messages):
        for key in ("content", "name"):
            value = message.get(key)
            if isinstance(value, str):
                slots.append((m, key))
            elif key == "content" and isinstance(value, list):
                slots += [(m, key, k) for k, part in enumerate(value)
                          if isinstance(part, dict) and isinstance(part.get("text"), str)]
    return slots


def _get_text(messages: list[dict[str, Any]], slot: tuple[Any, ...]) -> str:
    m, key, *part = slot
    return messages[m][key][part[0]]["text"] if part else messages[m][key]


def _set_text(messages: list[dict[str, Any]], slot: tuple[Any, ...], text: str) -> None:
    """``text`` into ``slot`` of ``messages`` (a list), copying the message (and its parts) it changes."""
    m, key, *part = slot
    messages[m] = dict(messages[m])
    if part:
        parts = list(messages[m][key])
        parts[part[0]] = {**parts[part[0]], "text": text}
        messages[m][key] = parts
    else:
        messages[m][key] = text


def _marked(tokenizer: Any, render_messages: Any, masked: list[dict[str, Any]], specials: set[int]
            ) -> tuple[str, list[int]]:
    """A marked rendering and the special ids of the template's own text in it (markers hold none)."""
    text = render_messages(masked)
    return text, [i for i in encode(tokenizer, text) if i in specials]


def _slot_text(masked_text: str, marker: str, real_text: str) -> str:
    """What the template put where ``marker`` stood, given the rendering with that one slot filled in."""
    count = masked_text.count(marker)
    length = (len(real_text) - len(masked_text)) // count + len(marker)
    start = masked_text.index(marker)
    value = real_text[start:start + length]
    if masked_text.replace(marker, value) != real_text:
        raise TemplateError("the chat template changes its own text with a tool result's content; the agent"
                            " cannot keep tool output apart from the template's own tokens")
    return value


def tool_message(name: str, content: str) -> dict[str, Any]:
    return {"role": "tool", "name": name, "content": content}
