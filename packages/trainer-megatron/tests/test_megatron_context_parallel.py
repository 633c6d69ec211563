"""Context parallelism (parallel.context_parallel_size) over gloo equals one rank: log-probs, loss, grad
norm and the weights after each of three GRPO steps (fp32, within 1e-5), with packed sequences of unequal
lengths including one shorter than 2 * CP tokens (it is padded; some chunks hold padding only); resuming
from a checkpoint (CP2 and the slow layouts: the optimizer sharded over DP x CP) replays the steps bit for bit. The attention math is checked on its own too: every
simulated CP rank's chunks against causal attention over the whole sequences."""

from __future__ import annotations

import pytest
import torch
from megatron_testlib import assert_replayed_like_one_rank, ensure_single_rank_group, launch, make_hf_model
from megatron_worker import run_scenario

from slime_rl.trainer_megatron import context_parallel as cpmod

COMMON = ["algorithm.use_kl_loss=true", "algorithm.kl_loss_coef=0.1", "algorithm.entropy_coef=0.01",
          "algorithm.eps_clip=0.1", "trainer.max_tokens_per_gpu=40"]
SHORT = [1, 2]  # a 3-token sample: shorter than 2 * CP for CP >= 2

LAYOUTS = {
    # name: (family, ranks, parallel overrides, slow)
    "cp2": ("qwen3", 2, ["parallel.context_parallel_size=2"], False),
    "cp2_tp2": ("qwen2", 4, ["parallel.context_parallel_size=2", "parallel.tensor_model_parallel_size=2"], False),
    "cp4_moe": ("qwen3_moe", 4, ["parallel.context_parallel_size=4"], False),
    "cp2_moe": ("qwen2_moe", 2, ["parallel.context_parallel_size=2"], True),
    "cp2_glm": ("glm4_moe", 2, ["parallel.context_parallel_size=2"], True),  # partial RoPE on CP's chunks
    "cp4": ("llama", 4, ["parallel.context_parallel_size=4"], True),
    "cp2_pp2": ("llama", 4, ["parallel.context_parallel_size=2", "parallel.pipeline_model_parallel_size=2"], True),
    "cp2_dp2": ("qwen3", 4, ["parallel.context_parallel_size=2"], True),
    "cp2_ep2_moe": ("qwen3_moe", 4, ["parallel.context_parallel_size=2", "parallel.expert_model_parallel_size=2"],
                    True),
}


# resume checked where it adds a layout's checkpoint (sharded optimizer over DP x CP, stages), not in every fast case
RESUMED = {"cp2", "cp2_dp2", "cp2_pp2", "cp2_ep2_moe", "cp4"}


def _params(names):
    return [pytest.param(n, marks=pytest.mark.slow) if LAYOUTS[n][3] else n for n in sorted(names)]


@pytest.mark.parametrize("layout", _params(LAYOUTS))
def test_context_parallel_matches_one_rank(layout, tmp_path):
    family, ranks, parallel, _ = LAYOUTS[layout]
    model = make_hf_model(tmp_path / "model", family, tie=family == "llama", vocab=256)
    spec = dict(model=str(model), num_samples=6, vocab=256, ref=True, steps=3, short_first=SHORT,
                prompt=(3, 20), response=(2, 24))
    ensure_single_rank_group()
    single = run_scenario({**spec, "overrides": COMMON})
    resume = {"save_after": 1, "ckpt": str(tmp_path / "ckpt")} if layout in RESUMED else {}
    multi = launch(ranks, {**spec, "overrides": COMMON + parallel + [f"cluster.actor_num_gpus_per_node={ranks}"],
                           **resume}, tmp_path)

    assert multi["roundtrip_exact"] and multi["peers_agree"]  # every CP rank returns the whole shard's values
    for a, b in zip(single["log_probs"], multi["log_probs"], strict=True):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0), (a, b)
    for one, many in zip(single["metrics"], multi["metrics"], strict=True):
        for name in ("loss", "grad_norm", "ref_kl", "entropy", "ppo_kl"):
            assert abs(one[name] - many[name]) <= 1e-5, (name, one[name], many[name])
    assert multi["metrics"][2]["ppo_kl"] != 0  # the steps moved the policy
    for name, weight in single["final"].items():
        assert torch.allclose(weight, multi["final"][name], atol=1e-5, rtol=0), name
    if resume:
        assert multi["resumed_metrics"] == multi["metrics"][1:]
        assert all(torch.equal(t, multi["resumed_final"][n]) for n, t in multi["final"].items())


