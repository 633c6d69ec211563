"""Mixture-of-experts models (Qwen3-MoE; Qwen2-MoE with its gated shared expert; GLM-4.5 with a dense first
layer, sigmoid group-limited routing with a correction bias, shared experts and partial RoPE; DeepSeek-V3 with the same
routing and multi-head latent attention) on megatron-core's
MoE layer: HF -> Megatron -> HF is bit-exact, log-probs equal transformers' (fp32, <= 1e-4), expert
parallelism over gloo (EP=2) gives EP=1's log-probs, losses, gradient norms and updated weights
(<= 1e-5 over three steps), and routing replay makes the forward use the experts it is given."""

from __future__ import annotations

import pytest
import torch
from megatron_testlib import (
    assert_replayed_like_one_rank,
    ensure_single_rank_group,
    hf_response_log_probs,
    launch,
    load_hf,
    make_hf_model,
    make_samples,
    max_gap_to_hf,
    per_sample,
    to_batch,
    trainer_for,
)
from megatron_worker import run_scenario

from slime_rl.trainer_megatron.convert import SafetensorsFolder

VOCAB = 256
# adam_eps 1e-6: Adam's first steps move every weight by about +-lr whatever its gradient's size, so at the default
# eps a ~1e-9 gradient summed in another order (more ranks) moved one weight by 1.3e-5 to 1.6e-5; 4e-8 with this one
COMMON = ["algorithm.entropy_coef=0.01", "algorithm.eps_clip=0.1", "trainer.adam_eps=1e-6"]


MOE_FAMILIES = ["qwen3_moe", "qwen2_moe", "glm4_moe", "deepseek_v3", "deepseek_v2"]


@pytest.mark.parametrize("family", MOE_FAMILIES)
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
    assert max_gap_to_hf(samples, ours, load_hf(model_dir)) <= 1e-4
    metrics = trainer.train_step(_with_old(batch, trainer))
    assert metrics["moe_expert_load_max_over_mean"] >= 1.0


def _with_old(batch, trainer):
    batch.old_log_probs = trainer.compute_log_probs(batch)
    return batch


@pytest.mark.parametrize("family,batching", [("qwen2_moe", ["trainer.max_tokens_per_gpu=40"]),
                                             ("qwen3_moe", ["trainer.micro_batch_size=2"]),
                                             pytest.param("glm4_moe", ["trainer.micro_batch_size=2"],
                                                          marks=pytest.mark.slow),
                                             # multi-head latent attention on packed rows (thd RoPE)
                                             pytest.param("deepseek_v3", ["trainer.max_tokens_per_gpu=40"],
                                                          marks=pytest.mark.slow),
                                             # V2's softmax routing, unrenormalised and scaled, on padded rows
                                             pytest.param("deepseek_v2", ["trainer.micro_batch_size=2"],
                                                          marks=pytest.mark.slow)])
def test_expert_parallel_matches_one_rank(family, batching, tmp_path):
    """Packed micro-batches (qwen2_moe) pack differently on the two ranks: split_to_count evens them.
    With a KL term (reference weights swapped in) and a resume from a checkpoint saved after step 1.
    The one rank runs Megatron's SequentialMLP, the two ranks the grouped experts (the default).
    GLM-4.5's and DeepSeek-V3's two layers are one dense and one MoE layer."""
    model = make_hf_model(tmp_path / "model", family, vocab=VOCAB)
    moe_layers = 1 if family in ("glm4_moe", "deepseek_v3", "deepseek_v2") else 2
    spec = dict(model=str(model), num_samples=6, vocab=VOCAB, steps=3, ref=True)
    batching = batching + ["algorithm.use_kl_loss=true", "algorithm.kl_loss_coef=0.1"]
    ensure_single_rank_group()
    single = run_scenario({**spec, "overrides": COMMON + batching + ["trainer.megatron.moe_grouped_gemm=false"]})
    multi = launch(2, {**spec, "overrides": COMMON + batching + ["parallel.expert_model_parallel_size=2",
                                                                "cluster.actor_num_gpus_per_node=2"],
                       "save_after": 1, "ckpt": str(tmp_path / "ckpt")}, tmp_path)
    assert single["roundtrip_exact"] and multi["roundtrip_exact"]
    assert (single["local_experts"], multi["local_experts"]) == (moe_layers * 8, moe_layers * 4)  # EP=2: half
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


