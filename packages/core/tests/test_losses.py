"""Losses against hand-worked values, their invariants, gradcheck, and micro-batch/DP split invariance."""

import math

import pytest
import torch

from slime_rl.core.algorithms.losses import (
    LossBatch,
    aggregate,
    compute_loss,
    kl_estimate,
    pad_sequences,
    ppo_clip_loss,
    reduce_metrics,
    sft_loss,
    tis_weights,
    value_loss,
)
from slime_rl.core.config import AlgorithmConfig

torch.set_num_threads(1)
F64 = torch.float64
AGG_MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]


def t(rows):
    return torch.tensor(rows, dtype=F64)


def counts(mask):
    return {"num_tokens": float(mask.sum()), "num_seqs": float(mask.shape[0])}


# ---------------------------------------------------------------- aggregation


def test_aggregation_modes_differ_exactly_as_defined():
    x = t([[1.0, 2.0, 3.0], [4.0, 99.0, 99.0]])
    mask = t([[1, 1, 1], [1, 0, 0]])
    assert aggregate(x, mask, "token-mean", num_tokens=4, num_seqs=2).item() == pytest.approx(10 / 4)
    assert aggregate(x, mask, "seq-mean-token-sum", num_tokens=4, num_seqs=2).item() == pytest.approx(10 / 2)
    assert aggregate(x, mask, "seq-mean-token-mean", num_tokens=4, num_seqs=2).item() == pytest.approx((6 / 3 + 4) / 2)
    # the denominators are the caller's global counts, not this micro-batch's
    assert aggregate(x, mask, "token-mean", num_tokens=8, num_seqs=2).item() == pytest.approx(10 / 8)
    assert aggregate(x, mask, "seq-mean-token-mean", num_tokens=4, num_seqs=5).item() == pytest.approx(6 / 5)


def test_padding_with_nan_or_inf_does_not_leak():
    x = t([[1.0, float("nan")], [2.0, float("inf")]])
    mask = t([[1, 0], [1, 0]])
    for mode in AGG_MODES:
        assert math.isfinite(aggregate(x, mask, mode, num_tokens=2, num_seqs=2).item())


# ---------------------------------------------------------------- PPO surrogate


def ppo_case():
    """ratios 0.5, 1.1, 1.5 against A = +1 and -1; eps_clip 0.2, eps_clip_high 0.28."""
    ratios = [0.5, 0.5, 1.1, 1.1, 1.5, 1.5]
    adv = [1.0, -1.0, 1.0, -1.0, 1.0, -1.0]
    log_probs = t([[math.log(r) for r in ratios]]).requires_grad_()
    return log_probs, torch.zeros(1, 6, dtype=F64), t([adv]), torch.ones(1, 6, dtype=F64)


def test_ppo_loss_by_hand_and_zero_gradient_where_clipped():
    log_probs, old, adv, mask = ppo_case()
    loss, clipped, _ = ppo_clip_loss(log_probs - old, adv, 0.2, 0.28)
    # r=0.5,A=+1: max(-0.5, -0.8) = -0.5 (unclipped); r=0.5,A=-1: max(0.5, 0.8) = 0.8 (clipped)
    # r=1.1: inside the range, -A*r; r=1.5,A=+1: max(-1.5, -1.28) = -1.28 (clipped); r=1.5,A=-1: 1.5
    expected = [-0.5, 0.8, -1.1, 1.1, -1.28, 1.5]
    assert loss[0].tolist() == pytest.approx(expected)
    assert clipped[0].tolist() == [0, 1, 0, 0, 1, 0]
    loss.sum().backward()
    # d(-A r)/d log r = -A r where unclipped, 0 where clipped
    assert log_probs.grad[0].tolist() == pytest.approx([-0.5, 0.0, -1.1, 1.1, 0.0, 1.5])


def test_ppo_loss_equals_minus_a_ratio_where_unclipped():
    g = torch.Generator().manual_seed(1)
    log_ratio = torch.randn(4, 16, generator=g, dtype=F64) * 0.3
    adv = torch.randn(4, 16, generator=g, dtype=F64)
    loss, clipped, _ = ppo_clip_loss(log_ratio, adv, 0.2, 0.28)
    free = clipped == 0
    assert free.sum() > 10 and (~free).sum() > 5  # the example exercises both branches
    torch.testing.assert_close(loss[free], (-adv * log_ratio.exp())[free])


