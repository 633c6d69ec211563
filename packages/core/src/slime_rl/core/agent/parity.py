"""Chat-template parity: do the ids the agent builds turn by turn equal the template's rendering?

The agent appends the model's sampled ids and, between turns, only what the template would put there
(template.py). For a conversation this module builds those ids as the agent would, with each
assistant turn being exactly the text the template renders for it followed by the end-of-turn id (a
model that follows its template), and compares them with the template's rendering of the whole
conversation, tokenised at once. A difference is either drift (the same conversation gives other ids
turn by turn than at once: the trainer would score ids no prompt of that conversation produces), or
a history rewrite: the template renders an earlier assistant turn differently from how that turn was
generated (Qwen3 drops earlier ``<think>`` blocks), which no token-in/token-out loop can match and
which is reported as such.

`check_parity` runs the four features of docs/agents.md's table; `slime-cli doctor --model PATH`
prints `format_report` of them.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Any

from slime_rl.core.agent.template import TemplateError, TurnTemplate, encode, render

SYSTEM = {"role": "system", "content": "You are a careful assistant."}
USER = {"role": "user", "content": "What is 17 * 3?"}
CODE = "print(17 * 3)"
CALL = {"role": "assistant", "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "python", "arguments": {"code": CODE}}}]}
TOOL = {"role": "tool", "name": "python", "content": "51"}
FINAL = {"role": "assistant", "content": "17 * 3 = 51."}
THINK_CALL = {**CALL, "content": "<think>Multiplying is easy with the tool.</think>\n"}
THINK_FINAL = {"role": "assistant", "content": "<think>The tool printed 51.</think>\n17 * 3 = 51."}
TOOLS = [{"type": "function", "function": {
    "name": "python", "description": "Run Python code and return what it prints.",
    "parameters": {"type": "object", "properties": {"code": {"type": "string", "description": "the code"}},
                   "required": ["code"]}}}]
FEATURES: dict[str, tuple[list[dict[str, Any]], list[dict[str, Any]] | None]] = {
    "system prompt": ([SYSTEM, USER, FINAL], None),
    "tool call": ([USER, CALL], TOOLS),
    "tool result": ([USER, CALL, TOOL, FINAL], TOOLS),
    "thinking": ([USER, THINK_CALL, TOOL, THINK_FINAL], TOOLS),
}
MATCH, DIFFERS, REWRITE, UNUSABLE = "match", "differs", "history rewrite", "template unusable"


@dataclass
class ParityResult:
    feature: str
    status: str  # MATCH, DIFFERS, REWRITE or UNUSABLE
    detail: str = ""
    notes: list[str] = field(default_factory=list)  # how the template treats the feature (tools as text, ...)
    position: int | None = None  # first differing token position
    turn_by_turn: str = ""  # the agent's ids around it, decoded
    template: str = ""  # the template's ids around it, decoded

    @property
    def cell(self) -> str:
        """The table cell: status and notes."""
        return "; ".join([self.status + (f" at token {self.position}" if self.position is not None else ""),
                          *self.notes])


def check_parity(tokenizer: Any, features: dict[str, Any] | None = None) -> list[ParityResult]:
    return [check_feature(tokenizer, name, *spec) for name, spec in (features or FEATURES).items()]


def check_feature(tokenizer: Any, feature: str, messages: list[dict[str, Any]],
                  tools: list[dict[str, Any]] | None) -> ParityResult:
    notes: list[str] = []
    messages = copy.deepcopy(messages)
    try:
        template = TurnTemplate.from_tokenizer(tokenizer)
        if tools is not None and render(tokenizer, [USER], tools=tools) == render(tokenizer, [USER]):
            notes.append("the template shows no tool schemas")
        if any("tool_calls" in m for m in messages) and CODE not in render(tokenizer, [USER, CALL]):
            notes.append("tool calls as text (the template ignores tool_calls)")
            for m in messages:
                if "tool_calls" in m:
                    call = m.pop("tool_calls")[0]["function"]
                    m["content"] += "<tool_call>" + json.dumps(call) + "</tool_call>"
        ids, generated = _turn_by_turn(tokenizer, template, messages, tools)
    except TemplateError as err:
        return ParityResult(feature, UNUSABLE, str(err), notes)
    whole = render(tokenizer, messages, tools=tools)
    expected = encode(tokenizer, whole)
    tail = encode(tokenizer, template.after_end_of_turn)
    if ids + tail == expected:
        return ParityResult(feature, MATCH, notes=notes)
    position = next((k for k, (a, b) in enumerate(zip(ids, expected, strict=False)) if a != b),
                    min(len(ids), len(expected)))
    window = slice(max(0, position - 6), position + 10)
    result = ParityResult(feature, DIFFERS, notes=notes, position=position,
                          turn_by_turn=tokenizer.decode(ids[window], skip_special_tokens=False),
                          template=tokenizer.decode(expected[window], skip_special_tokens=False))
    rewritten = [n for n, text in enumerate(generated[:-1], 1) if text and text not in whole]
    if rewritten:
        result.status = REWRITE
        result.detail = (f"the template renders assistant turn {rewritten[0]} differently once later turns follow"
                         " (e.g. drops its <think> block); the trainer scores the ids as sampled")
    else:
        result.detail = "the ids built turn by turn differ from the template's rendering of the conversation"
    return result


def _turn_by_turn(tokenizer: Any, template: TurnTemplate, messages: list[dict[str, Any]],
                  tools: list[dict[str, Any]] | None) -> tuple[list[int], list[str]]:
    """The ids the agent would hold after ``messages``, with each assistant turn sampled as the template renders
    it (then its end-of-turn id), and the text of each assistant turn as generated."""
    first = next(k for k, m in enumerate(messages) if m["role"] == "assistant")
    ids = encode(tokenizer, render(tokenizer, messages[:first], add_generation_prompt=True, tools=tools))
    generated: list[str] = []
    k = first
    while k < len(messages):
        if messages[k]["role"] != "assistant":
            raise TemplateError(f"message {k} is {messages[k]['role']!r}; the agent loop expects an assistant turn")
        # As the model generated it: the newest turn, after its own generation prompt (a template that
        # rewrites earlier turns renders it differently later; check_feature reports that).
        probe = {"role": "user", "content": "U"}
        before = render(tokenizer, [probe], add_generation_prompt=True)
        after = render(tokenizer, [probe, messages[k]])
        if not after.startswith(before) or not after.endswith(template.closing):
            raise TemplateError(f"the template does not render assistant turn {len(generated) + 1} as the"
                                " generation prompt followed by the turn and its closing")
        text = after[len(before):len(after) - len(template.closing)]
        generated.append(text)
        ids += encode(tokenizer, text) + [template.end_of_turn_ids[0]]
        k += 1
        observations = []
        while k < len(messages) and messages[k]["role"] == "tool":
            observations.append(messages[k])
            k += 1
        if observations:
            ids += template.observation_ids(observations, ended_on_end_of_turn=True)
    return ids, generated


def format_report(results: list[ParityResult]) -> str:
    """Human-readable: one line per feature, and for a difference its position and both decodings."""
    lines = []
    width = max(len(r.feature) for r in results)
    for r in results:
        lines.append(f"  {r.feature.ljust(width)}  {r.cell}")
        if r.detail:
            lines.append(f"  {''.ljust(width)}  {r.detail}")
        if r.position is not None:
            lines.append(f"  {''.ljust(width)}  turn by turn: {r.turn_by_turn!r}")
            lines.append(f"  {''.ljust(width)}  template:     {r.template!r}")
    return "\n".join(lines)


def load_tokenizer(spec: str) -> Any:
    """The tokenizer of an HF folder, a ``.gguf`` file, or a ``builtin:`` model (its converted folder when there
    is one, else straight from the GGUF: the check needs no weights)."""
    from pathlib import Path

    from transformers import AutoTokenizer

    from slime_rl.core.config.builtin_models import (
        BUILTIN_MODELS,
        BUILTIN_PREFIX,
        _gguf_path,
        default_cache_dir,
    )

    if spec.startswith(BUILTIN_PREFIX):
        name = spec[len(BUILTIN_PREFIX):]
        if name not in BUILTIN_MODELS:
            raise ValueError(f"--model: unknown built-in model {name!r}; built in: "
                             + ", ".join(f"builtin:{n}" for n in sorted(BUILTIN_MODELS)))
        converted = default_cache_dir() / name
        if (converted / "tokenizer_config.json").is_file():
            return AutoTokenizer.from_pretrained(converted)
        gguf = _gguf_path(BUILTIN_MODELS[name])
        return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    if not path.is_dir():
        raise ValueError(f"--model: {spec} is not a model folder, a .gguf file or builtin:<name>")
    return AutoTokenizer.from_pretrained(path)
