"""examples/custom_engine, a third-party rollout engine package, installed the way its users would: into a fresh
venv with slime-rl-core, -buffer, -trainer-megatron and -cli from packages/ and only what the example declares
(slime-rl-rollout-hf, the engine it wraps by default; not rollout-sglang). There its own test runs the
conformance suite, ``slime-cli doctor`` lists it, and ``slime-cli train`` runs with ``rollout.engine: recording``
to completion, every request of the run in its records."""

import json
import sys
from pathlib import Path

import pytest
import yaml
from venvs import TORCH_SPEC, pip_install, sh

pytestmark = pytest.mark.slow

INSTALLED = ["packages/core", "packages/buffer", "packages/trainer-megatron", "packages/cli"]


@pytest.fixture(scope="module")
def example_venv(tmp_path_factory) -> Path:
    venv = tmp_path_factory.mktemp("venvs") / "example"
    sh(sys.executable, "-m", "venv", venv)
    python = venv / "bin" / "python"
    pip_install(python, TORCH_SPEC)
    # slime-rl-rollout-hf is not on PyPI: the example's declared dependency comes from its folder
    pip_install(python, *INSTALLED, "packages/rollout-hf", "examples/custom_engine[test]")
    return venv


def test_the_venv_holds_only_what_was_asked_for(example_venv):
    names = sh(example_venv / "bin" / "python", "-c", "from importlib.metadata import distributions; "
               "print('\\n'.join(sorted(d.metadata['Name'] for d in distributions())))").split()
    assert sorted(n for n in names if n.startswith("slime-rl")) == sorted([
        "slime-rl-core", "slime-rl-buffer", "slime-rl-trainer-megatron", "slime-rl-cli", "slime-rl-rollout-hf",
        "slime-rl-recording-engine"])
    assert "sglang" not in names and "torch" in names


def test_the_examples_own_conformance_test_passes_there(example_venv):
    out = sh(example_venv / "bin" / "python", "-m", "pytest", "examples/custom_engine/tests", "-q",
             "-p", "no:cacheprovider")
    assert "2 passed" in out


def test_doctor_lists_the_engine_with_its_distribution(example_venv):
    out = sh(example_venv / "bin" / "slime-cli", "doctor")
    line = next(line for line in out.splitlines() if line.strip().startswith("recording "))
    assert "recording_engine.engine:RecordingEngine (slime-rl-recording-engine 0.1.0), loads" in line
    assert "sglang " not in out.split("slime_rl.rollout_engines:")[1].split("slime_rl.trainers:")[0]


def test_slime_cli_trains_with_the_recording_engine(example_venv, tmp_path):
    python = example_venv / "bin" / "python"
    model = tmp_path / "tiny-model"
    sh(python, "-c", f"from slime_rl.core.testing import tiny_model_folder; tiny_model_folder({str(model)!r})")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input": f"def f{i}(x):", "label": "return x"}) + "\n" for i in range(8)))
    records = tmp_path / "records.jsonl"
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({
        "model": {"path": str(model), "dtype": "float32"},
        "data": {"prompt_data": str(prompts), "rollout_batch_size": 2, "n_samples_per_prompt": 2, "num_rollout": 2},
        "rollout": {"engine": "recording", "max_response_len": 8, "reward": "f1",
                    "recording": {"record_inner": "hf", "record_to": str(records)}, "hf": {"max_batch_size": 8}},
        "trainer": {"global_batch_size": 4},
        "cluster": {"device": "cpu", "actor_num_gpus_per_node": 1},
        "logging": {"dir": str(tmp_path / "run"), "tensorboard": False, "progress_bar": False},
    }))
    sh(example_venv / "bin" / "slime-cli", "train", config, timeout=600)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len([r for r in rows if "rollout/reward_mean" in r]) == 2
    lines = [json.loads(line) for line in records.read_text().splitlines()]
    generated = [line for line in lines if line["event"] == "generate" and "token_ids" in line]
    assert len(generated) >= 2 * 2 * 2  # 2 steps of 2 prompts x 2 samples (more when groups are over-sampled)
    assert {line["weight_version"] for line in generated} == {0, 1}  # step 2 generated on the synced weights
    assert [line["version"] for line in lines if line["event"] == "update_weights" and line["last"]][:1] == [1]
