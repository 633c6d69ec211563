"""End to end on CPU through `slime-cli train`: examples/react_agent's ReAct agent, unmodified (it speaks only the
`openai` package), trained through the run's gateway (rollout.generate_fn: gateway) with the transformers engine and
the Megatron trainer, on a task that takes two calculator calls before the answer (react_e2e.py). The reward rises; the trained
trajectories hold the tool turns (observations, loss mask 0); every trained token id is an id the engine sampled,
at the place it sampled it, with the engine's log-prob, checked token by token against the engine's log."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
SUPPORT = REPO / "tests" / "support"
AGENT = REPO / "examples" / "react_agent"
STEPS = int(os.environ.get("GATEWAY_E2E_STEPS", "24"))
EPISODES = 4 * 16  # rollout_batch_size * n_samples_per_prompt


@pytest.fixture(scope="module")
def react_model(tmp_path_factory) -> Path:
    """A tiny random Qwen2 with the chat tokenizer, warm-started on the agent's ReAct lines."""
    sys.path[:0] = [str(SUPPORT), str(AGENT)]
    from agent_runs import warm_started_chat_model
    from react_e2e import warm_start

    return warm_started_chat_model(tmp_path_factory.mktemp("react-model"), warm_start)


@pytest.mark.slow
def test_react_agent_trains_through_the_gateway(react_model, tmp_path):
    from agent_runs import rebuilds, recorded_rows
    from react_e2e import LABEL, QUESTION

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input": QUESTION, "label": LABEL}) + "\n" for _ in range(100)))
    records = tmp_path / "records"
    records.mkdir()
    run_dir = tmp_path / "run"
    config = tmp_path / "react.yaml"
    config.write_text(yaml.safe_dump({
        "model": {"path": str(react_model), "dtype": "float32"},
        "data": {"prompt_data": str(prompts), "apply_chat_template": False, "rollout_batch_size": 4,
                 "n_samples_per_prompt": 16, "num_rollout": STEPS},
        "rollout": {"engine": "agent_e2e:RecordingEngine", "generate_fn": "gateway",
                    "gateway": {"agent": "react_agent:run", "samples": "trajectory", "agent_timeout": 120},
                    "reward": "react_e2e:calculator_then_answer", "max_response_len": 256, "temperature": 1.0},
        "trainer": {"backend": "agent_e2e:RecordingTrainer", "lr": 1e-3, "adam_beta2": 0.99},
        "cluster": {"device": "cpu"},
        "logging": {"dir": str(run_dir), "tensorboard": False, "progress_bar": False, "save_rollouts": True},
    }))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SUPPORT), str(AGENT), os.environ.get("PYTHONPATH", "")]),
           "AGENT_E2E_DIR": str(records), "SLIME_RL_TORCH_THREADS": "1", "OMP_NUM_THREADS": "1",
           "REACT_AGENT_MODEL": "policy"}
    cli = Path(sys.executable).with_name("slime-cli")
    done = subprocess.run([str(cli), "train", str(config)], env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]

    # every trained sample against the engine's log: the episode whose calls build it, token by token
    calls_of: dict[str, list[dict]] = {}
    for row in recorded_rows(records, "engine"):
        episode, call = row["request_id"].split("/")
        calls_of.setdefault(episode, []).append({**row, "call": int(call)})
    trained = recorded_rows(records, "trainer")
    assert len(trained) == STEPS * EPISODES  # one trajectory per episode: no history here branches
    from slime_rl.core.testing import chat_tokenizer
    tok = chat_tokenizer()
    tool_turns, used = [], set()
    for row in trained:
        # an episode of the engine's log not yet given to another row that builds exactly this one (two episodes
        # can sample the same trajectory: then either will do, but each serves one row)
        match = next((e for e, calls in calls_of.items()
                      if e not in used and rebuilds(sorted(calls, key=lambda c: c["call"]), row, first_call_is_prompt=True)),
                     None)
        assert match is not None, f"trained sample {row['sample_id']} is no episode the engine sampled"
        used.add(match)
        # the tool turns: observation segments (loss mask 0) between sampled turns, each the agent's Observation
        prompt_len = len(row["tokens"]) - len(row["loss_mask"])
        segments, current = [], []
        for k, m in enumerate(row["loss_mask"]):
            if m == 0:
                current.append(row["tokens"][prompt_len + k])
            elif current:
                segments.append(current)
                current = []
        assert all("Observation: " in tok.decode(s) for s in segments)
        tool_turns.append(len(segments))
    late = tool_turns[-(STEPS // 3) * EPISODES:]
    print(f"tool turns per trained trajectory, last third: mean {statistics.fmean(late):.2f}")
    assert sum(n >= 2 for n in late) >= 0.5 * len(late), late  # the task's two calculator calls, trained on

    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rewards = [m["rollout/reward_mean"] for m in metrics if "rollout/reward_mean" in m]
    assert len(rewards) == STEPS
    start, last = statistics.fmean(rewards[:3]), statistics.fmean(rewards[-(STEPS // 3):])
    print(f"reward per step: {' '.join(f'{r:.2f}' for r in rewards)}; first 3 steps {start:.2f}, last third {last:.2f}")
    assert last >= start + 0.15, rewards

