"""A synthetic visual task for vision-language RL tests: shapes drawn into small images with PIL, offline and
deterministic (a seed gives the same files byte for byte).

- ``colour``: one shape (square, circle or triangle, anywhere, of any size) in one of `COLOURS`; the answer is
  its colour's name.
- ``count``: 1 to 4 shapes, one per quadrant, of any colours; the answer is how many ("1".."4").
- ``colour_number``: ``colour``'s pictures, the answer the colour's number in `COLOURS` ("1" red .. "4" yellow):
  one digit, which a random model learns to write long before it could spell a colour's name.
Every record of a task has the same prompt text, so only the image tells the answer: a policy that ignores it
cannot beat chance (1 / 4 for both tasks). ``blank=True`` writes the control: the same prompts and labels
(drawn from the same random stream) with an empty image, so no policy can.

`shapes_reward` checks the answer: the response's first word (lower case, punctuation dropped) against the label.
Use it as ``rollout.reward: slime_rl.core.testing.shapes:shapes_reward``. `digit_reward_shaped` is the reward of
the digit-answer tasks (count, colour_number) for training a random model, which would not write the right digit
by chance often enough to learn from 0/1 alone: 1 for the right answer, 0.3 for another of the four, 0.1 for any
digit first.
"""

from __future__ import annotations

import json
import random
import string
from pathlib import Path
from typing import Any, Literal

COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 70, 220), "yellow": (230, 200, 40)}
KINDS = ("square", "circle", "triangle")
BACKGROUND = (255, 255, 255)
PROMPTS = {"colour": "What colour is the shape in the picture? Answer with one word.",
           "count": "How many shapes are in the picture? Answer with a number.",
           "colour_number": "What colour is the shape in the picture? Answer 1 for red, 2 for green, 3 for blue, "
                            "4 for yellow."}
MAX_COUNT = 4
Task = Literal["colour", "count", "colour_number"]


def _shape(draw: Any, kind: str, box: tuple[int, int, int, int], fill: tuple[int, int, int]) -> None:
    x0, y0, x1, y1 = box
    if kind == "square":
        draw.rectangle(box, fill=fill)
    elif kind == "circle":
        draw.ellipse(box, fill=fill)
    else:
        draw.polygon([((x0 + x1) // 2, y0), (x1, y1), (x0, y1)], fill=fill)


def _box(rng: random.Random, x: int, y: int, cell: int) -> tuple[int, int, int, int]:
    """A random square box inside the ``cell``-sized square at (x, y), at least half its side."""
    side = rng.randint(cell // 2, cell - 4)
    left, top = x + rng.randint(2, cell - side - 2), y + rng.randint(2, cell - side - 2)
    return left, top, left + side, top + side


def draw_example(rng: random.Random, task: Task, *, size: int = 56, blank: bool = False) -> tuple[Any, str]:
    """(image, label) of one example; with ``blank`` the label is drawn as usual and the image left empty."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (size, size), BACKGROUND)
    draw = ImageDraw.Draw(image)
    if task in ("colour", "colour_number"):
        colour, kind = rng.choice(sorted(COLOURS)), rng.choice(KINDS)
        box = _box(rng, 0, 0, size)
        if not blank:
            _shape(draw, kind, box, COLOURS[colour])
        return image, colour if task == "colour" else str(list(COLOURS).index(colour) + 1)
    if task != "count":
        raise ValueError(f"task: {task!r}; use colour, colour_number or count")
    count = rng.randint(1, MAX_COUNT)
    half = size // 2
    cells = rng.sample([(0, 0), (half, 0), (0, half), (half, half)], count)
    for x, y in cells:
        kind, colour, box = rng.choice(KINDS), rng.choice(sorted(COLOURS)), _box(rng, x, y, half)
        if not blank:
            _shape(draw, kind, box, COLOURS[colour])
    return image, str(count)


def write_shapes_data(out_dir: str | Path, *, n: int, seed: int, task: Task = "colour", blank: bool = False,
                      size: int = 56, name: str = "train", strict: bool = False) -> Path:
    """``n`` records as ``out_dir/<name>.jsonl`` (``input``, ``images`` (a path relative to the file), ``label``)
    and their PNGs under ``out_dir/images/``; returns the JSONL's path. Data config: ``input_key: input``,
    ``label_key: label``, ``image_key: images``, ``apply_chat_template: true``. ``strict``: the records ask
    `digit_reward_shaped` for the plain 0/1 (``metadata.strict``), so a held-out set's mean reward is its accuracy."""
    out_dir = Path(out_dir)
    (out_dir / "images").mkdir(parents=True, exist_ok=True)
    rng = random.Random(f"{seed}-{task}")  # the labels do not depend on blank: the control has the same ones
    lines = []
    for i in range(n):
        image, label = draw_example(rng, task, size=size, blank=blank)
        relative = f"images/{name}_{i:05d}.png"
        image.save(out_dir / relative, format="PNG", optimize=False)
        record = {"input": PROMPTS[task], "images": [relative], "label": label}
        lines.append(json.dumps({**record, "metadata": {"strict": True}} if strict else record))
    path = out_dir / f"{name}.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def first_word(text: str) -> str:
    """The first word of ``text``, lower case, without punctuation."""
    words = text.strip().lower().translate(str.maketrans("", "", string.punctuation)).split()
    return words[0] if words else ""


def shapes_reward(sample: Any) -> float:
    """1.0 when the response's first word is the label (the colour's name, or the count), else 0.0."""
    return float(first_word(sample.response) == str(sample.label).lower())


def digit_reward_shaped(sample: Any) -> float:
    """A digit answer's reward with a path to it (module doc): 1.0 right, 0.3 another answer, 0.1 a digit; for a
    record with ``metadata.strict`` (a held-out set, `write_shapes_data`'s ``strict``) only 1.0 or 0.0."""
    word = first_word(sample.response)
    if word == str(sample.label) or (sample.metadata or {}).get("strict"):
        return float(word == str(sample.label))
    if word in {str(n) for n in range(1, MAX_COUNT + 1)}:
        return 0.3
    return 0.1 if word[:1].isdigit() else 0.0
