"""What the tests of prompt data `slime-cli train` and `plan` refuse before anything starts share (test_bad_data,
test_vlm_bad_images_cli): a run config around a prompt file, the training loop standing in so that a run that
starts fails the test, and the check of the one-line refusal."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import yaml


def forbid_the_loop(monkeypatch, why: str) -> None:
    """slime_rl.core.run.loop as a module whose ``train`` fails the test with ``why``: nothing may start."""
    module = types.ModuleType("slime_rl.core.run.loop")

    def train(cfg, callback=None):
        raise AssertionError(why)

    module.train = train
    monkeypatch.setitem(sys.modules, "slime_rl.core.run.loop", module)


def run_config(tmp_path: Path, prompts: Path, **data) -> Path:
    """A CPU run's config on ``prompts`` (the model an empty folder: a refusal comes before it is read), written to
    ``tmp_path``/run.yaml; ``data``: more data keys."""
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"path": str(model)},
        "data": {"prompt_data": str(prompts), "rollout_batch_size": 2, "n_samples_per_prompt": 2, **data},
        "cluster": {"device": "cpu"},
        "logging": {"dir": str(tmp_path / "logs")},
    }))
    return path


def assert_one_line(result, where: str) -> str:
    """``result`` (a CliRunner result) is exit 2 with one line on stderr, ``error: <where>: ...``, and no
    traceback; that line."""
    assert result.exit_code == 2, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"error: {where}: "), lines[0]
    assert "Traceback" not in result.output
    return lines[0]
