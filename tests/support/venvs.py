"""Fresh virtual environments for packaging tests: each starts from a base venv's site-packages (hard links),
so torch and what is already there are not installed again."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TORCH_SPEC = "torch==2.13.0"  # exactly this: any other spec pulls GBs of CUDA wheels
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PYTHONPATH": ""}


def sh(*cmd, cwd=REPO, timeout=900):
    result = subprocess.run([str(c) for c in cmd], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        pytest.fail(f"{' '.join(map(str, cmd))} exited {result.returncode}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result.stdout


def site_packages(venv: Path) -> Path:
    return venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"


def _link_or_copy(src, dst):
    try:
        os.link(src, dst)  # pip and Python replace files rather than write into them, so links are safe
    except OSError:
        shutil.copy2(src, dst)


def fresh_venv(base: Path, dest: Path) -> Path:
    """A new venv whose site-packages starts as ``base``'s; returns its python."""
    sh(sys.executable, "-m", "venv", "--without-pip", dest)
    shutil.copytree(site_packages(base), site_packages(dest), copy_function=_link_or_copy, dirs_exist_ok=True)
    return dest / "bin" / "python"


def pip_install(python: Path, *args):
    return sh(python, "-m", "pip", "install", "--no-compile", *args)
