"""The parts of benchmarks/trainer_throughput.py that decide its figures: the sorted, token-budget
transformers baseline computes the same log-probs and gradients as a full log-softmax, the FLOPs count
each sample's attention, the long-tailed lengths, the micro-batch balance and the launch count.
(The benchmark's whole run on the CPU: tests/e2e/test_trainer_throughput_bench.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from script_imports import benchmark


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    transformers = pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("tiny-llama")
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      tie_word_embeddings=True, max_position_embeddings=256)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


class GradientRecorder:
    """An optimizer that keeps the gradients it is handed instead of stepping."""

    def __init__(self, model):
        self.model, self.grads = model, {}

    def step(self):
        self.grads = {n: p.grad.clone() for n, p in self.model.named_parameters() if p.grad is not None}

    def zero_grad(self, set_to_none=True):
        self.model.zero_grad(set_to_none=set_to_none)


def test_the_sorted_budget_baseline_matches_a_full_log_softmax(tiny_model):
    """Sorted into budget micro-batches, the head in chunks of 5 tokens recomputed in backward: the same
    per-token log-probs and the same gradients as one padded batch with a full log-softmax."""
    tt, tb = benchmark("trainer_throughput"), benchmark("transformers_baseline")
    prompts, responses = tt.mix_lengths(9, (2, 12), (1, 60), median=8, sigma=1.2, seed=3)
    samples = tt.samples_of_lengths(prompts, responses, vocab=96, seed=3)
    full = tb.TransformersBaseline(tiny_model, "cpu", autocast=False, micro_batch_size=len(samples))
    ours = tb.SortedBudgetBaseline(tiny_model, "cpu", autocast=False, max_tokens=80)
    ours.chunk = 5
    groups = ours.groups([len(s.tokens) for s in samples])
    assert len(groups) > 1 and any(len(g) > 1 for g in groups)

    (grid,) = full.log_probs(samples)
    # position p predicts token p + 1: the response's predictors are prompt-1 .. length-2
    expected = {i: grid[i, len(s.tokens) - s.response_length - 1 : len(s.tokens) - 1]
                for i, s in enumerate(samples)}
    got = {}
    for rows, flat in zip(groups, ours.log_probs(samples), strict=True):
        for i, part in zip(rows, flat.split([samples[i].response_length for i in rows]), strict=True):
            got[i] = part
    assert sorted(got) == list(range(len(samples)))
    for i in got:
        torch.testing.assert_close(got[i], expected[i], atol=1e-5, rtol=1e-5)

    for baseline in (full, ours):
        baseline.opt = GradientRecorder(baseline.model)
        baseline.train_step(samples, baseline.log_probs(samples))
    assert full.opt.grads.keys() == ours.opt.grads.keys()
    for name, grad in full.opt.grads.items():
        torch.testing.assert_close(ours.opt.grads[name], grad, atol=1e-6, rtol=1e-4, msg=name)


def test_sorted_budget_groups_fit_the_budget_longest_first():
    tb = benchmark("transformers_baseline")
    lengths = [5, 30, 12, 12, 3, 50, 7]
    groups = tb.sorted_budget_groups(lengths, max_tokens=40)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert groups[0] == [5]  # over the budget: a micro-batch of its own
    assert [lengths[i] for g in groups for i in g] == sorted(lengths, reverse=True)
    for g in groups[1:]:
        assert len(g) * max(lengths[i] for i in g) <= 40
    assert groups == [[5], [1], [2, 3, 6], [0, 4]]


def test_flops_count_each_samples_attention():
    tt = benchmark("trainer_throughput")
    _, _, hidden, _, layers, heads, _, _, _ = tt.SHAPES["qwen2.5-1.5b"]
    short_and_long = tt.model_flops("qwen2.5-1.5b", [100, 8100])
    mean = tt.model_flops("qwen2.5-1.5b", [4100, 4100])
    # 12 * layers * hidden * (sum of L_i^2 - what the mean length counts)
    assert short_and_long - mean == pytest.approx(12 * layers * hidden * (100**2 + 8100**2 - 2 * 4100**2))
    # Qwen3-30B-A3B: 32 heads of 128 are 4096 wide, twice its hidden size of 2048
    per_token = tt.model_flops_per_token
    assert per_token("qwen3-30b-a3b-reduced", 2) - per_token("qwen3-30b-a3b-reduced", 1) == 12 * 4 * 32 * 128


def test_mix_lengths_are_seeded_within_range_and_long_tailed():
    tt = benchmark("trainer_throughput")
    prompts, responses = tt.mix_lengths(128, (100, 500), (50, 8192), median=512, sigma=1.2, seed=0)
    assert (prompts, responses) == tt.mix_lengths(128, (100, 500), (50, 8192), median=512, sigma=1.2, seed=0)
    other_prompts, other_responses = tt.mix_lengths(128, (100, 500), (50, 8192), median=512, sigma=1.2,
                                                    seed=1)
    assert other_prompts != prompts and other_responses != responses
    assert sorted(other_responses) == sorted(responses)  # another order of the same quantiles
    assert 100 <= min(prompts) and max(prompts) <= 500
    ordered = sorted(responses)
    assert ordered[0] >= 50 and ordered[-1] == 8192  # the cap is reached
    assert ordered[63] <= 512 <= ordered[64]  # the median
    assert ordered[-2] >= 8 * ordered[64]  # a long tail: the next-to-longest is many medians long


def test_balance_and_percentiles():
    figures = benchmark("step_figures")
    lengths = [10, 10, 20, 40]
    packed = figures.balance([[3], [0, 1, 2]], lengths, padded=False)
    assert packed.micro_batches == 2
    assert packed.tokens_max_over_mean == pytest.approx(40 / 40)
    assert packed.attention_max_over_mean == pytest.approx(1600 / ((1600 + 600) / 2))
    assert packed.padded_over_real == 1.0
    padded = figures.balance([[3], [0, 1, 2]], lengths, padded=True)
    assert padded.padded_over_real == pytest.approx((40 + 3 * 20) / 80)
    assert figures.percentiles(list(range(1, 101))) == "p50 50 / p90 90 / p99 99 / max 100"


def test_launches_count_the_operators_of_each_call():
    figures = benchmark("step_figures")
    once, what = figures.launches(lambda: torch.ones(3) + 1, "cpu")
    five, _ = figures.launches(lambda: [torch.ones(3) + 1 for _ in range(5)], "cpu")
    assert what == "CPU leaf ops" and once >= 2 and five == 5 * once


def _matrix_params_per_token(model, topk: int) -> int:
    """The weights one token multiplies through in ``model`` (a transformers DeepSeek-V3, any device), read from
    its tensors: every matrix of attention and dense MLPs, the router, top-k routed experts and the shared experts
    of MoE layers (the fused experts' tensors hold every expert: a token uses top-k of them), and the LM head."""
    total = model.lm_head.weight.numel()
    for layer in model.model.layers:
        total += sum(p.numel() for p in layer.self_attn.parameters() if p.dim() == 2)
        experts = getattr(layer.mlp, "experts", None)
        for name, p in layer.mlp.named_parameters():
            if p.dim() == 2:  # dense MLP, shared experts, router
                total += p.numel()
            elif name.startswith("experts."):  # [experts, ...]: one expert's share, top-k times
                total += p.numel() // experts.num_experts * topk
    return total


@pytest.mark.parametrize("shape", ["tiny-deepseek-v3", "deepseek-v3-reduced"])
def test_deepseek_flops_count_the_weights_a_token_goes_through(shape):
    """The MLA FLOPs formula (deepseek_shapes.py) against the transformers model's own tensors, built on the meta
    device: 6 x the weights a token multiplies through, plus its attention over q/k (nope + rope) and v head dims."""
    transformers = pytest.importorskip("transformers")
    tt, ds = benchmark("trainer_throughput"), benchmark("deepseek_shapes")
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(tt.hf_config(shape))
    _, _, _, _, layers, heads, _, _, _ = tt.SHAPES[shape]
    mla = ds.DEEPSEEK[shape]
    active = _matrix_params_per_token(model, topk=tt.MOE[shape][1])
    attention = 6 * layers * heads * (mla.qk_nope_head_dim + mla.qk_rope_head_dim + mla.v_head_dim)
    assert tt.model_flops_per_token(shape, 1) == 6 * active + attention
    assert tt.model_flops_per_token(shape, 101) - tt.model_flops_per_token(shape, 1) == 100 * attention


def test_deepseek_v3_reduced_is_v3s_layer_structure_and_fits_one_80gb_gpu_twice():
    """Issue 37's reduced shape: 1 dense + 3 MoE layers, MLA with V3's ranks and head dims, 64 experts of 1408,
    ~0.6B parameters a MoE layer; ours and transformers' weights, gradients and Adam states together leave an
    80 GB H100 (79.2 GiB as torch counts it) at least 12 GiB for activations."""
    transformers = pytest.importorskip("transformers")
    tt, ds = benchmark("trainer_throughput"), benchmark("deepseek_shapes")
    config = tt.hf_config("deepseek-v3-reduced")
    assert (config.num_hidden_layers, config.first_k_dense_replace) == (4, 1)
    assert (config.q_lora_rank, config.kv_lora_rank, config.qk_nope_head_dim, config.qk_rope_head_dim,
            config.v_head_dim) == (1536, 512, 128, 64, 128)
    assert (config.n_routed_experts, config.moe_intermediate_size, config.num_experts_per_tok) == (64, 1408, 6)
    # what SGLang reads and transformers' config lacks
    assert (config.topk_method, config.scoring_func, config.moe_layer_freq) == ("noaux_tc", "sigmoid", 1)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    moe_layer = sum(p.numel() for p in model.model.layers[1].parameters())
    assert 0.55e9 < moe_layer < 0.65e9
    params = ds.hf_param_count(config)
    assert params == sum(p.numel() for p in model.parameters())
    memory = ds.memory_estimate(params)
    assert memory["total_gib"] == pytest.approx(params * 36 / 2**30)
    assert memory["total_gib"] <= 79.2 - 12


def test_deepseek_models_get_a_random_correction_bias(tmp_path):
    """A fresh DeepSeek model's correction bias is zeros; the benchmark's is random, as a trained one is not zero."""
    pytest.importorskip("transformers")
    from safetensors import safe_open

    tt = benchmark("trainer_throughput")
    folder = tt.make_model("tiny-deepseek-v3", tmp_path / "model")
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        biases = [f.get_tensor(name) for name in f.keys() if name.endswith("e_score_correction_bias")]
    assert len(biases) == 3  # the MoE layers; the dense first layer has no router
    assert all(bias.abs().min() > 0 for bias in biases) and not torch.equal(biases[0], biases[1])