def _hf_gates(hf) -> dict[int, torch.nn.Module]:
    """transformers' routers by layer (MoE layers only: GLM's first layer is dense)."""
    return {i: layer.mlp.gate for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts")}


def _routing_weights(gate, logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """The weights ``gate`` gives experts ``idx``, as its family computes them from the router logits."""
    if hasattr(gate, "e_score_correction_bias"):  # GLM: unbiased sigmoid scores, renormalised, scaled
        scores = logits.float().sigmoid().gather(1, idx)
        scores = scores / (scores.sum(-1, keepdim=True) + 1e-20) if gate.norm_topk_prob else scores
        return scores * gate.routed_scaling_factor
    scores = torch.softmax(logits, dim=-1, dtype=torch.float).gather(1, idx)
    if hasattr(gate, "topk_method"):  # DeepSeek-V2: never renormalised, scaled
        return scores * gate.routed_scaling_factor
    return scores / scores.sum(-1, keepdim=True) if gate.norm_topk_prob else scores


def _hf_routing(hf, tokens: list[int], forced: dict[int, torch.Tensor] | None = None):
    """transformers' own expert choices for ``tokens`` ([len, all layers, k]; zeros at dense layers, as an
    engine reports them) and its log-probs, with each MoE layer's router made to pick ``forced[layer]``
    instead (weighted by its own scores)."""
    gates = _hf_gates(hf)
    originals = {layer: g.forward for layer, g in gates.items()}
    k = hf.config.num_experts_per_tok
    chosen = torch.zeros(len(tokens), len(hf.model.layers), k, dtype=torch.int64)

    def keep(layer: int):
        def hook(module, inputs, out) -> None:  # (a hook that returns something replaces the output)
            chosen[:, layer] = out[2]
        return hook

    hooks = [g.register_forward_hook(keep(layer)) for layer, g in gates.items()]
    if forced is not None:
        for layer, gate in gates.items():
            def pick(hidden, gate=gate, idx=forced[layer]):
                logits = torch.nn.functional.linear(hidden.reshape(-1, gate.hidden_dim).float(), gate.weight.float())
                return logits, _routing_weights(gate, logits, idx).to(hidden.dtype), idx
            gate.forward = pick
    try:
        with torch.no_grad():
            out = hf(torch.tensor([tokens]))
    finally:
        for layer, gate in gates.items():
            gate.forward = originals[layer]
        for hook in hooks:
            hook.remove()
    return chosen, torch.log_softmax(out.logits[0].float(), -1)


def _router_logits(hf, tokens: list[int]) -> dict[int, torch.Tensor]:
    """Each MoE layer's router logits for ``tokens``, ``[len, experts]``."""
    logits = {}
    hooks = [g.register_forward_hook(lambda m, i, out, layer=layer: logits.__setitem__(layer, out[0].float()))
             for layer, g in _hf_gates(hf).items()]
    try:
        with torch.no_grad():
            hf(torch.tensor([tokens]))
    finally:
        for hook in hooks:
            hook.remove()
    return logits


def _min_topk_gap(hf, samples, k: int) -> float:
    """The smallest gap, over every token and MoE layer of ``samples``, between the last chosen and the first
    unchosen candidate: experts by router score (GLM: sigmoid + bias, within the chosen groups), and GLM's
    groups by group score (the sum of their 2 best)."""
    gaps = []
    gates = _hf_gates(hf)
    for s in samples:
        for layer, logits in _router_logits(hf, s.tokens).items():
            gate = gates[layer]
            if not hasattr(gate, "e_score_correction_bias"):
                top = torch.softmax(logits, dim=-1).topk(k + 1, dim=-1).values
                gaps.append((top[:, k - 1] - top[:, k]).min().item())
                continue
            biased = logits.sigmoid() + gate.e_score_correction_bias
            groups = biased.view(len(biased), gate.num_group, -1)
            group_scores = groups.topk(2, dim=-1).values.sum(-1)
            if gate.topk_group < gate.num_group:
                ranked = group_scores.topk(gate.topk_group + 1, dim=-1).values
                gaps.append((ranked[:, -2] - ranked[:, -1]).min().item())
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter(
                1, group_scores.topk(gate.topk_group, dim=-1).indices, True)
            candidates = groups.masked_fill(~keep[..., None], float("-inf")).reshape(len(biased), -1)
            top = candidates.topk(k + 1, dim=-1).values
            gaps.append((top[:, k - 1] - top[:, k]).min().item())
    return min(gaps)


@pytest.mark.parametrize("family", MOE_FAMILIES)
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
        least = torch.zeros_like(chosen)  # the lowest router logits (dense layers: zeros, never read)
        for layer, logits in _router_logits(hf, s.tokens).items():
            least[:, layer] = (-logits).topk(k, dim=-1).indices
        forced.append(least)
        _, logp = _hf_routing(hf, s.tokens, {layer: least[:, layer] for layer in _hf_gates(hf)})
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
                 ["trainer.micro_batch_size=2"], 2 * 4, "qwen2_moe", 2),
    # PP=2 x EP=2 x DP=2: one layer per stage, 1F1B over packed micro-batches evened across EP ranks
    "pp2-ep2": (["parallel.pipeline_model_parallel_size=2", "parallel.expert_model_parallel_size=2"],
                ["trainer.max_tokens_per_gpu=40"], 1 * 4, "qwen2_moe", 2),
    # GLM-4.5, 4 layers (dense, then 3 MoE): the first stage holds the dense layer and one MoE layer
    "glm-pp2-ep2": (["parallel.pipeline_model_parallel_size=2", "parallel.expert_model_parallel_size=2"],
                    ["trainer.max_tokens_per_gpu=40"], 1 * 4, "glm4_moe", 4),
    # DeepSeek-V3 as GLM-4.5 above: multi-head latent attention on both stages
    "deepseek-pp2-ep2": (["parallel.pipeline_model_parallel_size=2", "parallel.expert_model_parallel_size=2"],
                         ["trainer.max_tokens_per_gpu=40"], 1 * 4, "deepseek_v3", 4),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(FOUR_RANK_LAYOUTS))
