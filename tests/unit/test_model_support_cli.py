"""`slime-cli plan` refuses a model whose architecture the trainer does not build, with the list it builds, and
`slime-cli doctor --model` says whether the trainer builds a checkpoint and which part is missing (the CLI
finds the trainer's check through its settings entry point; trainer-megatron holds the list)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from slime_rl.cli.app import app
from slime_rl.core.testing import chat_tokenizer, tiny_config
from slime_rl.trainer_megatron.support import SUPPORTED_ARCHITECTURES

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "grpo_math.yaml"
runner = CliRunner()


def _model_folder(folder: Path, architecture: str, model_type: str) -> Path:
    """A GLM-4.5-shaped config.json named ``architecture``, and a chat tokenizer (doctor checks its template)."""
    config = tiny_config("glm4_moe", vocab_size=64)
    config.architectures = [architecture]
    config.save_pretrained(folder)
    text = (folder / "config.json").read_text().replace('"model_type": "glm4_moe"', f'"model_type": "{model_type}"')
    (folder / "config.json").write_text(text)
    chat_tokenizer().save_pretrained(folder)
    return folder


@pytest.mark.parametrize("architecture,model_type,supported", [("Glm4MoeForCausalLM", "glm4_moe", True),
                                                                ("DeepseekV32ForCausalLM", "deepseek_v32", False)])
def test_plan_and_doctor_say_whether_the_trainer_builds_the_model(architecture, model_type, supported, tmp_path):
    model = _model_folder(tmp_path / "m", architecture, model_type)
    plan = runner.invoke(app, ["plan", str(EXAMPLE), f"model.path={model}"])
    doctor = runner.invoke(app, ["doctor", "--model", str(model)])
    support = doctor.stdout.split("model support of", 1)[1].split("\n\n", 1)[0]
    if supported:
        assert plan.exit_code == 0, plan.output
        assert "megatron: supported" in support and "Glm4MoeForCausalLM: supported (family glm4_moe)" in support
        assert doctor.exit_code == 0, doctor.stdout
        return
    assert plan.exit_code == 2 and plan.stdout == ""
    (line,) = plan.stderr.splitlines()
    assert line.startswith(f"error: model.path: {model}: architecture DeepseekV32ForCausalLM is not supported")
    assert "lacks DeepSeek Sparse Attention" in line and line.endswith(", ".join(SUPPORTED_ARCHITECTURES))
    assert "megatron: NOT supported" in support and "lacks DeepSeek Sparse Attention" in support
    assert doctor.exit_code == 1
