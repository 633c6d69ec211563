"""check_data: the driver runs the data source's optional `check` (and the eval sets' source's) before Ray."""

from __future__ import annotations

import pytest

from slime_rl.core.config import Config, ConfigError
from slime_rl.core.run.data import DataError, check_data


class CheckedSource:
    """A user's data source with the optional check."""

    @classmethod
    def check(cls, cfg: Config) -> None:
        raise DataError(f"{cfg.data.prompt_data}:3", "the record has no question; fix the line")


class UncheckedSource:
    """A user's data source without it: its errors come as the run reads."""


def test_check_data_runs_the_sources_optional_check():
    cfg = Config()
    cfg.data.prompt_data = "prompts.jsonl"
    cfg.data.source = f"{__name__}:CheckedSource"
    with pytest.raises(DataError) as err:
        check_data(cfg)
    assert str(err.value) == "prompts.jsonl:3: the record has no question; fix the line"
    cfg.data.source = f"{__name__}:UncheckedSource"
    check_data(cfg)  # nothing to run


def test_a_source_that_does_not_load_names_the_field():
    cfg = Config()
    cfg.data.source = "no_such_module:Source"
    with pytest.raises(ConfigError) as err:
        check_data(cfg)
    assert str(err.value).startswith("data.source: data_source 'no_such_module:Source': cannot import module")


class EvalSetSource:
    """A user's eval source with the optional check_eval."""

    @classmethod
    def check_eval(cls, cfg: Config) -> None:
        raise DataError(f"{cfg.eval.prompt_data['aime']}:2", "the record has no answer; fix the line")


def test_check_data_runs_the_eval_sources_check_eval():
    cfg = Config()
    cfg.data.source = f"{__name__}:UncheckedSource"
    cfg.eval.source = f"{__name__}:EvalSetSource"
    check_data(cfg)  # no eval sets: nothing to check
    cfg.eval.prompt_data = {"aime": "aime.jsonl"}
    with pytest.raises(DataError) as err:
        check_data(cfg)
    assert str(err.value) == "aime.jsonl:2: the record has no answer; fix the line"
    cfg.eval.source = "no_such_module:Source"
    with pytest.raises(ConfigError) as err:
        check_data(cfg)
    assert str(err.value).startswith("eval.source: data_source 'no_such_module:Source': cannot import module")
