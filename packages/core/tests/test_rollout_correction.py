"""The rollout corrections (algorithm.rollout_correction: tis, icepop, seq-tis, seq-mask-tis; use_tis) against a
float64 reference written out here loop by loop: loss, gradient and every metric, over sequences of different
lengths with a tool token, an untrained row and NaN padding; masked tokens add nothing to the loss or the
gradient; the quantile metrics combine exactly over micro-batches; the config refuses what makes no sense."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from slime_rl.core.algorithms import registry
from slime_rl.core.algorithms.losses import LossBatch, compute_loss, pad_sequences, reduce_metrics
from slime_rl.core.algorithms.registry import ROLLOUT_CORRECTIONS, register_rollout_correction
from slime_rl.core.algorithms.rollout_correction import CorrectionTerms, quantiles
from slime_rl.core.config import AlgorithmConfig, ConfigError, load_config

torch.set_num_threads(1)
F64 = torch.float64
AGG_MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]
EPS_CLIP, EPS_CLIP_HIGH = 0.2, 0.28
LIMIT = 20.0
# per sequence: its length and the offset of its log(pi_old / pi_roll): seqs 1 and 3 lie far outside [0.5, 2]
LENGTHS, OFFSETS = [7, 3, 5, 1, 2], [0.0, 0.9, -0.05, -1.0, 0.0]
TOOL_TOKEN = (0, 2)  # loss_mask 0 inside sequence 0
UNTRAINED_ROW = 4  # every token of the last row has loss_mask 0


def make_rows(seed=0):
    """Per sequence, python float lists (no padding): lp, old, roll, adv, m."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i, (n, offset) in enumerate(zip(LENGTHS, OFFSETS, strict=True)):
        old = (-torch.rand(n, generator=g, dtype=F64) * 2).tolist()
        noise = torch.randn(n, generator=g, dtype=F64).tolist()
        roll = [o - offset - 0.5 * z for o, z in zip(old, noise, strict=True)]
        lp = [o + 0.2 * z for o, z in zip(old, torch.randn(n, generator=g, dtype=F64).tolist(), strict=True)]
        adv = torch.randn(n, generator=g, dtype=F64).tolist()
        m = [0.0 if i == UNTRAINED_ROW else 1.0] * n
        if i == TOOL_TOKEN[0]:
            m[TOOL_TOKEN[1]] = 0.0
        rows.append(dict(lp=lp, old=old, roll=roll, adv=adv, m=m))
    return rows


def to_batch(rows):
    """Padded ``[B, T]`` float64 tensors; the engine's log-probs are NaN on padding (they must not leak)."""
    def pad(key, value=0.0):
        return pad_sequences([torch.tensor(r[key], dtype=F64) for r in rows], value=value)

    return LossBatch(log_probs=pad("lp").requires_grad_(), old_log_probs=pad("old"), advantages=pad("adv"),
                     loss_mask=pad("m"), rollout_log_probs=pad("roll", float("nan")))


# ---------------------------------------------------------------- the reference, one token at a time