def test_four_rank_expert_layouts_match_one_rank(layout, tmp_path):
    """Losses, gradient norms and weights of one rank (Megatron's SequentialMLP), over three steps."""
    parallel, batching, local_experts, family, layers = FOUR_RANK_LAYOUTS[layout]
    model = make_hf_model(tmp_path / "model", family, vocab=VOCAB, layers=layers)
    spec = dict(model=str(model), num_samples=8, vocab=VOCAB, steps=3)
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


def _hf_variant(model_dir, tmp_path, name: str, **config_fields):
    """transformers' model of ``model_dir`` with ``config_fields`` changed in its config.json."""
    import json
    import shutil

    folder = tmp_path / name
    shutil.copytree(model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    for key, value in config_fields.items():
        if key == "partial_rotary_factor":
            config["rope_parameters"][key] = value
        else:
            config[key] = value
    (folder / "config.json").write_text(json.dumps(config))
    return load_hf(folder)


def test_each_glm_routing_and_attention_part_shows_in_the_log_probs(tmp_path):
    """The trainer matches transformers on the tiny GLM-4.5 (<= 1e-4) and each GLM-specific part moves
    transformers' log-probs by far more than that when left out (the correction bias, the group limit,
    the routed scaling factor, partial RoPE): a trainer that ignored one would fail the parity check."""
    model_dir = make_hf_model(tmp_path / "m", "glm4_moe", vocab=VOCAB)
    samples = make_samples(5, VOCAB, prompt=(4, 12), response=(4, 20))
    batch = to_batch(samples)
    ours = per_sample(batch, trainer_for(model_dir).compute_log_probs(batch))

    hf = load_hf(model_dir)
    assert max_gap_to_hf(samples, ours, hf) <= 1e-4
    for gate in _hf_gates(hf).values():
        gate.e_score_correction_bias.zero_()
    variants = {"no correction bias": hf,
                "one group": _hf_variant(model_dir, tmp_path, "groups", n_group=1, topk_group=1),
                "no routed scaling": _hf_variant(model_dir, tmp_path, "scaling", routed_scaling_factor=1.0),
                "full RoPE": _hf_variant(model_dir, tmp_path, "rope", partial_rotary_factor=1.0)}
    for name, variant in variants.items():
        assert max_gap_to_hf(samples, ours, variant) > 1e-3, name


def _glm_checkpoint_as_released(model_dir, tmp_path):
    """``model_dir`` stored as GLM-4.5's releases are: bf16 weights but a float32 e_score_correction_bias,
    and a multi-token-prediction layer after the last decoder layer (``num_nextn_predict_layers: 1``), which
    transformers does not build: random tensors under the names GLM-4.5 uses."""
    import json

    from safetensors.torch import load_file, save_file

    tensors = load_file(model_dir / "model.safetensors")
    tensors = {n: t if n.endswith("e_score_correction_bias") else t.to(torch.bfloat16) for n, t in tensors.items()}
    g = torch.Generator().manual_seed(5)
    mtp = {"eh_proj.weight": (64, 128), "enorm.weight": (64,), "hnorm.weight": (64,),
           "shared_head.norm.weight": (64,), "self_attn.q_proj.weight": (64, 64),
           "mlp.experts.0.gate_proj.weight": (32, 64), "mlp.gate.e_score_correction_bias": (8,)}
    for suffix, size in mtp.items():
        tensors[f"model.layers.2.{suffix}"] = torch.randn(size, generator=g).to(torch.bfloat16)
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1, "dtype": "bfloat16"}))
    return sorted(n for n in tensors if n.startswith("model.layers.2."))


