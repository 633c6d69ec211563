"""Mixture-of-experts models (Qwen3-MoE; Qwen2-MoE with its gated shared expert) on megatron-core's MoE
layer: HF -> Megatron -> HF is bit-exact, log-probs equal transformers' (fp32, <= 1e-4), expert
parallelism over gloo (EP=2) gives EP=1's log-probs, losses, gradient norms and updated weights
(<= 1e-5 over three steps), and routing replay makes the forward use the experts it is given."""

from __future__ import annotations

import pytest
import torch
from megatron_testlib import (
    ensure_single_rank_group,
    hf_response_log_probs,
    launch,
    load_hf,
    make_config,
    make_hf_model,
    make_samples,
    per_sample,
    to_batch,
)
from megatron_worker import run_scenario

from slime_rl.trainer_megatron.convert import SafetensorsFolder
from slime_rl.trainer_megatron.trainer import MegatronTrainer

VOCAB = 256
COMMON = ["algorithm.entropy_coef=0.01", "algorithm.eps_clip=0.1"]


def trainer_for(model_dir, overrides=()):
    ensure_single_rank_group()
    return MegatronTrainer.from_config(make_config(model_dir, list(overrides)))


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_round_trip_and_log_probs_match_transformers(family, tmp_path):
    model_dir = make_hf_model(tmp_path / "m", family, vocab=VOCAB)
    trainer = trainer_for(model_dir)
    reader = SafetensorsFolder(model_dir)
    buckets = list(trainer.named_weights(bucket_bytes=64 << 10))
    exported = dict(item for bucket in buckets for item in bucket)
    assert sorted(exported) == sorted(reader.weight_map)
    assert any(".mlp.experts.7.down_proj.weight" in n for n in exported) and any(".mlp.gate.weight" in n
                                                                                 for n in exported)
    assert all(torch.equal(t, reader.get(n)) for n, t in exported.items())
    assert all(sum(t.numel() * t.element_size() for _, t in b) <= 64 << 10 for b in buckets)

    samples = make_samples(5, VOCAB, prompt=(1, 12), response=(1, 20))
    batch = to_batch(samples)
    ours = per_sample(batch, trainer.compute_log_probs(batch))
    hf = load_hf(model_dir)
    diffs = [(torch.tensor(lp) - hf_response_log_probs(hf, s.tokens, s.response_length)).abs().max()
             for s, lp in zip(samples, ours, strict=True)]
    assert max(float(d) for d in diffs) <= 1e-4
    metrics = trainer.train_step(_with_old(batch, trainer))
    assert metrics["moe_expert_load_max_over_mean"] >= 1.0


def _with_old(batch, trainer):
    batch.old_log_probs = trainer.compute_log_probs(batch)
    return batch


@pytest.mark.parametrize("family,batching", [("qwen2_moe", ["trainer.max_tokens_per_gpu=40"]),
                                             ("qwen3_moe", ["trainer.micro_batch_size=2"])])
def test_expert_parallel_matches_one_rank(family, batching, tmp_path):
    """Packed micro-batches (qwen2_moe) pack differently on the two ranks: split_to_count evens them.
    With a KL term (reference weights swapped in) and a resume from a checkpoint saved after step 1.
    The one rank runs Megatron's SequentialMLP, the two ranks the grouped experts (the default)."""
    model = make_hf_model(tmp_path / "model", family, vocab=VOCAB)
    spec = dict(model=str(model), num_samples=6, vocab=VOCAB, steps=3, ref=True)
    batching = batching + ["algorithm.use_kl_loss=true", "algorithm.kl_loss_coef=0.1"]
    ensure_single_rank_group()
    single = run_scenario({**spec, "overrides": COMMON + batching + ["trainer.megatron.moe_grouped_gemm=false"]})
    multi = launch(2, {**spec, "overrides": COMMON + batching + ["parallel.expert_model_parallel_size=2",
                                                                "cluster.actor_num_gpus_per_node=2"],
                       "save_after": 1, "ckpt": str(tmp_path / "ckpt")}, tmp_path)
    assert single["roundtrip_exact"] and multi["roundtrip_exact"]
    assert (single["local_experts"], multi["local_experts"]) == (2 * 8, 2 * 4)  # 2 layers; EP=2 holds half
    assert (single["experts_modules"], multi["experts_modules"]) == (["SequentialMLP"], ["GroupedExperts"])
    for a, b in zip(single["log_probs"], multi["log_probs"], strict=True):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)
    for one, two in zip(single["metrics"], multi["metrics"], strict=True):
        assert abs(one["loss"] - two["loss"]) <= 1e-5, (one, two)
        assert abs(one["grad_norm"] - two["grad_norm"]) <= 1e-5, (one, two)
    assert multi["metrics"][2]["ppo_kl"] != 0  # the steps moved the policy
    for name, t in single["final"].items():
        assert torch.allclose(t, multi["final"][name], atol=1e-5, rtol=0), name
    assert abs(single["metrics"][2]["ref_kl"] - multi["metrics"][2]["ref_kl"]) <= 1e-5
    if family == "qwen2_moe":  # packed: no padding tokens routed, so the ranks' summed loads are one rank's
        for one, two in zip(single["metrics"], multi["metrics"], strict=True):
            assert abs(one["moe_expert_load_max_over_mean"] - two["moe_expert_load_max_over_mean"]) <= 1e-6
    # resume after step 1 (experts in Megatron's distributed checkpoint): steps 2 and 3 replay bit for bit
    assert multi["resumed_metrics"] == multi["metrics"][1:]
    assert all(torch.equal(t, multi["resumed_final"][n]) for n, t in multi["final"].items())