def reference(kind, rows, low, high, mode):
    """(loss, d loss / d log_probs per row, metrics) of PPO times the correction's weight, in python floats."""
    n_tok = sum(sum(r["m"]) for r in rows)
    n_seq = len(rows)
    per_row_x, per_row_g, per_row_w = [], [], []
    token_ratios, seq_ratios = [], []
    masked_tokens = truncated_tokens = masked_seqs = 0
    for r in rows:
        trained = [mi > 0 for mi in r["m"]]
        log_r = [max(-LIMIT, min(LIMIT, o - q)) if t else 0.0 for o, q, t in zip(r["old"], r["roll"], trained,
                                                                                 strict=True)]
        ratio = [math.exp(x) for x in log_r]
        count = sum(r["m"])
        rho = math.exp(sum(mi * x for mi, x in zip(r["m"], log_r, strict=True)) / count) if count else 1.0
        weights, masked, truncated = [], [], []
        for rt in ratio:
            if kind == "tis":
                w, drop, cut = min(rt, high), False, rt > high
            elif kind == "icepop":
                drop = not low <= rt <= high
                w, cut = (0.0 if drop else rt), False
            elif kind == "seq-tis":
                w, drop, cut = min(rho, high), False, rho > high
            else:  # seq-mask-tis
                drop = not low <= rho <= high
                w, cut = (0.0 if drop else rt), False
            weights.append(w)
            masked.append(drop)
            truncated.append(cut)
        weights = [w if t else 0.0 for w, t in zip(weights, trained, strict=True)]
        xs, gs = [], []
        for lp, old, adv, w in zip(r["lp"], r["old"], r["adv"], weights, strict=True):
            pr = math.exp(max(-LIMIT, min(LIMIT, lp - old)))
            unclipped, clipped = -adv * pr, -adv * min(max(pr, 1 - EPS_CLIP), 1 + EPS_CLIP_HIGH)
            loss, grad = (clipped, 0.0) if clipped > unclipped else (unclipped, -adv * pr)
            xs.append(loss * w)
            gs.append(grad * w)
        per_row_x.append(xs)
        per_row_g.append(gs)
        per_row_w.append(weights)
        masked_tokens += sum(d and t for d, t in zip(masked, trained, strict=True))
        truncated_tokens += sum(c and t for c, t in zip(truncated, trained, strict=True))
        masked_seqs += count > 0 and all(d for d, t in zip(masked, trained, strict=True) if t)
        token_ratios += [rt for rt, t in zip(ratio, trained, strict=True) if t]
        if count:
            seq_ratios.append(rho)

    def agg(per_row):
        if mode == "token-mean":
            return sum(mi * x for r, xs in zip(rows, per_row, strict=True) for mi, x in zip(r["m"], xs, strict=True)) / n_tok
        if mode == "seq-mean-token-sum":
            return sum(mi * x for r, xs in zip(rows, per_row, strict=True) for mi, x in zip(r["m"], xs, strict=True)) / n_seq
        return sum(sum(mi * x for mi, x in zip(r["m"], xs, strict=True)) / max(sum(r["m"]), 1.0)
                   for r, xs in zip(rows, per_row, strict=True)) / n_seq

    def agg_grad(r, gs):
        if mode == "token-mean":
            return [mi * g / n_tok for mi, g in zip(r["m"], gs, strict=True)]
        if mode == "seq-mean-token-sum":
            return [mi * g / n_seq for mi, g in zip(r["m"], gs, strict=True)]
        return [mi * g / max(sum(r["m"]), 1.0) / n_seq for mi, g in zip(r["m"], gs, strict=True)]

    metrics = {
        "rollout_corr_weight_mean": agg(per_row_w),
        "rollout_corr_masked_frac": masked_tokens / n_tok,
        "rollout_corr_masked_seq_frac": masked_seqs / n_seq,
        "rollout_corr_truncated_frac": truncated_tokens / n_tok,
        "train_rollout_logprob_abs_diff": agg([[abs(o - q) if mi > 0 else 0.0 for o, q, mi in
                                               zip(r["old"], r["roll"], r["m"], strict=True)] for r in rows]),
    }
    for name, values in (("rollout_corr_ratio", token_ratios), ("rollout_corr_seq_ratio", seq_ratios)):
        for p, q in zip((5, 50, 95), np.percentile(np.array(values, dtype=np.float64), [5, 50, 95]), strict=True):
            metrics[f"{name}_p{p}"] = float(q)
    return agg(per_row_x), [agg_grad(r, gs) for r, gs in zip(rows, per_row_g, strict=True)], metrics


