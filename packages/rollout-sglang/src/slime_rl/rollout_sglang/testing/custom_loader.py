"""The stand-in server's ``/update_weights_from_tensor`` by ``load_format``, as SGLang 0.5.17's weight_updater.py
dispatches it: ``flattened_bucket``, ``direct`` or none load the tensors; a name given to
``--custom-weight-loader`` at launch is imported and called as ``loader(model, named_tensors)``, where the
stand-in's model is a `StandinModel` whose ``load_weights`` takes HF-named tensors (SGLang's models do too)."""

from __future__ import annotations

import os
from typing import Any

from slime_rl.core.infra.plugins import load_attr
from slime_rl.rollout_sglang.testing.lora import decode_tensor_payload


def scheduler_crash(message: str) -> None:
    """An exception in SGLang's scheduler process: it logs it and SIGQUITs the server, which exits unanswered."""
    print(f"[standin-sglang] Scheduler hit an exception: {message}", flush=True)
    os._exit(1)


class UncaughtInScheduler(Exception):
    """An exception SGLang's scheduler does not catch (a custom loader's): the stand-in exits unanswered."""


class StandinModel:
    def __init__(self, server: Any):
        self.server = server

    def load_weights(self, named_tensors: list) -> None:
        self.server._apply(list(named_tensors), None)


def custom_loaders(extra_flags: list[str]) -> list[str]:
    """The names after ``--custom-weight-loader`` (SGLang: nargs=*) among the flags the stand-in kept."""
    names, taking = [], False
    for flag in extra_flags:
        if flag == "--custom-weight-loader":
            taking = True
        elif flag.startswith("--"):
            taking = False
        elif taking:
            names.append(flag)
    return names


def load_tensor_payload(server: Any, payload: str, load_format: str | None, version: str | None) -> None:
    if load_format in (None, "flattened_bucket", "direct"):
        return server._apply(decode_tensor_payload(payload, load_format), version)
    if load_format not in custom_loaders(server.extra_flags):
        raise NotImplementedError(f"Unknown load_format={load_format}")  # SGLang's words
    loader = load_attr(_as_attr(load_format), what="custom weight loader")
    try:  # SGLang 0.5.17's weight_updater calls it unguarded: what it raises kills the scheduler
        loader(StandinModel(server), decode_tensor_payload(payload, None))
    except Exception as err:
        raise UncaughtInScheduler(f"{type(err).__name__}: {err}") from err
    if version is not None:
        server.weight_version = version


def _as_attr(dotted: str) -> str:
    """SGLang's ``dynamic_import`` path (``pkg.module.func``) as ``pkg.module:func``."""
    module, _, attr = dotted.rpartition(".")
    return f"{module}:{attr}"