def test_compute_loss_ppo_value_gradient_and_metrics():
    log_probs, old, adv, mask = ppo_case()
    algo = AlgorithmConfig()
    loss, m = compute_loss(algo, LossBatch(log_probs, old, adv, mask), eps_clip_high=0.28, num_tokens=6, num_seqs=1)
    expected = [-0.5, 0.8, -1.1, 1.1, -1.28, 1.5]
    assert loss.item() == pytest.approx(sum(expected) / 6)
    assert m["pg_loss"].item() == pytest.approx(sum(expected) / 6)
    assert m["clip_frac"].item() == pytest.approx(2 / 6)
    ratios = [0.5, 0.5, 1.1, 1.1, 1.5, 1.5]
    assert m["ratio_mean"].item() == pytest.approx(sum(ratios) / 6)
    assert m["ratio_max"].item() == pytest.approx(1.5) and m["ratio_min"].item() == pytest.approx(0.5)
    assert m["ppo_kl"].item() == pytest.approx(-sum(math.log(r) for r in ratios) / 6)
    assert m["approx_kl"].item() == pytest.approx(sum(r - 1 - math.log(r) for r in ratios) / 6)
    assert not any(v.requires_grad for v in m.values())
    loss.backward()
    assert log_probs.grad[0].tolist() == pytest.approx([g / 6 for g in [-0.5, 0.0, -1.1, 1.1, 0.0, 1.5]])


def test_dual_clip_bound_holds():
    g = torch.Generator().manual_seed(2)
    log_ratio = torch.randn(8, 32, generator=g, dtype=F64) * 1.5  # ratios up to ~100
    adv = torch.randn(8, 32, generator=g, dtype=F64)
    loss, _, dual = ppo_clip_loss(log_ratio, adv, 0.2, 0.2, eps_clip_c=3.0)
    negative = adv < 0
    assert (loss[negative] <= -3.0 * adv[negative] + 1e-12).all()
    assert dual.sum() > 0
    plain, _, _ = ppo_clip_loss(log_ratio, adv, 0.2, 0.2)
    torch.testing.assert_close(loss[~negative], plain[~negative])  # positive advantages untouched
    # by hand: r = 5, A = -1: PPO gives max(5, 1.2) = 5, dual-clip caps it at 3 with no gradient
    lr = t([[math.log(5.0)]]).requires_grad_()
    one, _, d = ppo_clip_loss(lr, t([[-1.0]]), 0.2, 0.2, eps_clip_c=3.0)
    one.sum().backward()
    assert one.item() == pytest.approx(3.0) and d.item() == 1 and lr.grad.item() == 0.0


# ---------------------------------------------------------------- GSPO, CISPO, TIS


def test_gspo_sequence_ratio_by_hand():
    # seq 0: token log-ratios (0.1, 0.3) -> mean 0.2; seq 1: (0.4, padding) -> 0.4, tool token masked
    log_probs = t([[0.1, 0.3, 0.0], [0.4, 7.0, 0.0]]).requires_grad_()
    old = torch.zeros(2, 3, dtype=F64)
    adv = t([[1.0, 1.0, 0.0], [-0.5, -0.5, 0.0]])
    mask = t([[1, 1, 0], [1, 0, 0]])
    algo = AlgorithmConfig(advantage_estimator="gspo", loss_agg="seq-mean-token-mean", eps_clip=0.5)
    loss, m = compute_loss(algo, LossBatch(log_probs, old, adv, mask), eps_clip_high=0.5, num_tokens=3, num_seqs=2)
    r0, r1 = math.exp(0.2), math.exp(0.4)
    assert loss.item() == pytest.approx((-1.0 * r0 + 0.5 * r1) / 2)
    assert m["ratio_max"].item() == pytest.approx(r1) and m["ratio_min"].item() == pytest.approx(r0)
    loss.backward()
    # d/d lp_t of exp(mean lp) = ratio / len; seq-mean-token-mean then divides by 2 seqs
    assert log_probs.grad.tolist()[0] == pytest.approx([-r0 / 2 / 2, -r0 / 2 / 2, 0.0])
    assert log_probs.grad.tolist()[1] == pytest.approx([0.5 * r1 / 2, 0.0, 0.0])
    # policy_loss=gspo with a grpo estimator selects the same surrogate
    same, _ = compute_loss(AlgorithmConfig(policy_loss="gspo", loss_agg="seq-mean-token-mean", eps_clip=0.5),
                           LossBatch(log_probs, old, adv, mask), eps_clip_high=0.5, num_tokens=3, num_seqs=2)
    assert same.item() == pytest.approx(loss.item())