CASES = {  # name: (algorithm keys, reference kind, low, high)
    "tis": (dict(rollout_correction="tis"), "tis", 0.0, 2.0),
    "use_tis": (dict(use_tis=True, tis_clip=1.5), "tis", 0.0, 1.5),
    "icepop": (dict(rollout_correction="icepop"), "icepop", 0.5, 2.0),
    "icepop_band": (dict(rollout_correction="icepop", rollout_correction_low=0.8, rollout_correction_high=1.4),
                    "icepop", 0.8, 1.4),
    "seq-tis": (dict(rollout_correction="seq-tis", rollout_correction_high=1.3), "seq-tis", 0.0, 1.3),
    "seq-mask-tis": (dict(rollout_correction="seq-mask-tis"), "seq-mask-tis", 0.5, 2.0),
}


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_loss_gradient_and_metrics_equal_the_float64_reference(case, mode):
    keys, kind, low, high = CASES[case]
    rows = make_rows()
    batch = to_batch(rows)
    n_tok = sum(sum(r["m"]) for r in rows)
    loss, metrics = compute_loss(AlgorithmConfig(loss_agg=mode, **keys), batch, eps_clip_high=EPS_CLIP_HIGH,
                                 num_tokens=n_tok, num_seqs=len(rows))
    loss.backward()
    want_loss, want_grads, want_metrics = reference(kind, rows, low, high, mode)
    assert loss.dtype == F64 and loss.item() == pytest.approx(want_loss, rel=1e-12, abs=1e-14)
    for i, want in enumerate(want_grads):
        got = batch.log_probs.grad[i]
        assert got[: len(want)].tolist() == pytest.approx(want, rel=1e-12, abs=1e-15), i
        assert got[len(want):].abs().sum().item() == 0.0  # padding
    final = reduce_metrics([metrics])
    for name, value in want_metrics.items():
        assert final[name] == pytest.approx(value, rel=1e-12, abs=1e-15), name
    if case == "use_tis":  # its metrics as before, aggregated like the loss
        assert final["tis_weight_mean"] == pytest.approx(want_metrics["rollout_corr_weight_mean"], rel=1e-12)
    else:
        assert "tis_weight_mean" not in final
    assert all(math.isfinite(v) for v in final.values())


def test_the_example_exercises_every_branch():
    """Tokens and sequences masked and kept, weights truncated, for the bands the cases use."""
    rows = make_rows()
    _, _, icepop = reference("icepop", rows, 0.5, 2.0, "token-mean")
    _, _, seq_mask = reference("seq-mask-tis", rows, 0.5, 2.0, "token-mean")
    _, _, tis = reference("tis", rows, 0.0, 2.0, "token-mean")
    _, _, seq_tis = reference("seq-tis", rows, 0.0, 1.3, "token-mean")
    # of the 15 trained tokens icepop drops 5 (two in sequence 2, which seq-mask-tis keeps with a ratio-5 token),
    # seq-mask-tis the 4 of sequences 1 and 3
    assert icepop["rollout_corr_masked_frac"] == 5 / 15 and seq_mask["rollout_corr_masked_frac"] == 4 / 15
    assert seq_mask["rollout_corr_masked_seq_frac"] == 2 / 5  # sequences 1 and 3; the untrained row is not "masked"
    assert icepop["rollout_corr_masked_seq_frac"] == 1 / 5  # the one-token sequence 3
    assert 0 < tis["rollout_corr_truncated_frac"] and 0 < seq_tis["rollout_corr_truncated_frac"]


@pytest.mark.parametrize("case", ["icepop", "seq-mask-tis"])
def test_masked_tokens_add_nothing_to_the_loss_or_the_gradient(case):
    keys, kind, low, high = CASES[case]
    rows = make_rows()
    algo = AlgorithmConfig(**keys)
    n = dict(num_tokens=sum(sum(r["m"]) for r in rows), num_seqs=len(rows))
    batch = to_batch(rows)
    loss, metrics = compute_loss(algo, batch, eps_clip_high=EPS_CLIP_HIGH, **n)
    loss.backward()
    ratio = (batch.old_log_probs - batch.rollout_log_probs).exp()
    if kind == "icepop":
        dropped = (ratio < low) | (ratio > high)
    else:
        seq = ((batch.old_log_probs - batch.rollout_log_probs).nan_to_num() * batch.loss_mask).sum(-1)
        rho = (seq / batch.loss_mask.sum(-1).clamp(min=1)).exp()
        dropped = ((rho < low) | (rho > high))[:, None].expand_as(ratio)
    dropped = dropped & (batch.loss_mask > 0)
    assert dropped.sum() >= 2
    assert batch.log_probs.grad[dropped].abs().max().item() == 0.0
    # whatever the dropped tokens' log-probs and advantages, the loss stays
    moved = to_batch(rows)
    with torch.no_grad():
        moved.log_probs[dropped] += 3.0
        moved.advantages[dropped] *= -50.0
    again, _ = compute_loss(algo, moved, eps_clip_high=EPS_CLIP_HIGH, **n)
    assert again.item() == pytest.approx(loss.item(), rel=1e-14, abs=0)
    assert reduce_metrics([metrics])["rollout_corr_masked_frac"] == pytest.approx(dropped.sum().item() / n["num_tokens"])


