"""benchmarks/vlm_trainer_throughput.py at a tiny size on the CPU, so the code of the GPU stage bench-vlm (issue 41)
runs in CI: both contenders do one GRPO update on the same samples with images, and in fp32 their old log-probs
agree (the trainer's packed micro-batches against transformers' padded ones with an attention mask)."""

from __future__ import annotations

from script_imports import benchmark


def test_the_vlm_benchmark_runs_both_contenders_on_the_same_batch(tmp_path, capsys):
    bench = benchmark("vlm_trainer_throughput")
    rows, gap = bench.main(["--device", "cpu", "--shape", "tiny-vl", "--samples", "4", "--images", "2", "--grid", "8",
                            "8", "--prompt-len", "8", "--response-len", "16", "--max-tokens-per-gpu", "1024",
                            "--baseline-micro-batch-size", "2", "--warmup", "0", "--steps", "1",
                            "--folder", str(tmp_path)])
    assert [r["contender"] for r in rows] == ["transformers", "megatron"]
    assert all(r["train_step_s"] > 0 and r["train_tok_s"] > 0 for r in rows)
    assert gap.numel() == 4 * 16 and float(gap.max()) <= 1e-4
    out = capsys.readouterr().out
    assert "| contender | log-probs s | train step s |" in out and "trainer / transformers train tokens/s:" in out
