"""The estimator and policy-loss registries: a user's `module:attr` and a decorated entry are used by the
advantage and loss computations, and unknown names and broken functions are refused naming the field."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from pydantic import ValidationError

from slime_rl.core.algorithms import registry
from slime_rl.core.algorithms.advantages import AdvantageInputs, compute_advantages
from slime_rl.core.algorithms.losses import LossBatch, compute_loss
from slime_rl.core.algorithms.registry import (
    ADVANTAGE_ESTIMATORS,
    POLICY_LOSSES,
    register_advantage_estimator,
    register_policy_loss,
)
from slime_rl.core.batch import RolloutBatch
from slime_rl.core.config import AlgorithmConfig, ConfigError, load_config
from slime_rl.core.config.placement import plan_placement
from slime_rl.core.sample import Sample

torch.set_num_threads(1)

USER_MODULE = "user_algorithms"
USER_CODE = '''
import torch

from slime_rl.core.algorithms.losses import PolicyLossTerms
from slime_rl.core.algorithms.registry import register_advantage_estimator


@register_advantage_estimator("user_median_baseline", groups=True)
def median_baseline(inputs):
    grouped = inputs.grouped(inputs.rewards)
    return inputs.mine(grouped - grouped.median(dim=-1, keepdim=True).values)[:, None] * inputs.valid


def doubled_reward(inputs):  # undecorated: declares nothing
    return 2 * inputs.rewards[:, None] * inputs.valid, inputs.rewards[:, None] * inputs.valid


@register_advantage_estimator("user_critic", needs_critic=True)
def values_as_advantages(inputs):
    return inputs.values


def two_arguments(inputs, extra):
    return inputs.valid


def vanilla_pg(inputs):
    return PolicyLossTerms(loss=-inputs.advantages * inputs.log_probs, clipped=torch.zeros_like(inputs.log_probs),
                           ratio=inputs.log_ratio.exp())


NOT_A_FUNCTION = 3
'''


@pytest.fixture(autouse=True)
def fresh_registries(monkeypatch):
    """Entries a test registers (its own or a user module's) leave with it."""
    for reg in (ADVANTAGE_ESTIMATORS, POLICY_LOSSES):
        monkeypatch.setattr(reg, "_entries", dict(reg._entries))


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """The user's module, written into tmp_path and put on sys.path (imported afresh by each test)."""
    (tmp_path / f"{USER_MODULE}.py").write_text(USER_CODE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, USER_MODULE, raising=False)
    yield USER_MODULE
    sys.modules.pop(USER_MODULE, None)


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"input": "1+1", "label": "2"}\n')
    return path


def batch_of(rewards, lengths, loss_masks, group_size, values=None):
    rows = zip(rewards, lengths, loss_masks, strict=True)
    samples = [Sample(index=i, group_index=i // group_size, reward=r, response_length=n, tokens=[0] * n,
                      loss_mask=m, rollout_log_probs=[0.0] * n) for i, (r, n, m) in enumerate(rows)]
    batch = RolloutBatch.from_samples(samples)
    if values is not None:
        batch.values = torch.tensor(values, dtype=torch.float32)
    return batch


def per_sample(batch, column):
    ends = batch.response_offsets().tolist()
    return [column[ends[i]:ends[i + 1]].tolist() for i in range(len(batch))]


def test_a_user_module_attr_estimator_computes_the_advantages(user_module):
    algo = AlgorithmConfig(advantage_estimator=f"{user_module}:median_baseline")
    # two groups of three: medians 2 and 5; the last token of sample 1 is not trained on
    batch = batch_of([1.0, 2.0, 6.0, 5.0, 4.0, 9.0], [2, 3, 1, 1, 2, 1],
                     [[1, 1], [1, 1, 0], [1], [1], [1, 1], [1]], group_size=3)
    compute_advantages(batch, algo, n_samples_per_prompt=3)
    assert per_sample(batch, batch.advantages) == [[-1.0, -1.0], [0.0, 0.0, 0.0], [4.0],
                                                   [0.0], [-1.0, -1.0], [4.0]]
    assert batch.returns is None
    # what it declared comes with it: it groups, so the step must hold each group as one run of n
    with pytest.raises(ValueError, match="groups of n_samples_per_prompt=4"):
        compute_advantages(batch, algo, n_samples_per_prompt=4)


def test_an_undecorated_user_function_declares_nothing_and_may_give_returns(user_module):
    entry = ADVANTAGE_ESTIMATORS.resolve(f"{user_module}:doubled_reward")
    assert (entry.groups, entry.needs_critic, entry.whitens) == (False, False, False)
    batch = batch_of([1.0, -0.5], [2, 1], [[1, 0], [1]], group_size=1)
    compute_advantages(batch, AlgorithmConfig(advantage_estimator=f"{user_module}:doubled_reward"),
                       n_samples_per_prompt=1)
    assert per_sample(batch, batch.advantages) == [[2.0, 0.0], [-1.0]]
    assert per_sample(batch, batch.returns) == [[1.0, 1.0], [-0.5]]


