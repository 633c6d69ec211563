"""Prompts with images (docs/vlm.md): JSONL and Parquet records with paths, data URIs and bytes, several images
a prompt; bad images refused at file:line with the fix, up front and as the run reads; the rollout contract's
round trip refused with its reason."""

from __future__ import annotations

import base64
import io
import json

import pytest
import torch

pytest.importorskip("PIL")
from PIL import Image  # noqa: E402

from slime_rl.buffer.data_source import PromptDataSource  # noqa: E402
from slime_rl.core.run.data import DataError  # noqa: E402
from slime_rl.core.testing import tiny_vl_model_folder  # noqa: E402
from slime_rl.core.vision.contract import collapse, placeholder_runs  # noqa: E402


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_vl_model_folder(tmp_path_factory.mktemp("tiny-vl"))


@pytest.fixture(scope="module")
def tokenizer(model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def _png(path, size=(90, 60), colour=(255, 0, 0)):
    Image.new("RGB", size, colour).save(path)
    return path


def _png_bytes(size=(60, 60), colour=(0, 0, 255)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format="PNG")
    return buf.getvalue()


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _source(path, model, tokenizer, **kw):
    args = dict(tokenizer=tokenizer, image_key="images", processor_path=str(model), apply_chat_template=True,
                shuffle=False, label_key="label")
    return PromptDataSource(path, **{**args, **kw})


def test_jsonl_paths_and_data_uris_several_a_prompt(tmp_path, model, tokenizer):
    (tmp_path / "img").mkdir()
    _png(tmp_path / "img" / "a.png")
    _png(tmp_path / "img" / "b.png", size=(200, 100), colour=(0, 255, 0))
    uri = "data:image/png;base64," + base64.b64encode(_png_bytes()).decode()
    data = _jsonl(tmp_path / "d.jsonl", [
        {"input": "How many shapes?", "images": ["img/a.png", "img/b.png"], "label": "2"},
        {"input": [{"role": "user", "content": [{"type": "text", "text": "Colour?"}, {"type": "image"}]}],
         "images": uri, "label": "blue"},
        {"input": "no image here", "label": "x"},
    ])
    source = _source(data, model, tokenizer, n_samples_per_prompt=2)
    assert source.check_records() == 3
    (a1, a2), (b1, _), (c1, _) = source.get_groups(3)
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    # 90x60 -> 84x56: 4x6 patches -> 6 pads; 200x100 -> 140x56 (within 112x112's pixel budget): 4x10 -> 10 pads
    assert [n for _, n in placeholder_runs(a1.tokens, pad)] == [6, 10]
    assert a1.multimodal_inputs == {"images": [str(tmp_path / "img" / "a.png"), str(tmp_path / "img" / "b.png")]}
    grid = a1.multimodal_train_inputs["image_grid_thw"]
    assert grid.tolist() == [[1, 4, 6], [1, 4, 10]]
    assert a1.multimodal_train_inputs["pixel_values"].shape == (int(grid.prod(-1).sum()), 3 * 2 * 14 * 14)
    assert a2.multimodal_train_inputs is a1.multimodal_train_inputs  # shared within the group, never copied
    assert b1.multimodal_inputs == {"images": [uri]} and len(placeholder_runs(b1.tokens, pad)) == 1
    text = tokenizer.decode(collapse(b1.tokens, pad))
    assert text.index("Colour?") < text.index("<|image_pad|>")  # the image part where the messages put it
    assert c1.multimodal_inputs is None and c1.multimodal_train_inputs is None and pad not in c1.tokens


def test_parquet_bytes_and_datasets_image_dicts(tmp_path, model, tokenizer):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    table = pa.table({"input": ["What colour?", "And here?"],
                      "images": pa.array([[{"bytes": _png_bytes(), "path": None}],
                                          [{"bytes": _png_bytes((56, 84)), "path": None}]], pa.list_(image)),
                      "label": ["blue", "blue"]})
    pq.write_table(table, tmp_path / "d.parquet")
    source = _source(tmp_path / "d.parquet", model, tokenizer)
    assert source.check_records() == 2
    (s,), (t,) = source.get_groups(2)
    assert s.multimodal_inputs["images"][0].startswith("data:image/png;base64,")
    assert t.multimodal_train_inputs["image_grid_thw"].tolist() == [[1, 6, 4]]
    json.dumps(s.to_dict())  # JSON-safe: the bytes travel as a data URI


@pytest.mark.parametrize("case, expected", [
    ("missing", "image 0: {dir}/nope.png: no such file; fix the path"),
    ("garbage", "not an image file PIL can read"),
    ("huge", "over data.max_image_pixels=10,000; downscale the image or raise data.max_image_pixels"),
    ("url", "is a URL (https://example.com/a.png); a run reads no network"),
    ("number", "image 'images' is int; give a path"),
    ("bad_uri", "not valid base64"),
])
def test_bad_images_are_refused_up_front_at_file_line(tmp_path, model, tokenizer, case, expected):
    (tmp_path / "garbage.png").write_bytes(b"this is not a png")
    _png(tmp_path / "big.png", size=(200, 100))
    value = {"missing": "nope.png", "garbage": "garbage.png", "huge": "big.png", "url": "https://example.com/a.png",
             "number": 7, "bad_uri": "data:image/png;base64,@@@"}[case]
    data = _jsonl(tmp_path / "d.jsonl", [{"input": "fine", "label": "x"}, {"input": "q", "images": value, "label": "y"}])
    source = _source(data, model, None, max_image_pixels=10_000)
    with pytest.raises(DataError) as err:
        source.check_records()
    assert str(err.value).startswith(f"{data}:2: ")
    assert expected.format(dir=tmp_path) in str(err.value)


def test_a_damaged_image_is_refused_when_read_and_skipped_on_request(tmp_path, model, tokenizer):
    whole = _png_bytes((90, 90))
    (tmp_path / "cut.png").write_bytes(whole[: len(whole) // 2])
    _png(tmp_path / "ok.png")
    data = _jsonl(tmp_path / "d.jsonl", [{"input": "a", "images": "cut.png", "label": "x"},
                                         {"input": "b", "images": "ok.png", "label": "y"}])
    with pytest.raises(DataError, match=rf"^{data}:1: image 0: .*cut.png: the image data is damaged"):
        _source(data, model, tokenizer).get_groups(2)
    skipping = _source(data, model, tokenizer, skip_bad_lines=True)
    assert [[s.label for s in g] for g in skipping.get_groups(2)] == [["y"]]
    assert skipping.num_skipped == 1


def test_image_slots_must_match_the_images(tmp_path, model, tokenizer):
    _png(tmp_path / "a.png")
    data = _jsonl(tmp_path / "d.jsonl", [
        {"input": [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "?"}]}],
         "images": ["a.png"], "label": "x"}])
    with pytest.raises(DataError, match=r":1: the messages hold 2 image part\(s\) .* and the record 1 image"):
        _source(data, model, tokenizer).get_groups(1)
    raw = _jsonl(tmp_path / "r.jsonl", [{"input": "no placeholder", "images": ["a.png"], "label": "x"}])
    with pytest.raises(DataError, match=r":1: the prompt holds 0 image placeholder"):
        _source(raw, model, tokenizer, apply_chat_template=False).get_groups(1)


