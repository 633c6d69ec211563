"""The code sandbox: run untrusted Python (a model's code) in a separate, limited process.

API, stable for the agent's ``python`` tool and the ``code_tests`` reward (docs/sandbox.md):

- :class:`SandboxSettings`: the limits; ``SandboxSettings.from_config(cfg)`` reads ``cfg.rollout.sandbox``;
- ``await arun_python(code, settings, stdin=None)`` / ``run_python(...)`` -> :class:`SandboxResult`,
  at most ``settings.concurrency`` calls at once per event loop (``run_python``: per process);
- :func:`make_python_tool` -> ``async (code: str) -> str``, the observation text;
- :func:`isolation_support`: what this machine allows (namespaces or not), probed once.
"""

from slime_rl.core.sandbox.isolation import (
    IsolationSupport,
    SandboxUnavailable,
    isolation_support,
    require_isolation_error,
)
from slime_rl.core.sandbox.run import SandboxError, SandboxResult, arun_python, run_python
from slime_rl.core.sandbox.settings import SandboxSettings
from slime_rl.core.sandbox.tool import make_python_tool

__all__ = [
    "IsolationSupport", "SandboxError", "SandboxResult", "SandboxSettings", "SandboxUnavailable", "arun_python",
    "isolation_support", "make_python_tool", "require_isolation_error", "run_python",
]
