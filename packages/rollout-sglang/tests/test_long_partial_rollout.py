"""Partial rollout with a 64k-token response budget through SGLangEngine and a stand-in server (issue 36,
item 4): the server runs with the context length the config implies (prompt + response), a response
aborted mid-way resumes from prompt + its tokens with the budget it has left, which the server accepts
(input + max_new_tokens reaches the context length, never passes it), and a budget past it is refused."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest
from test_engine import make_config

from slime_rl.core.contracts import SamplingParams
from slime_rl.core.run.rollout import generate_single_turn
from slime_rl.core.sample import Sample, SampleStatus
from slime_rl.rollout_sglang import launch
from slime_rl.rollout_sglang.engine import SGLangEngine

PROMPT_LEN, RESPONSE_LEN = 64, 65536


@pytest.fixture
def long_model(tiny_model, tmp_path):
    folder = tmp_path / "long-model"
    shutil.copytree(tiny_model, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 131072}))
    return folder


def test_a_64k_response_aborted_twice_resumes_within_the_context(long_model, standin_python, tmp_path):
    cfg = make_config(long_model, standin_python, tmp_path / "run", num_engines=1, max_prompt_len=PROMPT_LEN,
                      max_response_len=RESPONSE_LEN, partial_rollout=True,
                      engine_args={"standin_token_delay": 0.001})
    assert launch.engine_args(cfg)["context_length"] == PROMPT_LEN + RESPONSE_LEN
    engine = SGLangEngine.from_config(cfg)
    sample = Sample(index=0, tokens=list(range(3, 3 + PROMPT_LEN)))
    params = SamplingParams(max_new_tokens=RESPONSE_LEN, ignore_eos=True)

    async def generate_then_abort() -> None:
        task = asyncio.create_task(generate_single_turn(sample, params, engine))
        await asyncio.sleep(0.5)
        await engine.abort()
        await asyncio.wait_for(task, 30)

    async def run():
        lengths = []
        for _ in range(2):  # generated, aborted; resumed from prompt + response, aborted again
            await generate_then_abort()
            assert sample.status == SampleStatus.ABORTED, sample.metadata
            lengths.append(sample.response_length)
        # one token past the context: the server refuses, naming the limit
        over = SamplingParams(max_new_tokens=RESPONSE_LEN - sample.response_length + 1)
        with pytest.raises(Exception, match=f"maximum context length of {PROMPT_LEN + RESPONSE_LEN} tokens"):
            await engine.generate(sample.tokens, over)
        return lengths

    try:
        first, second = asyncio.run(run())
    finally:
        asyncio.run(engine.shutdown())
    assert 0 < first < second < RESPONSE_LEN
    assert sample.prompt_length == PROMPT_LEN and len(sample.tokens) == PROMPT_LEN + second
    assert len(sample.loss_mask) == len(sample.rollout_log_probs) == second == len(sample.token_versions)
