"""The stand-in SGLang server (a test double, slime_rl.rollout_sglang.testing) for the
cross-package tests: real SGLang needs a GPU."""

from __future__ import annotations

import json
from pathlib import Path

from slime_rl.rollout_sglang.testing import standin_python


def fake_sglang_python(folder: Path) -> str:
    """An 'interpreter' whose ``-m sglang.launch_server ARGS`` runs the stand-in server with ARGS."""
    return standin_python(folder)


def standin_loop_config(model_dir: Path, tmp_path: Path, monkeypatch, *, transport: str, overrides: list[str]):
    """Three steps of the real loop on the tiny model through stand-in SGLang servers behind the real router,
    weights synced over ``transport``; ``overrides`` add to it. Stand-in servers read the tokenizer from
    TOY_TOKENIZER; Ray workers import toy_rewards from this folder."""
    from slime_rl.core.config import load_config

    monkeypatch.setenv("TOY_TOKENIZER", str(model_dir))
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent))
    monkeypatch.setenv("SLIME_RL_TORCH_THREADS", "1")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input": f"def f{i}(", "label": ""}) + "\n" for i in range(20)))
    return load_config(None, [
        f"model.path={model_dir}", f"data.prompt_data={prompts}", "data.rollout_batch_size=2",
        "data.n_samples_per_prompt=4", "data.num_rollout=3", "rollout.max_response_len=6",
        "rollout.engine=sglang", f"rollout.sglang.engine_python={fake_sglang_python(tmp_path)}",
        f"rollout.update_weight_transport={transport}", "rollout.reward=toy_rewards:digit_token_fraction",
        "trainer.lr=0.01", "cluster.device=cpu", f"logging.dir={tmp_path / 'run'}", "logging.tensorboard=false",
        *overrides,
    ])