def test_by_hand():
    """One sequence of ratios 0.4, 1, 2.5 (geometric mean 1) and one of 3, 3 (mean 3); on-policy, A = 1."""
    log_r = [[math.log(0.4), 0.0, math.log(2.5)], [math.log(3.0), math.log(3.0), 0.0]]
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=F64)
    batch = LossBatch(torch.zeros(2, 3, dtype=F64, requires_grad=True), torch.zeros(2, 3, dtype=F64),
                      torch.ones(2, 3, dtype=F64), mask, rollout_log_probs=-torch.tensor(log_r, dtype=F64))

    def run(**keys):
        loss, m = compute_loss(AlgorithmConfig(**keys), batch, eps_clip_high=0.2, num_tokens=5, num_seqs=2)
        return loss.item(), reduce_metrics([m])

    # icepop [0.5, 2]: weights 0, 1, 0 | 0, 0: the loss is -A * 1 over 5 tokens
    loss, m = run(rollout_correction="icepop")
    assert loss == pytest.approx(-1 / 5) and m["rollout_corr_masked_frac"] == pytest.approx(4 / 5)
    assert m["rollout_corr_masked_seq_frac"] == pytest.approx(1 / 2)
    assert m["rollout_corr_ratio_p50"] == pytest.approx(2.5) and m["rollout_corr_seq_ratio_p50"] == pytest.approx(2.0)
    # seq-mask-tis [0.5, 2]: sequence 0 kept with its token ratios, sequence 1 dropped
    loss, m = run(rollout_correction="seq-mask-tis")
    assert loss == pytest.approx(-(0.4 + 1.0 + 2.5) / 5) and m["rollout_corr_masked_seq_frac"] == pytest.approx(1 / 2)
    # seq-tis capped at 2: 1, 1, 1 | 2, 2
    loss, m = run(rollout_correction="seq-tis")
    assert loss == pytest.approx(-(3 * 1.0 + 2 * 2.0) / 5) and m["rollout_corr_truncated_frac"] == pytest.approx(2 / 5)
    # tis capped at 2: 0.4, 1, 2 | 2, 2 (use_tis the same, with its own metrics too)
    assert run(rollout_correction="tis")[0] == pytest.approx(-(0.4 + 1.0 + 2.0 + 2.0 + 2.0) / 5)
    loss, m = run(use_tis=True)
    assert loss == pytest.approx(-7.4 / 5) and m["tis_clipfrac"] == pytest.approx(3 / 5)
    # a wider band keeps everything: icepop is then plain (untruncated) token IS
    loss, m = run(rollout_correction="icepop", rollout_correction_high=4.0)
    assert loss == pytest.approx(-(0.4 + 1.0 + 2.5 + 3.0 + 3.0) / 5) and m["rollout_corr_masked_frac"] == 0.0


# ---------------------------------------------------------------- the quantile metrics


