"""Dying engines through the training loop: the real sglang-router in front of stand-in SGLang servers
(a test double; real SGLang needs a GPU: benchmarks/async_speedup.py --kill-engine-after there), the real
Megatron trainer, the trainer pushing the weights itself. A server SIGKILLed mid-rollout or mid-sync is
restarted with the current weights and the run goes on, losing and doubling nothing; a server that never
answers a weight sync fails the run within rollout.sglang.weight_sync_timeout, naming the engine."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
from script_imports import benchmark
from standin import fake_sglang_python

from slime_rl.core.config import load_config
from slime_rl.core.run.loop import train

STEPS, GROUPS_PER_STEP, SAMPLES = 3, 2, 4


def run_config(tmp_path: Path, model: Path, *extra: str):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input": f"def f{i}(", "label": ""}) + "\n" for i in range(20)))
    return load_config(None, [
        f"model.path={model}", f"data.prompt_data={prompts}", f"data.rollout_batch_size={GROUPS_PER_STEP}",
        f"data.n_samples_per_prompt={SAMPLES}", f"data.num_rollout={STEPS}", "rollout.max_response_len=24",
        "rollout.engine=sglang", f"rollout.sglang.engine_python={fake_sglang_python(tmp_path)}",
        "rollout.update_weight_transport=tensor", "rollout.reward=toy_rewards:digit_token_fraction",
        "trainer.lr=0.01", "cluster.device=cpu", f"logging.dir={tmp_path / 'run'}", "logging.tensorboard=false",
        "logging.save_rollouts=true", *extra,
    ])


@pytest.fixture
def loop_env(tiny_model_dir, monkeypatch):
    pytest.importorskip("aiohttp", reason="the stand-in server needs slime-rl-rollout-sglang[test]")
    monkeypatch.setenv("TOY_TOKENIZER", str(tiny_model_dir))
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parents[1] / "support"))
    monkeypatch.setenv("SLIME_RL_TORCH_THREADS", "1")
    return tiny_model_dir


def server_urls(model: Path) -> dict[int, str]:
    """Process group -> URL of every stand-in server of ``model`` (from its command line)."""
    urls = {}
    for pgid in benchmark("async_speedup").sglang_server_groups(model):
        cmd = psutil.Process(pgid).cmdline()
        urls[pgid] = f"http://{cmd[cmd.index('--host') + 1]}:{cmd[cmd.index('--port') + 1]}"
    return urls


def rows_and_samples(tmp_path: Path, summary: dict) -> tuple[list[dict], dict[int, list[dict]]]:
    rows = [json.loads(line) for line in Path(summary["metrics_file"]).read_text().splitlines()]
    samples = {step: [json.loads(line) for line in
                      (tmp_path / "run" / "rollouts" / f"step_{step:06d}.jsonl").read_text().splitlines()]
               for step in range(1, STEPS + 1)}
    return rows, samples


def assert_nothing_lost_or_doubled(samples: dict[int, list[dict]]) -> None:
    every = [s for step in samples.values() for s in step]
    assert len(every) == STEPS * GROUPS_PER_STEP * SAMPLES
    assert len({s["index"] for s in every}) == len(every)  # none doubled
    groups = sorted(s["group_index"] for s in every)
    assert groups == sorted(g for g in range(STEPS * GROUPS_PER_STEP) for _ in range(SAMPLES))  # none skipped
    assert all(s["status"] in ("completed", "truncated") and s["response_length"] > 0 for s in every)


@pytest.mark.slow
def test_a_server_killed_mid_rollout_comes_back_with_the_current_weights(loop_env, tmp_path):
    """SIGKILL during step 2's generation (after the step-1 sync made version 1): the monitor restarts the
    server and restores version 1 from the copy the trainer's sender wrote; the requests that were on it
    are retried; step 2 completes on version 1."""
    killed: list[int] = []
    step_1_done = threading.Event()

    def kill_while_generating() -> None:  # step 2's requests take ~0.7 s each (24 tokens x 30 ms)
        step_1_done.wait(600)
        ((pgid, url),) = server_urls(loop_env).items()
        while not httpx.get(f"{url}/standin/state", timeout=5).json()["running"]:
            time.sleep(0.02)
        os.killpg(pgid, signal.SIGKILL)
        killed.append(pgid)

    def callback(event: str, payload: dict) -> None:
        if event == "step" and payload["step"] == 1:
            step_1_done.set()

    killer = threading.Thread(target=kill_while_generating, daemon=True)
    killer.start()
    cfg = run_config(tmp_path, loop_env, "rollout.sglang.server_args.standin_token_delay=0.03")
    summary = train(cfg, callback)
    rows, samples = rows_and_samples(tmp_path, summary)
    assert len(killed) == 1
    assert [r["step"] for r in rows] == [1, 2, 3] and all("train/loss" in r for r in rows)
    assert rows[0]["engine/restarts"] == 0 and rows[1]["engine/restarts"] == 1 == rows[2]["engine/restarts"]
    assert rows[1]["engine/request_retries"] > 0  # the dead server's requests, sent again
    assert_nothing_lost_or_doubled(samples)
    # every step ran on the weights synced after the step before: the restarted server got version 1 back
    assert [{s["weight_version"] for s in samples[step]} for step in (1, 2, 3)] == [{0}, {1}, {2}]


@pytest.mark.slow
def test_a_server_killed_mid_sync_is_left_out_of_it_and_restored_after(loop_env, tmp_path):
    """Each weight update takes 1 s on the server; SIGKILL while it loads version 2. The sender leaves the
    dead server out, the sync completes, and the restarted server gets version 2 from the restore copy."""
    killed: list[tuple[int, bool]] = []  # (process group, whether the sync was still going: no continue yet)
    stop = threading.Event()

    def kill_during_the_second_sync() -> None:
        servers: dict[int, str] = {}
        while not stop.wait(0.05):
            servers = servers or server_urls(loop_env)  # found once: the scan is slow on a busy machine
            for pgid, url in servers.items():
                try:
                    seen = [e["kind"] if e["kind"] != "update_weights_from_tensor" else f"update v{e['weight_version']}"
                            for e in httpx.get(f"{url}/standin/state", timeout=2).json()["events"]]
                except httpx.HTTPError:
                    continue
                if "update v2" in seen:
                    os.killpg(pgid, signal.SIGKILL)
                    killed.append((pgid, "continue_generation" not in seen[seen.index("update v2"):]))
                    return

    watcher = threading.Thread(target=kill_during_the_second_sync, daemon=True)
    watcher.start()
    cfg = run_config(tmp_path, loop_env, "rollout.sglang.server_args.standin_update_delay=1.0")
    try:
        summary = train(cfg)
    finally:
        stop.set()
    rows, samples = rows_and_samples(tmp_path, summary)
    assert killed and killed[0][1], "the kill came after the sync had ended"
    assert [r["step"] for r in rows] == [1, 2, 3] and all("train/loss" in r for r in rows)
    assert rows[2]["engine/restarts"] == 1
    assert_nothing_lost_or_doubled(samples)
    assert {s["weight_version"] for s in samples[3]} == {2}  # restored to the version whose sync it died in


@pytest.mark.slow
def test_a_server_that_never_answers_a_weight_sync_fails_the_run_within_the_timeout(loop_env, tmp_path):
    """Weight updates never answer: the first sync (after step 1's training) fails after
    rollout.sglang.weight_sync_timeout, and the error names the server, the step and the call."""
    marks: dict[str, float] = {}

    def callback(event: str, payload: dict) -> None:
        marks[event] = time.monotonic()

    cfg = run_config(tmp_path, loop_env, "rollout.sglang.server_args.standin_update_delay=inf",
                     "rollout.sglang.weight_sync_timeout=3")
    with pytest.raises(Exception, match=r"sglang engine 0 \(http://127\.0\.0\.1:\d+\): weight sync v1 bucket 0 "
                                        r"\(tensor\): /update_weights_from_tensor timed out after 3 s"):
        train(cfg, callback)
    assert "step" not in marks  # step 1 never completed: its sync is what failed
    assert time.monotonic() - marks["start"] < 60  # one rollout, one train step and the 3 s: no hang
