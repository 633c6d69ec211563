"""HFEngine keeps the RolloutEngine contract: the conformance suite (slime_rl.core.testing.conformance), with a
transformers forward of the same weights as the log-prob reference. And the suite itself catches engines that
break one guarantee each (the failures a backend gets wrong in practice), naming the guarantee."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from slime_rl.core.algorithms.lora import peft_name
from slime_rl.core.testing import conformance as cf
from slime_rl.core.testing.conformance import Backend, ConformanceError, check_conformance
from slime_rl.rollout_hf.engine import HFEngine

PROMPTS = ["Question: What is 3 + 4?\nAnswer:", "def forward(self, x):", "The sum of 12 and"]


SCALING = 2.0  # alpha / rank of the adapters


def lora_pairs(model, rank: int = 4, seed: int = 2) -> list:
    """Random LoRA pairs for every layer's q_proj and v_proj under PEFT names, large enough to change the greedy
    response (the trainer's B starts at zero; a trained one does not stay there)."""
    generator = torch.Generator().manual_seed(seed)
    pairs = []
    for name, weight in model.state_dict().items():
        if name.endswith(("q_proj.weight", "v_proj.weight")):
            out_features, in_features = weight.shape
            pairs += [(peft_name(name, "A"), torch.randn(rank, in_features, generator=generator) * 0.5),
                      (peft_name(name, "B"), torch.randn(out_features, rank, generator=generator) * 0.5)]
    return sorted(pairs)


def hf_backend(engine_class, tokenizer, make_model, arch: str = "llama", **fields) -> Backend:
    model = make_model(arch, len(tokenizer), seed=0)
    return Backend(
        make_engine=lambda: engine_class(copy.deepcopy(model), tokenizer, lora_scaling=SCALING),
        prompts=[tokenizer(p).input_ids for p in PROMPTS],
        initial_weights=list(model.state_dict().items()),
        new_weights=list(make_model(arch, len(tokenizer), seed=1).state_dict().items()),
        decode=tokenizer.decode,
        reference=cf.transformers_reference(copy.deepcopy(model)),
        adapters=lora_pairs(model), adapter_scaling=SCALING,
        **fields)


def test_hf_engine_passes_the_conformance_suite(tokenizer, make_model):
    report = check_conformance(hf_backend(HFEngine, tokenizer, make_model))
    print("\n" + report.describe(), report.figures)
    # over a dense model the engine claims no routed experts
    assert report.failed == {} and report.not_checked == {cf.ROUTED: "capability 'routed_experts' not claimed"}
    assert report.figures["max_logprob_diff"] <= 1e-4 and report.figures["tokens_before_abort"] > 0


def test_hf_engine_on_a_moe_model_passes_with_routed_experts(tokenizer, make_model):
    report = check_conformance(hf_backend(HFEngine, tokenizer, make_model, "qwen3_moe"))
    assert cf.ROUTED in report.passed and not report.not_checked


# ---------------------------------------------------------------- engines that break one guarantee each


class WrongTemperatureEngine(HFEngine):
    """Samples and scores at temperature 1 whatever it is asked."""

    async def generate(self, input_ids, params, request_id=None):
        if params.temperature > 0:
            params = replace(params, temperature=1.0)
        return await super().generate(input_ids, params, request_id)


class IgnoredWeightsEngine(HFEngine):
    """Reports the new version but keeps its weights."""

    async def update_weights(self, named_tensors, *, version, last):
        if last:
            self._version = version


class DropsPartialEngine(HFEngine):
    """Returns an aborted request without the tokens it made."""

    async def generate(self, input_ids, params, request_id=None):
        out = await super().generate(input_ids, params, request_id)
        if out.finish_reason == "abort":
            out.token_ids, out.log_probs, out.token_versions = [], [], []
        return out


@pytest.mark.parametrize("engine_class,guarantee,says,also", [
    # a resumed response is sampled at 0.7 too: its log-probs are as wrong
    (WrongTemperatureEngine, cf.LOG_PROBS, "the reference forward at temperature 0.7", [cf.RESUME]),
    (IgnoredWeightsEngine, cf.WEIGHTS, "the new weights were not applied", [cf.ADAPTERS]),  # adapters neither
    (DropsPartialEngine, cf.ABORT, "the partial response must come back", []),
], ids=["logprobs-at-temperature-1", "weights-not-applied", "abort-drops-partial"])
def test_a_broken_engine_fails_naming_the_guarantee(engine_class, guarantee, says, also, tokenizer, make_model):
    backend = hf_backend(engine_class, tokenizer, make_model)
    with pytest.raises(ConformanceError) as caught:
        check_conformance(backend)
    message = str(caught.value)
    assert f"- {guarantee}: " in message and says in message, message
    failed = [line[2:].split(":")[0] for line in message.split("\n\n")[0].splitlines()[1:]]
    assert sorted(failed) == sorted([guarantee, *also]), message  # the others still pass


def test_unknown_capabilities_and_too_few_prompts_are_refused(tokenizer, make_model):
    with pytest.raises(ValueError, match="capabilities: 'telepathy' is not one the suite knows"):
        check_conformance(hf_backend(HFEngine, tokenizer, make_model, capabilities=frozenset({"telepathy"})))
    with pytest.raises(ValueError, match="'adapters' is claimed; give Backend.adapters"):
        check_conformance(replace(hf_backend(HFEngine, tokenizer, make_model), adapters=None))
    with pytest.raises(ValueError, match="at least two non-empty prompts"):
        check_conformance(replace(hf_backend(HFEngine, tokenizer, make_model), prompts=[[1, 2]]))
