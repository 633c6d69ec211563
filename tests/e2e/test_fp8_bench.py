"""benchmarks/fp8_rollout.py's rollout and sync modes on the CPU against the stand-in SGLang server, so the code
of the GPU stages bench-fp8-rollout-* and bench-fp8-sync (docs/gpu-results.md, issue 38) runs in CI: the three
server variants generate, the FP8 sync quantises at every sync and the engine's checksums equal the trainer's."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

from slime_rl.rollout_sglang.testing import standin_python

BENCHMARKS = Path(__file__).parents[2] / "benchmarks"


def test_the_fp8_benchmark_runs_its_rollout_and_sync_rows(tmp_path, capsys):
    python = standin_python(tmp_path)
    out = tmp_path / "rows.json"
    common = ["--shape", "tiny", "--python", python, "--work-dir", str(tmp_path / "work"), "--json", str(out)]
    sys.path.insert(0, str(BENCHMARKS))
    try:
        bench = importlib.import_module("fp8_rollout")
        bench.main(["rollout", *common, "--requests", "8", "--concurrency", "4", "--prompt-len", "16",
                    "--max-new-tokens", "8", "--variants", "bf16", "fp8", "fp8-kv", "fp8-channel"])
        bench.main(["sync", *common, "--device", "cpu", "--syncs", "1"])
        bench.main(["table", str(out)])
    finally:
        sys.path.remove(str(BENCHMARKS))
    rows = json.loads(out.read_text())
    rollouts = {r["variant"]: r for r in rows if r["mode"] == "rollout"}
    assert set(rollouts) == {"bf16", "fp8", "fp8-kv", "fp8-channel"}
    assert all(r["tokens"] == 64 for r in rollouts.values())
    assert rollouts["fp8-kv"]["flags"]["kv_cache_dtype"] == "fp8_e4m3"
    assert rollouts["fp8-channel"]["flags"]["quantization"] == "fp8"  # SGLang quantises the bf16 folder itself
    assert "quantization" not in rollouts["fp8"]["flags"]  # the block-FP8 folder says it in its config
    assert all(r["prefill_s"] > 0 for r in rollouts.values())  # timed apart, its one token each not counted above
    syncs = {r["variant"]: r for r in rows if r["mode"] == "sync"}
    assert syncs["fp8"]["checked"] == syncs["bf16"]["checked"] > 0  # every tensor the engine holds by that name
    config = json.loads((tmp_path / "work" / "tiny-fp8" / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [32, 32]
    printed = capsys.readouterr().out
    assert "FP8 / bf16 = " in printed and "(target <= 1.5)" in printed and "(target >= 1.3)" in printed
    assert "the prompts' prefill alone, s" in printed
