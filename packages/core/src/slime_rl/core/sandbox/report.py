"""What ``slime-cli doctor`` says about the sandbox on this machine."""

from __future__ import annotations

import os
import time

from slime_rl.core.sandbox.isolation import isolation_support
from slime_rl.core.sandbox.run import run_python
from slime_rl.core.sandbox.settings import SandboxSettings


def sandbox_report(settings: SandboxSettings | None = None) -> list[tuple[str, str, bool]]:
    """(name, status, ok) lines: the isolation level and why, whether require_isolation can hold,
    who the code runs as, and one trial call."""
    settings = settings or SandboxSettings()
    support = isolation_support()
    lines = [("isolation", f"{support.level}: {support.reason}", True),
             ("require_isolation", "can be set" if support.isolated else
              "refused here (no namespaces): the config check rejects rollout.sandbox.require_isolation=true", True)]
    if os.geteuid() == 0:
        lines.append(("user", f"each call drops from root to its own uid ({settings.uid_base} and up)", True))
    else:
        lines.append(("user", "runs as this user (not root): max_processes counts all of this user's processes,"
                              " and the code can read what this user can", True))
    lines.append(("interpreter", settings.interpreter, True))
    start = time.monotonic()
    try:
        result = run_python("import sys; print(sys.version_info[0])", settings)
    except Exception as err:  # report, don't crash: that is the doctor's job
        lines.append(("trial_call", f"fails: {' '.join(str(err).split())[:300]}", False))
        return lines
    took = time.monotonic() - start
    if result.ok and result.stdout.strip() == "3":
        lines.append(("trial_call", f"works ({took:.2f} s, isolation {result.isolation})", True))
    else:
        lines.append(("trial_call", f"fails: {result.observation()[-300:]!r}", False))
    return lines
