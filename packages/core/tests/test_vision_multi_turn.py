"""Multi-turn episodes of a vision-language prompt (docs/vlm.md): every turn's engine call carries the prompt's
images (the ids it sends hold their pads), and an environment that replaces the prompt drops them. A tool that
returns a picture: tests/unit/test_vlm_tool_pictures.py (it runs the hf engine too)."""

from __future__ import annotations

import asyncio

from slime_rl.core.agent import MultiTurnGenerate
from slime_rl.core.agent.environment import GuessNumber
from slime_rl.core.agent.tools import Tool
from slime_rl.core.contracts import SamplingParams
from slime_rl.core.sample import Sample
from slime_rl.core.testing import chat_tokenizer
from slime_rl.core.testing.standins import ScriptedImageEngine


def _add(a: float, b: float) -> str:
    return str(a + b)


def test_every_turn_of_an_image_prompt_sends_its_images():
    tok = chat_tokenizer()
    generate = MultiTurnGenerate(tok, {"add": Tool("add", _add, "add")}, max_turns=3)
    engine = ScriptedImageEngine(tok, ['<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>',
                                   "Two shapes and 5."])
    refs = ["/data/a.png", "data:image/png;base64,AA=="]
    sample = Sample(index=1, tokens=[5, 6, 7], multimodal_inputs={"images": list(refs)})
    out = asyncio.run(generate(sample, SamplingParams(max_new_tokens=200), engine))
    assert out.metadata["episode_end"] == "final_answer" and out.metadata["tool_calls"] == 1
    assert engine.images == [refs, refs]
    text_only = ScriptedImageEngine(tok, ["No tools needed."])
    asyncio.run(generate(Sample(index=2, tokens=[5, 6, 7]), SamplingParams(max_new_tokens=50), text_only))
    assert text_only.images == [None]  # no images=: an engine without them takes text samples as before


def test_an_environment_that_replaces_the_prompt_drops_its_images():
    tok = chat_tokenizer()
    generate = MultiTurnGenerate(tok, {}, max_turns=2, environment=lambda: GuessNumber(max_guesses=2))
    engine = ScriptedImageEngine(tok, ["50", "60"])
    sample = Sample(index=3, label="37", tokens=[1, 2], multimodal_inputs={"images": ["/data/a.png"]})
    out = asyncio.run(generate(sample, SamplingParams(max_new_tokens=200), engine))
    assert out.multimodal_inputs is None and engine.images == [None, None]

