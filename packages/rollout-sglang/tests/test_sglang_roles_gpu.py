"""GPU acceptance for served roles on SGLang 0.5.17 (issue 39; `bash scripts/gpu/run.sh roles-sglang`): a teacher's
prefill log-probs, a scalar reward model through ``--is-embedding`` and ``/classify`` for each scalar-head family
the bundle lists, a judge's text, all through the run's `RoleClient`, against transformers on the same weights;
a role's server refuses the admin endpoints to the role's key (frozen) and every call without it.

    python -m pytest packages/rollout-sglang/tests/test_sglang_roles_gpu.py -m gpu -s
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
import torch

from slime_rl.core.config import Config
from slime_rl.core.roles.client import RoleClient, RoleError
from slime_rl.core.testing import save_model, stdlib_text, tiny_config, tiny_model, train_tokenizer
from slime_rl.rollout_sglang.role_server import SGLangRoleServer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]

ARGS = {"attention_backend": "triton", "sampling_backend": "pytorch", "grammar_backend": "none",
        "cuda_graph_backend_decode": "disabled", "cuda_graph_backend_prefill": "disabled",
        "mem_fraction_static": 0.1, "max_total_tokens": 65536}
KEY = "sk-role-gpu-test-0123456789"


def tokenizer():
    lines = [line for text in stdlib_text(40) for line in text.splitlines(keepends=True)]
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"]
    return train_tokenizer(lines, vocab_size=1000, special_tokens=specials, bos_token=specials[0],
                           eos_token=specials[1], pad_token=specials[2])


def causal(out: Path, family: str = "llama") -> Path:
    tok = tokenizer()
    config = tiny_config(family, vocab_size=1024, hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
                         head_dim=64, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)
    return save_model(out, tiny_model(config, seed=0), tok, dtype=torch.bfloat16)


def reward_model(out: Path, family: str) -> Path:
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    base = causal(out.with_name(out.name + "-base"), family)
    config = AutoConfig.from_pretrained(base)
    config.num_labels = 1
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config).to(torch.bfloat16)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(base).save_pretrained(out)
    return out


def serve(tmp_path: Path, kind: str, path: Path) -> tuple[SGLangRoleServer, RoleClient]:
    cfg = Config.model_validate({"model": {"path": str(path), "dtype": "bfloat16"}, "cluster": {"device": "cuda"},
                                 "logging": {"dir": str(tmp_path / "run")},
                                 "roles": {"r": {"kind": kind, "path": str(path), "engine": "sglang",
                                                 "engine_args": ARGS}}})
    server = SGLangRoleServer.start(cfg, "r", api_key=KEY, gpu_ids=[0])
    return server, RoleClient("r", server.url, KEY, timeout_s=60)


def test_a_teachers_prefill_log_probs_match_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    path = causal(tmp_path / "teacher")
    server, client = serve(tmp_path, "teacher", path)
    try:
        seqs = [[1, 17, 300, 42, 9, 77], [1, 5, 6]]
        rows = asyncio.run(client.prefill_log_probs(seqs, [3, 2]))
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda()
        for seq, row in zip(seqs, rows, strict=True):
            logits = model(torch.tensor([seq], device="cuda")).logits[0, :-1].float().log_softmax(-1)
            want = logits.gather(-1, torch.tensor(seq[1:], device="cuda")[:, None]).squeeze(-1)[-len(row):]
            gap = (torch.tensor(row, device="cuda") - want).abs().max().item()
            print(f"teacher prefill: {len(row)} tokens, max |SGLang - transformers| {gap:.4f} (bf16)")
            assert gap < 0.1
        assert len(asyncio.run(client.generate("def main(", max_new_tokens=8))) > 0  # a judge's text path
        # frozen: the role's key opens no admin endpoint
        denied = httpx.post(server.url + "/update_weights_from_disk", json={"model_path": str(path)},
                            headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
        assert denied.status_code in (401, 403), denied.text
        with pytest.raises(RoleError, match="HTTP 401"):
            asyncio.run(RoleClient("r", server.url, None, timeout_s=30).generate("x"))
    finally:
        server.stop()


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_a_scalar_reward_model_scores_like_transformers(tmp_path, family):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = reward_model(tmp_path / f"rm-{family}", family)
    server, client = serve(tmp_path, "reward_model", path)
    try:
        texts = ["def main():\n    return 1\n", "import os\nprint(os.getcwd())\n"]
        scores = asyncio.run(client.classify(texts))
        model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).cuda()
        tok = AutoTokenizer.from_pretrained(path)
        want = [model(**tok(t, return_tensors="pt").to("cuda")).logits[0, 0].item() for t in texts]
        print(f"reward model {family}: SGLang {scores} transformers {want}")
        assert scores == pytest.approx(want, abs=0.05 + 0.05 * max(abs(w) for w in want))
    finally:
        server.stop()
