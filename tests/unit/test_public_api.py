"""What users import from their own code still imports: the names below (core's top level, the contracts,
Sample, the rewards, the conformance suite, the test models, the sandbox and agent APIs), every import the
docs and examples show, and every old module path core/moved.py answers (the same module, with a
DeprecationWarning naming the new path). A name that moves keeps its old path here for a release."""

from __future__ import annotations

import ast
import importlib
import re
import sys
import warnings
from pathlib import Path

import pytest

from slime_rl.core.infra.plugins import load_attr
from slime_rl.core.moved import MOVED

REPO = Path(__file__).resolve().parents[2]

# module -> names a user's code imports from it
PUBLIC_API: dict[str, tuple[str, ...]] = {
    "slime_rl.core": ("Buffer", "Config", "ConfigError", "DataSource", "GenerateOutput", "PolicyTrainer",
                      "RolloutEngine", "Sample", "SampleStatus", "SamplingParams", "load_config"),
    "slime_rl.core.sample": ("Sample", "SampleStatus", "Reward"),
    "slime_rl.core.contracts": ("RolloutEngine", "PolicyTrainer", "DataSource", "Buffer", "WeightSender",
                                "SamplingParams", "GenerateOutput", "NamedTensors", "FinishReason",
                                "RewardFunction", "GroupRewardFunction", "DynamicSamplingFilter", "BufferFilter",
                                "GenerateFunction"),
    "slime_rl.core.config": ("Config", "ConfigError", "load_config", "parse_overrides"),
    "slime_rl.core.rewards": ("BUILTIN_REWARDS", "CodeTestsReward", "RemoteReward", "load_reward", "score_samples"),
    "slime_rl.core.rewards.math_answer": ("math_reward", "dapo_reward", "deepscaler_reward"),
    "slime_rl.core.rewards.text_match": ("exact_match_reward", "f1_reward"),
    "slime_rl.core.testing": ("stdlib_text", "train_tokenizer", "tiny_config", "tiny_model", "save_model",
                              "tiny_model_folder", "chat_tokenizer"),
    "slime_rl.core.testing.conformance": ("Backend", "check_conformance", "transformers_reference"),
    "slime_rl.core.sandbox": ("SandboxSettings", "arun_python", "run_python", "make_python_tool",
                              "isolation_support"),
    "slime_rl.core.agent": ("MultiTurnGenerate", "Tool", "ToolResult", "load_tools", "tool_schemas"),
    "slime_rl.core.infra.plugins": ("load_plugin", "load_attr"),
    "slime_rl.core.run.rollout": ("generate_single_turn",),
}
# a config's built-in reward names (rollout.reward), which users write instead of module:attr
BUILTIN_REWARD_NAMES = {"math", "dapo", "deepscaler", "exact_match", "f1", "remote", "code_tests"}


@pytest.mark.parametrize("module", sorted(PUBLIC_API))
def test_public_names_import(module):
    imported = importlib.import_module(module)
    missing = [name for name in PUBLIC_API[module] if not hasattr(imported, name)]
    assert missing == [], f"{module} lost {missing}"


def test_core_top_level_lists_its_names():
    import slime_rl.core

    assert set(PUBLIC_API["slime_rl.core"]) <= set(slime_rl.core.__all__)
    assert all(getattr(slime_rl.core, name) is not None for name in slime_rl.core.__all__)


def test_the_built_in_rewards_are_there():
    from slime_rl.core.rewards import BUILTIN_REWARDS

    assert set(BUILTIN_REWARDS) >= BUILTIN_REWARD_NAMES
    assert all(callable(reward) for reward in BUILTIN_REWARDS.values())


def fresh_import(name: str) -> tuple[object, list[warnings.WarningMessage]]:
    """Import ``name`` as a user's first import of it would, with the warnings it gives."""
    sys.modules.pop(name, None)  # an old name only aliases the module at its new one: dropping it loses nothing
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(name)
    return module, caught


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_is_the_module_at_its_new_one_with_a_warning(old):
    old_name, new_name = f"slime_rl.core.{old}", f"slime_rl.core.{MOVED[old]}"
    module, caught = fresh_import(old_name)
    assert module is importlib.import_module(new_name)
    deprecations = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
    assert f"{old_name} moved to {new_name}; the old path goes in the next release" in deprecations