@pytest.mark.slow
def test_context_parallel_replays_the_given_experts_as_one_rank_does(tmp_path):
    """Routing replay (the engine's experts for every token, here random ones) under CP: each rank replays
    its chunks' tokens, padding goes to experts 0..k-1; log-probs and steps equal one rank's."""
    model = make_hf_model(tmp_path / "model", "qwen3_moe", vocab=256)
    spec = dict(model=str(model), num_samples=6, vocab=256, steps=2, short_first=SHORT, random_routes=True, ref=True,
                prompt=(3, 20), response=(2, 24))
    overrides = COMMON + ["algorithm.routing_replay=rollout"]
    ensure_single_rank_group()
    single = run_scenario({**spec, "overrides": overrides})
    multi = launch(2, {**spec, "overrides": overrides + ["parallel.context_parallel_size=2",
                                                         "cluster.actor_num_gpus_per_node=2"]}, tmp_path)
    assert_replayed_like_one_rank(single, multi)


@pytest.mark.slow
def test_context_parallel_critic_matches_one_rank(tmp_path):
    from megatron_worker import run_critic

    model = make_hf_model(tmp_path / "model", "qwen2", vocab=256)
    spec = dict(scenario="critic", model=str(model), num_samples=6, vocab=256, steps=2, short_first=SHORT,
                prompt=(3, 20), response=(2, 24))
    overrides = ["trainer.critic_lr=0.01", "algorithm.value_clip=100", "trainer.max_tokens_per_gpu=40"]
    ensure_single_rank_group()
    single = run_critic({**spec, "overrides": overrides})
    multi = launch(2, {**spec, "overrides": overrides + ["parallel.context_parallel_size=2",
                                                         "cluster.actor_num_gpus_per_node=2"]}, tmp_path)
    for before_one, before_two in zip(single["values"], multi["values"], strict=True):
        for a, b in zip(before_one, before_two, strict=True):
            assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)
    for one, two in zip(single["metrics"], multi["metrics"], strict=True):
        assert abs(one["loss"] - two["loss"]) <= 1e-5 and abs(one["grad_norm"] - two["grad_norm"]) <= 1e-5
    assert single["values"][1] != single["values"][0]  # the first step moved the values


# ---------------------------------------------------------------- the pieces, in one process


@pytest.mark.parametrize("size", [2, 3, 4])
def test_ranks_hold_balanced_chunks_that_cover_every_token_once(size):
    lengths = [3, 17, 8, 40]
    splits = [cpmod.split_sequences(lengths, size, r) for r in range(size)]
    rows = torch.cat([s.local_rows() for s in splits])
    assert sorted(rows.tolist()) == list(range(sum(splits[0].padded_lens)))
    assert all(n % (2 * size) == 0 and n - 2 * size < m <= n for n, m in zip(splits[0].padded_lens, lengths,
                                                                              strict=True))
    # causal work per rank (keys each query sees) is the same on every rank
    work = [sum(int(k) for k in s.varlen_bounds(torch.device("cpu"))[1].diff()) for s in splits]
    assert len(set(work)) == 1