def _hf_routing(hf, tokens: list[int], forced: dict[int, torch.Tensor] | None = None):
    """transformers' top-k per layer for ``tokens`` ([len, layers, k]) and its response log-probs, with
    each layer's router made to pick ``forced[layer]`` instead (weights: its own renormalised scores)."""
    gates = [layer.mlp.gate for layer in hf.model.layers]
    originals = [g.forward for g in gates]
    if forced is not None:
        for layer, gate in enumerate(gates):
            def pick(hidden, gate=gate, idx=forced[layer]):
                logits = torch.nn.functional.linear(hidden.reshape(-1, gate.hidden_dim), gate.weight)
                scores = torch.softmax(logits, dim=-1, dtype=torch.float).gather(1, idx)
                if gate.norm_topk_prob:
                    scores = scores / scores.sum(-1, keepdim=True)
                return logits, scores.to(logits.dtype), idx
            gate.forward = pick
    try:
        with torch.no_grad():
            out = hf(torch.tensor([tokens]), output_router_logits=True)
    finally:
        for gate, original in zip(gates, originals, strict=True):
            gate.forward = original
    k = hf.config.num_experts_per_tok
    chosen = torch.stack([logits.topk(k, dim=-1).indices for logits in out.router_logits], dim=1)
    return chosen, torch.log_softmax(out.logits[0].float(), -1)


def _min_topk_gap(hf, samples, k: int) -> float:
    """The smallest gap, over every token and layer of ``samples``, between the k-th and (k+1)-th router score."""
    gaps = []
    with torch.no_grad():
        for s in samples:
            for logits in hf(torch.tensor([s.tokens]), output_router_logits=True).router_logits:
                top = torch.softmax(logits.float(), dim=-1).topk(k + 1, dim=-1).values
                gaps.append((top[:, k - 1] - top[:, k]).min().item())
    return min(gaps)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_routing_replay_follows_the_given_experts(family, tmp_path):
    """The engine's choices (here transformers' own, and then the least likely experts, which no router
    picks) replace the router's top-k: natural choices give the unreplayed log-probs, forced ones give
    what transformers gives when made to route the same way, padded and packed alike."""
    model_dir = make_hf_model(tmp_path / "m", family, vocab=VOCAB)
    hf = load_hf(model_dir)
    k, natural, forced, expected = hf.config.num_experts_per_tok, [], [], []
    # Samples on which no token's k-th and (k+1)-th router scores tie: at a tie transformers' top-k and
    # Megatron's may pick either expert, so "natural" would not be what the trainer picks (seen on one CPU).
    for seed in range(1, 50):
        samples = make_samples(4, VOCAB, seed=seed)
        if _min_topk_gap(hf, samples, k) > 1e-6:
            break
    for s in samples:
        chosen, _ = _hf_routing(hf, s.tokens)
        natural.append(chosen)
        with torch.no_grad():
            logits = hf(torch.tensor([s.tokens]), output_router_logits=True).router_logits
        least = torch.stack([(-lg).topk(k, dim=-1).indices for lg in logits], dim=1)
        forced.append(least)
        _, logp = _hf_routing(hf, s.tokens, {layer: least[:, layer] for layer in range(least.shape[1])})
        ids = torch.tensor(s.tokens)
        expected.append(logp[:-1].gather(1, ids[1:, None]).squeeze(1)[-s.response_length:])
    replay = ["algorithm.routing_replay=rollout"]
    padded = trainer_for(model_dir, replay + ["trainer.micro_batch_size=3"])
    plain = padded.compute_log_probs(to_batch(samples))  # no routed experts in the batch: own routing

    for s, r in zip(samples, natural, strict=True):
        s.rollout_routed_experts = r.tolist()
    assert torch.allclose(padded.compute_log_probs(to_batch(samples)), plain, atol=1e-5, rtol=0)

    for s, r in zip(samples, forced, strict=True):
        s.rollout_routed_experts = r[:-1].tolist()  # as an engine reports it: the last token never fed
    batch = to_batch(samples)
    assert batch.routed_experts.dtype == torch.int16 and batch.routed_experts.shape[1:] == (2, k)
    replayed = padded.compute_log_probs(batch)
    packed = trainer_for(model_dir, replay + ["trainer.max_tokens_per_gpu=40"]).compute_log_probs(batch)
    assert (replayed - plain).abs().max() > 2e-3  # the forced experts matter (20x the tolerance below)
    assert torch.allclose(replayed, torch.cat(expected), atol=1e-4, rtol=0)
    assert torch.allclose(packed, replayed, atol=1e-5, rtol=0)
    batch.old_log_probs = replayed
    metrics = padded.train_step(batch)  # the training pass replays too: the ratio starts at 1
    assert abs(metrics["ppo_kl"]) <= 1e-6 and metrics["grad_norm"] > 0


