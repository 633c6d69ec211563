"""Images through SGLangEngine on CPU (stand-in servers behind the real sglang-router; the stand-in runs
SGLang 0.5.17's multimodal path, testing/vision.py): the engine sends one pad per image and the images, the
server's expansion gives back exactly our prompt, pre-expanded pads fail as they do in SGLang, and a server
whose processor sizes images otherwise is caught by the prompt-token check."""

from __future__ import annotations

import asyncio
import json
import shutil

import httpx
import pytest

pytest.importorskip("PIL")
from PIL import Image  # noqa: E402
from test_engine import make_config  # noqa: E402

from slime_rl.core.contracts import SamplingParams  # noqa: E402
from slime_rl.core.testing import tiny_vl_model_folder  # noqa: E402
from slime_rl.core.vision.contract import collapse  # noqa: E402
from slime_rl.core.vision.processor import load_processor  # noqa: E402
from slime_rl.core.vision.prompt import encode_prompt, prompt_text  # noqa: E402
from slime_rl.rollout_sglang.client import GenerateError  # noqa: E402
from slime_rl.rollout_sglang.engine import SGLangEngine  # noqa: E402
from slime_rl.rollout_sglang.keys import bearer  # noqa: E402
from slime_rl.rollout_sglang.launch import engine_args  # noqa: E402

PARAMS = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def vl_model(request, tmp_path_factory):
    return tiny_vl_model_folder(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    out = tmp_path_factory.mktemp("img")
    for name, size in (("small", (90, 60)), ("wide", (200, 100))):
        Image.new("RGB", size, (200, 30, 30)).save(out / f"{name}.png")
    return [str(out / "small.png"), str(out / "wide.png")]


def _ours(model, refs):
    processor = load_processor(model)
    text = prompt_text("Count the shapes.", len(refs), processor, "test", apply_chat_template=True)
    return encode_prompt(text, refs, processor, "test").token_ids, processor.image_token_id


def _state(engine):
    server = engine.servers[0]
    return httpx.get(f"{server.url}/standin/state", headers=bearer(engine.keys.admin_key)).json()


def test_launch_keeps_the_tokenizer_and_a_bundled_vision_attention(vl_model, standin_python, tmp_path):
    args = engine_args(make_config(vl_model, standin_python, tmp_path, num_engines=1))
    assert args["skip_tokenizer_init"] is False and args["mm_attention_backend"] == "sdpa"


def test_sglang_sees_our_prompt_from_one_pad_per_image(vl_model, images, standin_python, tmp_path):
    engine = SGLangEngine.from_config(make_config(vl_model, standin_python, tmp_path, num_engines=1))
    try:
        assert engine.accepts_images
        ours, pad = _ours(vl_model, images)
        out = asyncio.run(engine.generate(ours, PARAMS, images=images))
        assert len(out.token_ids) == 6
        events = _state(engine)["events"]
        sent = [e for e in events if e["kind"] == "image_request"]
        served = [e for e in events if e["kind"] == "generate"]
        assert sent[-1]["sent"] == len(collapse(ours, pad)) < len(ours)  # one pad per image on the wire
        assert served[-1]["input_len"] == len(ours)  # SGLang's expansion is our prompt, token for token
        body = [e for e in events if e["kind"] == "generate_body"][-1]["body"]
        assert [uri[:22] for uri in body["image_data"]] == ["data:image/png;base64,"] * 2

        # What the contract avoids: our pads as they are, which SGLang's processor expands a second time.
        with pytest.raises(GenerateError, match="processing the multimodal data"):
            asyncio.run(engine.client.generate(ours, PARAMS, "raw", image_data=body["image_data"]))
        with pytest.raises(ValueError, match=r"2 image placeholder\(s\) in the ids for 1 image"):
            asyncio.run(engine.generate(ours, PARAMS, images=images[:1]))
    finally:
        asyncio.run(engine.shutdown())


def test_a_server_that_sizes_images_otherwise_is_caught(vl_model, images, standin_python, tmp_path):
    """The server's processor allows fewer pixels than ours: its prompt is shorter than the one the trainer
    scores, and the request fails with the reason instead of training on another prompt."""
    other = shutil.copytree(vl_model, tmp_path / "other")
    config = json.loads((other / "preprocessor_config.json").read_text())
    config.update(max_pixels=56 * 56, size={"shortest_edge": 28 * 28, "longest_edge": 56 * 56})
    (other / "preprocessor_config.json").write_text(json.dumps(config))
    (other / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen2_5_VLProcessor"}))
    cfg = make_config(vl_model, standin_python, tmp_path, num_engines=1, engine_args={"tokenizer_path": str(other)})
    engine = SGLangEngine.from_config(cfg)
    try:
        ours, _ = _ours(vl_model, images)
        with pytest.raises(GenerateError, match=rf"a prompt of \d+ tokens, ours has {len(ours)}"):
            asyncio.run(engine.generate(ours, PARAMS, images=images))
    finally:
        asyncio.run(engine.shutdown())


def test_a_response_ends_before_a_sampled_vision_token(vl_model):
    """sglang-router drops logit_bias, so SGLang may sample a vision token; the engine ends the response
    before it (stop), its log-probs and routed experts cut to match, and leaves other responses alone."""
    from slime_rl.core.contracts import GenerateOutput
    from slime_rl.rollout_sglang.vision import end_before_vision_tokens, vision_token_ids

    ids = vision_token_ids(vl_model)
    processor = load_processor(vl_model)
    pad = processor.image_token_id
    assert pad in ids and len(ids) == 4
    out = GenerateOutput([5, 6, pad, 7], [-0.1, -0.2, -0.3, -0.4], "length", 2,
                         routed_experts=[[[0]]] * 13, token_versions=[2, 2, 2, 2])  # 10 prompt + 4 new - 1
    cut = end_before_vision_tokens(out, ids, first=True)
    assert (cut.token_ids, cut.log_probs, cut.finish_reason) == ([5, 6], [-0.1, -0.2], "stop")
    assert len(cut.routed_experts) == 11 and cut.token_versions == [2, 2]
    assert end_before_vision_tokens(GenerateOutput([5, 6], [-0.1, -0.2], "length", 2), ids,
                                    first=True).finish_reason == "length"
    starts_with_pad = GenerateOutput([pad, 5], [-0.1, -0.2], "length", 2)
    with pytest.raises(ValueError, match=f"first response token was the vision token {pad}"):
        end_before_vision_tokens(starts_with_pad, ids, first=True)  # the trainer takes no empty response
    assert end_before_vision_tokens(starts_with_pad, ids, first=False).token_ids == []  # a later part: ends there