def test_generate_single_turn_at_its_old_path():
    from slime_rl.core.run.rollout import generate_single_turn

    old, caught = fresh_import("slime_rl.core.rollout")
    assert old.generate_single_turn is generate_single_turn
    assert any(issubclass(w.category, DeprecationWarning) for w in caught)


# ------------------------------------------------------------------ what the docs and examples tell users to import

DOC_FILES = [*sorted((REPO / "docs").glob("*.md")), REPO / "README.md", *sorted(REPO.glob("packages/*/README.md")),
             *sorted(REPO.glob("examples/**/*.md"))]
_FROM_IMPORT = re.compile(r"^\s*from\s+(slime_rl[\w.]*)\s+import\s+(\([^)]*\)|[^\n]+)", re.M)
_MODULE_ATTR = re.compile(r"\b(slime_rl\.[\w.]+:[A-Za-z_]\w*)")


def doc_imports(text: str) -> list[tuple[str, str]]:
    """(module, name) of every ``from slime_rl... import a, b`` line in a page (parenthesised ones too)."""
    found = []
    for module, names in _FROM_IMPORT.findall(text):
        for name in re.sub(r"#[^\n]*", "", names).strip("()").split(","):
            if name := name.split(" as ")[0].strip():
                found.append((module, name))
    return found


def example_imports(path: Path) -> list[tuple[str, str]]:
    """(module, name) of every ``from slime_rl... import`` in an example's Python file."""
    return [(node.module, alias.name) for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("slime_rl.")
            for alias in node.names]


def shown_imports() -> list[tuple[str, str, str]]:
    """(where, module, name) over the docs' pages and the examples' Python."""
    shown = [(_where(doc), module, name) for doc in DOC_FILES for module, name in doc_imports(doc.read_text())]
    for path in sorted((REPO / "examples").rglob("*.py")):
        shown += [(_where(path), module, name) for module, name in example_imports(path)]
    return shown


def shown_module_attrs() -> list[tuple[str, str]]:
    """(where, ``module:attr``) for every slime_rl function or class a page or an example config names."""
    files = [*DOC_FILES, *sorted((REPO / "examples").rglob("*.yaml"))]
    return [(_where(path), spec) for path in files for spec in _MODULE_ATTR.findall(path.read_text())]


def _where(path: Path) -> str:
    return str(path.relative_to(REPO))


def test_the_readers_find_what_a_page_shows():
    page = """```python
from slime_rl.core.sample import SampleStatus
from slime_rl.core.testing.conformance import (
    Backend,  # the engine under test
    check_conformance as check,
)
```
rollout.reward: slime_rl.cli.default_run:addition_reward
"""
    assert doc_imports(page) == [("slime_rl.core.sample", "SampleStatus"),
                                 ("slime_rl.core.testing.conformance", "Backend"),
                                 ("slime_rl.core.testing.conformance", "check_conformance")]
    assert _MODULE_ATTR.findall(page) == ["slime_rl.cli.default_run:addition_reward"]
    assert len(shown_imports()) >= 10 and len(shown_module_attrs()) >= 2  # the docs and examples do show some


def test_every_import_the_docs_and_examples_show_works():
    broken = []
    for where, module, name in shown_imports():
        try:
            if not hasattr(importlib.import_module(module), name):
                broken.append(f"{where}: from {module} import {name}: no such name")
        except ImportError as err:
            broken.append(f"{where}: from {module} import {name}: {err}")
    assert broken == []


def test_every_module_attr_the_docs_and_examples_name_loads():
    broken = []
    for where, spec in shown_module_attrs():
        try:
            load_attr(spec)
        except Exception as err:  # PluginError, or the module failing to import: report them all
            broken.append(f"{where}: {spec}: {err}")
    assert broken == []
