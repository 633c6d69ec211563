"""benchmarks/trainer_throughput.py's long-tailed RL mix row on the CPU at a tiny size, so its code runs in CI
(the Megatron trainer and the sorted transformers baseline, the kernel/op counts and the balance); its real
run is the GPU stage bench-trainer-mix (docs/gpu-results.md)."""

from __future__ import annotations

from script_imports import benchmark


def test_the_mix_row_runs_both_contenders_and_prints_their_figures(tmp_path, capsys):
    bench = benchmark("trainer_throughput")
    rows, figures = bench.main(["--device", "cpu", "--shape", "tiny", "--mix", "--samples", "8",
                                "--mix-prompt-len", "5", "20", "--mix-response-len", "5", "120",
                                "--mix-response-median", "30", "--max-tokens-per-gpu", "256",
                                "--threads", "1", "--steps", "1", "--warmup", "0", "--skip-memory",
                                "--peak-tflops", "1",
                                "--model-dir", str(tmp_path / "model")])
    assert [r["contender"] for r in rows] == ["megatron", "transformers"]
    assert all(r["train_step_s"] > 0 and r["mfu"] > 0 for r in rows)
    for name, (count, what, balance) in figures.items():
        assert what == "CPU leaf ops" and count > 100, name
        assert balance.micro_batches >= 2 and balance.tokens_max_over_mean >= 1
    assert figures["megatron"][2].padded_over_real == 1.0  # packed
    out = capsys.readouterr().out
    assert "long-tailed mix, seed 0: prompt p50" in out and "transformers baseline: sorted" in out
    assert "megatron / transformers tokens/s (1 thread(s)):" in out


def test_the_deepseek_row_trains_mla_models_against_transformers_deepseek_v3(tmp_path, capsys):
    """The bench-deepseek stage's code at CPU size (~20 s): the trainer's MLA, dense first layer and grouped routing
    next to transformers' DeepseekV3ForCausalLM, with the parameters and the two contenders' memory printed first."""
    bench = benchmark("trainer_throughput")
    rows, figures = bench.main(["--device", "cpu", "--shape", "tiny-deepseek-v3", "--samples", "4",
                                "--prompt-len", "12", "--response-len", "8", "--micro-batch-size", "2",
                                "--threads", "1", "--steps", "1", "--warmup", "0", "--skip-memory",
                                "--peak-tflops", "1", "--model-dir", str(tmp_path / "model")])
    assert [r["contender"] for r in rows] == ["megatron", "transformers"]
    assert all(r["train_step_s"] > 0 and 0 < r["mfu"] < 1 for r in rows)
    assert all(balance.micro_batches == 2 for _, _, balance in figures.values())
    out = capsys.readouterr().out
    assert "tiny-deepseek-v3: 0.01B parameters;" in out and "before activations: one contender held at a time" in out
    assert "## tiny-deepseek-v3 on cpu (float32)" in out


def test_the_long_sample_benchmark_trains_on_samples_as_long_as_the_models_positions(tmp_path, capsys):
    """benchmarks/long_sample_train.py (issue 36's 32k/64k rows on the GPU stage long-train) at CPU size: a model
    whose positions are exactly the longest sample passes the positions check and trains with full recompute."""
    bench = benchmark("long_sample_train")
    rows = bench.main(["--device", "cpu", "--shape", "tiny", "--lengths", "96", "160", "--prompt-len", "32",
                       "--steps", "1", "--warmup", "0", "--peak-tflops", "1", "--model-dir", str(tmp_path / "model")])
    assert [r["length"] for r in rows] == [96, 160]
    assert all(r["train_s"] > 0 and r["log_probs_s"] > 0 and r["peak"] > 0 for r in rows)
    assert "| 160 |" in capsys.readouterr().out
