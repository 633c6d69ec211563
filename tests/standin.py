"""The stand-in SGLang server (a test double, packages/rollout-sglang/tests/standin_sglang.py) for the
cross-package tests: real SGLang needs a GPU."""

from __future__ import annotations

import stat
import sys
from pathlib import Path

STANDIN = Path(__file__).parents[1] / "packages" / "rollout-sglang" / "tests" / "standin_sglang.py"


def fake_sglang_python(folder: Path) -> str:
    """An 'interpreter' whose ``-m sglang.launch_server ARGS`` runs the stand-in server with ARGS."""
    script = folder / "python"
    script.write_text(
        "#!/bin/sh\n# TEST DOUBLE: the stand-in SGLang server instead of sglang.launch_server\n"
        f'if [ "$1" = "-m" ] && [ "$2" = "sglang.launch_server" ]; then shift 2; exec "{sys.executable}" "{STANDIN}" "$@"; fi\n'
        f'exec "{sys.executable}" "$@"\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return str(script)
