"""A vision-language Sample: its image references survive to_dict/from_dict and the buffer's store; the
processor's tensors (multimodal_train_inputs) are derived, so neither keeps them."""

from __future__ import annotations

import json

import pytest
import torch

from slime_rl.core.sample import Sample


def _vl_sample() -> Sample:
    return Sample(index=3, tokens=[1, 2, 3], multimodal_inputs={"images": ["/data/a.png", "data:image/png;base64,AA=="]},
                  multimodal_train_inputs={"pixel_values": torch.ones(8, 1176),
                                           "image_grid_thw": torch.tensor([[1, 2, 2], [1, 2, 2]])})


def test_to_dict_keeps_the_images_and_drops_the_tensors():
    data = _vl_sample().to_dict()
    assert data["multimodal_inputs"] == {"images": ["/data/a.png", "data:image/png;base64,AA=="]}
    assert data["multimodal_train_inputs"] is None
    back = Sample.from_dict(json.loads(json.dumps(data)))
    assert back.multimodal_inputs == data["multimodal_inputs"] and back.multimodal_train_inputs is None


def test_the_buffer_store_keeps_the_images():
    store = pytest.importorskip("slime_rl.buffer.store")
    (back,) = store.decode_group(store.encode_group([_vl_sample()]))
    assert back.multimodal_inputs["images"][0] == "/data/a.png" and back.multimodal_train_inputs is None
