"""SGLangEngine against the conformance suite (slime_rl.core.testing.conformance) on CPU: the real engine code
and the real sglang-router, with stand-in SGLang servers (testing/server.py, a test double) behind it.

The stand-in's "model" is a hash of the context and the weights, not a forward pass, so log-prob agreement
with a reference is checked on the GPU only (test_sglang_gpu_conformance.py); every other guarantee is
checked here. Its routing of experts reads only config.json's MoE fields, so one run serves a dense Llama
folder whose config also names experts."""

from __future__ import annotations

import json
import shutil

from safetensors.torch import load_file
from test_engine import make_config, new_weights
from tokenizers import Tokenizer

from slime_rl.core.testing import conformance as cf
from slime_rl.core.testing.conformance import Backend, check_conformance
from slime_rl.rollout_sglang.engine import SGLangEngine


def test_sglang_engine_passes_the_suite_with_stand_in_servers(tiny_model, standin_python, tmp_path):
    moe = tmp_path / "tiny-moe"
    shutil.copytree(tiny_model, moe)
    config = json.loads((moe / "config.json").read_text())
    config.update(num_experts=8, num_experts_per_tok=2)  # the stand-in routes experts by these fields
    (moe / "config.json").write_text(json.dumps(config))
    # stop strings are in the suite: keep the server's tokenizer (launch.py skips it when rollout.stop is empty)
    cfg = make_config(moe, standin_python, tmp_path / "run",
                      engine_args={"enable_return_routed_experts": True, "skip_tokenizer_init": False})
    tokenizer = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    lines = ["the quick brown fox jumps over", "what is 1 + 2? the answer", "def add(a, b): return"]
    backend = Backend(
        make_engine=lambda: SGLangEngine.from_config(cfg),
        prompts=[tokenizer.encode(line).ids for line in lines],
        initial_weights=sorted(load_file(str(tiny_model / "model.safetensors")).items()),
        new_weights=new_weights(tiny_model, 2.0),
        decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=False),
        long_new_tokens=1500,  # 2 ms a token on the stand-in: 3 s
    )
    report = check_conformance(backend)
    print("\n" + report.describe(), report.figures)
    # no reference; pause and adapters unclaimed (docs/backends.md says why)
    assert set(report.not_checked) == {cf.LOG_PROBS, cf.PAUSE, cf.ADAPTERS}, report.describe()
    assert SGLangEngine.capabilities == {"release_memory", "routed_experts"}
