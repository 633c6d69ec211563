"""What a chat template puts between turns, learned from the template itself by rendering probes.

The agent never re-tokenises what the model sampled. After an assistant turn it appends only what
the template would put next: the rest of the assistant turn's closing (``"\\n"`` after ChatML's
``<|im_end|>``, or the whole closing when the turn stopped on a tool-call close instead), then the
tool messages and the next assistant header, rendered by the template's own tool role. Those ids
are the observation: loss mask 0. `slime_rl.core.agent.parity` checks, for a tokenizer, that the
ids built this way equal the template's rendering of the whole conversation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_PROBE = "Xq7Zv"  # a text no template produces: where it sits tells the turn's closing apart
_PROBE_TURNS = [{"role": "user", "content": "U"}, {"role": "assistant", "content": _PROBE}]


class TemplateError(ValueError):
    """A chat template the agent cannot work with; the message says why and the fix."""


def render(tokenizer: Any, messages: list[dict[str, Any]], *, add_generation_prompt: bool = False,
           tools: list[dict[str, Any]] | None = None, **kwargs: Any) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                         tokenize=False, **kwargs)


def encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))  # the template holds any BOS itself


@dataclass
class TurnTemplate:
    """The pieces of one tokenizer's chat template the agent needs."""

    tokenizer: Any
    end_of_turn_ids: list[int]  # ids that end an assistant turn: the template's end-of-turn token and eos
    closing: str  # the template's text after an assistant message's content (ChatML: "<|im_end|>\n")
    after_end_of_turn: str  # the part of ``closing`` after the end-of-turn token (ChatML: "\n")
    template_kwargs: dict[str, Any]

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
        return cls(tokenizer, eot_ids, closing, after, template_kwargs)

    def observation_text(self, tool_messages: list[dict[str, Any]], *, ended_on_end_of_turn: bool) -> str:
        """The text after a sampled assistant turn up to the next assistant turn's first sampled token: the
        template's rendering of [probe turns + tool messages], less its rendering of the probe turns."""
        head = render(self.tokenizer, _PROBE_TURNS, **self.template_kwargs)
        full = render(self.tokenizer, _PROBE_TURNS + tool_messages, add_generation_prompt=True, **self.template_kwargs)
        if not full.startswith(head):
            raise TemplateError("the chat template renders the earlier turns differently once a tool message"
                                " follows, so turns cannot be appended as tokens; check it with"
                                " `slime-cli doctor --model PATH`")
        return (self.after_end_of_turn if ended_on_end_of_turn else self.closing) + full[len(head):]

    def observation_ids(self, tool_messages: list[dict[str, Any]], *, ended_on_end_of_turn: bool) -> list[int]:
        return encode(self.tokenizer, self.observation_text(tool_messages, ended_on_end_of_turn=ended_on_end_of_turn))


def tool_message(name: str, content: str) -> dict[str, Any]:
    return {"role": "tool", "name": name, "content": content}