FOUR_RANK_LAYOUTS = {
    # EP=2 x ETP=2: each expert split over two ranks (gloo's missing reduce-scatter replaced on the CPU)
    "ep2-etp2": (["parallel.expert_model_parallel_size=2", "parallel.expert_tensor_parallel_size=2"],
                 ["trainer.micro_batch_size=2"], 2 * 4),
    # PP=2 x EP=2 x DP=2: one layer per stage, 1F1B over packed micro-batches evened across EP ranks
    "pp2-ep2": (["parallel.pipeline_model_parallel_size=2", "parallel.expert_model_parallel_size=2"],
                ["trainer.max_tokens_per_gpu=40"], 1 * 4),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(FOUR_RANK_LAYOUTS))
def test_four_rank_expert_layouts_match_one_rank(layout, tmp_path):
    """Losses, gradient norms and weights of one rank (Megatron's SequentialMLP), over three steps."""
    parallel, batching, local_experts = FOUR_RANK_LAYOUTS[layout]
    model = make_hf_model(tmp_path / "model", "qwen2_moe", vocab=VOCAB)
    spec = dict(model=str(model), num_samples=8, vocab=VOCAB, steps=3)
    # Adam's first steps move every weight by about +-lr whatever its gradient's size: at the default
    # eps a gradient of ~1e-9 summed in another order (four ranks) flips one weight by 1.3e-5.
    batching = batching + ["trainer.adam_eps=1e-6"]
    ensure_single_rank_group()
    single = run_scenario({**spec, "overrides": COMMON + batching + ["trainer.megatron.moe_grouped_gemm=false"]})
    multi = launch(4, {**spec, "overrides": COMMON + batching + parallel + ["cluster.actor_num_gpus_per_node=4"]},
                   tmp_path)
    assert multi["roundtrip_exact"] and multi["local_experts"] == local_experts  # rank 0's layers x experts
    assert (single["experts_modules"], multi["experts_modules"]) == (["SequentialMLP"], ["GroupedExperts"])
    for one, four in zip(single["metrics"], multi["metrics"], strict=True):
        assert abs(one["loss"] - four["loss"]) <= 1e-5 and abs(one["grad_norm"] - four["grad_norm"]) <= 1e-5
    for name, t in single["final"].items():
        assert torch.allclose(t, multi["final"][name], atol=1e-5, rtol=0), name


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_local_dispatch_matches_megatron_dispatcher(family, tmp_path, monkeypatch):
    """One rank holding every expert: moe.LocalDispatcher (counts kept where the router made them, no
    identity sort by local expert) gives megatron-core's dispatcher's log-probs, loss, gradient norm
    and updated weights bit for bit, and never copies the counts to the host."""
    from megatron.core.transformer.moe import token_dispatcher

    model_dir = make_hf_model(tmp_path / "m", family, vocab=VOCAB)
    batch = to_batch(make_samples(6, VOCAB, prompt=(1, 12), response=(1, 20)))
    trainers = {local: trainer_for(model_dir, COMMON) for local in (True, False)}  # the same weights
    host_copies = []
    to_host = token_dispatcher.maybe_move_tensor_to_cpu  # (set once the first trainer is built)
    monkeypatch.setattr(token_dispatcher, "maybe_move_tensor_to_cpu",
                        lambda t, *a, **k: host_copies.append(t) or to_host(t, *a, **k))
    results = {}
    for local, trainer in trainers.items():
        dispatchers = [m.token_dispatcher for m in trainer.model.modules() if hasattr(m, "token_dispatcher")]
        assert len(dispatchers) == 2 and all(type(d).__name__ == "LocalDispatcher" and d.local for d in dispatchers)
        for d in dispatchers:
            d.local = local
        host_copies.clear()
        log_probs = trainer.compute_log_probs(batch)
        batch.old_log_probs = log_probs
        metrics = trainer.train_step(batch)
        weights = {n: t.clone() for bucket in trainer.named_weights(bucket_bytes=1 << 30) for n, t in bucket}
        results[local] = (log_probs, metrics, weights, len(host_copies))
    (lp_local, m_local, w_local, copies_local), (lp_mcore, m_mcore, w_mcore, copies_mcore) = results[True], results[False]
    assert copies_local == 0 and copies_mcore > 0
    assert torch.equal(lp_local, lp_mcore)
    assert (m_local["loss"], m_local["grad_norm"]) == (m_mcore["loss"], m_mcore["grad_norm"])
    assert sorted(w_local) == sorted(w_mcore) and all(torch.equal(w_local[n], w_mcore[n]) for n in w_local)