def test_glm_checkpoint_round_trips_with_its_float32_bias_and_mtp_layer(tmp_path):
    """A bf16 GLM-4.5 checkpoint: the router's correction bias stays float32 in the trainer (its bf16 cast
    would move it) and out of it; the MTP layer is not trained and not synced (the engine keeps the
    checkpoint's), and save_hf writes it back as it was: every tensor of the checkpoint, bit for bit."""
    model_dir = make_hf_model(tmp_path / "m", "glm4_moe", vocab=VOCAB)
    mtp_names = _glm_checkpoint_as_released(model_dir, tmp_path)
    reader = SafetensorsFolder(model_dir)
    bias_name = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert reader.get(bias_name).dtype == torch.float32
    trainer = trainer_for(model_dir, ["model.dtype=bfloat16"])
    routers = [m for m in trainer.model.modules() if type(m).__name__ == "TopKRouter"]
    assert len(routers) == 1 and routers[0].expert_bias.dtype == torch.float32
    assert torch.equal(routers[0].expert_bias, reader.get(bias_name))

    synced = dict(item for bucket in trainer.named_weights(bucket_bytes=1 << 20) for item in bucket)
    assert sorted(synced) == sorted(set(reader.weight_map) - set(mtp_names))
    assert all(torch.equal(t, reader.get(n)) for n, t in synced.items())
    assert synced[bias_name].dtype == torch.float32

    batch = to_batch(make_samples(4, VOCAB))
    batch.old_log_probs = trainer.compute_log_probs(batch)
    trainer.train_step(batch)
    assert torch.equal(routers[0].expert_bias, reader.get(bias_name))  # frozen: no load-balancing update
    trainer.save_hf(str(tmp_path / "out"))
    saved = SafetensorsFolder(tmp_path / "out")
    assert sorted(saved.weight_map) == sorted(reader.weight_map)
    for name in mtp_names + [bias_name]:
        assert saved.get(name).dtype == reader.get(name).dtype and torch.equal(saved.get(name), reader.get(name)), name
    assert not torch.equal(saved.get("model.layers.1.mlp.gate.weight"), reader.get("model.layers.1.mlp.gate.weight"))


