"""A sample longer than the model's positions is refused before anything starts, for the trainer and the
engines alike, naming the fix; RoPE scaling in config.json counts as SGLang counts it (config/positions.py)."""

from __future__ import annotations

import json

import pytest

from slime_rl.core.config import ConfigError, load_config
from slime_rl.core.config.positions import ModelPositions, asked_length

QWEN = {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 32768}


def load(tmp_path, hf: dict, *overrides: str):
    folder = tmp_path / "model"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"input": "1 + 1 =", "label": "2"}\n')
    return load_config(None, [f"model.path={folder}", f"data.prompt_data={prompts}", "cluster.device=cpu", *overrides])


def test_a_64k_sample_on_a_32k_model_is_refused_with_the_fix(tmp_path):
    with pytest.raises(ConfigError) as err:
        load(tmp_path, QWEN, "rollout.max_prompt_len=2048", "rollout.max_response_len=63488")
    message = str(err.value)
    assert message.startswith("rollout.max_response_len: rollout.max_prompt_len 2,048 + max_response_len 63,488 ="
                              " 65,536 tokens exceed the 32,768 positions of ")
    assert '"rope_scaling": {"rope_type": "linear", "factor": 2}' in message and "\n" not in message


def test_the_eval_length_counts_too_and_an_unbounded_prompt_takes_one_token(tmp_path):
    assert asked_length(load(tmp_path, QWEN, "rollout.max_response_len=1000")) == 1001
    with pytest.raises(ConfigError, match="a prompt \\+ max_response_len 32,768 = 32,769 tokens exceed"):
        load(tmp_path, QWEN, "rollout.max_response_len=1000", "eval.max_response_len=32768")
    load(tmp_path, QWEN, "rollout.max_prompt_len=768", "rollout.max_response_len=32000")  # exactly 32,768: fits


@pytest.mark.parametrize(("rope", "positions"), [
    ({"rope_type": "linear", "factor": 4.0}, 131072),  # a factor alone multiplies max_position_embeddings
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}, 131072),  # Qwen's recipe
    ({"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192}, 65536),  # already extended
    ({"rope_type": "default"}, 32768),
])
def test_rope_scaling_extends_the_positions(tmp_path, rope, positions):
    hf = {**QWEN, "rope_scaling": rope, **({"max_position_embeddings": 65536} if rope["rope_type"] == "llama3" else {})}
    model = ModelPositions.from_hf(hf)
    assert model.positions == positions
    load(tmp_path, hf, "rollout.max_prompt_len=1024", f"rollout.max_response_len={positions - 1024}")
    with pytest.raises(ConfigError, match=f"exceed the {positions:,} positions"):
        load(tmp_path, hf, "rollout.max_prompt_len=1024", f"rollout.max_response_len={positions - 1023}")
    # transformers 5 names the same mapping rope_parameters
    assert ModelPositions.from_hf({**QWEN, "rope_parameters": rope}).positions == ModelPositions.from_hf(
        {**QWEN, "rope_scaling": rope}).positions


def test_no_positions_in_config_json_means_no_check():
    assert ModelPositions.from_hf({"hidden_size": 8}) is None
    assert ModelPositions.from_hf({"text_config": QWEN}).positions == 32768  # multimodal configs nest it
