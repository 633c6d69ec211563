"""The code_tests reward: a response's code block against the label's test cases, in the sandbox."""

import asyncio
import json

import pytest

from slime_rl.core.config import RolloutConfig
from slime_rl.core.rewards import BUILTIN_REWARDS, load_reward, score_samples
from slime_rl.core.rewards.code_tests import CodeTestsLabelError, CodeTestsReward, extract_code, parse_tests
from slime_rl.core.sample import Sample, SampleStatus
from slime_rl.core.sandbox import SandboxSettings

SETTINGS = SandboxSettings(timeout_s=2.0, cpu_time_s=3, max_concurrency=2)
ADD = "Here it is:\n```python\ndef add(a, b):\n    return a + b\n```\n"
ECHO_SUM = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"


def score(response: str, label) -> float:
    return asyncio.run(CodeTestsReward(SETTINGS)(Sample(prompt="p", response=response, label=label)))


def test_assert_cases_score_the_fraction_passed():
    label = {"tests": ["assert add(1, 2) == 3", "assert add(2, 2) == 5", "assert add(-1, 1) == 0"]}
    assert score(ADD, label) == pytest.approx(2 / 3)
    assert score(ADD, json.dumps(label)) == pytest.approx(2 / 3)  # the label as a JSON string


def test_stdin_stdout_cases_in_both_forms():
    assert score(ECHO_SUM, {"inputs": ["1 2\n", "5 5\n"], "outputs": ["3\n", "11"]}) == 0.5
    assert score(ECHO_SUM, [{"input": "2 3", "output": "5  \n\n"}]) == 1.0  # trailing whitespace ignored


def test_code_that_exits_early_or_loops_does_not_pass():
    exits = "```python\nimport sys\nsys.exit(0)\n```"
    assert score(exits, {"tests": ["assert False"]}) == 0.0
    loops = "```python\ndef add(a, b):\n    while True:\n        pass\n```"
    assert score(loops, {"tests": ["assert add(1, 2) == 3"]}) == 0.0


def test_no_code_block_scores_zero():
    assert score("the answer is add(a, b) = a + b", {"tests": ["assert add(1, 2) == 3"]}) == 0.0


def test_code_extraction_prefers_the_last_python_block():
    text = "```python\nx = 1\n```\nthen\n```text\nnot code\n```\n```py\nx = 2\n```"
    assert extract_code(text) == "x = 2\n"
    assert extract_code("```\nplain\n```") == "plain\n"


@pytest.mark.parametrize("label, says", [
    (None, "no test cases"),
    ("not json", "not JSON"),
    ({"tests": []}, "no test cases"),
    ({"inputs": ["1"], "outputs": []}, "equal length"),
    ({"tests": [{"input": "1"}]}, "test case 0"),
    ({"tests": [{"input": 1, "output": "1"}]}, "must be strings"),
])
def test_bad_labels_are_named(label, says):
    with pytest.raises(CodeTestsLabelError, match=says):
        parse_tests(label)


def test_registered_and_a_bad_label_fails_only_its_sample():
    assert "code_tests" in BUILTIN_REWARDS
    reward = load_reward("code_tests", group=False, sandbox=RolloutConfig().sandbox)
    assert isinstance(reward, CodeTestsReward)
    samples = [Sample(prompt="p", response=ADD, label={"tests": ["assert add(1, 2) == 3"]}, index=0, group_index=0),
               Sample(prompt="p", response=ADD, label="oops", index=1, group_index=1)]
    asyncio.run(score_samples(samples, RolloutConfig(reward="code_tests")))
    assert samples[0].reward == 1.0 and samples[0].status != SampleStatus.FAILED
    assert samples[1].status == SampleStatus.FAILED and "not JSON" in samples[1].metadata["error"]
