"""The issue-16 benchmarks (benchmarks/weight_sync.py, benchmarks/colocated_step.py) on the CPU with tiny
shapes, so their code runs in CI; their real runs are on the H200 (docs/gpu-results.md)."""

from __future__ import annotations

import pytest
from script_imports import benchmark
from standin import fake_sglang_python


def test_weight_sync_benchmark_times_every_path_and_checks_the_engines_weights(tmp_path, capsys):
    pytest.importorskip("aiohttp", reason="the stand-in server needs slime-rl-rollout-sglang[test]")
    weight_sync = benchmark("weight_sync")
    rows = weight_sync.main(["--shape", "tiny", "--device", "cpu", "--engine-python", fake_sglang_python(tmp_path),
                             "--bucket-mb", "1", "--paths", *weight_sync.PATHS, "--syncs", "2", "--warmup", "0",
                             "--work-dir", str(tmp_path / "work")])
    assert [r.path for r in rows] == list(weight_sync.PATHS)
    for row in rows:
        assert len(row.seconds) == 2 and all(s > 0 for s in row.seconds)
        # the engine's checksums of every tensor it holds under a trainer name equal the trainer's: embed_tokens
        # and lm_head, each layer's o_proj, down_proj and two norms, the final norm (SGLang fuses q/k/v, gate/up)
        assert row.checked == 2 + 2 * 4 + 1
    out = capsys.readouterr().out
    assert "| tiny | engine-copy | 1 | 1 |" in out
    # where each sync's time goes: the loop's path pushes, flushes, and queues the restore copy whose disk write
    # runs on after the sync (no request is out, so no pause and no continue); posting straight to SGLang does
    # none of that
    phases = {r.path: r.phases for r in rows}
    assert {"push bucket", "flush", "restore copy", "restore finish"} <= set(phases["trainer"])
    assert not {"pause", "continue"} & set(phases["trainer"])
    assert set(phases["direct"]) == {"post bucket"}
    assert next(r for r in rows if r.path == "trainer").background_s > 0
    assert "[tiny] trainer        per sync: " in out


def test_weight_sync_benchmark_times_adapter_syncs_against_the_full_sync(tmp_path, capsys):
    """--lora-rank (issue 20): the server starts with the LoRA flags; the adapter paths load rank-4 adapters
    (the stand-in checks every tensor's PEFT name and shape against the model) and each adapter row is
    set against the full-weight row of the same way in (IPC/by value: trainer; a folder: disk)."""
    pytest.importorskip("aiohttp", reason="the stand-in server needs slime-rl-rollout-sglang[test]")
    weight_sync = benchmark("weight_sync")
    rows = weight_sync.main(["--shape", "tiny", "--device", "cpu", "--engine-python", fake_sglang_python(tmp_path),
                             "--bucket-mb", "1", "--paths", "trainer", "adapter", "adapter-engine", "disk", "adapter-disk",
                             "--lora-rank", "4",
                             "--syncs", "2", "--warmup", "0", "--work-dir", str(tmp_path / "work")])
    full, adapter, adapter_engine, full_disk, adapter_disk = rows
    assert [r.path for r in rows] == ["trainer", "adapter", "adapter-engine", "disk", "adapter-disk"]
    assert full.checked == full_disk.checked == 2 + 2 * 4 + 1
    assert adapter.checked == adapter_engine.checked == adapter_disk.checked == 1  # one server lists it
    # tiny: 2 layers x 7 projections x (A + B), rank 4, bf16
    shapes = {"q": (64, 64), "k": (32, 64), "v": (32, 64), "o": (64, 64), "gate": (128, 64), "up": (128, 64),
              "down": (64, 128)}
    assert adapter.gb * 1e9 == 2 * sum(4 * (out + inp) * 2 for out, inp in shapes.values())
    out = capsys.readouterr().out
    assert "[tiny] adapter / trainer (full weights), 1 MiB buckets: " in out
    assert "[tiny] adapter-disk / disk (full weights), 1 MiB buckets: " in out
    assert "[tiny] adapter-engine / disk" not in out
    # an adapter sync loads the new adapter, unloads the one before, and leaves its folder to a background write
    assert {"load adapter", "unload adapter", "adapter folder"} <= set(adapter.phases)
    assert "pause" not in adapter.phases and adapter.background_s > 0


