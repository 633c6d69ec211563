"""The built-in filters: DAPO's dynamic-sampling filter and the buffer filters, by name and by module:attr."""

from __future__ import annotations

import statistics
import subprocess
import sys

import pytest

from slime_rl.core.algorithms.filters import (
    BUFFER_FILTERS,
    DYNAMIC_SAMPLING_FILTERS,
    freshest_first,
    nonzero_std,
    oldest_first,
)
from slime_rl.core.infra.plugins import load_function
from slime_rl.core.sample import Sample


def group(group_index: int, rewards: list, versions: list[int] | None = None) -> list[Sample]:
    return [Sample(index=10 * group_index + k, group_index=group_index, reward=reward,
                   weight_version=(versions or [0] * len(rewards))[k]) for k, reward in enumerate(rewards)]


def test_dapo_filter_drops_exactly_the_zero_variance_groups():
    patterns = [[0, 0, 0, 0], [1, 1, 1, 1], [0, 1, 0, 0], [0.5, 0.5, 0.5, 0.25], [1.0, 1, 1.0, 1],
                [-1, -1, -1, -1], [0.2, 0.2, 0.2, 0.2000001], [3], [2, 2]]
    groups = [group(i, list(r)) for i, r in enumerate(patterns)]
    kept = [g[0].group_index for g in groups if nonzero_std(g)]
    assert kept == [i for i, r in enumerate(patterns) if statistics.pstdev(r) > 0] == [2, 3, 6]
    as_dicts = [group(0, [{"acc": 1.0, "fmt": 0.0}, {"acc": 1.0, "fmt": 0.0}]),
                group(1, [{"acc": 1.0, "fmt": 0.0}, {"acc": 1.0, "fmt": 1.0}])]
    assert [nonzero_std(g) for g in as_dicts] == [False, True]
    with pytest.raises(ValueError, match="sample 11 \\(group 1\\) has no reward"):
        nonzero_std(group(1, [1.0, None]))


def test_buffer_filters_choose_positions():
    held = [group(i, [0.0, 1.0], versions=[v, v + 1]) for i, v in enumerate([1, 3, 2, 3])]
    assert oldest_first(held, 3) == [0, 1, 2] and oldest_first(held, 9) == [0, 1, 2, 3]
    assert freshest_first(held, 3) == [1, 3, 2]  # by each group's oldest sample, FIFO among equals
    assert oldest_first([], 2) == freshest_first([], 2) == []


def test_filters_load_by_name_and_module_attr():
    assert load_function("nonzero_std", DYNAMIC_SAMPLING_FILTERS, what="filter") is nonzero_std
    assert load_function("slime_rl.core.algorithms.filters:nonzero_std", {}, what="filter") is nonzero_std
    assert load_function("freshest_first", BUFFER_FILTERS, what="buffer filter") is freshest_first
    assert set(BUFFER_FILTERS) == {"oldest_first", "freshest_first", "stalest_first"} and set(DYNAMIC_SAMPLING_FILTERS) == {"nonzero_std"}


def test_importing_the_filters_leaves_torch_out():
    """A user's filter that imports these runs in a reward worker, which starts without torch."""
    code = "import sys, slime_rl.core.algorithms.filters; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"
