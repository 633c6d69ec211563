"""Each backend's typed section (config/backends.py): found through the settings entry point without importing the
backend, checked at load time with core's one-line errors, old key names moved with a notice (config/renamed.py).
A throwaway distribution registers the engine `toy` (its module raises on import: the loader must not import it)
with its settings in a light module, and the engine `plain`, which registers none."""

import sys
import textwrap
import warnings

import pytest

from slime_rl.core.config import Config, ConfigError, RenamedKeyWarning, load_config
from slime_rl.core.config.renamed import RENAMED_KEYS, move_renamed_keys
from slime_rl.core.testing.distributions import write_distribution

GROUP = "slime_rl.rollout_engines"


@pytest.fixture
def toy_backends(tmp_path, monkeypatch):
    (tmp_path / "toy_engine.py").write_text("raise ImportError('imported the engine: the loader must not')\n")
    (tmp_path / "toy_settings.py").write_text(textwrap.dedent("""
        from typing import ClassVar
        from pydantic import Field, field_validator
        from slime_rl.core.config import BackendSettings

        class ToySettings(BackendSettings):
            engine_args_field: ClassVar[str | None] = "passthrough"
            chunk_size: int | None = Field(None, description="tokens per chunk")
            passthrough: dict = Field(default_factory=dict)

            @field_validator("chunk_size")
            @classmethod
            def _positive(cls, value):
                if value is not None and value < 1:
                    raise ValueError(f"give a number of tokens >= 1 (got {value})")
                return value

            def check(self, cfg, where):
                if self.chunk_size == 13:
                    from slime_rl.core.config import ConfigError
                    raise ConfigError(f"{where}.chunk_size", "13 is unlucky; pick another")
    """))
    (tmp_path / "plain_engine.py").write_text("class PlainEngine:\n    pass\n")
    write_distribution(tmp_path, "slime-rl-toy", "0.1.0", {
        GROUP: {"toy": "toy_engine:ToyEngine", "plain": "plain_engine:PlainEngine"},
        f"{GROUP}.settings": {"toy": "toy_settings:ToySettings"}})
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "prompts.jsonl").write_text('{"input": "1 + 1 =", "label": "2"}\n')
    yield tmp_path
    for name in ("toy_engine", "toy_settings", "plain_engine"):
        sys.modules.pop(name, None)


def load(tmp_path, *overrides):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a notice here would be a test's mistake
        return load_config(None, [f"data.prompt_data={tmp_path / 'prompts.jsonl'}", "rollout.engine=toy",
                                  *overrides])


def refused(tmp_path, *overrides) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load(tmp_path, *overrides)
    assert "\n" not in str(info.value)
    return info.value


def test_the_chosen_engines_section_is_its_model_found_without_importing_it(toy_backends):
    cfg = load(toy_backends, "rollout.toy.chunk_size=512")
    assert type(cfg.rollout.settings).__name__ == "ToySettings" and cfg.rollout.settings.chunk_size == 512
    assert cfg.rollout.toy is cfg.rollout.settings and "toy_engine" not in sys.modules
    assert "toy:\n    chunk_size: 512" in cfg.to_yaml()  # plan prints it
    assert Config.model_validate(cfg.to_dict()) == cfg  # the resolved config loads back
    # no section given: the model's defaults, shown by plan too
    assert load(toy_backends).rollout.settings.chunk_size is None and "toy:" in load(toy_backends).to_yaml()


def test_a_wrong_key_in_a_backend_section_is_one_line_with_the_nearest_key(toy_backends):
    err = refused(toy_backends, "rollout.toy.chunksize=512")
    assert str(err) == "rollout.toy.chunksize: unknown key; did you mean `rollout.toy.chunk_size`?"
    err = refused(toy_backends, "rollout.tyo.chunk_size=512")  # the section's own name, mistyped
    assert str(err) == "rollout.tyo: unknown key; did you mean `rollout.toy`?"


def test_a_bad_value_names_the_full_field_and_the_fix(toy_backends):
    err = refused(toy_backends, "rollout.toy.chunk_size=0")
    assert str(err) == "rollout.toy.chunk_size: give a number of tokens >= 1 (got 0)"
    assert str(refused(toy_backends, "rollout.toy.chunk_size=true")) == (
        "rollout.toy.chunk_size: must be a whole number (got true, a boolean)")
    assert str(refused(toy_backends, "rollout.toy.chunk_size=13")) == (
        "rollout.toy.chunk_size: 13 is unlucky; pick another")
    with pytest.raises(ValueError, match=r"rollout.toy.chunk_size: give a number"):  # in Python too (pydantic's)
        Config.model_validate({"rollout": {"engine": "toy", "toy": {"chunk_size": -5}}})


def test_other_installed_engines_sections_may_stay_and_are_checked(toy_backends):
    cfg = load(toy_backends, "rollout.engine=plain", "rollout.toy.chunk_size=64")
    assert cfg.rollout.toy.chunk_size == 64 and type(cfg.rollout.settings).__name__ == "NoSettings"
    assert refused(toy_backends, "rollout.engine=plain", "rollout.toy.chunk_size=0").field == "rollout.toy.chunk_size"
    # an engine without a registered model: its class is imported and its `settings` read (none: no keys)
    assert str(refused(toy_backends, "rollout.engine=plain", "rollout.plain.x=1")).startswith(
        "rollout.plain.x: unknown key")


def test_an_old_key_name_still_loads_with_a_one_line_notice_naming_the_new_key(toy_backends):
    with pytest.warns(RenamedKeyWarning) as notices:
        cfg = load_config(None, [f"data.prompt_data={toy_backends / 'prompts.jsonl'}", "rollout.engine=toy",
                                 "rollout.engine_args={chunk_size: 256, anything: 1}"])
    assert [str(n.message) for n in notices] == [
        "rollout.engine_args is now rollout.toy.passthrough; the old name works until the next release"]
    assert cfg.rollout.toy.passthrough == {"chunk_size": 256, "anything": 1}
    with pytest.raises(ConfigError, match=r"^rollout.engine_urls: is now rollout.sglang.engine_urls, which the"):
        move_renamed_keys({"rollout": {"engine_urls": [], "sglang": {"engine_urls": []}}})


def test_old_key_names_work_from_python_too(toy_backends):
    tree = {"rollout": {"engine": "toy", "engine_args": {"chunk_size": 8}}}
    with pytest.warns(RenamedKeyWarning, match="^rollout.engine_args is now rollout.toy.passthrough;"):
        cfg = Config.model_validate(tree)
    assert cfg.rollout.toy.passthrough == {"chunk_size": 8} and tree["rollout"]["engine_args"]  # the input untouched


def test_renamed_keys_move_and_retired_keys_are_refused():
    with pytest.warns(RenamedKeyWarning, match="^trainer.moe_grouped_gemm is now trainer.megatron.moe_grouped_gemm;"):
        moved = move_renamed_keys({"trainer": {"moe_grouped_gemm": False, "megatron": {"recompute": True}}})
    assert moved == {"trainer": {"megatron": {"recompute": True, "moe_grouped_gemm": False}}}
    assert RENAMED_KEYS["rollout.engine_urls"] == "rollout.sglang.engine_urls"
    with pytest.raises(ConfigError, match=r"^cluster.async: renamed: use cluster.async_mode"):
        move_renamed_keys({"cluster": {"async": True}})
