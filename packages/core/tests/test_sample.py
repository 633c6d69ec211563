import dataclasses
import json

import pytest

from slime_rl.core.sample import Sample, SampleStatus


def full_sample() -> Sample:
    """A sample with every field set to a non-default value."""
    return Sample(
        index=7,
        group_index=3,
        prompt=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}],
        label={"answer": "5", "aliases": ["five"]},
        tokens=[1, 2, 3, 4, 5, 6],
        response="5",
        response_length=3,
        loss_mask=[1, 0, 1],
        rollout_log_probs=[-0.5, 0.0, -1.25],
        reward={"acc": 1.0, "format": 0.5},
        status=SampleStatus.TRUNCATED,
        weight_version=4,
        metadata={"source": "gsm", "turns": [1, 2], "nested": {"k": None}},
        old_log_probs=[-0.4, -0.1, -1.0],
        ref_log_probs=[-0.6, -0.2, -1.5],
        advantages=[0.3, 0.3, 0.3],
        returns=[1.0, 0.9, 0.8],
        values=[0.1, 0.2, 0.3],
        rollout_routed_experts=[[[0, 3], [1, 2]]] * 5,
        token_versions=[4, 4, 5],
        multimodal_inputs={"images": ["/data/cat.png"]},
    )

# Derived from multimodal_inputs and never saved (test_vision_sample.py checks that to_dict drops it).
DERIVED = ("multimodal_train_inputs",)


def test_full_sample_sets_every_field():
    defaults = Sample()
    s = full_sample()
    unset = [f.name for f in dataclasses.fields(Sample)
             if getattr(s, f.name) == getattr(defaults, f.name) and f.name not in DERIVED]
    assert unset == []


def test_round_trip_through_dict_and_json():
    s = full_sample()
    assert Sample.from_dict(s.to_dict()) == s
    wire = json.dumps(s.to_dict())
    back = Sample.from_dict(json.loads(wire))
    assert back == s
    assert back.status is SampleStatus.TRUNCATED


@pytest.mark.parametrize("status", list(SampleStatus))
def test_every_status_round_trips_as_its_string(status):
    s = Sample(status=status, reward=0.5, prompt="plain text prompt")
    d = json.loads(json.dumps(s.to_dict()))
    assert d["status"] == status.value
    assert Sample.from_dict(d) == s


def test_to_dict_is_a_copy():
    s = full_sample()
    d = s.to_dict()
    d["tokens"].append(99)
    d["metadata"]["source"] = "changed"
    assert s.tokens == [1, 2, 3, 4, 5, 6] and s.metadata["source"] == "gsm"


def test_from_dict_fills_defaults_and_refuses_unknown_fields():
    s = Sample.from_dict({"index": 1, "prompt": "hi"})
    assert s.status is SampleStatus.PENDING and s.tokens == [] and s.reward is None
    with pytest.raises(ValueError, match="rewrad"):
        Sample.from_dict({"rewrad": 1.0})
    with pytest.raises(ValueError):
        Sample.from_dict({"status": "finished"})


def test_token_layout_and_append_response():
    s = Sample(tokens=[10, 11, 12])
    s.append_response([20, 21], [-0.1, -0.2], trained=True)
    s.append_response([30], None, trained=False)  # a tool observation: not trained on
    s.append_response([22], [-0.3], trained=True)
    assert s.prompt_length == 3
    assert s.response_tokens == [20, 21, 30, 22]
    assert s.loss_mask == [1, 1, 0, 1]
    assert s.rollout_log_probs == [-0.1, -0.2, 0.0, -0.3]
    with pytest.raises(ValueError, match="2 tokens but 1 log-probs"):
        s.append_response([1, 2], [-0.1], trained=True)


def test_reward_value():
    assert Sample(reward=1).reward_value() == 1.0
    assert Sample(reward={"acc": 0.5}).reward_value("acc") == 0.5
    with pytest.raises(ValueError, match="reward_key"):
        Sample(reward={"acc": 0.5}).reward_value()
    with pytest.raises(ValueError, match="no reward"):
        Sample().reward_value()


def test_token_versions_follow_the_response():
    s = Sample(tokens=[1], weight_version=2)
    s.append_response([5, 6], [-0.1, -0.2], trained=True, versions=[2, 3])
    s.append_response([7], None, trained=False)  # a tool's tokens: the latest version known
    assert s.token_versions == [2, 3, 3] and s.versions_per_token() == [2, 3, 3]
    with pytest.raises(ValueError, match="token versions"):
        s.append_response([8], [-0.1], trained=True, versions=[3, 3])
    assert s.reset_to_prompt().token_versions == []
    legacy = Sample(tokens=[1, 5, 6], response_length=2, weight_version=4)  # saved before token versions
    assert legacy.versions_per_token() == [4, 4]