def test_cispo_by_hand_gradient_through_log_prob_only():
    # ratio 2.0 is clipped to 1.28 but still passes gradient -w*A; ratio 0.9 stays 0.9
    log_probs = t([[math.log(2.0), math.log(0.9)]]).requires_grad_()
    old = torch.zeros(1, 2, dtype=F64)
    adv = t([[1.0, -2.0]])
    algo = AlgorithmConfig(policy_loss="cispo", eps_clip=1.0)
    loss, m = compute_loss(algo, LossBatch(log_probs, old, adv, torch.ones(1, 2, dtype=F64)),
                           eps_clip_high=0.28, num_tokens=2, num_seqs=1)
    lp = [math.log(2.0), math.log(0.9)]
    assert loss.item() == pytest.approx((-1.28 * 1.0 * lp[0] + 0.9 * 2.0 * lp[1]) / 2)
    assert m["clip_frac"].item() == pytest.approx(1 / 2)
    loss.backward()
    assert log_probs.grad[0].tolist() == pytest.approx([-1.28 / 2, 0.9 * 2.0 / 2])


def test_tis_weights_lie_in_range_and_scale_the_loss():
    g = torch.Generator().manual_seed(3)
    old = torch.randn(4, 10, generator=g, dtype=F64)
    rollout = old + torch.randn(4, 10, generator=g, dtype=F64)
    w, truncated = tis_weights(old, rollout, tis_clip=2.0)
    assert (w >= 0).all() and (w <= 2.0).all() and truncated.sum() > 0
    torch.testing.assert_close(w[truncated == 0], (old - rollout).exp()[truncated == 0])
    # by hand: on-policy (ratio 1), A = 1, tokens with old - rollout = log 0.5 and log 3 -> weights 0.5 and 2
    log_probs = torch.zeros(1, 2, dtype=F64, requires_grad=True)
    batch = LossBatch(log_probs, torch.zeros(1, 2, dtype=F64), torch.ones(1, 2, dtype=F64),
                      torch.ones(1, 2, dtype=F64), rollout_log_probs=t([[-math.log(0.5), -math.log(3.0)]]))
    loss, m = compute_loss(AlgorithmConfig(use_tis=True, tis_clip=2.0), batch, eps_clip_high=0.2,
                           num_tokens=2, num_seqs=1)
    assert loss.item() == pytest.approx((-0.5 - 2.0) / 2)
    assert m["tis_weight_mean"].item() == pytest.approx(1.25) and m["tis_clipfrac"].item() == pytest.approx(0.5)
    assert m["train_rollout_logprob_abs_diff"].item() == pytest.approx((math.log(2) + math.log(3)) / 2)


# ---------------------------------------------------------------- KL, entropy, value, SFT


def test_kl_estimators_by_hand():
    lp, ref = t([[-1.0]]), t([[-1.5]])  # log(pi/pi_ref) = 0.5
    assert kl_estimate(lp, ref, "k1").item() == pytest.approx(0.5)
    assert kl_estimate(lp, ref, "k2").item() == pytest.approx(0.125)
    assert kl_estimate(lp, ref, "k3").item() == pytest.approx(math.exp(-0.5) - 1 + 0.5)
    assert kl_estimate(t([[0.0]]), t([[-30.0]]), "low_var_kl").item() == pytest.approx(10.0)
    assert kl_estimate(t([[-30.0]]), t([[0.0]]), "k3").item() > 10.0  # k3 itself is not clamped


