"""Everything a run writes is checked before anything starts (issue 34): a read-only or unwritable
checkpoint.save_dir or logging.dir, and a HOME that does not exist (the built-in model's cache is under
it), end `slime-cli plan` and `train` with exit 2 and one line naming the field or variable and the fix;
HOME is never created (as root it had been, and filled with 260 MB)."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from slime_rl.cli.app import app

runner = CliRunner()


@pytest.fixture
def read_only(tmp_path):
    """A folder this process cannot write: a read-only tmpfs as root (whom permissions do not stop), else 0555."""
    folder = tmp_path / "read_only"
    folder.mkdir()
    if os.geteuid() == 0:
        if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(folder)],
                          capture_output=True).returncode != 0:
            pytest.skip("as root, a read-only folder needs a mount, which is not allowed here")
        yield folder
        subprocess.run(["umount", str(folder)], check=True)
    else:
        folder.chmod(stat.S_IRUSR | stat.S_IXUSR)
        yield folder
        folder.chmod(stat.S_IRWXU)


def _config(tmp_path: Path, **changes: str) -> Path:
    (tmp_path / "prompts.jsonl").write_text('{"input": "1 + 1 =", "label": "2"}\n')
    tree = {"model": {"path": "builtin:smollm2-135m-instruct"},
            "data": {"prompt_data": str(tmp_path / "prompts.jsonl"), "rollout_batch_size": 2, "n_samples_per_prompt": 2},
            "rollout": {"engine": "hf", "reward": "math", "max_response_len": 8},
            "trainer": {"backend": "megatron"}, "cluster": {"device": "cpu"},
            "checkpoint": {"save_dir": changes.get("save_dir", str(tmp_path / "ckpt"))},
            "logging": {"dir": changes.get("log_dir", str(tmp_path / "logs"))}}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def _refused(config: Path, field: str) -> str:
    """plan and train both: exit 2, one stderr line naming ``field``; the line."""
    lines = set()
    for command in ("plan", "train"):
        result = runner.invoke(app, [command, str(config)])
        assert result.exit_code == 2, result.output
        assert len(result.stderr.splitlines()) == 1 and result.stderr.startswith(f"error: {field}: "), result.stderr
        lines.add(result.stderr.strip())
    assert len(lines) == 1
    return lines.pop()


def test_a_read_only_save_dir_or_logging_dir_is_refused_before_anything_starts(tmp_path, read_only,
                                                                              loop_never_entered):
    line = _refused(_config(tmp_path, save_dir=str(read_only)), "checkpoint.save_dir")
    assert f"{read_only} is not writable (" in line and "give checkpoint.save_dir a folder this user can write" in line
    line = _refused(_config(tmp_path, log_dir=str(read_only / "run")), "logging.dir")
    assert f"{read_only / 'run'} cannot be created: {read_only} is not writable" in line
    assert loop_never_entered.calls == []


def test_a_home_that_does_not_exist_is_refused_and_never_created(tmp_path, monkeypatch, loop_never_entered):
    home = tmp_path / "nonexistent"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("SLIME_RL_CACHE", raising=False)
    line = _refused(_config(tmp_path), "HOME")
    assert line == (f"error: HOME: {home} does not exist, and the built-in model is converted into"
                    " $HOME/.cache/slime-rl; set HOME to this user's home folder, or SLIME_RL_CACHE to a folder for"
                    " the built-in model (~270 MB)")
    assert not home.exists() and loop_never_entered.calls == []

    from slime_rl.core.config import ConfigError
    from slime_rl.core.config.builtin_models import resolve_model_path

    with pytest.raises(ConfigError, match=r"^HOME: .* does not exist"):  # the Python API's way in, too
        resolve_model_path("builtin:smollm2-135m-instruct")
    assert not home.exists()


def test_an_unwritable_model_cache_is_refused(tmp_path, read_only, monkeypatch, loop_never_entered):
    monkeypatch.setenv("SLIME_RL_CACHE", str(read_only / "cache"))
    line = _refused(_config(tmp_path), "SLIME_RL_CACHE")
    assert f"{read_only / 'cache' / 'models'} cannot be created: {read_only} is not writable" in line
