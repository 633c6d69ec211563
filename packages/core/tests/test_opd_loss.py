"""On-policy distillation's estimator (``opd``), against float64 references: the advantage is the teacher's
minus the student's log-prob of each sampled token; fed to the policy loss at ratio 1, its expected gradient is
exactly the negative gradient of the reverse KL ``KL(pi_S || pi_T)`` (docs/distillation.md derives it), so
descending it pulls the student onto the teacher."""

import pytest
import torch

from slime_rl.core.algorithms import advantages as advantages_module
from slime_rl.core.algorithms.advantages import grpo_advantages, opd_advantages
from slime_rl.core.algorithms.losses import PolicyLossInputs, ppo_policy_loss
from slime_rl.core.algorithms.registry import advantage_estimator_of
from slime_rl.core.batch import RolloutBatch
from slime_rl.core.config import AlgorithmConfig
from slime_rl.core.sample import Sample

torch.set_num_threads(1)
F64 = torch.float64


def reverse_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """``sum_y pi_S(y) (log pi_S(y) - log pi_T(y))`` per row, exactly (float64)."""
    s, t = student_logits.log_softmax(-1), teacher_logits.log_softmax(-1)
    return (s.exp() * (s - t)).sum(-1)


def expected_surrogate(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """The PPO policy loss of the ``opd`` advantage, its expectation over the student's own tokens taken exactly:
    every token y of the vocabulary weighted by pi_S(y) (no gradient through the weight, as sampling has none)."""
    log_probs = student_logits.log_softmax(-1)
    old = log_probs.detach()
    advantages = opd_advantages(teacher_logits.log_softmax(-1), old, torch.ones_like(old))
    algo = AlgorithmConfig()
    terms = ppo_policy_loss(PolicyLossInputs(log_probs=log_probs, old_log_probs=old, log_ratio=log_probs - old,
                                             advantages=advantages, loss_mask=torch.ones_like(old), algo=algo,
                                             eps_clip_high=algo.eps_clip))
    return (old.exp() * terms.loss).sum(-1).sum()


def test_the_advantage_is_teacher_minus_student_on_trained_tokens():
    teacher = torch.tensor([[-0.5, -1.0, -2.0], [-0.1, -3.0, 0.0]], dtype=F64)
    student = torch.tensor([[-1.5, -0.25, -2.0], [-0.2, -1.0, 0.0]], dtype=F64)
    valid = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=F64)
    assert torch.equal(opd_advantages(teacher, student, valid),
                       torch.tensor([[1.0, -0.75, 0.0], [0.1, -2.0, 0.0]], dtype=F64))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_its_expected_policy_gradient_is_the_reverse_kl_gradient(seed):
    gen = torch.Generator().manual_seed(seed)
    student = torch.randn(4, 11, generator=gen, dtype=F64, requires_grad=True)  # 4 positions, vocabulary 11
    teacher = torch.randn(4, 11, generator=gen, dtype=F64) * 2
    (surrogate_grad,) = torch.autograd.grad(expected_surrogate(student, teacher), student)
    (kl_grad,) = torch.autograd.grad(reverse_kl(student, teacher).sum(), student)
    torch.testing.assert_close(surrogate_grad, kl_grad, rtol=0, atol=1e-12)


def test_descending_it_shrinks_the_reverse_kl_to_the_teachers_distribution():
    gen = torch.Generator().manual_seed(3)
    student = torch.randn(3, 7, generator=gen, dtype=F64, requires_grad=True)
    teacher = torch.randn(3, 7, generator=gen, dtype=F64) * 3
    kls = []
    for _ in range(300):
        kls.append(float(reverse_kl(student, teacher).sum().detach()))
        (grad,) = torch.autograd.grad(expected_surrogate(student, teacher), student)
        with torch.no_grad():
            student -= 0.5 * grad
    assert all(b <= a + 1e-12 for a, b in zip(kls, kls[1:], strict=False))
    assert kls[-1] < 0.01 * kls[0]


def batch_of(rewards, lengths, student, teacher):
    samples = [Sample(index=i, group_index=i // 2, reward=r, response_length=n, tokens=[0] * (n + 1),
                      loss_mask=[1] * n, rollout_log_probs=lp)
               for i, (r, n, lp) in enumerate(zip(rewards, lengths, student, strict=True))]
    batch = RolloutBatch.from_samples(samples)
    batch.teacher_log_probs = torch.tensor([x for row in teacher for x in row], dtype=torch.float32)
    return batch


def test_the_registry_entry_mixes_the_task_reward_by_opd_reward_coef():
    """``opd`` as the config names it: teacher log-probs from the batch, the student's from the engine (no
    separate old pass), plus opd_reward_coef times GRPO's advantage of the task reward."""
    student = [[-1.0, -2.0], [-0.5, -0.5, -0.5], [-3.0], [-1.0, -1.0]]
    teacher = [[-0.5, -2.5], [-0.5, -1.5, -0.25], [-1.0], [-2.0, -0.5]]
    rewards, lengths = [1.0, 0.0, 0.0, 1.0], [2, 3, 1, 2]
    algo = AlgorithmConfig(advantage_estimator="opd", opd_kl_coef=0.5, opd_reward_coef=2.0)
    assert advantage_estimator_of(algo).needs_teacher
    batch = batch_of(rewards, lengths, student, teacher)
    advantages_module.compute_advantages(batch, algo, n_samples_per_prompt=2)
    grpo = grpo_advantages(torch.tensor(rewards, dtype=F64).view(2, 2), normalize_std=True).view(-1).tolist()
    expected = [0.5 * (t - s) + 2.0 * grpo[i] for i, (srow, trow) in enumerate(zip(student, teacher, strict=True))
                for s, t in zip(srow, trow, strict=True)]
    assert batch.advantages.double().tolist() == pytest.approx(expected, abs=1e-6)


def test_without_the_teachers_log_probs_it_says_what_is_missing():
    batch = batch_of([1.0, 0.0], [1, 1], [[-1.0], [-1.0]], [[-1.0], [-1.0]])
    batch.teacher_log_probs = None
    with pytest.raises(ValueError, match=r"opd needs the teacher's log-probs \(roles, kind teacher\)"):
        advantages_module.compute_advantages(batch, AlgorithmConfig(advantage_estimator="opd"), n_samples_per_prompt=2)