def test_an_estimator_returning_the_wrong_shape_is_named():
    register_advantage_estimator("test_per_sample")(lambda inputs: inputs.rewards)
    register_advantage_estimator("test_a_list")(lambda inputs: [0.0])
    batch = batch_of([1.0, 2.0], [2, 1], [[1, 1], [1]], group_size=1)
    with pytest.raises(ValueError, match=r"'test_per_sample' returned advantages of shape \(2,\); give one value per"
                                         r" padded response token, \(2, 2\)"):
        compute_advantages(batch, AlgorithmConfig(advantage_estimator="test_per_sample"), n_samples_per_prompt=1)
    with pytest.raises(ValueError, match="'test_a_list' returned advantages as a list"):
        compute_advantages(batch, AlgorithmConfig(advantage_estimator="test_a_list"), n_samples_per_prompt=1)


def test_a_user_estimator_that_needs_a_critic_gets_one(user_module, prompts):
    spec = f"{user_module}:values_as_advantages"
    cfg = load_config(None, [f"data.prompt_data={prompts}", f"algorithm.advantage_estimator={spec}"])
    assert plan_placement(cfg, device="cpu").critic  # the loop starts the critic the plan says
    batch = batch_of([1.0], [2], [[1, 1]], group_size=1, values=[0.25, 0.5])
    compute_advantages(batch, cfg.algorithm, n_samples_per_prompt=1)
    assert batch.advantages.tolist() == [0.25, 0.5]
    with pytest.raises(ValueError, match="user_critic needs critic values"):
        compute_advantages(batch_of([1.0], [2], [[1, 1]], group_size=1), cfg.algorithm, n_samples_per_prompt=1)
    assert not plan_placement(load_config(None, [f"data.prompt_data={prompts}"]), device="cpu").critic


def test_a_decorated_entry_is_used_by_its_name_with_what_it_declares():
    @register_advantage_estimator("test_reward_minus_one", whitens=True)
    def reward_minus_one(inputs: AdvantageInputs) -> torch.Tensor:
        return (inputs.rewards - 1)[:, None] * inputs.valid

    algo = AlgorithmConfig(advantage_estimator="test_reward_minus_one")
    batch = batch_of([1.0, 2.0, 4.0], [1, 1, 1], [[1], [1], [1]], group_size=1)
    compute_advantages(batch, algo, n_samples_per_prompt=1)
    whitened = torch.tensor([0.0, 1.0, 3.0])
    whitened = (whitened - whitened.mean()) / whitened.std()  # it declares whitens: no normalize_advantages needed
    assert batch.advantages.tolist() == pytest.approx(whitened.tolist(), abs=1e-6)
    assert ADVANTAGE_ESTIMATORS.resolve("test_reward_minus_one").function is reward_minus_one

    with pytest.raises(ValueError, match="already registered"):  # a taken name is not silently replaced
        register_advantage_estimator("grpo")(reward_minus_one)
    with pytest.raises(ValueError, match="no ':'"):
        register_advantage_estimator("a:b")(reward_minus_one)
    with pytest.raises(registry.PluginError, match=r"takes \(\); it is called as fn\(inputs"):
        register_advantage_estimator("test_no_arguments")(lambda: None)


def test_a_user_policy_loss_is_the_surrogate(user_module):
    log_probs = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]], dtype=torch.float64, requires_grad=True)
    advantages = torch.tensor([[1.0, 1.0], [-2.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=torch.float64)
    batch = LossBatch(log_probs=log_probs, old_log_probs=log_probs.detach(), advantages=advantages, loss_mask=mask)
    algo = AlgorithmConfig(policy_loss=f"{user_module}:vanilla_pg")
    loss, metrics = compute_loss(algo, batch, eps_clip_high=0.2, num_tokens=3, num_seqs=2)
    assert loss.item() == pytest.approx((1.0 + 2.0 - 1.0) / 3)  # -A log pi over the 3 trained tokens
    assert metrics["clip_frac"].item() == 0.0 and metrics["ratio_mean"].item() == pytest.approx(1.0)
    loss.backward()
    assert log_probs.grad.flatten().tolist() == pytest.approx([-1 / 3, -1 / 3, 2 / 3, 0.0])

    @register_policy_loss("test_vanilla_pg")
    def registered(inputs):
        return sys.modules[user_module].vanilla_pg(inputs)

    same, _ = compute_loss(AlgorithmConfig(policy_loss="test_vanilla_pg"), batch, eps_clip_high=0.2, num_tokens=3,
                           num_seqs=2)
    assert same.item() == pytest.approx(loss.item())


def test_unknown_names_are_refused_with_the_closest(prompts):
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"data.prompt_data={prompts}", "algorithm.advantage_estimator=grpoo"])
    assert err.value.field == "algorithm.advantage_estimator"
    assert "did you mean 'grpo'?" in str(err.value) and "reinforce_plus_plus_baseline" in str(err.value)
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"data.prompt_data={prompts}", "algorithm.policy_loss=cispoo"])
    assert err.value.field == "algorithm.policy_loss" and "did you mean 'cispo'?" in str(err.value)
    with pytest.raises(ValidationError, match="registered: "):
        AlgorithmConfig(advantage_estimator="not_an_estimator")