@pytest.mark.parametrize("size", [1, 2, 4])
def test_local_positions_are_megatrons_rope_positions(size):
    from megatron.core.models.common.embeddings import rope_utils

    split = cpmod.split_sequences([5, 16, 9], size, size - 1)
    cu = torch.tensor([0, *torch.tensor(split.padded_lens).cumsum(0).tolist()])
    freqs = torch.arange(64.0)[:, None, None, None]  # "freqs" = the position itself
    ours = cpmod.local_positions(cu, size, size - 1)
    theirs = torch.cat([rope_utils._get_thd_freqs_on_this_cp_rank(size - 1, size, x, freqs).flatten()
                        for x in torch.split(torch.empty(split.local_tokens), (cu.diff() // size).tolist())])
    assert ours.tolist() == theirs.long().tolist()
    full = torch.cat([torch.arange(n) for n in split.padded_lens])
    assert ours.tolist() == full[split.local_rows()].tolist()


@pytest.mark.parametrize("size", [2, 4])
def test_micro_batches_per_cp_rank_budget_and_gather(size):
    """max_tokens_per_gpu counts one CP rank's tokens (padding included); every rank's predicting rows,
    gathered as gather_tokens does, give the targets of the same micro-batch without CP."""
    from megatron_testlib import make_samples, to_batch

    from slime_rl.trainer_megatron import batching

    samples = make_samples(10, 256, prompt=(1, 30), response=(1, 40))
    batch = to_batch(samples)
    cpu = torch.device("cpu")
    ranks = [batching.micro_batches(batch, micro_batch_size=1, max_tokens=24, device=cpu, context_parallel=(size, r))
             for r in range(size)]
    assert all(len(mbs) == len(ranks[0]) for mbs in ranks)
    for mbs in zip(*ranks, strict=True):
        tokens = {mb.input_ids.shape[1] for mb in mbs}
        assert len(tokens) == 1 and (tokens.pop() <= 24 or len(mbs[0].rows) == 1)  # a lone long sample may exceed
        plan = mbs[0].cp_gather
        most = max(plan.counts)
        pieces = torch.zeros(size * most, dtype=torch.long)
        for r, mb in enumerate(mbs):
            assert mb.cp_gather.counts == plan.counts and len(mb.targets) == plan.counts[r]
            pieces[r * most : r * most + len(mb.targets)] = mb.targets
            # each predicting row holds the token before its target, in the rank's own chunks
            assert mb.input_ids[0, mb.hidden_index].tolist() == [
                batch.tokens[int(i)] for i in _predicting_tokens(batch, mb)]
        assert pieces[plan.rows].tolist() == _targets(batch, mbs[0].rows).tolist()


def _targets(batch, rows):
    return torch.cat([batch.tokens[int(batch.offsets()[r]) + int(batch.lengths[r] - batch.response_lengths[r]):
                                   int(batch.offsets()[r] + batch.lengths[r])].long() for r in rows])


def _predicting_tokens(batch, mb):
    """Rows of ``batch.tokens`` just before each of this CP rank's targets (in its own order)."""
    out = []
    for r in mb.rows.tolist():
        start, n, resp = int(batch.offsets()[r]), int(batch.lengths[r]), int(batch.response_lengths[r])
        out += list(range(start + n - resp - 1, start + n - 1))
    everything = torch.tensor(out)
    mine = torch.zeros(len(everything), dtype=torch.bool)
    mine[(mb.cp_gather.rows // max(mb.cp_gather.counts)) == _rank_of(mb)] = True
    return everything[mine]


def _rank_of(mb) -> int:
    return mb.packed.context_parallel.rank


def simulated_ranks_attention(query, key, value, lengths, size, scale, *, use_varlen):
    """Causal attention of packed sequences computed the CP way: each simulated rank's query chunks over the
    all-gathered K/V, outputs put back in the packed order. Differentiable, collective-free."""
    splits = [cpmod.split_sequences(lengths, size, r) for r in range(size)]
    total = sum(splits[0].padded_lens)
    real = torch.cat([torch.arange(n) + start for n, start in zip(
        lengths, torch.tensor([0, *splits[0].padded_lens[:-1]]).cumsum(0).tolist(), strict=True)])

    def padded(x):
        out = x.new_zeros(total, *x.shape[1:])
        return out.index_copy(0, real.to(x.device), x)

    q, k, v = padded(query), padded(key), padded(value)
    gathered_k = torch.cat([k[s.local_rows().to(k.device)] for s in splits])
    gathered_v = torch.cat([v[s.local_rows().to(v.device)] for s in splits])
    out = q.new_zeros(total, *q.shape[1:])
    for s in splits:
        rows = s.key_rows().to(q.device)
        part = cpmod.attend_chunks(q[s.local_rows().to(q.device)], gathered_k[rows], gathered_v[rows], s, scale,
                                   use_varlen=use_varlen)
        out = out.index_copy(0, s.local_rows().to(q.device), part)
    return out[real.to(q.device)]


@pytest.mark.parametrize("size", [2, 4])
def test_chunked_attention_equals_causal_attention_per_sequence(size):
    g = torch.Generator().manual_seed(0)
    lengths, heads, kv_heads, dim = [3, 21, 9, 14], 4, 2, 8
    t = sum(lengths)
    query = torch.randn(t, heads, dim, generator=g, dtype=torch.float64, requires_grad=True)
    key = torch.randn(t, kv_heads, dim, generator=g, dtype=torch.float64, requires_grad=True)
    value = torch.randn(t, kv_heads, dim, generator=g, dtype=torch.float64, requires_grad=True)
    grad_out = torch.randn(t, heads, dim, generator=g, dtype=torch.float64)
    scale = dim ** -0.5
    ours = simulated_ranks_attention(query, key, value, lengths, size, scale, use_varlen=False)
    reference = []
    for q, k, v in zip(*(x.split(lengths) for x in (query, key, value)), strict=True):
        k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
        out = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                                               v.transpose(0, 1), is_causal=True, scale=scale)
        reference.append(out.transpose(0, 1))
    reference = torch.cat(reference)
    assert torch.allclose(ours, reference, atol=1e-12)
    grads = torch.autograd.grad(ours, (query, key, value), grad_out)
    expected = torch.autograd.grad(reference, (query, key, value), grad_out)
    for a, b in zip(grads, expected, strict=True):
        assert torch.allclose(a, b, atol=1e-12)


def test_context_parallel_needs_packed_micro_batches(tmp_path):
    from megatron_testlib import make_config

    from slime_rl.trainer_megatron.trainer import MegatronTrainer

    model = make_hf_model(tmp_path / "model", "llama", vocab=256)
    ensure_single_rank_group()
    cfg = make_config(model, ["parallel.context_parallel_size=2"])
    with pytest.raises(ValueError, match="trainer.max_tokens_per_gpu"):
        MegatronTrainer.from_config(cfg)
