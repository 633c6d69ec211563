"""Plugin loading through real entry points: each test installs a throwaway distribution
(a .dist-info folder and a module) on sys.path, the way pip would lay them out."""

import textwrap

import pytest

from slime_rl.core.infra import plugins
from slime_rl.core.infra.plugins import (
    PluginError,
    check_plugin,
    installed,
    load_attr,
    load_function,
    load_plugin,
)
from slime_rl.core.testing.distributions import write_distribution

GROUP = "slime_rl.rollout_engines"


@pytest.fixture
def fake_dist(tmp_path, monkeypatch):
    """A distribution `slime-rl-fake` with engines `fake` (works) and `broken` (its module is missing)."""
    (tmp_path / "heavy_engines.py").write_text("raise ImportError('imported: the driver would hold it')\n")
    (tmp_path / "fake_engines.py").write_text(textwrap.dedent("""
        class FakeEngine:
            name = "fake"

        def make():
            return FakeEngine()

        NOT_CALLABLE = 3
    """))
    write_distribution(tmp_path, "slime-rl-fake", "0.1.0", {GROUP: {
        "fake": "fake_engines:FakeEngine", "broken": "fake_engines_gone:Engine", "noattr": "fake_engines:Missing",
        "heavy": "heavy_engines:Engine"}})
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_installed_lists_entry_points(fake_dist):
    found = installed(GROUP)
    assert found["fake"] == "fake_engines:FakeEngine"
    assert found["broken"] == "fake_engines_gone:Engine"


def test_load_by_name_and_by_module_attr(fake_dist):
    cls = load_plugin(GROUP, "fake")
    assert cls.__name__ == "FakeEngine" and cls.name == "fake"
    assert load_plugin(GROUP, "fake_engines:FakeEngine") is cls
    assert load_plugin(GROUP, "fake_engines:FakeEngine.name") == "fake"  # dotted attributes


def test_unknown_name_lists_what_is_installed(fake_dist):
    with pytest.raises(PluginError) as info:
        load_plugin(GROUP, "vllm")
    msg = str(info.value)
    assert "'vllm'" in msg and "fake" in msg and "broken" in msg and "module:attr" in msg


def test_known_backend_names_its_package(monkeypatch):
    monkeypatch.setattr(plugins, "entry_points", lambda group: [])  # nothing installed
    with pytest.raises(PluginError, match=r"installed: none.*pip install slime-rl-rollout-sglang"):
        load_plugin("slime_rl.rollout_engines", "sglang")
    with pytest.raises(PluginError, match="pip install slime-rl-trainer-megatron"):
        load_plugin("slime_rl.trainers", "megatron")
    with pytest.raises(PluginError, match="pip install slime-rl-buffer"):
        load_plugin("slime_rl.data_sources", "jsonl")


def test_installed_but_broken_entry_point(fake_dist):
    with pytest.raises(PluginError) as info:
        load_plugin(GROUP, "broken")
    msg = str(info.value)
    assert "'broken'" in msg and "slime-rl-fake" in msg and "fake_engines_gone" in msg and "does not load" in msg
    with pytest.raises(PluginError, match="does not load"):
        load_plugin(GROUP, "noattr")


def test_check_plugin_finds_a_backend_without_importing_it(fake_dist):
    """slime-cli train's driver checks backends this way, so it never holds megatron or transformers."""
    check_plugin(GROUP, "heavy")  # its module raises on import: passing shows it was not imported
    with pytest.raises(PluginError, match="does not load"):
        load_plugin(GROUP, "heavy")
    with pytest.raises(PluginError) as info:
        check_plugin(GROUP, "broken")
    assert "does not load: No module named 'fake_engines_gone'" in str(info.value)
    with pytest.raises(PluginError, match="installed: .*fake"):
        check_plugin(GROUP, "vllm")
    with pytest.raises(PluginError, match="cannot import module"):
        check_plugin(GROUP, "fake_engines_gone:Engine")  # the user's own code is imported


def test_load_attr_errors(fake_dist):
    with pytest.raises(PluginError, match="expected the form"):
        load_attr("fake_engines.FakeEngine", what="reward")
    with pytest.raises(PluginError, match="cannot import module 'no_such_module'"):
        load_attr("no_such_module:f", what="reward")
    with pytest.raises(PluginError, match="has no attribute 'nope'"):
        load_attr("fake_engines:nope", what="reward")
    with pytest.raises(PluginError, match="^reward "):
        load_attr("fake_engines:", what="reward")


def test_load_function(fake_dist):
    def builtin_reward(sample):
        return 1.0

    assert load_function("math", {"math": builtin_reward}, what="reward") is builtin_reward
    assert load_function("fake_engines:make", {}, what="reward")().name == "fake"
    with pytest.raises(PluginError, match=r"no built-in reward named 'maths' \(built in: math\)"):
        load_function("maths", {"math": builtin_reward}, what="reward")
    with pytest.raises(PluginError, match="is a int, not a callable"):
        load_function("fake_engines:NOT_CALLABLE", {}, what="reward")
