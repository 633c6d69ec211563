"""Nothing of a local run is reachable without its key, and nothing of it outlives it.

Runs the CPU loop in a subprocess (as tests/e2e/test_resume.py does) and reads the process table:
no process of the run listens beyond loopback, Ray refuses a client without the run's token,
nothing is written to ~/.ray, an inherited RAY_AUTH_MODE=disabled is refused, and a run killed
with SIGKILL leaves no processes or folders behind (those of an earlier dead run go at the
next start)."""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from slime_rl.core.infra import leftovers
from slime_rl.core.infra.net import free_port

TRAIN = "import sys; from slime_rl.core.config import load_config; from slime_rl.core.run.loop import train; " \
        "train(load_config(None, sys.argv[1:]))"


def overrides(tiny_model_dir: Path, tmp_path: Path, num_rollout: int) -> list[str]:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input": f"x{i} = ", "label": str(i)}) + "\n" for i in range(40)))
    return [f"model.path={tiny_model_dir}", f"data.prompt_data={prompts}", "data.rollout_batch_size=2",
            "data.n_samples_per_prompt=2", f"data.num_rollout={num_rollout}", "rollout.max_response_len=4",
            "cluster.device=cpu", "cluster.actor_num_gpus_per_node=2", "parallel.tensor_model_parallel_size=2",
            f"logging.dir={tmp_path / 'run'}", "logging.tensorboard=false"]


def clean_env(home: Path, **extra: str) -> dict[str, str]:
    """The user's environment: no Ray settings inherited from this test process."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "SLIME_RL_ALLOW"))}
    return {**env, "HOME": str(home), "SLIME_RL_TORCH_THREADS": "1", "OMP_NUM_THREADS": "1", **extra}


def steps_done(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def start_run(args: list[str], env: dict[str, str], run_dir: Path, steps: int = 1,
              cli_config: Path | None = None) -> subprocess.Popen:
    """The driver, once it has trained ``steps`` steps (so every process of the run is up); with
    ``cli_config``, `slime-cli train` on that config (``args`` then written into it)."""
    command = ([sys.executable, "-m", "slime_rl.cli.app", "train", str(write_yaml(cli_config, args))]
               if cli_config is not None else [sys.executable, "-c", TRAIN, *args])
    driver = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while steps_done(run_dir) < steps:
        if driver.poll() is not None:
            pytest.fail(f"the run ended early: {driver.stderr.read()[-3000:]}")
        assert time.time() < deadline, "the run made no progress"
        time.sleep(0.1)
    return driver


def tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def listeners(processes: list[psutil.Process]) -> list[tuple[str, str, int]]:
    """(process name, address, port) of every listening TCP socket of ``processes``."""
    pids = {p.pid: p for p in processes}
    found = []
    for conn in psutil.net_connections("inet"):
        if conn.status == psutil.CONN_LISTEN and conn.pid in pids:
            found.append((pids[conn.pid].name(), conn.laddr.ip, conn.laddr.port))
    return found


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%")[0])
    return ip.is_loopback or (ip.version == 6 and ip.ipv4_mapped is not None and ip.ipv4_mapped.is_loopback)


def ray_folder_of(pid: int) -> list[Path]:
    return list(Path(tempfile.gettempdir()).glob(f"{leftovers.RAY_PREFIX}{leftovers.owner_tag(pid)}-*"))


def dead_owner() -> tuple[str, dict]:
    """The tag and owner record of a process that has exited (its pid and start time, read while it lived)."""
    proc = subprocess.Popen(["sleep", "30"])
    tag, record = leftovers.owner_tag(proc.pid), leftovers.owner_record(proc.pid)
    proc.kill()
    proc.wait()
    return tag, record


def plant_dead_run_leftovers() -> list[Path]:
    """What a run killed mid weight sync leaves: a weight bucket in shared memory, Ray's folder."""
    tag, record = dead_owner()
    weights = Path(leftovers.shared_memory_dir()) / f"{leftovers.WEIGHTS_PREFIX}{tag}-planted"
    weights.mkdir()
    (weights / "bucket-0.safetensors").write_bytes(b"\0" * 1024)
    ray_tmp = Path(tempfile.gettempdir()) / f"{leftovers.RAY_PREFIX}{tag}-planted"
    (ray_tmp / "session_latest").mkdir(parents=True)
    for folder in (weights, ray_tmp):
        leftovers.write_owner_record(folder, record)
    return [weights, ray_tmp]


