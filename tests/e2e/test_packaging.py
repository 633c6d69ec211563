"""Each package installs alone, from its folder, into a fresh venv holding only torch, and imports.

This is what a user of one backend gets with ``pip install packages/core packages/<name>``:
a missing dependency declaration, a top-level import of another backend, or an
entry point that does not load fails here. It also runs core's tests in a venv
holding core and its dependencies only.

To keep it to a few minutes, torch==2.13.0 (the CPU build, from local disk) is
installed once into a base venv, and core once into a copy of it; a package's venv
starts as a copy of core's (hard links to its site-packages: torch, pip, core and
core's dependencies, exactly what pip would put there first) and pip installs the
rest, two packages at a time. Installs skip byte-compiling, which is most of their
time for ray and transformers.
"""

import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from venvs import ENV, REPO, TORCH_SPEC, fresh_venv, pip_install, sh

pytestmark = pytest.mark.slow

# folder -> (distribution, module, needs core)
PACKAGES = {
    "core": ("slime-rl-core", "slime_rl.core", False),
    "buffer": ("slime-rl-buffer", "slime_rl.buffer", True),
    "trainer-megatron": ("slime-rl-trainer-megatron", "slime_rl.trainer_megatron", True),
    "rollout-sglang": ("slime-rl-rollout-sglang", "slime_rl.rollout_sglang", True),
    "rollout-hf": ("slime-rl-rollout-hf", "slime_rl.rollout_hf", True),
    "cli": ("slime-rl-cli", "slime_rl.cli", True),
}


@pytest.fixture(scope="module")
def torch_venv(tmp_path_factory) -> Path:
    venv = tmp_path_factory.mktemp("venvs") / "base"
    sh(sys.executable, "-m", "venv", venv)
    pip_install(venv / "bin" / "python", TORCH_SPEC)
    return venv


CHECK = textwrap.dedent("""
    import importlib, json, sys
    from importlib.metadata import distribution, distributions
    import torch
    dist_name, module = sys.argv[1], sys.argv[2]
    importlib.import_module(module)
    loaded = []
    for ep in distribution(dist_name).entry_points:
        if ep.group.startswith("slime_rl."):
            ep.load()
            loaded.append(f"{ep.group}:{ep.name}")
    slime = sorted(d.metadata["Name"] for d in distributions() if d.metadata["Name"].startswith("slime-rl"))
    print(json.dumps({"torch": torch.__version__, "slime": slime, "entry_points": loaded}))
""")


def install_and_check(python: Path, folder: str) -> dict:
    import json

    dist, module, needs_core = PACKAGES[folder]
    paths = (["packages/core"] if needs_core else []) + [f"packages/{folder}"]
    pip_install(python, *paths)
    report = json.loads(sh(python, "-c", CHECK, dist, module).strip().splitlines()[-1])
    assert report["torch"] == "2.13.0+cpu", f"installing {folder} replaced torch: {report['torch']}"
    assert report["slime"] == sorted({"slime-rl-core", dist})  # nothing else came along
    return report


@pytest.fixture(scope="module")
def core_python(torch_venv, tmp_path_factory) -> Path:
    python = fresh_venv(torch_venv, tmp_path_factory.mktemp("venvs") / "core")
    install_and_check(python, "core")
    return python


@pytest.fixture(scope="module")
def core_venv(core_python) -> Path:
    return core_python.parent.parent


def test_core_installs_alone(core_python):
    out = sh(core_python, "-c", "import slime_rl.core as c; print(c.__version__, c.Sample, c.load_config)")
    assert out.startswith("0.")


@pytest.fixture(scope="module")
def package_installs(core_venv, tmp_path_factory):
    """Starts every other package's install, two at a time, in venvs copied from core's; folder -> Future."""
    root = tmp_path_factory.mktemp("venvs")
    pythons = {folder: fresh_venv(core_venv, root / folder) for folder in PACKAGES if folder != "core"}
    pool = ThreadPoolExecutor(max_workers=2)  # pip waits on the network and the disk as much as on a core
    futures = {f: pool.submit(lambda f=f: (pythons[f], install_and_check(pythons[f], f))) for f in pythons}
    yield futures
    pool.shutdown(wait=True, cancel_futures=True)


def test_core_tests_pass_with_only_core(core_python, package_installs):
    # package_installs first: its venvs are copied from core's before pytest goes in here
    pip_install(core_python, "pytest>=8")
    out = sh(core_python, "-m", "pytest", "packages/core/tests", "-m", "not gpu and not slow", "-q",
             "-p", "no:cacheprovider")
    assert " passed" in out and " failed" not in out


@pytest.mark.parametrize("folder", [f for f in PACKAGES if f != "core"])
def test_package_installs_with_core_and_imports(folder, package_installs):
    python, report = package_installs[folder].result()
    if folder == "cli":
        script = python.parent / "slime-cli"
        assert sh(script, "--version").startswith("slime-cli ")
        # plan checks the backends the config names: without them, one line saying what to install
        plan = subprocess.run([str(script), "plan", str(REPO / "examples" / "grpo_math.yaml")], cwd=REPO, env=ENV,
                              capture_output=True, text=True, timeout=300)
        assert plan.returncode == 2, plan.stderr[-2000:]
        assert plan.stderr.strip().splitlines() == [plan.stderr.strip()]
        # the first backend the config names that is not installed: its section's line says what to install
        assert plan.stderr.startswith("error: rollout.sglang: ") and "pip install slime-rl-rollout-sglang" in plan.stderr
    else:
        assert report["entry_points"], f"{folder} registers no slime_rl entry point"
