"""benchmarks/scale_sim.py run from a test (tests/unit/test_scale_sim.py, tests/e2e/test_scale_sim_dead_engine.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_scale_sim(tmp_path: Path, *args: str, timeout: int = 600) -> list[dict]:
    """The benchmark in its own process (Ray reads its environment when first imported); its measurements."""
    out = tmp_path / "results.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "scale_sim.py"), *args, "--json", str(out)],
                          capture_output=True, text=True, timeout=timeout, env={**env, "HOME": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(out.read_text())
