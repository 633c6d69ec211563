"""The hf engine's role server (role_server.py) answers the run's `RoleClient` as SGLang does: a teacher's prefill
log-probs equal the model's own (float64 reference), a reward model's /classify scores equal its scalar head, a
judge's text is the model's greedy continuation, and nothing but /health answers without the role's key."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from slime_rl.core.roles.client import RoleClient, RoleError
from slime_rl.core.testing import tiny_model_folder
from slime_rl.core.testing.roles import tiny_reward_model_folder
from slime_rl.rollout_hf.role_server import HFRoleServer

torch.set_num_threads(1)
KEY = "sk-hf-role-0123456789abcdef"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("roles")
    causal = tiny_model_folder(root / "causal")
    return causal, tiny_reward_model_folder(root / "rm", causal)


def serve(path, kind):
    model_cls = AutoModelForSequenceClassification if kind == "reward_model" else AutoModelForCausalLM
    model = model_cls.from_pretrained(path, dtype=torch.float64)
    server = HFRoleServer(model, AutoTokenizer.from_pretrained(path), kind=kind, api_key=KEY, path=str(path))
    return server, RoleClient("r", server.url, KEY, timeout_s=30, attempts=1), model


def test_a_teachers_prefill_is_the_models_own_log_probs(folders):
    server, client, model = serve(folders[0], "teacher")
    try:
        seqs = [[5, 17, 300, 42, 9], [7, 8, 9]]
        rows = asyncio.run(client.prefill_log_probs(seqs, [3, 1]))
        for seq, row in zip(seqs, rows, strict=True):
            with torch.no_grad():
                logits = model(torch.tensor([seq])).logits[0, :-1].log_softmax(-1)
            want = logits.gather(-1, torch.tensor(seq[1:])[:, None]).squeeze(-1)[-len(row):]
            torch.testing.assert_close(torch.tensor(row, dtype=torch.float64), want, rtol=0, atol=1e-6)
        text = asyncio.run(client.generate("def main(", max_new_tokens=5, ignore_eos=True))
        assert isinstance(text, str) and text
    finally:
        server.stop()


def test_a_reward_models_scores_are_its_scalar_head(folders):
    server, client, model = serve(folders[1], "reward_model")
    try:
        texts = ["def main():", "import os\nprint(1)"]
        scores = asyncio.run(client.classify(texts))
        tok = AutoTokenizer.from_pretrained(folders[1])
        with torch.no_grad():
            want = [model(**tok(t, return_tensors="pt")).logits[0, 0].item() for t in texts]
        assert scores == pytest.approx(want, abs=1e-6) and scores[0] != scores[1]
        with pytest.raises(RoleError, match="HTTP 400"):  # a reward model generates nothing
            asyncio.run(client.generate("x"))
    finally:
        server.stop()


def test_only_health_answers_without_the_key(folders):
    server, _, _ = serve(folders[0], "judge")
    try:
        assert httpx.get(server.url + "/health").status_code == 200
        assert httpx.post(server.url + "/generate", json={"text": "x"}).status_code == 401
        assert httpx.get(server.url + "/model_info", headers={"Authorization": "Bearer wrong"}).status_code == 401
        with pytest.raises(RoleError) as err:
            asyncio.run(RoleClient("r", server.url, "sk-wrong-key-000000", attempts=1).generate("x"))
        assert "HTTP 401" in str(err.value) and KEY not in str(err.value)
    finally:
        server.stop()