def test_quantiles_are_numpys_and_combine_exactly_over_parts():
    g = torch.Generator().manual_seed(11)
    values = torch.randn(101, generator=g, dtype=F64).exp()
    assert quantiles(values) == pytest.approx(np.percentile(values.numpy(), [5, 50, 95]).tolist(), rel=1e-15)
    assert quantiles(torch.tensor([3.0])) == [3.0, 3.0, 3.0]
    parts = [{"x_dist": values[:40], "n": torch.tensor(1.0)}, {"x_dist": torch.full((2, 3), float("nan"))},
             {"x_dist": values[40:].float(), "n": 2.0}]  # NaN: no value (padding), 2-D: as a loss gives them
    partial = reduce_metrics(parts[:2], final=False)  # one rank's, before the gather over ranks
    assert partial["x_dist"].dtype == F64 and partial["x_dist"].numel() == 40
    final = reduce_metrics([partial, reduce_metrics(parts[2:], final=False)])
    assert "x_dist" not in final and final["n"] == 3.0
    assert [final["x_p5"], final["x_p50"], final["x_p95"]] == pytest.approx(
        np.percentile(np.concatenate([values[:40].numpy(), values[40:].float().double().numpy()]), [5, 50, 95]))
    assert reduce_metrics([{"x_dist": torch.zeros(0)}]) == {}  # no values: no quantiles


@pytest.mark.parametrize("case", ["icepop", "seq-mask-tis", "use_tis"])
def test_micro_batches_give_the_whole_steps_metrics(case):
    rows = make_rows()
    n = dict(num_tokens=sum(sum(r["m"]) for r in rows), num_seqs=len(rows))
    algo = AlgorithmConfig(**CASES[case][0])
    _, whole = compute_loss(algo, to_batch(rows), eps_clip_high=EPS_CLIP_HIGH, **n)
    parts = [compute_loss(algo, to_batch(rows[a:b]), eps_clip_high=EPS_CLIP_HIGH, **n)[1]
             for a, b in ((0, 1), (1, 3), (3, 5))]
    combined, want = reduce_metrics(parts), reduce_metrics([whole])
    assert combined.keys() == want.keys() and "rollout_corr_ratio_p95" in want
    for name, value in want.items():
        assert combined[name] == pytest.approx(value, rel=1e-12, abs=1e-15), name


# ---------------------------------------------------------------- inputs, registry and config


def test_without_the_engines_log_probs_the_key_is_named():
    rows = make_rows()
    b = to_batch(rows)
    bare = LossBatch(b.log_probs, b.old_log_probs, b.advantages, b.loss_mask)
    with pytest.raises(ValueError, match="algorithm.rollout_correction needs the engine's log-probs"):
        compute_loss(AlgorithmConfig(rollout_correction="icepop"), bare, eps_clip_high=0.2, num_tokens=10, num_seqs=5)


@pytest.fixture
def fresh_registry(monkeypatch):
    monkeypatch.setattr(ROLLOUT_CORRECTIONS, "_entries", dict(ROLLOUT_CORRECTIONS._entries))


def test_a_registered_correction_is_used_with_what_it_declares(fresh_registry):
    @register_rollout_correction("test_halve_positive", masks=True)
    def halve_positive(inputs):
        """Tokens the trainer likes more than the engine did weigh 1/2; others are dropped."""
        keep = inputs.log_ratio > 0
        return CorrectionTerms(keep * 0.5, (~keep).double(), torch.zeros_like(inputs.log_ratio))

    rows = make_rows()
    n = dict(num_tokens=sum(sum(r["m"]) for r in rows), num_seqs=len(rows))
    on_policy = to_batch(rows)
    on_policy.log_probs = on_policy.old_log_probs.clone().requires_grad_()
    loss, m = compute_loss(AlgorithmConfig(rollout_correction="test_halve_positive"), on_policy, eps_clip_high=0.2, **n)
    keep = ((on_policy.old_log_probs - on_policy.rollout_log_probs) > 0) & (on_policy.loss_mask > 0)
    assert loss.item() == pytest.approx((-0.5 * on_policy.advantages[keep]).sum().item() / n["num_tokens"], rel=1e-12)
    assert reduce_metrics([m])["rollout_corr_masked_frac"] == pytest.approx(1 - keep.sum().item() / n["num_tokens"])
    assert ROLLOUT_CORRECTIONS.resolve("test_halve_positive").masks
    with pytest.raises(ValueError, match="already registered"):
        register_rollout_correction("icepop")(halve_positive)
    with pytest.raises(ValueError, match="level 'geometric'"):
        register_rollout_correction("test_geo", level="geometric")
    register_rollout_correction("test_a_tuple")(lambda inputs: (inputs.log_ratio, inputs.log_ratio))
    with pytest.raises(ValueError, match="'test_a_tuple' returned a tuple; return CorrectionTerms"):
        compute_loss(AlgorithmConfig(rollout_correction="test_a_tuple"), to_batch(rows), eps_clip_high=0.2, **n)


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"input": "1 + 1 =", "label": "2"}\n')
    return path