def test_k3_nonnegative_and_zero_when_equal():
    g = torch.Generator().manual_seed(4)
    lp, ref = torch.randn(64, generator=g, dtype=F64), torch.randn(64, generator=g, dtype=F64)
    for kind in ("k3", "low_var_kl"):
        assert (kl_estimate(lp, ref, kind) >= 0).all()
        assert kl_estimate(lp, lp, kind).abs().max().item() == 0.0


def test_kl_loss_and_entropy_bonus_terms():
    log_probs = t([[-1.0, -2.0]]).requires_grad_()
    ref = t([[-1.5, -2.0]])
    entropy = t([[0.7, 0.3]]).requires_grad_()
    batch = LossBatch(log_probs, log_probs.detach().clone(), t([[1.0, 1.0]]), torch.ones(1, 2, dtype=F64),
                      ref_log_probs=ref, entropy=entropy)
    algo = AlgorithmConfig(use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="k2", entropy_coef=0.01)
    loss, m = compute_loss(algo, batch, eps_clip_high=0.2, num_tokens=2, num_seqs=1)
    pg = -1.0  # ratio 1, A = 1
    kl = (0.125 + 0.0) / 2
    ent = (0.7 + 0.3) / 2
    assert loss.item() == pytest.approx(pg + 0.1 * kl - 0.01 * ent)
    assert m["kl_loss"].item() == pytest.approx(kl) and m["entropy"].item() == pytest.approx(ent)
    loss.backward()
    assert entropy.grad[0].tolist() == pytest.approx([-0.01 / 2, -0.01 / 2])
    # without use_kl_loss the KL is only watched
    loss2, m2 = compute_loss(AlgorithmConfig(kl_loss_type="k2"), batch, eps_clip_high=0.2, num_tokens=2, num_seqs=1)
    assert loss2.item() == pytest.approx(pg) and "kl_loss" not in m2 and m2["ref_kl"].item() == pytest.approx(kl)


def test_value_loss_clipped_by_hand():
    values = t([[1.0, 0.0]]).requires_grad_()
    old, returns = t([[0.5, 0.5]]), t([[2.0, 2.0]])
    loss, m = value_loss(values, old, returns, torch.ones(1, 2, dtype=F64), value_clip=0.2, loss_agg="token-mean",
                         num_tokens=2, num_seqs=1)
    # token 0: plain (1-2)^2 = 1, clipped (0.7-2)^2 = 1.69 -> 1.69 (clipped, no gradient)
    # token 1: plain (0-2)^2 = 4, clipped (0.3-2)^2 = 2.89 -> 4
    assert loss.item() == pytest.approx(0.5 * (1.69 + 4.0) / 2)
    assert m["value_clipfrac"].item() == pytest.approx(0.5)
    loss.backward()
    assert values.grad[0].tolist() == pytest.approx([0.0, 0.5 * 2 * (0.0 - 2.0) / 2])


def test_sft_loss_masked_nll():
    log_probs = t([[-1.0, -2.0, -9.0], [-3.0, -9.0, -9.0]])
    mask = t([[1, 1, 0], [1, 0, 0]])
    loss, _ = sft_loss(log_probs, mask, loss_agg="token-mean", num_tokens=3, num_seqs=2)
    assert loss.item() == pytest.approx(6 / 3)
    loss, _ = compute_loss(AlgorithmConfig(loss_type="sft", loss_agg="seq-mean-token-mean"),
                           LossBatch(log_probs, log_probs, torch.zeros_like(mask), mask),
                           eps_clip_high=0.2, num_tokens=3, num_seqs=2)
    assert loss.item() == pytest.approx((1.5 + 3.0) / 2)


# ---------------------------------------------------------------- gradcheck, split invariance


