"""Elastic engines and delta syncs in a whole run (issue 42's CPU acceptance): a fully async job on the hf engine
grows from 1 to 3 engines through `slime-cli engines`, shrinks to 1, takes a late joiner and loses the first ones,
over 20 steps of delta syncs. Every group is trained once or recorded (the fully async ledger), every serving
engine's weights are bit-equal to the trainer's after every sync (rollout.elastic.verify_weights: a joiner's
first sync is full), and each step reports its change fraction and bytes moved."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from standin import fake_sglang_python

from slime_rl.cli.engines import call
from slime_rl.core.run import checkpoint

TRAIN = "import sys; from slime_rl.core.config import load_config; from slime_rl.core.run.loop import train; " \
        "train(load_config(None, sys.argv[1:]))"
STEPS = 20


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.parametrize("engine", ["hf", "sglang"])
def test_engines_join_and_leave_a_fully_async_run_with_delta_syncs(engine, tiny_model_dir, tmp_path):
    """On the SGLang stand-ins each engine of the pool is an SGLangEngine with its own server and router; those
    engines expose no current_weight, so their syncs stay full (delta into SGLang goes by the trainer's sender,
    packages/rollout-sglang/tests/test_delta_sync.py) and verify_weights has nothing to hash."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input": f"x{i} = ", "label": str(i)}) + "\n" for i in range(120)))
    run_dir = tmp_path / "run"
    overrides = [
        f"model.path={tiny_model_dir}", f"data.prompt_data={prompts}", "data.rollout_batch_size=2",
        "data.n_samples_per_prompt=4", f"data.num_rollout={STEPS}", "rollout.max_response_len=24",
        "rollout.reward=toy_rewards:digit_token_fraction", "cluster.async_mode=fully", "rollout.max_staleness=2",
        "rollout.update_weight_mode=delta", "rollout.elastic.enabled=true", "rollout.elastic.verify_weights=true",
        "rollout.elastic.max_engines=4", "trainer.lr=1e-4",
        "cluster.device=cpu", f"logging.dir={run_dir}", "logging.tensorboard=false", "logging.save_rollouts=true",
        f"checkpoint.save_interval={STEPS}",
    ]
    if engine == "sglang":
        pytest.importorskip("aiohttp", reason="the stand-in server needs slime-rl-rollout-sglang[test]")
        overrides += ["rollout.engine=sglang", f"rollout.sglang.engine_python={fake_sglang_python(tmp_path)}",
                      "rollout.update_weight_transport=tensor",
                      # stand-in tokens take 0.2 s: an SGLang engine takes longer to start than a step of
                      # instant tokens, and the run would end before the plan
                      "rollout.sglang.server_args={standin_token_delay: 0.2}"]
    env = {**os.environ, "TOY_TOKENIZER": str(tiny_model_dir), "PYTHONPATH": str(Path(__file__).parents[1] / "support"),
           "SLIME_RL_TORCH_THREADS": "1", "OMP_NUM_THREADS": "1"}
    run = subprocess.Popen([sys.executable, "-c", TRAIN, *overrides], env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    # (rows seen before acting, action, target): grow to 3, shrink to 1, a late joiner, the last original leaves
    plan = [(3, "add", "2"), (7, "remove", "engine-0"), (8, "remove", "engine-1"), (11, "add", "1"),
            (14, "remove", "engine-2")]
    answers = []
    try:
        deadline = time.time() + 900
        while plan and run.poll() is None:
            assert time.time() < deadline, "the run made no progress"
            if len(rows(run_dir / "metrics.jsonl")) < plan[0][0]:
                time.sleep(0.1)
                continue
            try:
                serving = all(e["state"] == "serving" for e in call(run_dir, "list")["engines"])
            except FileNotFoundError:  # the run ended (its endpoint went with it): its output says why
                break
            # an added engine serves after the next sync; the next action waits for it (a remove leaving no
            # engine serving is refused, by design)
            if serving and len(rows(run_dir / "metrics.jsonl")) >= plan[0][0]:
                _, action, target = plan.pop(0)
                answers.append(call(run_dir, action, target))
            time.sleep(0.1)
        output, _ = run.communicate(timeout=900)
    finally:
        run.kill()
    assert run.returncode == 0, output[-4000:]
    assert not plan, f"the run ended before {plan}"
    assert [e["name"] for e in answers[0]["engines"]] == ["engine-0", "engine-1", "engine-2"]
    assert [e["name"] for e in answers[-1]["engines"]] == ["engine-3"]
    moved = sum(a.get("requests_moved", 0) for a in answers)

    metrics = [r for r in rows(run_dir / "metrics.jsonl") if "weights/bytes_moved" in r]
    assert len(metrics) == STEPS
    counts = [r["engine/count"] for r in metrics]
    assert max(counts) == 3 and counts[-1] == 1
    deltas = [r["weights/delta"] for r in metrics]
    if engine == "hf":
        assert all(r["weights/engines_verified"] >= 1 for r in metrics)  # every sync checked bit for bit
        assert deltas[0] == 0 and sum(deltas) >= STEPS // 2  # full after a join, deltas otherwise
    else:
        assert sum(deltas) == 0 and all(r["weights/bytes_moved"] == r["weights/full_bytes"] for r in metrics)
    assert all(r["weights/bytes_moved"] < r["weights/full_bytes"] for r in metrics if r["weights/delta"])
    assert all(0.0 <= r["weights/changed_fraction"] <= 1.0 for r in metrics)
    assert metrics[-1]["engine/requests_moved"] == moved

    trained = [json.loads(lines[i])["group_index"] for k in range(1, STEPS + 1)
               for lines in [(run_dir / "rollouts" / f"step_{k:06d}.jsonl").read_text().splitlines()]
               for i in range(0, len(lines), 4)]
    assert len(trained) == len(set(trained)) == 2 * STEPS  # none twice
    fully = checkpoint.latest(run_dir / "checkpoints")[1]["rollout_state"]["fully_async"]
    ledger = fully["ledger"]
    assert ledger["trained"] == trained
    held = [g[0]["group_index"] for g in fully["ready"] + fully["in_flight"]]
    accounted = trained + held + ledger["filtered"] + ledger["failed"] + ledger["dropped_stale"]
    assert sorted(accounted) == list(range(len(accounted)))  # every group handed out, none lost
