"""Multi-turn with a picture in an observation (docs/vlm.md): a tool returns an image, through the built-in
multi-turn loop with the tiny Qwen2.5-VL's processor, then the hf engine takes the whole episode."""

from __future__ import annotations

import asyncio

import pytest

from slime_rl.core.agent import MultiTurnGenerate
from slime_rl.core.agent.tools import Tool
from slime_rl.core.contracts import SamplingParams
from slime_rl.core.sample import Sample
from slime_rl.core.testing.standins import ScriptedImageEngine

pytest.importorskip("PIL")




def test_a_tool_that_returns_a_picture(tmp_path):
    """The tool's picture becomes an image part of its tool message: the observation holds the picture's pads
    (its placeholder expanded by the processor, loss mask 0), the next turn's call carries the prompt's and the
    tool's pictures, SGLang's way back from one pad per image gives the whole sequence, the hf engine takes it,
    the trainer's tensors are rebuilt for both pictures, and a reset drops the tool's picture again."""
    from PIL import Image

    from slime_rl.core.testing import tiny_vl_model_folder
    from slime_rl.core.vision.contract import check_round_trip, placeholder_runs
    from slime_rl.core.vision.images import load_images
    from slime_rl.core.vision.observation import ObservationImages
    from slime_rl.core.vision.processor import load_processor
    from slime_rl.core.vision.prompt import encode_prompt, fill_train_inputs, prompt_text

    folder = tiny_vl_model_folder(tmp_path / "tiny-vl")
    processor = load_processor(folder)
    Image.new("RGB", (56, 56), (200, 0, 0)).save(tmp_path / "prompt.png")
    Image.new("RGB", (90, 60), (0, 0, 200)).save(tmp_path / "zoom.png")

    def look() -> dict:
        """Zoom into the picture."""
        return {"text": "zoomed in", "images": [str(tmp_path / "zoom.png")]}

    prompt_refs = [str(tmp_path / "prompt.png")]
    text = prompt_text("How many shapes? Use the tools.", 1, processor, "test", apply_chat_template=True)
    tokens = encode_prompt(text, prompt_refs, processor, "test").token_ids
    tok = processor.tokenizer
    generate = MultiTurnGenerate(tok, {"look": Tool("look", look, "look")}, max_turns=3,
                                 images=ObservationImages(processor))
    engine = ScriptedImageEngine(tok, ['<tool_call>{"name": "look", "arguments": {}}</tool_call>', "2"])
    sample = Sample(index=1, tokens=list(tokens), multimodal_inputs={"images": list(prompt_refs)})
    out = asyncio.run(generate(sample, SamplingParams(max_new_tokens=300), engine))

    everything = prompt_refs + [str(tmp_path / "zoom.png")]
    assert out.metadata["episode_end"] == "final_answer" and engine.images == [prompt_refs, everything]
    assert out.multimodal_inputs == {"images": everything, "prompt_images": 1}
    runs = placeholder_runs(out.tokens, processor.image_token_id)
    assert [n for _, n in runs] == [4, 6]  # 56x56: 2x2 merged tokens; 90x60: 3x2
    start = runs[1][0] - out.prompt_length
    assert out.loss_mask[start:start + 6] == [0] * 6  # the picture is observation, never trained on
    check_round_trip(out.tokens, load_images(everything, "test"), processor)  # SGLang's way back: our ids
    assert fill_train_inputs([out], processor) == 1
    assert out.multimodal_train_inputs["image_grid_thw"].tolist() == [[1, 4, 4], [1, 4, 6]]

    from slime_rl.rollout_hf.engine import HFEngine

    hf = HFEngine.from_pretrained(folder, dtype="float32", device="cpu")
    scored = asyncio.run(hf.generate(out.tokens, SamplingParams(max_new_tokens=1), images=everything))
    assert len(scored.token_ids) == 1

    out.reset_to_prompt()
    assert out.multimodal_inputs == {"images": prompt_refs} and out.multimodal_train_inputs is None
    assert out.tokens == tokens