@pytest.mark.slow
def test_colocated_step_benchmark_tables_every_phase_of_a_step(tmp_path, capsys):
    """Through the real loop (Megatron trainer, HF engine on the CPU): each phase's time and share of the
    step, and the train phase's MFU; ~60 s, nearly all of it Ray's and Megatron's start."""
    colocated_step = benchmark("colocated_step")
    result = colocated_step.main(["--device", "cpu", "--engine", "hf", "--shape", "tiny", "--prompts", "2",
                                  "--samples", "2", "--prompt-len", "8", "--response-len", "4", "--steps", "1",
                                  "--work-dir", str(tmp_path)])
    (row,) = result["rows"]
    phases = [name for name, _, _ in result["windows"]]
    assert phases[0] == "rollout" and {"train", "weight_sync"} <= set(phases)
    out = capsys.readouterr().out
    assert f"| train | {row['time/train']:.2f} |" in out
    assert "MFU" in out and "of the step" in out


def test_async_speedup_lengths_have_the_long_tail_asked_for():
    async_speedup = benchmark("async_speedup")
    lengths = async_speedup.long_tail_lengths(48, 48, 1.0, 1024)
    assert lengths == async_speedup.long_tail_lengths(48, 48, 1.0, 1024)  # every mode, every run: the same work
    p50, p99 = async_speedup.percentile(lengths, 0.5), async_speedup.percentile(lengths, 0.99)
    assert p99 / p50 >= async_speedup.MIN_TAIL_RATIO and max(lengths) <= 1024
    with pytest.raises(SystemExit):  # a distribution without the tail is refused
        async_speedup.main(["--groups", "48", "--sigma", "0.5", "--device", "cpu", "--engine", "hf"])


@pytest.mark.slow
def test_async_speedup_benchmark_runs_the_same_work_in_every_mode(tmp_path, capsys):
    """Through the real loop (Megatron trainer, HF engine on the CPU) in off, one_step and fully: each mode
    trains every group once with its own response length (ignore_eos), and the table has every figure; ~40 s."""
    async_speedup = benchmark("async_speedup")
    args = ["--device", "cpu", "--engine", "hf", "--shape", "tiny", "--groups", "8", "--batch", "2", "--samples", "2",
            "--prompt-len", "8", "--median-len", "4", "--sigma", "1.5", "--max-len", "64", "--work-dir", str(tmp_path)]
    results = async_speedup.main(args)
    assert [r.mode for r in results] == list(async_speedup.MODES)
    lengths = async_speedup.long_tail_lengths(8, 4, 1.5, 64)
    for r in results:
        dropped = r.rows[-1].get("fully_async/dropped_stale_total", 0.0)
        if dropped == 0:  # each group trained once, each response exactly its prompt's length
            assert r.trained_tokens == 2 * sum(lengths) and len(r.rows) == 4
        assert 0 < r.engine_busy_s <= r.wall_s * 1.01 and 0 < r.trainer_busy_s <= r.wall_s * 1.01
    fully = results[-1]
    assert max(row["staleness/max"] for row in fully.rows) <= 2  # --max-staleness
    out = capsys.readouterr().out
    assert "| mode | steps | wall s | trained tok/s | engine busy | trainer busy |" in out
    assert "speedup fully/off:" in out and "speedup fully/one_step:" in out


@pytest.mark.slow
def test_async_speedup_kill_option_on_the_stand_in_server(tmp_path, capsys):
    """--kill-engine-at-step through the real loop with the SGLang engine (stand-in servers behind the real
    sglang-router, the Megatron trainer): the server is SIGKILLed at step 2's notice, restarted with the current
    weights, the run completes and its metrics count the restart. A kill at a step, not after seconds: a run
    sized for a kill 3 s in took 237 s on a slow day (400 groups; 80 had once ended before the kill)."""
    pytest.importorskip("aiohttp", reason="the stand-in server needs slime-rl-rollout-sglang[test]")
    async_speedup = benchmark("async_speedup")
    (result,) = async_speedup.main([
        "--device", "cpu", "--engine", "sglang", "--engine-python", fake_sglang_python(tmp_path), "--shape", "tiny",
        "--modes", "fully", "--groups", "40", "--batch", "2", "--samples", "2", "--prompt-len", "8",
        "--median-len", "4", "--sigma", "1.5", "--max-len", "64", "--kill-engine-at-step", "2",
        "--work-dir", str(tmp_path / "work")])
    assert len(result.killed) == 1 and result.restarts >= 1 and len(result.rows) >= 1
    assert "engine kill: PASS" in capsys.readouterr().out


