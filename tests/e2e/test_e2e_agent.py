"""End to end on CPU through `slime-cli train`: the built-in multi-turn agent with a tool, the transformers
engine and the Megatron trainer, on a toy tool task (call the tool, then answer). Trajectories take 2-4 turns;
every observation token has loss mask 0 and every sampled token 1; the ids the trainer trains on are the ids
the engine sampled, token by token, with the engine's log-probs beside them; the reward rises."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

HERE = Path(__file__).resolve().parents[1] / "support"
STEPS = 30


@pytest.fixture(scope="module")
def agent_model(tmp_path_factory) -> Path:
    """A tiny random Qwen2 with the chat tokenizer, warm-started on the tool-call format."""
    from agent_e2e import warm_start
    from agent_runs import warm_started_chat_model

    return warm_started_chat_model(tmp_path_factory.mktemp("agent-model"), warm_start)


@pytest.mark.slow
def test_agent_learns_toy_tool_task_through_slime_cli(agent_model, tmp_path):
    from agent_runs import rebuilds, recorded_rows
    from agent_task import PROMPT, SECRET

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input": [{"role": "user", "content": PROMPT}], "label": SECRET}) + "\n"
                               for _ in range(100)))
    records = tmp_path / "records"
    records.mkdir()
    run_dir = tmp_path / "run"
    config = tmp_path / "agent.yaml"
    config.write_text(yaml.safe_dump({
        "model": {"path": str(agent_model), "dtype": "float32"},
        "data": {"prompt_data": str(prompts), "apply_chat_template": True, "rollout_batch_size": 4,
                 "n_samples_per_prompt": 8, "num_rollout": STEPS},
        "rollout": {"engine": "agent_e2e:RecordingEngine", "generate_fn": "multi_turn",
                    "tools": ["agent_task:lookup"], "max_turns": 4, "tool_timeout": 10,
                    "reward": "agent_task:used_tool_then_answered", "max_response_len": 160, "temperature": 1.0},
        "trainer": {"backend": "agent_e2e:RecordingTrainer", "lr": 1e-3, "adam_beta2": 0.99},
        "cluster": {"device": "cpu"},
        "logging": {"dir": str(run_dir), "tensorboard": False, "progress_bar": False, "save_rollouts": True},
    }))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
           "AGENT_E2E_DIR": str(records), "SLIME_RL_TORCH_THREADS": "1", "OMP_NUM_THREADS": "1"}
    cli = Path(sys.executable).with_name("slime-cli")
    done = subprocess.run([str(cli), "train", str(config)], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]

    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rewards = [m["rollout/reward_mean"] for m in metrics if "rollout/reward_mean" in m]
    assert len(rewards) == STEPS
    start, last = statistics.fmean(rewards[:3]), statistics.fmean(rewards[-(STEPS // 3):])
    print(f"reward per step: {' '.join(f'{r:.2f}' for r in rewards)}; first 3 steps {start:.2f}, last third {last:.2f}")
    # The untrained policy's level (the first 3 steps: +-0.05 over 96 episodes) against the last third's mean
    # (+-0.03): a policy that does not learn stays near its start, one that collapses falls (at lr 3e-3 it hit 0
    # at step 7). Against the first third instead, which already learns, a run going 0.28 -> 0.72 failed.
    assert last >= start + 0.25, rewards

    # Every trained sample, against what the engine sampled for it, token by token.
    engine_turns: dict[str, list[dict]] = {}
    for row in recorded_rows(records, "engine"):
        session, turn = row["request_id"].split("/")
        engine_turns.setdefault(session, []).append({**row, "turn": int(turn)})
    sessions_of: dict[int, list[str]] = {}
    for session in engine_turns:
        sessions_of.setdefault(int(session[1:].split("-")[0]), []).append(session)
    trained = recorded_rows(records, "trainer")
    assert len(trained) == STEPS * 32
    rollouts = {s["index"]: s for f in sorted((run_dir / "rollouts").glob("step_*.jsonl"))
                for s in map(json.loads, f.read_text().splitlines())}
    turn_counts = []
    for row in trained:
        tokens, mask = row["tokens"], row["loss_mask"]
        # the engine session whose turns build exactly this trajectory (a sample aborted and redone has others)
        matches = [s for s in sessions_of[row["sample_id"]]
                   if rebuilds(sorted(engine_turns[s], key=lambda t: t["turn"]), row, first_call_is_prompt=False)]
        assert len(matches) == 1, (row["sample_id"], sessions_of[row["sample_id"]])
        turns = sorted(engine_turns[matches[0]], key=lambda t: t["turn"])
        turn_counts.append(len(turns))
        sample = rollouts[row["sample_id"]]
        assert sample["tokens"] == tokens and sample["loss_mask"] == mask
        assert sample["metadata"]["turns"] == len(turns) <= 4
    late = turn_counts[-(STEPS // 3) * 32:]  # the last third's episodes
    assert sum(2 <= n <= 4 for n in late) >= 0.6 * len(late), late  # the task takes two turns or more
    assert max(turn_counts) <= 4