@pytest.mark.parametrize(("field", "spec", "message"), [
    ("advantage_estimator", "no_such_module_here:fn", "cannot import module 'no_such_module_here'"),
    ("advantage_estimator", f"{USER_MODULE}:missing", f"module '{USER_MODULE}' has no attribute 'missing'"),
    ("advantage_estimator", f"{USER_MODULE}:two_arguments", r"takes \(inputs, extra\); it is called as fn\("),
    ("advantage_estimator", f"{USER_MODULE}:NOT_A_FUNCTION", "is a int, not a function"),
    ("policy_loss", f"{USER_MODULE}:two_arguments", r"it is called as fn\(inputs: PolicyLossInputs\)"),
])
def test_a_broken_module_attr_is_refused_at_check_time(user_module, prompts, field, spec, message):
    overrides = [f"data.prompt_data={prompts}", f"algorithm.{field}={spec}"]
    AlgorithmConfig.model_validate({field: spec})  # the form passes the schema; the check loads it
    with pytest.raises(ConfigError, match=message) as err:
        load_config(None, overrides)
    assert err.value.field == f"algorithm.{field}"


def test_a_trainer_rank_that_cannot_import_the_users_estimator_fails_at_start(prompts):
    """The driver's check imports a `module:attr` in the driver; a rank (another node, another
    environment) imports it again when it starts, and says so before it builds its model."""
    from slime_rl.core.run.actors import TrainerWorker

    cfg = load_config(None, [f"data.prompt_data={prompts}"], check=False)
    cfg.algorithm.advantage_estimator = "not_on_this_rank:estimator"
    worker = TrainerWorker(cfg.to_dict(), rank=0, world_size=1, master_addr="127.0.0.1", master_port=1)
    with pytest.raises(ConfigError, match="cannot import module 'not_on_this_rank'") as err:
        worker.ready()
    assert err.value.field == "algorithm.advantage_estimator"


def test_declarations_are_checked_against_the_config(prompts):
    base = [f"data.prompt_data={prompts}"]
    with pytest.raises(ConfigError) as err:
        load_config(None, [*base, "algorithm.policy_loss=cispo", "algorithm.eps_clip_c=3.0"])
    assert err.value.field == "algorithm.eps_clip_c" and "ppo, gspo" in str(err.value)
    load_config(None, [*base, "algorithm.advantage_estimator=gspo", "algorithm.policy_loss=cispo",
                       "algorithm.eps_clip_c=3.0"])  # gspo implies its own loss, which has dual-clip
    with pytest.raises(ConfigError) as err:
        load_config(None, [*base, "algorithm.advantage_estimator=ppo", "algorithm.loss_type=sft"])
    assert err.value.field == "algorithm.loss_type"


def test_the_config_checks_names_and_declarations_without_torch():
    """`slime-cli plan` validates the config and places a critic without importing torch (2 s a process)."""
    code = ("import sys; from slime_rl.core.config import AlgorithmConfig;"
            " from slime_rl.core.algorithms.registry import advantage_estimator_of;"
            " assert advantage_estimator_of(AlgorithmConfig(advantage_estimator='ppo')).needs_critic;"
            " print('torch' in sys.modules)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert run.stdout == "False\n"


def test_the_docs_example_runs(tmp_path, monkeypatch):
    """docs/algorithms.md's `module:attr` examples, written out as the user's package."""
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[3] / "docs" / "algorithms.md").read_text()
    package = tmp_path / "my_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    blocks = [b.split("```", 1)[0] for b in doc.split("```python\n")[1:]]
    written = {}
    for block in blocks:
        first = block.splitlines()[0]
        if first.startswith("# my_pkg/"):
            written[first[2:]] = block
            (tmp_path / first[2:]).write_text(textwrap.dedent(block))
    assert set(written) == {"my_pkg/adv.py", "my_pkg/loss.py"}
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("my_pkg", "my_pkg.adv", "my_pkg.loss"):
        monkeypatch.delitem(sys.modules, name, raising=False)

    batch = batch_of([1.0, 2.0, 6.0], [1, 1, 1], [[1], [1], [1]], group_size=3)
    compute_advantages(batch, AlgorithmConfig(advantage_estimator="my_pkg.adv:median_baseline"),
                       n_samples_per_prompt=3)
    assert batch.advantages.tolist() == [-1.0, 0.0, 4.0]
    log_probs = torch.tensor([[-1.0]], dtype=torch.float64, requires_grad=True)
    loss, _ = compute_loss(AlgorithmConfig(policy_loss="my_pkg.loss:vanilla_pg"),
                           LossBatch(log_probs=log_probs, old_log_probs=log_probs.detach(),
                                     advantages=torch.tensor([[2.0]], dtype=torch.float64),
                                     loss_mask=torch.ones(1, 1, dtype=torch.float64)),
                           eps_clip_high=0.2, num_tokens=1, num_seqs=1)
    assert loss.item() == 2.0