@pytest.mark.parametrize("shape", ["tiny-moe", "tiny-deepseek-v3"])
def test_moe_replay_gap_benchmark_replays_the_engines_experts(shape, tmp_path, capsys):
    """Issue 19's replay measurement end to end on the CPU (HF engine, tiny Qwen3-MoE or DeepSeek-V3, fp32, the
    Megatron trainer; ~10 s each): every sample brings the engine's routed experts (DeepSeek's: chosen by biased
    sigmoid scores within groups, its dense first layer's row zeros), the trainer's log-probs follow the experts the
    batch carries (the shifted-experts control moves them), and in fp32 both passes match the engine's."""
    moe_replay_gap = benchmark("moe_replay_gap")
    result = moe_replay_gap.main(["--engine", "hf", "--device", "cpu", "--shape", shape, "--prompts", "4",
                                  "--prompt-len", "8", "--new-tokens", "8", "--work-dir", str(tmp_path)])
    assert result.tokens == 4 * 8
    assert result.mean_off < 1e-4 and result.mean_on < 1e-4  # fp32, same weights: replaying the engine's own
    assert result.max_on < 1e-3                                # choices keeps the parity routing alone has
    assert result.control_shift > 1e-3  # other experts, other log-probs: the replay reached the routers
    out = capsys.readouterr().out
    assert "| 32 | " in out and "replay cuts the mean gap" in out and "control (engine's experts shifted" in out


def test_moe_replay_gap_benchmark_names_samples_without_routed_experts():
    from slime_rl.core.sample import Sample

    moe_replay_gap = benchmark("moe_replay_gap")
    fed = Sample(index=0, tokens=[5, 6, 7], rollout_routed_experts=[[[0, 1]], [[2, 3]]])  # 3 tokens, 2 fed
    bare = Sample(index=1, tokens=[5, 6, 7])
    assert moe_replay_gap.missing_experts([fed, bare]) == ["sample 1: 0 routed-expert rows for 3 tokens"]


@pytest.mark.parametrize("shape", ["tiny-moe", "tiny-deepseek-v3"])
def test_moe_replay_gap_benchmark_through_sglang_engine_on_the_stand_in(shape, tmp_path, capsys):
    """The GPU run's path on the CPU (~15 s each; stages moe-replay, deepseek-replay): SGLangEngine starts the
    (stand-in) server with --enable-return-routed-experts, each request goes straight to the engine, its base64
    routed experts (a made-up routing, not the trainer's; every layer's row, DeepSeek's dense first layer's too)
    reach the trainer and move its log-probs. The stand-in's log-probs are made up, so the gaps mean nothing here."""
    pytest.importorskip("aiohttp", reason="the stand-in server needs slime-rl-rollout-sglang[test]")
    from slime_rl.core.testing import stdlib_text, train_tokenizer

    moe_replay_gap = benchmark("moe_replay_gap")
    train_tokenizer(stdlib_text(10), vocab_size=512).save_pretrained(tmp_path / "tokenizer")
    result = moe_replay_gap.main(["--engine", "sglang", "--engine-python", fake_sglang_python(tmp_path), "--device",
                                  "cpu", "--shape", shape, "--prompts", "4", "--prompt-len", "8", "--new-tokens",
                                  "8", "--tokenizer-path", str(tmp_path / "tokenizer"), "--work-dir", str(tmp_path)])
    assert result.tokens == 4 * 8
    assert abs(result.mean_on - result.mean_off) > 1e-4  # the stand-in's experts, not the trainer's own, were used
    assert result.control_shift > 1e-3
    assert "| 32 | " in capsys.readouterr().out