def refused(prompts, *overrides):
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"data.prompt_data={prompts}", *overrides])
    assert "\n" not in str(info.value)
    return info.value


def test_the_config_takes_the_corrections_and_refuses_what_makes_no_sense(prompts, tmp_path, monkeypatch):
    base = [f"data.prompt_data={prompts}"]
    for name in ("tis", "icepop", "seq-tis", "seq-mask-tis"):
        assert load_config(None, [*base, f"algorithm.rollout_correction={name}"]).algorithm.rollout_correction == name
    cfg = load_config(None, [*base, "algorithm.rollout_correction=icepop", "algorithm.rollout_correction_low=0.8",
                             "algorithm.rollout_correction_high=1.25"])
    assert (cfg.algorithm.rollout_correction_low, cfg.algorithm.rollout_correction_high) == (0.8, 1.25)
    assert load_config(None, [*base, "algorithm.use_tis=true"]).algorithm.rollout_correction is None  # as before

    err = refused(prompts, "algorithm.rollout_correction=icepopp")
    assert err.field == "algorithm.rollout_correction" and "did you mean 'icepop'?" in str(err)
    err = refused(prompts, "algorithm.rollout_correction=icepop", "algorithm.use_tis=true")
    assert err.field == "algorithm.use_tis" and "Keep one" in str(err)
    err = refused(prompts, "algorithm.rollout_correction=seq-mask-tis", "algorithm.loss_type=sft")
    assert err.field == "algorithm.rollout_correction" and "sft" in str(err)
    err = refused(prompts, "algorithm.rollout_correction=icepop", "algorithm.use_rollout_logprobs=true")
    assert "use_rollout_logprobs makes 1" in str(err)
    err = refused(prompts, "algorithm.rollout_correction=tis", "algorithm.rollout_correction_low=0.5")
    assert err.field == "algorithm.rollout_correction_low" and "icepop, seq-mask-tis" in str(err)
    err = refused(prompts, "algorithm.rollout_correction_low=0.5")
    assert err.field == "algorithm.rollout_correction_low" and "none is set" in str(err)
    err = refused(prompts, "algorithm.rollout_correction=icepop", "algorithm.rollout_correction_low=1.1",
                  "algorithm.rollout_correction_high=2")
    assert err.field == "algorithm.rollout_correction_low" and "[1.1, 2]" in str(err)
    err = refused(prompts, "algorithm.rollout_correction=seq-mask-tis", "algorithm.rollout_correction_high=0.9")
    assert err.field == "algorithm.rollout_correction_high" and "low defaults to 1 / high" in str(err)
    err = refused(prompts, "algorithm.rollout_correction=seq-tis", "algorithm.rollout_correction_high=0.9")
    assert err.field == "algorithm.rollout_correction_high" and ">= 1" in str(err)

    # a user's module:attr is imported and checked by the config, then used
    (tmp_path / "my_correction.py").write_text(
        "import torch\nfrom slime_rl.core.algorithms.rollout_correction import CorrectionTerms\n"
        "def ones(inputs):\n    z = torch.zeros_like(inputs.log_ratio)\n    return CorrectionTerms(z + 1, z, z)\n"
        "def two(a, b):\n    return a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = load_config(None, [*base, "algorithm.rollout_correction=my_correction:ones"])
    assert registry.rollout_correction_of(cfg.algorithm).masks is False
    err = refused(prompts, "algorithm.rollout_correction=my_correction:two")
    assert err.field == "algorithm.rollout_correction" and "it is called as fn(inputs: CorrectionInputs)" in str(err)
    err = refused(prompts, "algorithm.rollout_correction=my_correction:missing")
    assert err.field == "algorithm.rollout_correction"