@pytest.mark.slow
def test_a_local_run_listens_on_loopback_only_and_ray_wants_the_token(tiny_model_dir, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    planted = plant_dead_run_leftovers()
    run_dir = tmp_path / "run"
    driver = start_run(overrides(tiny_model_dir, tmp_path, num_rollout=40), clean_env(home), run_dir,
                       cli_config=tmp_path / "config.yaml")
    try:
        processes = tree(driver.pid)
        found = listeners(processes)
        names = {name for name, _, _ in found}
        assert {"gcs_server", "raylet"} <= names, found  # the probe sees the run's servers
        assert any(name.startswith("ray::TrainerWorker") for name in names), found  # and the trainer's store
        assert [entry for entry in found if not is_loopback(entry[1])] == []

        # A client without the token (anyone else on the machine) is refused; with it, answered.
        gcs = next(p for p in processes if p.name() == "gcs_server")
        gcs_port = next(port for name, _, port in found if name == "gcs_server")
        connect = f"from ray._raylet import GcsClient; GcsClient(address='127.0.0.1:{gcs_port}'); print('connected')"
        stranger = subprocess.run([sys.executable, "-c", connect], env=clean_env(tmp_path / "stranger"),
                                  capture_output=True, text=True, timeout=120)
        assert stranger.returncode != 0 and "AuthenticationError" in stranger.stderr, stranger.stderr[-2000:]
        token = gcs.environ()["RAY_AUTH_TOKEN"]
        insider = subprocess.run([sys.executable, "-c", connect], capture_output=True, text=True, timeout=120,
                                 env=clean_env(tmp_path / "stranger", RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token))
        assert insider.stdout.strip() == "connected", insider.stderr[-2000:]

        # The run's own folders are the user's only; a dead run's are gone.
        (ray_tmp,) = ray_folder_of(driver.pid)
        assert stat.S_IMODE(ray_tmp.stat().st_mode) == 0o700
        assert [p for p in planted if p.exists()] == []

        # SIGTERM ends it with its final line, and every process and folder of the run goes.
        line = stop_with(driver, signal.SIGTERM, processes[1:])
        assert re.fullmatch(r"error: stopped by SIGTERM during step \d+ \(\d+ done\); no checkpoint was saved, so a new"
                            r" run starts from step 0", line), line
        assert driver.returncode == 128 + signal.SIGTERM
        assert not ray_tmp.exists()
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
    assert not (home / ".ray").exists()  # the token never went to the user's home


def stop_with(driver: subprocess.Popen, signum: int, processes: list[psutil.Process]) -> str:
    """Send ``signum`` to the driver; its last stderr line, once it and every process of its run are gone."""
    driver.send_signal(signum)
    _, stderr = driver.communicate(timeout=120)
    _, alive = psutil.wait_procs(processes, timeout=20)
    assert [p.name() for p in alive] == [], f"still running after the run ended on {signal.Signals(signum).name}"
    return stderr.strip().splitlines()[-1]


@pytest.mark.slow
def test_a_stop_signal_ends_the_run_with_where_to_resume_and_leaves_nothing(tiny_model_dir, tmp_path):
    """SIGHUP (the terminal went) as SIGTERM above: one final line, 128 + the signal, the checkpoint to resume
    from. SIGQUIT goes through the same handler (run/stopping.py STOP_SIGNALS), each signal checked for real in
    packages/core/tests/test_stopping.py; its whole run here cost the slow tier a minute and more."""
    signum = signal.SIGHUP
    run_dir = tmp_path / "run"
    args = [*overrides(tiny_model_dir, tmp_path, num_rollout=40), "checkpoint.save_interval=1"]
    driver = start_run(args, clean_env(tmp_path), run_dir, steps=2, cli_config=tmp_path / "config.yaml")
    try:
        (ray_tmp,) = ray_folder_of(driver.pid)
        line = stop_with(driver, signum, tree(driver.pid)[1:])
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
    name, save_dir = signal.Signals(signum).name, run_dir / "checkpoints"
    found = re.fullmatch(rf"error: stopped by {name} during step (\d+) \((\d+) done\); last checkpoint: step (\d+)"
                         rf" in {re.escape(str(save_dir))}; resume with --resume \(checkpoint.resume=true\)", line)
    assert found, line
    step, done, saved = (int(g) for g in found.groups())
    assert step == done + 1 and saved >= 2 and (save_dir / "latest").read_text().strip() == f"step_{saved:06d}"
    assert driver.returncode == 128 + signum
    assert not ray_tmp.exists()


@pytest.mark.slow
def test_a_killed_run_leaves_no_processes_or_folders(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    driver = start_run(overrides(tiny_model_dir, tmp_path, num_rollout=40), clean_env(tmp_path), run_dir, steps=2)
    processes = tree(driver.pid)[1:]
    assert len(processes) >= 6  # GCS, raylet, agents, the trainer ranks, the rollout worker, the reaper
    (ray_tmp,) = ray_folder_of(driver.pid)
    tag = leftovers.owner_tag(driver.pid)
    killed_at = time.time()
    driver.send_signal(signal.SIGKILL)  # weight syncs run every step: mid-sync or between
    driver.wait()
    _, alive = psutil.wait_procs(processes, timeout=20)
    elapsed = time.time() - killed_at
    assert [p.name() for p in alive] == [], f"still running {elapsed:.0f} s after the driver died"
    print(f"the run's {len(processes)} processes were gone {elapsed:.1f} s after the driver died")
    assert not ray_tmp.exists()
    assert list(Path(leftovers.shared_memory_dir()).glob(f"{leftovers.WEIGHTS_PREFIX}{tag}-*")) == []


def test_an_inherited_auth_mode_disabled_is_refused_naming_the_opt_out(tiny_model_dir, tmp_path):
    config = write_yaml(tmp_path / "config.yaml", overrides(tiny_model_dir, tmp_path, num_rollout=1))
    result = subprocess.run([sys.executable, "-m", "slime_rl.cli.app", "train", str(config)],
                            env=clean_env(tmp_path, RAY_AUTH_MODE="disabled"), capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: RAY_AUTH_MODE: ")
    assert "SLIME_RL_ALLOW_RAY_WITHOUT_AUTH=1" in line
    assert not (tmp_path / "run").exists()  # refused before anything started


def test_ray_imported_before_slime_rl_is_refused(tmp_path):
    code = "import ray, slime_rl.core\nfrom slime_rl.core.infra.ray_cluster import local_ray\nwith local_ray(None): pass"
    result = subprocess.run([sys.executable, "-c", code], env=clean_env(tmp_path), capture_output=True, text=True,
                            timeout=300)
    assert result.returncode != 0
    assert "ConfigError: import order: ray was imported before slime_rl" in result.stderr


def write_yaml(path: Path, dotted: list[str]) -> Path:
    """A config file from dotted ``key=value`` overrides."""
    import yaml

    nested: dict = {}
    for item in dotted:
        key, value = item.split("=", 1)
        *parents, leaf = key.split(".")
        node = nested
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = yaml.safe_load(value)
    path.write_text(yaml.safe_dump(nested))
    return path


def test_weight_buckets_are_private_and_a_dead_runs_folders_go(tmp_path):
    import torch

    from slime_rl.core.weights.transport import read_bucket_file, write_bucket_file

    with leftovers.weights_folder() as folder:
        assert stat.S_IMODE(Path(folder).stat().st_mode) == 0o700
        assert leftovers.owner_tag() in Path(folder).name
        path = write_bucket_file([("w", torch.ones(2))], folder)
        assert stat.S_IMODE(Path(path).stat().st_mode) == 0o600
        read_bucket_file(path)
    assert not Path(folder).exists()

    planted = plant_dead_run_leftovers()
    live = leftovers.private_folder(leftovers.RAY_PREFIX)  # this process's: alive, kept
    try:
        removed = leftovers.remove_dead()  # (and any other dead run's of this user)
        assert set(planted) <= set(removed)
        assert [p for p in planted if p.exists()] == []
        assert live.exists() and live not in removed
    finally:
        shutil.rmtree(live)


JOIN = ("import slime_rl.core, ray\nfrom slime_rl.core.infra.ray_cluster import local_ray\n"
        "with local_ray(None): print('joined', ray.cluster_resources()['CPU'])")


def start_head(temp_dir: str, **auth: str) -> tuple[subprocess.Popen, str]:
    """A one-node Ray cluster on loopback (``ray start --head --block``) and its address."""
    port = free_port()
    env = clean_env(Path(temp_dir), RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", **auth)
    head = subprocess.Popen([sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block",
                             f"--port={port}", "--node-ip-address=127.0.0.1", "--num-cpus=1",
                             "--include-dashboard=false", f"--temp-dir={temp_dir}"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return head, f"127.0.0.1:{port}"


def stop_head(head: subprocess.Popen) -> None:
    processes = tree(head.pid)
    for proc in processes:
        proc.kill()
    psutil.wait_procs(processes, timeout=30)


def join(address: str, home: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", JOIN], capture_output=True, text=True, timeout=300,
                          env=clean_env(home, RAY_ADDRESS=address, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", **env))


def wait_until_joinable(address: str, home: Path, token: str | None) -> None:
    deadline = time.time() + 120
    auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token} if token else {"RAY_AUTH_MODE": "disabled"}
    code = f"from ray._raylet import GcsClient; GcsClient(address='{address}')"
    while subprocess.run([sys.executable, "-c", code], env=clean_env(home, **auth), capture_output=True,
                         timeout=120).returncode != 0:
        assert time.time() < deadline, "the head did not start"
        time.sleep(1)


@pytest.mark.slow
def test_joining_a_cluster_needs_its_token_and_its_authentication(tmp_path):
    import secrets

    token = secrets.token_urlsafe(32)
    home = tmp_path / "home"
    home.mkdir()
    temp_dir = tempfile.mkdtemp(prefix="lk-")  # short: Ray's socket paths must fit in 107 bytes
    head, address = start_head(temp_dir, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
    try:
        wait_until_joinable(address, home, token)
        joined = join(address, home, RAY_AUTH_TOKEN=token)
        assert joined.stdout.startswith("joined 1.0"), joined.stderr[-2000:]
        refused = join(address, home, RAY_AUTH_TOKEN="not-the-token")
        assert "ConfigError: RAY_AUTH_TOKEN: the Ray cluster at" in refused.stderr
        assert "refused our token: set RAY_AUTH_TOKEN" in refused.stderr
        missing = join(address, home)
        assert "ConfigError: RAY_AUTH_TOKEN: no token for the Ray cluster" in missing.stderr
    finally:
        stop_head(head)

    head, address = start_head(temp_dir, RAY_AUTH_MODE="disabled")
    try:
        wait_until_joinable(address, home, None)
        refused = join(address, home)
        assert "ConfigError: RAY_ADDRESS: the Ray cluster at" in refused.stderr
        assert "has authentication off" in refused.stderr and "SLIME_RL_ALLOW_RAY_WITHOUT_AUTH=1" in refused.stderr
        opted_out = join(address, home, RAY_AUTH_MODE="disabled", SLIME_RL_ALLOW_RAY_WITHOUT_AUTH="1")
        assert opted_out.stdout.startswith("joined 1.0"), opted_out.stderr[-2000:]
    finally:
        stop_head(head)
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert not (home / ".ray").exists()


@pytest.mark.slow
def test_the_opt_out_lets_a_run_train_without_authentication(tiny_model_dir, tmp_path):
    config = write_yaml(tmp_path / "config.yaml", overrides(tiny_model_dir, tmp_path, num_rollout=1))
    env = clean_env(tmp_path, RAY_AUTH_MODE="disabled", SLIME_RL_ALLOW_RAY_WITHOUT_AUTH="1")
    result = subprocess.run([sys.executable, "-m", "slime_rl.cli.app", "train", str(config)], env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert steps_done(tmp_path / "run") == 1
