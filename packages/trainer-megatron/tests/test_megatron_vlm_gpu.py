"""Qwen2.5-VL and Qwen3-VL in the Megatron trainer on the GPU (scripts/gpu/run.sh stage vlm): log-probs of samples with several
images against transformers' on the same device, bf16 and fp32, packed (the flash varlen kernel, the compiled mRoPE
table) and padded, on a config wide enough for bf16 rounding to show. Fresh processes per case (launch). The figures
printed here go to docs/gpu-results.md:

    python -m pytest packages/trainer-megatron/tests/test_megatron_vlm_gpu.py -m gpu -s
"""

from __future__ import annotations

import pytest
import torch
from megatron_testlib import launch
from vlm_scenario import make_vl_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# wider than the CPU tests' model: 4 LM layers of 512 (head dim 64), a 4-block vision tower of 128
TEXT = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
            initializer_range=0.02, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                     "mrope_section": [8, 12, 12]})
VISION = dict(depth=4, hidden_size=128, intermediate_size=256, num_heads=4, out_hidden_size=512,
              fullatt_block_indexes=[1, 3], initializer_range=0.02)
# Qwen3-VL: Qwen3 text (head dim 64 given), deepstack from vision blocks 1 and 2, an 8 x 8 learned position grid
QWEN3_TEXT = {**TEXT, "head_dim": 64}
QWEN3_VISION = dict(depth=4, hidden_size=128, intermediate_size=256, num_heads=4, out_hidden_size=512,
                    deepstack_visual_indexes=[1, 2], num_position_embeddings=64, initializer_range=0.02)


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def vl_model(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param) / "m"
    if request.param == "qwen3_vl":
        return make_vl_model(folder, family="qwen3_vl", vision=QWEN3_VISION, **QWEN3_TEXT)
    return make_vl_model(folder, vision=VISION, **TEXT)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("batching", ["trainer.max_tokens_per_gpu=8192", "trainer.micro_batch_size=4"])
def test_vl_log_probs_match_transformers_on_cuda(vl_model, tmp_path, dtype, batching):
    spec = dict(scenario="vlm_hf_parity", model=str(vl_model), num_samples=12, response=(32, 96),
                overrides=["cluster.device=cuda", f"model.dtype={dtype}", batching])
    diff = launch(1, spec, tmp_path)["abs_diff"]
    print(f"\n{vl_model.parent.name} {dtype} {batching}: |megatron - transformers| mean {diff.mean():.2e},"
          f" max {diff.max():.2e} over {diff.numel()} tokens")
    if dtype == "float32":
        assert diff.max() <= 1e-3  # TF32 is off by default on both sides; cuBLAS orders sums differently
    else:
        assert diff.mean() < 2e-2 and diff.max() < 0.5
