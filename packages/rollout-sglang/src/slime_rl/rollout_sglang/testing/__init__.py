"""A stand-in SGLang server for tests on machines without a GPU: a TEST DOUBLE of SGLang 0.5.17's HTTP API
(generate, abort, pause, weight updates by tensor, NCCL and disk, LoRA adapters, API keys), run behind the
real sglang-router. docs/standin-fidelity.md lists what it mirrors, with SGLang's source lines.

`standin_python` makes an "interpreter" for ``rollout.sglang.engine_python``: ``<it> -m sglang.launch_server ARGS``
starts the stand-in with the same ARGS, so a test drives the exact launch path a GPU run uses. The stand-in
needs ``tokenizers`` (the ``[testing]`` extra).
"""

from __future__ import annotations

import stat
import sys
from pathlib import Path

SERVER_MODULE = "slime_rl.rollout_sglang.testing.server"


def standin_python(folder: str | Path) -> str:
    """Write the interpreter wrapper into ``folder`` and return its path."""
    script = Path(folder) / "python"
    script.write_text(
        "#!/bin/sh\n"
        "# TEST DOUBLE: runs the stand-in SGLang server instead of sglang.launch_server\n"
        'if [ "$1" = "-m" ] && [ "$2" = "sglang.launch_server" ]; then\n'
        f'  shift 2; exec "{sys.executable}" -m {SERVER_MODULE} "$@"\n'
        "fi\n"
        f'exec "{sys.executable}" "$@"\n'
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return str(script)
