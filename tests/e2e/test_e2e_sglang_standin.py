"""The training loop with the SGLang engine on CPU: the real sglang-router in front of stand-in
SGLang servers (a test double; real SGLang needs a GPU, see docs/gpu-results.md for that run),
the real Megatron trainer, and the trainer-side weight push checked against the servers'
parameters after every sync."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from standin import fake_sglang_python, standin_loop_config

from slime_rl.core.config import load_config
from slime_rl.core.run.loop import train


@pytest.mark.slow
@pytest.mark.parametrize("transport,mode", [("tensor", "full"), ("disk", "full"), ("disk", "delta")])
def test_loop_through_sglang_router_with_trainer_side_weight_sync(transport, mode, tiny_model_dir, tmp_path,
                                                                 monkeypatch):
    pytest.importorskip("aiohttp", reason="the stand-in server needs slime-rl-rollout-sglang[test]")
    cfg = standin_loop_config(tiny_model_dir, tmp_path, monkeypatch, transport=transport,
                              overrides=["rollout.sglang.check_weight_update=true",
                                         f"rollout.update_weight_mode={mode}"])
    summary = train(cfg)
    rows = [json.loads(line) for line in Path(summary["metrics_file"]).read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    # every rollout ran on the weights of the step before (synced, checked equal, version reported)
    assert all(r["rollout/weight_version_lag"] == 0.0 for r in rows)
    assert all(r["rollout/tokens"] > 0 for r in rows)
    # change fraction and bytes moved, every run (issue 42); delta: the custom loader from the second sync on,
    # every parameter checked by /weights_checker after each
    moved = [(r["weights/bytes_moved"], r["weights/full_bytes"], r["weights/changed_fraction"]) for r in rows]
    assert [r["weights/delta"] for r in rows] == ([0, 1, 1] if mode == "delta" else [0, 0, 0])
    # a full sync moves every byte; a delta at most that, and nothing when the step changed nothing (a step whose
    # groups all got one reward has zero advantages: with the toy reward, two such steps in a row happen)
    for (b, full, changed), delta in zip(moved, (r["weights/delta"] for r in rows), strict=True):
        assert (0 <= b <= full and (b == 0) == (changed == 0)) if delta else b == full, \
            f"(bytes moved, full bytes, changed fraction) per step: {moved}"
    logs = (tmp_path / "run" / "sglang" / "logs")
    assert any(logs.iterdir()), "the servers' logs are kept next to the run"
    # The servers ran with the run's keys (from a private --config file, never on the command line)
    # and refused none of the loop's calls, the trainer's weight pushes included.
    server_logs = [p.read_text() for p in logs.glob("sglang-engine-*.log")]
    assert server_logs and all("--config" in text and "--api-key" not in text for text in server_logs)
    assert not any("refused" in text for text in server_logs)


@pytest.mark.slow
@pytest.mark.parametrize("reward", ["blocks_event_loop", "hangs"])
def test_hanging_rewards_fail_their_samples_and_weight_sync_goes_on(reward, tiny_model_dir, tmp_path, monkeypatch):
    """Three samples in eight get a reward that never returns (an async one blocking its event loop,
    or a plain one). Before, each hung the run or kept a thread of asyncio's default executor, which
    SGLang's weight sync also used: after two steps the sync would wait forever. Now the hung calls
    are killed at reward_timeout, their samples FAILED with the reason, and every step trains and syncs."""
    pytest.importorskip("aiohttp", reason="the stand-in server needs slime-rl-rollout-sglang[test]")
    monkeypatch.setenv("TOY_TOKENIZER", str(tiny_model_dir))
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parents[1] / "support"))
    monkeypatch.setenv("SLIME_RL_TORCH_THREADS", "1")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input": f"def f{i}(", "label": ""}) + "\n" for i in range(20)))
    cfg = load_config(None, [
        f"model.path={tiny_model_dir}", f"data.prompt_data={prompts}", "data.rollout_batch_size=2",
        "data.n_samples_per_prompt=4", "data.num_rollout=3", "rollout.max_response_len=6",
        "rollout.engine=sglang", f"rollout.sglang.engine_python={fake_sglang_python(tmp_path)}",
        "rollout.update_weight_transport=tensor", f"rollout.reward=hanging_rewards:{reward}",
        "rollout.reward_timeout=2", "trainer.lr=0.01", "cluster.device=cpu",
        f"logging.dir={tmp_path / 'run'}", "logging.tensorboard=false", "logging.save_rollouts=true",
    ])
    summary = train(cfg)
    rows = [json.loads(line) for line in Path(summary["metrics_file"]).read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and summary["steps"] == 3
    assert [r["rollout/samples_failed"] for r in rows] == [3, 3, 3]
    assert all(r["rollout/step_failed"] == 0 and "train/loss" in r for r in rows)
    for step in (1, 2, 3):
        samples = [json.loads(line) for line in
                   (tmp_path / "run" / "rollouts" / f"step_{step:06d}.jsonl").read_text().splitlines()]
        failed = [s for s in samples if s["status"] == "failed"]
        assert len(failed) == 3 and all(s["index"] % 8 < 3 for s in failed)
        assert {s["metadata"]["error"] for s in failed} == {f"reward 'hanging_rewards:{reward}' timed out after 2 s"}
        # each step ran on the weights the step before synced: versions advance
        assert {s["weight_version"] for s in samples} == {step - 1}
