"""LoRA in the Megatron trainer (fp32, gloo): TP=2 and PP=2 give what TP=1 gives (loss, the adapters'
gradients, the updated adapters; within 1e-5 over three steps) and resume bit for bit; the base weights
never move; the reference is the base model; the merged weights and the saved PEFT folder give, in
transformers and PEFT, the log-probs of the trainer's base + adapter forward (within 1e-5)."""

from __future__ import annotations

import pytest
import torch
from lora_scenario import run_lora
from megatron_testlib import (
    ensure_single_rank_group,
    hf_response_log_probs,
    launch,
    load_hf,
    make_hf_model,
    make_samples,
)

from slime_rl.core.algorithms.lora import peft_name

LORA = ["trainer.lora.rank=4", "trainer.lora.alpha=8", "algorithm.use_kl_loss=true", "algorithm.kl_loss_coef=0.1",
        "algorithm.entropy_coef=0.01", "trainer.lr=0.01"]
SPEC = dict(num_samples=6, vocab=256, steps=3)


def _close(a: dict, b: dict, atol: float = 1e-5) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert torch.allclose(a[name].float(), b[name].float(), atol=atol, rtol=0), name


@pytest.mark.parametrize("layout", ["tp2", "pp2", "dp2"])
def test_lora_two_ranks_match_one(layout, tmp_path):
    # q,v,o,up,down: fused layers partly targeted (k and gate rows held at zero)
    targets = ["trainer.lora.target_modules=[q_proj,v_proj,o_proj,up_proj,down_proj]"]
    # tp2 recomputes its layers in backward: the adapters must get their gradients all the same
    family, parallel = {"tp2": ("qwen2", "parallel.tensor_model_parallel_size=2 trainer.megatron.recompute=true"),
                        "pp2": ("llama", "parallel.pipeline_model_parallel_size=2"),
                        "dp2": ("qwen3", "trainer.max_tokens_per_gpu=48")}[layout]  # DP: adapter grads summed
    model = make_hf_model(tmp_path / "model", family, tie=True, vocab=256)
    spec = {**SPEC, "model": str(model), "scenario": "lora"}
    ensure_single_rank_group()
    single = run_lora({**spec, "overrides": LORA + targets})
    multi = launch(2, {**spec, "overrides": LORA + targets + [*parallel.split(), "cluster.actor_num_gpus_per_node=2"],
                       "save_after": 1, "ckpt": str(tmp_path / "ckpt")}, tmp_path)

    exported = single["adapters_init"]
    assert not any(".k_proj." in n or ".gate_proj." in n for n in exported)
    assert {n.rsplit(".", 3)[1] for n in exported} == {"q_proj", "v_proj", "o_proj", "up_proj", "down_proj"}
    _close(single["adapters_init"], multi["adapters_init"], atol=0)  # the same initial A, B = 0
    for k in range(3):
        one, two = single["metrics"][k], multi["metrics"][k]
        assert abs(one["loss"] - two["loss"]) <= 1e-5 and abs(one["grad_norm"] - two["grad_norm"]) <= 1e-5
        _close(single["grads"][k], multi["grads"][k])
        _close(single["adapters"][k], multi["adapters"][k])
    # B moved off zero, A moved too: the gradients reached both
    for name, b in single["adapters"][-1].items():
        assert not torch.equal(b, single["adapters_init"][name]), name
    assert single["base_unchanged"] and multi["base_unchanged"]
    assert multi["resumed_metrics"] == multi["metrics"][1:]
    assert all(torch.equal(t, multi["adapters"][-1][n]) for n, t in multi["resumed_adapters"].items())
    # the two-rank checkpoint (saved after step 1) loads into one rank: the adapters reshard exactly
    from megatron_testlib import make_config

    from slime_rl.trainer_megatron.trainer import MegatronTrainer

    one_rank = MegatronTrainer.from_config(make_config(model, LORA + targets))
    one_rank.load(str(tmp_path / "ckpt"))
    resharded = {n: t.cpu() for bucket in one_rank.named_weights(1 << 20) for n, t in bucket}
    _close(resharded, multi["adapters"][0], atol=0)