def test_glm_routing_megatron_cannot_match_is_refused(tmp_path):
    from slime_rl.trainer_megatron.model import hf_model_shape
    from slime_rl.trainer_megatron.moe import check_expert_parallel

    config = load_hf(make_hf_model(tmp_path / "m", "glm4_moe", vocab=VOCAB)).config
    shape = hf_model_shape(config)
    assert (shape.moe.dense_layers, shape.moe.num_groups, shape.moe.group_topk, shape.moe.scaling_factor,
            shape.rotary_percent, shape.qk_norm, shape.qkv_bias) == ((0,), 2, 1, 2.5, 0.5, True, True)
    check_expert_parallel(shape.moe, tp=2, ep=1, etp=1, sequence_parallel=True)  # test_megatron_sequence_parallel
    with pytest.raises(ValueError, match="parallel.sequence_parallel=true"):
        check_expert_parallel(shape.moe, tp=2, ep=1, etp=1)
    config.norm_topk_prob = False
    with pytest.raises(ValueError, match="norm_topk_prob=false with sigmoid routing"):
        hf_model_shape(config)
    config.norm_topk_prob, config.num_experts_per_tok = True, 3
    with pytest.raises(ValueError, match="num_experts_per_tok=3 and topk_group=1 is not supported"):
        hf_model_shape(config)


def test_a_glm_reference_checkpoint_routes_with_its_own_correction_bias(tmp_path):
    """model.ref_path differing from the policy only in e_score_correction_bias (a buffer, not a parameter):
    the reference pass routes with the reference's bias, as transformers does with that checkpoint."""
    import shutil

    from safetensors.torch import load_file, save_file

    model_dir = make_hf_model(tmp_path / "m", "glm4_moe", vocab=VOCAB)
    ref_dir = tmp_path / "ref"
    shutil.copytree(model_dir, ref_dir)
    tensors = load_file(ref_dir / "model.safetensors")
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    tensors[bias] = torch.randn(tensors[bias].shape, generator=torch.Generator().manual_seed(9)) * 0.2
    save_file(tensors, ref_dir / "model.safetensors", metadata={"format": "pt"})
    samples = make_samples(5, VOCAB, prompt=(4, 12), response=(4, 20))
    batch = to_batch(samples)
    trainer = trainer_for(model_dir, [f"model.ref_path={ref_dir}"])
    ref, policy = trainer.compute_log_probs(batch, model="ref"), trainer.compute_log_probs(batch)
    hf_ref = load_hf(ref_dir)
    expected = torch.cat([hf_response_log_probs(hf_ref, s.tokens, s.response_length) for s in samples])
    assert torch.allclose(ref, expected, atol=1e-4, rtol=0)
    assert (ref - policy).abs().max() > 1e-3  # the bias alone moves the log-probs
    assert torch.equal(trainer.compute_log_probs(batch), policy)  # and the policy's came back


@pytest.mark.slow  # two ranks, two GRPO steps (~15 s)
@pytest.mark.parametrize("family", ["glm4_moe", "deepseek_v2"])
def test_pipeline_stages_replay_their_own_layers_experts(family, tmp_path):
    """Routing replay under PP=2 on a GLM-4.5 (or a DeepSeek-V2: MLA, softmax routing) of 4 layers (dense, then
    3 MoE; the stages hold layers 0-1 and 2-3): each router takes its own global layer's experts (random ones, other
    ones in every layer), so the log-probs, losses and gradient norms equal one rank's."""
    model = make_hf_model(tmp_path / "model", family, vocab=VOCAB, layers=4)
    spec = dict(model=str(model), num_samples=6, vocab=VOCAB, steps=2, random_routes=True)
    overrides = COMMON + ["algorithm.routing_replay=rollout", "trainer.micro_batch_size=2"]
    ensure_single_rank_group()
    single = run_scenario({**spec, "overrides": overrides})
    multi = launch(2, {**spec, "overrides": overrides + ["parallel.pipeline_model_parallel_size=2",
                                                         "cluster.actor_num_gpus_per_node=2"]}, tmp_path)
    assert_replayed_like_one_rank(single, multi)