def random_batch(seed, batch=4, length=6, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    lengths = [6, 3, 5, 1][:batch]
    mask = pad_sequences([[1.0] * n for n in lengths], dtype=dtype)
    mask[0, 2] = 0.0  # a tool token
    old = -torch.rand(batch, length, generator=g, dtype=dtype) * 2
    return LossBatch(
        log_probs=(old + torch.randn(batch, length, generator=g, dtype=dtype) * 0.3).requires_grad_(),
        old_log_probs=old,
        advantages=torch.randn(batch, length, generator=g, dtype=dtype),
        loss_mask=mask,
        rollout_log_probs=old + torch.randn(batch, length, generator=g, dtype=dtype) * 0.5,
        ref_log_probs=old + torch.randn(batch, length, generator=g, dtype=dtype) * 0.3,
        entropy=torch.rand(batch, length, generator=g, dtype=dtype).requires_grad_(),
    )


def random_values(seed, mask):
    """A critic's ``(values, old_values, returns)`` over ``mask``'s shape; ``values`` requires grad."""
    g = torch.Generator().manual_seed(seed)
    values, old_values, returns = (torch.randn(*mask.shape, generator=g, dtype=mask.dtype) for _ in range(3))
    return values.requires_grad_(), old_values, returns


ALGOS = {
    "ppo": dict(),
    "ppo_dual_clip_tis": dict(eps_clip_c=3.0, use_tis=True),
    "icepop": dict(rollout_correction="icepop"),
    "seq_tis": dict(rollout_correction="seq-tis", rollout_correction_high=1.2),
    "gspo_seq_mask_tis": dict(advantage_estimator="gspo", eps_clip=0.1, rollout_correction="seq-mask-tis",
                              rollout_correction_high=1.2),
    "gspo": dict(advantage_estimator="gspo", eps_clip=0.1),
    "cispo": dict(policy_loss="cispo", eps_clip=1.0),
    "kl_k1_entropy": dict(use_kl_loss=True, kl_loss_coef=0.3, kl_loss_type="k1", entropy_coef=0.01),
    "kl_k2": dict(use_kl_loss=True, kl_loss_coef=0.3, kl_loss_type="k2"),
    "kl_k3": dict(use_kl_loss=True, kl_loss_coef=0.3, kl_loss_type="k3"),
    "kl_low_var": dict(use_kl_loss=True, kl_loss_coef=0.3, kl_loss_type="low_var_kl"),
    "sft": dict(loss_type="sft"),
}


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("name", sorted(ALGOS))
def test_gradcheck(name, mode):
    algo = AlgorithmConfig(loss_agg=mode, **ALGOS[name])
    b = random_batch(seed=5)
    fixed_log_ratio = (b.log_probs - b.old_log_probs).detach()

    def fn(log_probs, entropy):
        fields = {**b.__dict__, "log_probs": log_probs, "entropy": entropy}
        if name == "cispo":
            # CISPO's weight is under stop-gradient by design: hold the ratio fixed so the
            # finite differences see the same function the analytic gradient describes.
            fields["old_log_probs"] = log_probs.detach() - fixed_log_ratio
        return compute_loss(algo, LossBatch(**fields), eps_clip_high=0.28, **counts(b.loss_mask))[0]

    assert torch.autograd.gradcheck(fn, (b.log_probs, b.entropy))


@pytest.mark.parametrize("mode", AGG_MODES)
def test_gradcheck_value_loss(mode):
    mask = random_batch(seed=6).loss_mask
    values, old_values, returns = random_values(6, mask)

    def fn(values):
        return value_loss(values, old_values, returns, mask, value_clip=0.2, loss_agg=mode, **counts(mask))[0]

    assert torch.autograd.gradcheck(fn, (values,))


def split(batch, rows):
    """One micro-batch: the given rows, a leaf copy of the grad tensors."""
    out = {}
    for name, value in batch.__dict__.items():
        if value is not None:
            value = value[rows].detach().clone().requires_grad_(value.requires_grad)
        out[name] = value
    return LossBatch(**out)


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("name", sorted(ALGOS))
def test_halves_sum_to_the_whole(name, mode):
    """Two micro-batches (or two DP ranks) with global counts give the whole batch's loss, grads and metrics."""
    algo = AlgorithmConfig(loss_agg=mode, **ALGOS[name])
    whole = split(random_batch(seed=7), slice(0, 4))
    n = counts(whole.loss_mask)
    loss, metrics = compute_loss(algo, whole, eps_clip_high=0.28, **n)
    loss.backward()
    parts, part_metrics = [split(whole, slice(0, 1)), split(whole, slice(1, 4))], []
    total = 0.0
    for part in parts:
        part_loss, m = compute_loss(algo, part, eps_clip_high=0.28, **n)
        part_loss.backward()
        total += part_loss.item()
        part_metrics.append(m)
    assert total == pytest.approx(loss.item(), rel=1e-12, abs=1e-12)
    for field in ("log_probs", "entropy"):
        grads = [p.__dict__[field].grad for p in parts]
        if whole.__dict__[field].grad is None:
            assert all(g is None for g in grads)
            continue
        torch.testing.assert_close(torch.cat(grads), whole.__dict__[field].grad)
    assert_parts_combine(part_metrics, metrics)


def assert_parts_combine(part_metrics, metrics):
    """reduce_metrics over the parts' metrics gives the whole batch's (quantiles of *_dist values included)."""
    combined, whole = reduce_metrics(part_metrics), reduce_metrics([metrics])
    assert combined.keys() == whole.keys()
    for key, value in whole.items():
        assert combined[key] == pytest.approx(value, rel=1e-10, abs=1e-12), key


@pytest.mark.parametrize("mode", AGG_MODES)
def test_value_loss_halves_sum_to_the_whole(mode):
    """The critic's loss splits over micro-batches and DP ranks like the policy's."""
    mask = random_batch(seed=7).loss_mask
    values, old_values, returns = random_values(7, mask)
    n = counts(mask)
    loss, metrics = value_loss(values, old_values, returns, mask, value_clip=0.2, loss_agg=mode, **n)
    loss.backward()
    grads, parts = [], []
    for rows in (slice(0, 1), slice(1, 4)):
        part = values[rows].detach().clone().requires_grad_()
        part_loss, m = value_loss(part, old_values[rows], returns[rows], mask[rows], value_clip=0.2, loss_agg=mode, **n)
        part_loss.backward()
        grads.append(part.grad)
        parts.append(m)
    torch.testing.assert_close(torch.cat(grads), values.grad)
    assert_parts_combine(parts, metrics)


def test_bf16_inputs_are_computed_in_float32():
    b = random_batch(seed=8, dtype=torch.float32)
    half = LossBatch(**{k: (v.detach().bfloat16().requires_grad_(v.requires_grad) if v is not None else None)
                        for k, v in b.__dict__.items()})
    loss, m = compute_loss(AlgorithmConfig(), half, eps_clip_high=0.2, **counts(b.loss_mask))
    assert loss.dtype == torch.float32 and m["loss"].dtype == torch.float32
    loss.backward()
    assert half.log_probs.grad.dtype == torch.bfloat16


def test_pad_sequences_from_packed():
    flat = torch.arange(6, dtype=F64, requires_grad=True)
    rows = pad_sequences(flat.split([3, 1, 2]))
    assert rows.tolist() == [[0, 1, 2], [3, 0, 0], [4, 5, 0]]
    rows.sum().backward()
    assert flat.grad.tolist() == [1.0] * 6


def test_missing_inputs_are_named():
    b = random_batch(seed=9)
    bare = LossBatch(b.log_probs, b.old_log_probs, b.advantages, b.loss_mask)
    n = counts(b.loss_mask)
    with pytest.raises(ValueError, match="use_tis needs"):
        compute_loss(AlgorithmConfig(use_tis=True), bare, eps_clip_high=0.2, **n)
    with pytest.raises(ValueError, match="use_kl_loss needs"):
        compute_loss(AlgorithmConfig(use_kl_loss=True), bare, eps_clip_high=0.2, **n)
    with pytest.raises(ValueError, match="entropy_coef"):
        compute_loss(AlgorithmConfig(entropy_coef=0.1), bare, eps_clip_high=0.2, **n)
    with pytest.raises(ValueError, match="num_tokens=0"):
        compute_loss(AlgorithmConfig(), bare, eps_clip_high=0.2, num_tokens=0, num_seqs=4)
