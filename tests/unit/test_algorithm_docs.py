"""docs/algorithms.md's tables of advantage estimators, policy losses and rollout corrections are the registries'
own."""

from pathlib import Path

import pytest

from slime_rl.core.algorithms.registry import (
    ADVANTAGE_ESTIMATORS,
    POLICY_LOSSES,
    ROLLOUT_CORRECTIONS,
    docs_table,
)

DOC = Path(__file__).resolve().parents[2] / "docs" / "algorithms.md"


@pytest.mark.parametrize("registry", [ADVANTAGE_ESTIMATORS, POLICY_LOSSES, ROLLOUT_CORRECTIONS], ids=lambda r: r.field)
def test_the_doc_table_is_the_registry(registry):
    table = docs_table(registry)
    assert all(f"| `{name}` |" in table for name in registry.names())
    assert table in DOC.read_text(), f"docs/algorithms.md: replace the table of {registry.field} with\n{table}"