def test_lora_trains_adapters_only_and_exports_exactly(tmp_path):
    model_path = make_hf_model(tmp_path / "model", "qwen2", tie=False, vocab=256)
    ensure_single_rank_group()
    out = run_lora({**SPEC, "model": str(model_path), "overrides": LORA + ["checkpoint.save_hf_merged=true"],
                    "save_hf": str(tmp_path / "hf")})
    # only the adapters train and hold optimizer state: 2 layers x (qkv, proj, fc1, fc2) x (A, B)
    assert len(out["trainable"]) == 16 and all("_lora." in n for n in out["trainable"])
    hidden, inter, q, kv, r = 64, 128, 64, 32, 4
    per_layer = r * hidden + (q + 2 * kv) * r + r * q + hidden * r + r * hidden + 2 * inter * r + r * inter + hidden * r
    assert out["optimized_params"] == 2 * per_layer
    assert out["base_unchanged"]
    # the reference is the base: unchanged by training, and equal to transformers on the HF folder
    assert out["ref_log_probs"] == out["ref_log_probs_init"] == out["log_probs"]  # B = 0 at the start
    assert out["trained_log_probs"] != out["ref_log_probs"]
    samples = make_samples(SPEC["num_samples"], SPEC["vocab"])
    base = load_hf(model_path)
    for s, ref in zip(samples, out["ref_log_probs"], strict=True):
        assert torch.allclose(hf_response_log_probs(base, s.tokens, s.response_length), torch.tensor(ref), atol=1e-5)

    # merged weights (what a merged sync sends) and the saved merged folder: the trainer's forward
    merged_model = load_hf(tmp_path / "hf" / "merged")
    saved = merged_model.state_dict()
    _close({n: saved[n] for n in out["merged"]}, out["merged"], atol=0)
    import peft

    adapted = peft.PeftModel.from_pretrained(load_hf(model_path), str(tmp_path / "hf")).eval()
    for s, ours in zip(samples, out["trained_log_probs"], strict=True):
        ours = torch.tensor(ours)
        assert torch.allclose(hf_response_log_probs(merged_model, s.tokens, s.response_length), ours, atol=1e-5)
        assert torch.allclose(hf_response_log_probs(adapted, s.tokens, s.response_length), ours, atol=1e-5)
    # the PEFT folder holds what the adapter sync sends
    from safetensors.torch import load_file

    on_disk = load_file(tmp_path / "hf" / "adapter_model.safetensors")
    _close(on_disk, out["adapters"][-1], atol=0)
    assert peft_name("model.layers.1.mlp.down_proj.weight", "B") in on_disk


def test_lora_refuses_what_it_does_not_cover(tmp_path):
    from megatron_testlib import make_config

    from slime_rl.core.config.checks import check_config
    from slime_rl.core.config.schema import ConfigError

    model_path = make_hf_model(tmp_path / "model", "llama", vocab=256)
    with pytest.raises(ConfigError, match="model.ref_path"):
        check_config(make_config(model_path, ["trainer.lora.rank=4", f"model.ref_path={tmp_path}"]))
    with pytest.raises(ConfigError, match="trainer.lora"):
        check_config(make_config(model_path, ["trainer.lora.rank=4", "algorithm.advantage_estimator=ppo"]))
    with pytest.raises(ConfigError, match="checkpoint.save_hf_merged"):
        check_config(make_config(model_path, ["checkpoint.save_hf_merged=true"]))


def test_lora_dropout_acts_in_training_only(tmp_path):
    model_path = make_hf_model(tmp_path / "model", "llama", vocab=256)
    ensure_single_rank_group()
    spec = {**SPEC, "model": str(model_path), "steps": 1}
    plain = run_lora({**spec, "overrides": LORA})
    dropped = run_lora({**spec, "overrides": LORA + ["trainer.lora.dropout=0.5"]})
    assert dropped["log_probs"] == plain["log_probs"]  # no dropout when scoring
    b_grads = [name for name in plain["grads"][0] if name.endswith(".B")]
    assert b_grads and all(not torch.allclose(plain["grads"][0][n], dropped["grads"][0][n]) for n in b_grads)
