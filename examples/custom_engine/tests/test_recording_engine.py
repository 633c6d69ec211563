"""The recording engine keeps the RolloutEngine contract (slime-rl's conformance suite, with a transformers
forward as the log-prob reference) and writes a record of every call."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from recording_engine import RecordingEngine

from slime_rl.core.config import ConfigError, load_config
from slime_rl.core.testing import stdlib_text, tiny_config, tiny_model, train_tokenizer
from slime_rl.core.testing.conformance import Backend, check_conformance, transformers_reference
from slime_rl.rollout_hf.engine import HFEngine

torch.set_num_threads(1)


def test_recording_engine_passes_the_conformance_suite(tmp_path):
    tokenizer = train_tokenizer(stdlib_text(20), vocab_size=512)
    config = tiny_config("llama", vocab_size=len(tokenizer), initializer_range=0.2, eos_token_id=0)
    model = tiny_model(config, seed=0)
    records = tmp_path / "records.jsonl"
    backend = Backend(
        make_engine=lambda: RecordingEngine(HFEngine(copy.deepcopy(model), tokenizer), records),
        prompts=[tokenizer(text).input_ids for text in ("def main(", "import os\nimport", "class Foo:\n    def")],
        initial_weights=list(model.state_dict().items()),
        new_weights=list(tiny_model(config, seed=1).state_dict().items()),
        decode=tokenizer.decode,
        reference=transformers_reference(copy.deepcopy(model)),
    )
    report = check_conformance(backend)
    assert set(report.passed) >= {"abort keeps the partial response", "log-probs under the requested temperature"}

    lines = [json.loads(line) for line in records.read_text().splitlines()]
    events = {line["event"] for line in lines}
    assert {"generate", "abort", "update_weights", "pause_generation", "release_memory", "shutdown"} <= events
    generated = [line for line in lines if line["event"] == "generate" and "token_ids" in line]
    concurrent = sorted(line["request_id"] for line in generated if str(line["request_id"]).startswith("conformance-c"))
    assert concurrent == sorted(f"conformance-c{i}" for i in range(32))  # the suite's 32 at once, each once
    aborted = [line for line in generated if line["finish_reason"] == "abort"]
    assert aborted and all(len(line["token_ids"]) == len(line["log_probs"]) for line in aborted)
    refused = [line for line in lines if line["event"] == "generate" and "error" in line]
    assert refused and refused[0]["error"].startswith("ValueError")  # the duplicate request id


def test_its_typed_keys_are_checked_when_the_config_loads(tmp_path):
    """rollout.recording (settings.py) is checked like slime-rl's own keys; the wrapped engine keeps its section."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"input": "1 + 1 =", "label": "2"}\n')
    base = [f"data.prompt_data={prompts}", "cluster.device=cpu", "rollout.engine=recording"]
    cfg = load_config(None, [*base, f"rollout.recording.record_to={tmp_path / 'r.jsonl'}", "rollout.hf.max_batch_size=8"])
    assert (cfg.rollout.settings.record_inner, cfg.rollout.hf.max_batch_size) == ("hf", 8)
    with pytest.raises(ConfigError, match=r"^rollout.recording.record_too: unknown key; did you mean"
                                          r" `rollout.recording.record_to`\?$"):
        load_config(None, [*base, "rollout.recording.record_too=x.jsonl"])
    with pytest.raises(ConfigError, match=r"^rollout.recording.record_inner: 'recording' would record itself"):
        load_config(None, [*base, "rollout.recording.record_inner=recording"])
