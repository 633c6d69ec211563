"""Bad images through `slime-cli train` and `plan` (docs/vlm.md): one line ``error: <file:line>: image k: <what
and the fix>``, exit 2, before anything starts, as bad text lines are (tests/e2e/test_bad_data.py)."""

from __future__ import annotations

import json

import pytest
from refused_runs import assert_one_line, forbid_the_loop, run_config
from typer.testing import CliRunner

from slime_rl.cli.app import app

pytest.importorskip("PIL")
runner = CliRunner()


@pytest.fixture
def no_loop(monkeypatch):
    forbid_the_loop(monkeypatch, "the run started despite bad images")


@pytest.mark.parametrize("command", ["train", "plan"])
@pytest.mark.parametrize("case, words", [
    ("missing", "image 1: {dir}/gone.png: no such file; fix the path (relative paths are read from the data file's folder)"),
    ("too big", "image 0: {dir}/big.png: 300x200 is 60,000 pixels, over data.max_image_pixels=50,000; downscale"),
    ("not an image", "image 0: {dir}/notes.png: not an image file PIL can read"),
])
def test_a_bad_image_is_one_line_before_anything_starts(tmp_path, no_loop, command, case, words):
    from PIL import Image

    Image.new("RGB", (60, 60)).save(tmp_path / "ok.png")
    Image.new("RGB", (300, 200)).save(tmp_path / "big.png")
    (tmp_path / "notes.png").write_text("not a picture")
    bad = {"missing": ["ok.png", "gone.png"], "too big": ["big.png"], "not an image": "notes.png"}[case]
    lines = [{"input": "q", "images": ["ok.png"], "label": "1"}] * 3 + [{"input": "q", "images": bad, "label": "1"}]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in lines))
    config = run_config(tmp_path, prompts, image_key="images", apply_chat_template=True, max_image_pixels=50_000)
    line = assert_one_line(runner.invoke(app, [command, str(config)]), f"{prompts}:4")
    assert line.startswith(f"error: {prompts}:4: {words.format(dir=tmp_path)}"), line
