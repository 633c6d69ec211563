"""Prompt data as core sees it: the error a data source raises, and the check the driver runs.

A data source is a plugin (entry-point group ``slime_rl.data_sources``; the JSONL and Parquet
one is in slime-rl-buffer), so core only names it. `check_data` runs in the driver before Ray
starts: a bad line is found in seconds, not when the run reaches it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from slime_rl.core.config import Config

DATA_SOURCES = "slime_rl.data_sources"


class DataError(ValueError):
    """Bad prompt data. ``str(err)`` is one line: ``<file:line or field>: <what is wrong and the fix>``."""

    def __init__(self, where: str, message: str):
        self.where, self.message = where, message
        super().__init__(f"{where}: {message}")

    def __reduce__(self):  # pickle (Ray) rebuilds it from both arguments, not from the joined message
        return type(self), (self.where, self.message), self.__dict__


def check_data(cfg: Config) -> None:
    """Check the prompt data a run of ``cfg`` reads, before anything starts: ``data.prompt_data``
    with the data source's optional `DataSource.check`, and the eval sets with the optional
    `DataSource.check_eval` of ``eval.source`` (the source the rollout worker reads them with).
    Raises DataError naming file:line and the fix; ConfigError when the source does not load."""
    _run_check(cfg, "data.source", cfg.data.source, "check")
    if cfg.eval.prompt_data:
        _run_check(cfg, "eval.source", cfg.eval.source, "check_eval")


def _run_check(cfg: Config, field: str, source_name: str, method: str) -> None:
    from slime_rl.core.config import ConfigError
    from slime_rl.core.infra.plugins import PluginError, load_plugin

    try:
        source = load_plugin(DATA_SOURCES, source_name)
    except PluginError as err:
        raise ConfigError(field, str(err)) from None
    check = getattr(source, method, None)  # optional: a source without it is checked as it runs
    if check is not None:
        check(cfg)
