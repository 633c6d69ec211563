"""benchmarks/moe_step_profile.py on the CPU at the tiny-moe size, so its code runs in CI: one trainer, two
variants (today's dispatch and megatron-core's), each MoE piece labelled and counted; its real run is the GPU
stage profile-moe (docs/gpu-results.md)."""

from __future__ import annotations

from script_imports import benchmark


def test_the_profile_counts_each_variants_ops_and_moe_pieces(tmp_path, capsys):
    bench = benchmark("moe_step_profile")
    results = bench.main(["--device", "cpu", "--shape", "tiny-moe", "--samples", "4", "--prompt-len", "12",
                          "--response-len", "6", "--micro-batch-size", "2", "--steps", "1", "--warmup", "0",
                          "--top", "5", "--variants", "as-is", "megatron-dispatch", "--model-dir", str(tmp_path / "m")])
    assert results["log_probs_vs_first"] == {"as-is": 0.0, "megatron-dispatch": 0.0}
    local, mcore = results["as-is"]["profiles"], results["megatron-dispatch"]["profiles"]
    for phase in ("compute_log_probs", "train_step"):
        assert 0 < local[phase]["ops"] < mcore[phase]["ops"], phase  # no identity sort by local expert
        pieces = local[phase]["pieces"]
        # 4 layers x 2 micro-batches, forward only
        assert pieces["moe/router"][0] == pieces["moe/experts"][0] == pieces["moe/dispatch_postprocess"][0] == 8
    assert local["train_step"]["host_reads"]["aten::_local_scalar_dense"] > 0
    out = capsys.readouterr().out
    assert "## megatron-dispatch: tiny-moe on cpu (float32)" in out and "| moe/experts | 8 |" in out
