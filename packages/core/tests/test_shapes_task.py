"""The synthetic visual task (slime_rl.core.testing.shapes): deterministic files, balanced labels, the answer in
the image and only there (an oracle that reads the pixels is always right, the blank control gives every
record the same prompt and image), and the reward."""

from __future__ import annotations

import json
from collections import Counter
from types import SimpleNamespace

import pytest

pytest.importorskip("PIL")
from PIL import Image  # noqa: E402

from slime_rl.core.testing.shapes import (  # noqa: E402
    BACKGROUND,
    COLOURS,
    PROMPTS,
    digit_reward_shaped,
    shapes_reward,
    write_shapes_data,
)


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _oracle(path, task: str) -> str:
    """The answer read off the pixels: the colour nearest the shape's pixels, or the quadrants holding some."""
    image = Image.open(path).convert("RGB")
    size = image.width
    inked = [(x, y, image.getpixel((x, y))) for x in range(size) for y in range(size)
             if image.getpixel((x, y)) != BACKGROUND]
    if task in ("colour", "colour_number"):
        mean = [sum(p[2][c] for p in inked) / len(inked) for c in range(3)]
        name = min(COLOURS, key=lambda name: sum((a - b) ** 2 for a, b in zip(COLOURS[name], mean, strict=True)))
        return name if task == "colour" else str(list(COLOURS).index(name) + 1)
    half = size // 2
    return str(len({(x >= half, y >= half) for x, y, _ in inked}))


@pytest.mark.parametrize("task", ["colour", "count", "colour_number"])
def test_the_answer_is_in_the_image_and_only_there(tmp_path, task):
    path = write_shapes_data(tmp_path / "a", n=200, seed=5, task=task)
    again = write_shapes_data(tmp_path / "b", n=200, seed=5, task=task)
    assert path.read_text() == again.read_text()
    assert all((tmp_path / "a" / "images" / f.name).read_bytes() == f.read_bytes()
               for f in (tmp_path / "b" / "images").iterdir())  # byte for byte
    records = _records(path)
    assert {r["input"] for r in records} == {PROMPTS[task]}  # the text never tells the answer
    counts = Counter(r["label"] for r in records)
    assert len(counts) == 4 and min(counts.values()) >= 30  # 4 answers, none rare: chance is 1/4
    assert all(_oracle(path.parent / r["images"][0], task) == r["label"] for r in records)
    other = _records(write_shapes_data(tmp_path / "c", n=200, seed=6, task=task))
    assert [r["label"] for r in other] != [r["label"] for r in records]


def test_the_blank_control_keeps_the_labels_and_drops_what_tells_them(tmp_path):
    shapes = _records(write_shapes_data(tmp_path / "s", n=100, seed=1, task="count"))
    blank_path = write_shapes_data(tmp_path / "b", n=100, seed=1, task="count", blank=True)
    blank = _records(blank_path)
    assert [r["label"] for r in blank] == [r["label"] for r in shapes]
    pictures = {(blank_path.parent / r["images"][0]).read_bytes() for r in blank}
    assert len(pictures) == 1 and len({r["input"] for r in blank}) == 1  # one input for every label


def test_reward_checks_the_first_word():
    def reward(response, label):
        return shapes_reward(SimpleNamespace(response=response, label=label))

    assert reward(" Red.", "red") == 1.0 and reward("red shape", "red") == 1.0
    assert reward("blue", "red") == 0.0 and reward("", "red") == 0.0 and reward("a red", "red") == 0.0
    assert reward("3", "3") == 1.0 and reward("34", "3") == 0.0


def test_the_shaped_reward_leads_to_the_answer_and_is_plain_on_strict_records(tmp_path):
    def reward(response, label, **metadata):
        return digit_reward_shaped(SimpleNamespace(response=response, label=label, metadata=metadata))

    assert [reward(r, "2") for r in ("2", "3", "7", "x")] == [1.0, 0.3, 0.1, 0.0]
    assert [reward(r, "2", strict=True) for r in ("2", "3", "7", "x")] == [1.0, 0.0, 0.0, 0.0]
    held_out = _records(write_shapes_data(tmp_path, n=4, seed=0, task="colour_number", strict=True))
    assert all(r["metadata"] == {"strict": True} for r in held_out)
