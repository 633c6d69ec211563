"""LoRA through the real loop with the SGLang engine on CPU (issue 20): the Megatron trainer trains
adapters, its ranks push them to stand-in SGLang servers (a test double with SGLang 0.5.17's LoRA
endpoints) behind the real sglang-router as one adapter per version; every rollout names the adapter
of the step before, and old adapters leave the servers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from standin import standin_loop_config

from slime_rl.core.run.loop import train


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["tensor", "disk"])
def test_lora_loop_syncs_adapters_to_sglang(transport, tiny_model_dir, tmp_path, monkeypatch):
    pytest.importorskip("aiohttp", reason="the stand-in server needs slime-rl-rollout-sglang[test]")
    run = tmp_path / "run"
    cfg = standin_loop_config(tiny_model_dir, tmp_path, monkeypatch, transport=transport,
                              overrides=["trainer.lora.rank=4", "trainer.lora.alpha=8"])
    summary = train(cfg)
    rows = [json.loads(line) for line in Path(summary["metrics_file"]).read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["rollout/weight_version_lag"] == 0.0 for r in rows)
    layers = json.loads((tiny_model_dir / "config.json").read_text())["num_hidden_layers"]
    server_logs = sorted((run / "sglang" / "logs").glob("sglang-engine-*.log"))
    assert server_logs
    for log in server_logs:  # the stand-in logs its LoRA events as JSON lines (the run stopped the servers)
        events = [json.loads(line.split(" event ", 1)[1]) for line in log.read_text().splitlines()
                  if line.startswith("[standin-sglang] event ")]
        loads = [e for e in events if e["kind"] == "load_lora_adapter"]
        # every sync: the trainer's A and B of 7 projections per layer, as one adapter per version
        assert [(e["lora_name"], e["success"], e["num_tensors"]) for e in loads] == \
            [(f"slime-v{v}", True, 2 * 7 * layers) for v in (1, 2, 3)]
        assert all((e["lora_path"] == "__tensor__") == (transport == "tensor") for e in loads)
        assert [e["lora_name"] for e in events if e["kind"] == "unload_lora_adapter"] == ["slime-v1", "slime-v2"]
        # step 1 rolled out on the base (requests naming no adapter are not logged), step k on the adapter
        # of step k - 1, in that order
        named = [e["lora"] for e in events if e["kind"] == "generate"]
        assert set(named) == {"slime-v1", "slime-v2"} and named == sorted(named)
    assert (run / "sglang" / "adapters" / "v3" / "adapter_model.safetensors").is_file()
