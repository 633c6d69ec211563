"""The conformance suite's own rules that need no engine (the suite against real engines: rollout-hf's and
rollout-sglang's tests, examples/custom_engine)."""

from __future__ import annotations

import pytest

from slime_rl.core.testing import conformance as cf


def suite_with_scores(scores: dict[int, float]) -> cf._Suite:
    """A suite whose reference scores a next token by ``scores`` alone."""
    backend = cf.Backend(make_engine=lambda: None, prompts=[[1], [2]], initial_weights=[], new_weights=[],
                         decode=str, reference=lambda weights, context, response, t: [scores[response[0]]],
                         logprob_tolerance=1e-3)
    return cf._Suite(backend, engine=None, capabilities=frozenset())


def test_greedy_along_another_path_may_break_only_a_near_tie():
    suite = suite_with_scores({5: -1.0, 6: -1.0004, 7: -3.0})
    suite.same_greedy([1], [3, 5, 9], [3, 6, 8], "resumed")  # a tie within the tolerance: either token is greedy
    with pytest.raises(cf._Broken, match=r"resumed: \[3, 7\] where the uninterrupted greedy response goes on \[3, 5\]"):
        suite.same_greedy([1], [3, 7], [3, 5], "resumed")
    suite.b.reference = None  # without a reference nothing is a tie
    with pytest.raises(cf._Broken):
        suite.same_greedy([1], [5], [6], "resumed")


def test_every_capability_names_a_checked_guarantee():
    checked = [guarantee for guarantee, _ in cf._CHECKS]
    assert set(cf.CAPABILITIES.values()) <= set(checked) and len(set(checked)) == len(checked)