def test_a_prompt_the_engine_would_retokenize_differently_is_refused_with_the_reason(tmp_path, model, tokenizer):
    """A tokenizer that tidies spaces when it decodes ("a , b" -> "a, b"; transformers does it for a BPE only when
    told to): SGLang's decode -> processor would give other ids than ours, so the prompt is refused, naming the
    first token that differs."""
    from transformers import AutoTokenizer

    _png(tmp_path / "a.png")
    data = _jsonl(tmp_path / "d.jsonl", [{"input": "one , two . three ?", "images": ["a.png"], "label": "x"},
                                         {"input": "one, two. three?", "images": ["a.png"], "label": "x"}])
    tidy = AutoTokenizer.from_pretrained(model)
    source = _source(data, model, tidy)
    _tidy(source.processor().tokenizer)
    with pytest.raises(DataError, match=r":1: the engine would not see this prompt's ids: .*first different at"):
        source.get_groups(1)
    skipping = _source(data, model, tidy, skip_bad_lines=True)
    _tidy(skipping.processor().tokenizer)
    ((ok,),) = skipping.get_groups(1)
    assert ok.prompt == "one, two. three?"
    plain = _source(data, model, tidy)  # the model's own tokenizer keeps spaces: both prompts pass
    assert len(plain.get_groups(2)) == 2


def _tidy(tokenizer):
    tokenizer.clean_up_tokenization_spaces = True
    tokenizer.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output = True


def test_train_inputs_are_rebuilt_for_a_sample_saved_without_them(tmp_path, model, tokenizer):
    from slime_rl.core.sample import Sample
    from slime_rl.core.vision.processor import load_processor
    from slime_rl.core.vision.prompt import fill_train_inputs

    _png(tmp_path / "a.png")
    data = _jsonl(tmp_path / "d.jsonl", [{"input": "q", "images": ["a.png"], "label": "x"}])
    (fresh, *_) = _source(data, model, tokenizer).get_groups(1)[0]
    saved = Sample.from_dict(json.loads(json.dumps(fresh.to_dict())))
    assert saved.multimodal_train_inputs is None
    assert fill_train_inputs([saved], load_processor(model)) == 1
    for key in ("pixel_values", "image_grid_thw"):
        assert torch.equal(saved.multimodal_train_inputs[key], fresh.multimodal_train_inputs[key])