def test_local_dispatch_only_where_one_rank_holds_every_expert(tmp_path):
    model_dir = make_hf_model(tmp_path / "m", "qwen3_moe", vocab=VOCAB)
    dispatcher = next(m.token_dispatcher for m in trainer_for(model_dir).model.modules()
                      if hasattr(m, "token_dispatcher"))
    assert dispatcher.can_stay_local()
    for field, value in (("ep_size", 2), ("tp_size", 2), ("drop_and_pad", True)):
        kept = getattr(dispatcher, field)
        setattr(dispatcher, field, value)
        assert not dispatcher.can_stay_local(), field
        setattr(dispatcher, field, kept)


def test_routing_replay_on_a_dense_model_is_refused(tmp_path):
    model_dir = make_hf_model(tmp_path / "m", "qwen3", vocab=VOCAB)
    with pytest.raises(ValueError, match="routing_replay: rollout needs a mixture-of-experts model"):
        trainer_for(model_dir, ["algorithm.routing_replay=rollout"])


def test_unsupported_expert_layouts_are_refused_with_the_fix():
    from slime_rl.trainer_megatron.moe import MoEShape, check_expert_parallel

    moe = MoEShape(num_experts=8, topk=2, expert_intermediate_size=32, norm_topk_prob=True,
                   shared_expert_intermediate_size=None)
    with pytest.raises(ValueError, match="tensor_model_parallel_size: MoE models need sequence parallelism"):
        check_expert_parallel(moe, tp=2, ep=1, etp=1)
    with pytest.raises(ValueError, match="expert_tensor_parallel_size: > 1 needs"):
        check_expert_parallel(moe, tp=1, ep=1, etp=2)
    with pytest.raises(ValueError, match="expert_model_parallel_size: 3 must divide the model's 8 experts"):
        check_expert_parallel(moe, tp=1, ep=3, etp=1)
    with pytest.raises(ValueError, match="the model has no experts"):
        check_expert_parallel(None, tp=1, ep=2, etp=1)
    check_expert_parallel(moe, tp=1, ep=4, etp=2)


def test_split_to_count_evens_micro_batch_counts():
    """Every rank of an EP group must run as many micro-batches: the heaviest are halved until the
    count is reached, every row kept once; a rank with too few samples gets a clear error."""
    from slime_rl.trainer_megatron.batching import split_to_count

    lengths = [30, 5, 5, 20, 10]
    groups = split_to_count([[0, 1, 2], [3, 4]], lengths, 4)
    assert len(groups) == 4 and sorted(r for g in groups for r in g) == [0, 1, 2, 3, 4]
    assert [0] in groups  # the 40-token group went first
    assert split_to_count([[0], [1]], lengths, 2) == [[0], [1]]
    with pytest.raises(ValueError, match="expert parallelism: 2 samples on this rank cannot make the 3"):
        split_to_count([[0], [1]], lengths, 3)
