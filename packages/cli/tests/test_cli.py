"""slime-cli through typer's CliRunner: exit codes, one-line errors, plan output, train wiring."""

import os
import re
import shutil
import stat
import sys
import types
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest
import yaml
from cli_output import step_lines, table_rows
from typer.testing import CliRunner

from slime_rl.cli.app import app
from slime_rl.core.config import ConfigError, RunFailedError, builtin_models, load_config
from slime_rl.core.infra import plugins
from slime_rl.core.run import checkpoint
from slime_rl.core.run.run_dir import claim_logging_dir, record_logs

REPO = Path(__file__).resolve().parents[3]
EXAMPLE = REPO / "examples" / "grpo_math.yaml"
runner = CliRunner()


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def assert_user_error(result, field):
    """Exit 2, nothing on stdout, exactly one line on stderr naming the field, no traceback."""
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"error: {field}: "), lines[0]
    assert result.exception is None or isinstance(result.exception, SystemExit)
    return lines[0]


def test_help_and_version():
    result = run("--help")
    assert result.exit_code == 0
    for command in ("plan", "train", "doctor"):
        assert command in result.stdout
    result = run("--version")
    assert result.exit_code == 0
    assert result.stdout.strip() == f"slime-cli {version('slime-rl-cli')} (slime-rl-core {version('slime-rl-core')})"


def test_usage_errors_exit_2():
    assert run().exit_code == 2  # no command: help, as a usage error
    assert run("plan").exit_code == 2  # missing CONFIG
    assert run("plan", EXAMPLE, "--no-such-flag").exit_code == 2
    assert run("frobnicate").exit_code == 2


def split_plan(stdout):
    """(resolved config dict, derived line, placement text) from `plan`'s output."""
    head, _, placement = stdout.partition("\n\n")
    config_text, _, derived = head.partition("# derived: ")
    return yaml.safe_load(config_text), derived, placement


def test_plan_prints_the_resolved_config_and_placement():
    result = run("plan", EXAMPLE)
    assert result.exit_code == 0, result.output
    resolved, derived, placement = split_plan(result.stdout)
    expected = load_config(EXAMPLE)
    builtin_models.resolve_model_paths(expected)  # builtin:smollm2-135m-instruct shows as the folder it became
    assert resolved == expected.to_dict() and resolved["model"]["path"] != "builtin:smollm2-135m-instruct"
    assert resolved["data"]["prompt_data"] == str(REPO / "examples" / "data" / "math_prompts.jsonl")
    assert "global_batch_size=64" in derived and "num_engines=4" in derived
    assert "4 GPUs on 1 node(s), colocated" in placement
    rows = [line.split() for line in placement.splitlines() if line[:1].isdigit()]
    assert [row[:3] for row in rows] == [[str(i), "0", str(i)] for i in range(4)]  # bundle, node, gpu


def test_plan_applies_overrides():
    result = run("plan", EXAMPLE, "cluster.colocate=false", "cluster.rollout_num_gpus=2", "rollout.temperature=0.6")
    assert result.exit_code == 0, result.output
    resolved, _, placement = split_plan(result.stdout)
    assert resolved["rollout"]["temperature"] == 0.6 and resolved["cluster"]["colocate"] is False
    assert "6 GPUs" in placement and "disaggregated: engines start at bundle 4" in placement


def test_plan_prints_no_secret(monkeypatch):
    """A reward key (inline or env:NAME) and a reward URL's credentials are redacted in the printed config."""
    monkeypatch.setenv("TEST_PLAN_REWARD_KEY", "sk-env-plan-0a1b2c")
    for key in ("sk-inline-plan-3d4e5f", "env:TEST_PLAN_REWARD_KEY"):
        result = run("plan", EXAMPLE, "rollout.reward=remote", f"rollout.reward_api_key={key}",
                     "rollout.reward_url=https://judge:pw-plan-6a7b8c@rm.example:8000/score?token=tok-plan-9d8e7f")
        assert result.exit_code == 0, result.output
        for secret in ("sk-inline-plan-3d4e5f", "sk-env-plan-0a1b2c", "pw-plan-6a7b8c", "tok-plan-9d8e7f"):
            assert secret not in result.output
        resolved, _, _ = split_plan(result.stdout)
        assert resolved["rollout"]["reward_api_key"] == ("<redacted>" if key.startswith("sk") else key)
        assert resolved["rollout"]["reward_url"] == "https://<redacted>@rm.example:8000/score?token=<redacted>"


def test_plan_lora_example():
    result = run("plan", REPO / "examples" / "grpo_math_lora.yaml")
    assert result.exit_code == 0, result.output
    resolved, _, _ = split_plan(result.stdout)
    assert resolved["trainer"]["lora"]["rank"] == 16 and resolved["rollout"]["lora_sync"] == "adapter"


def test_plan_async_example():
    result = run("plan", REPO / "examples" / "grpo_math_async.yaml")
    assert result.exit_code == 0, result.output
    assert "disaggregated" in result.stdout


@pytest.mark.parametrize("overrides,field,words", [
    (["trainer.global_batch_size=100"], "trainer.global_batch_size", "must equal"),  # batch identity broken
    (["cluster.rollout_num_gpus_per_engine=3"], "cluster.rollout_num_gpus_per_engine", "must divide"),
    (["rollout.temprature=0.5"], "rollout.temprature", "did you mean `rollout.temperature`"),
    (["cluster.async_mode=one_step"], "cluster.async_mode", "colocate=false"),
    (["data.prompt_data=/nonexistent/prompts.jsonl"], "data.prompt_data", "/nonexistent/prompts.jsonl does not exist"),
    (["parallel.tensor_model_parallel_size=3"], "parallel.tensor_model_parallel_size", "must divide"),
    # the built-in model is checked like a folder: SmolLM2-135M has 9 attention heads
    (["parallel.tensor_model_parallel_size=2"], "parallel.tensor_model_parallel_size", "the model's 9 attention heads"),
    (["rollout.temperature"], "rollout.temperature", "section.key=value"),  # bad override syntax
])
def test_plan_refuses_bad_configs_in_one_line(overrides, field, words):
    line = assert_user_error(run("plan", EXAMPLE, *overrides), field)
    assert words in line


def test_plan_refuses_a_bad_config_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(EXAMPLE.read_text().replace("temperature:", "temprature:")
                   .replace("data/math_prompts.jsonl", str(EXAMPLE.parent / "data" / "math_prompts.jsonl")))
    assert "did you mean `rollout.temperature`" in assert_user_error(run("plan", bad), "rollout.temprature")
    assert_user_error(run("plan", tmp_path / "missing.yaml"), "config")


# ------------------------------------------------------------------ train


@pytest.fixture
def custom_config(tmp_path):
    """A config whose backends are named by module:attr (nothing here depends on a backend package)."""
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({
        "data": {"source": "slime_rl.core.contracts:DataSource", "rollout_batch_size": 2, "n_samples_per_prompt": 2},
        "rollout": {"engine": "slime_rl.core.contracts:RolloutEngine", "reward": "slime_rl.core.sample:Sample"},
        "trainer": {"backend": "slime_rl.core.contracts:PolicyTrainer"},
        "checkpoint": {"save_dir": str(tmp_path / "ckpt")},
        "logging": {"dir": str(tmp_path / "logs")},
    }))
    return path


EVAL_KEYS = ("eval/addition/pass@1", "eval/addition/reward_mean")


@pytest.fixture
def fake_loop(monkeypatch):
    """Stands in for slime_rl.core.run.loop so these tests check the CLI, not a training run.

    Like the real loop it calls back start, eval, step (reward k/4 at step k), eval, done; writes
    metrics.jsonl, a tensorboard folder and a checkpoint; and returns the loop's summary."""
    module = types.ModuleType("slime_rl.core.run.loop")
    module.calls = []
    module.error = None
    module.start_step = 0
    module.num_steps = 3

    def train(cfg, callback=None):
        module.calls.append(cfg)
        if module.error is not None:
            raise module.error
        notify = callback or (lambda event, payload: None)
        start, end = module.start_step, module.num_steps
        log_dir, save_dir = Path(cfg.logging.dir), cfg.checkpoint_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        (log_dir / "metrics.jsonl").write_text("")
        if cfg.logging.tensorboard:
            (log_dir / "tensorboard").mkdir(exist_ok=True)
        notify("start", {"start_step": start, "num_steps": end, "startup_s": 0.01})
        before = dict.fromkeys(EVAL_KEYS, start / 64)
        notify("eval", {"step": start, "metrics": before})
        for step in range(start + 1, end + 1):
            notify("step", {"step": step, "metrics": {"rollout/reward_mean": step / 4, "time/step": 0.5 * step,
                                                      "time/rollout": 0.1}})
        after = dict.fromkeys(EVAL_KEYS, 0.5)
        notify("eval", {"step": end, "metrics": after})
        checkpoint.step_dir(save_dir, end).mkdir(parents=True, exist_ok=True)
        checkpoint.commit(save_dir, end, {})
        summary = {"log_dir": str(log_dir), "checkpoint_dir": str(save_dir), "start_step": start,
                   "eval_before": before, "eval_after": after, "steps": end, "elapsed_s": 1.0,
                   "metrics_file": str(log_dir / "metrics.jsonl")}
        notify("done", summary)
        return summary

    module.train = train
    monkeypatch.setitem(sys.modules, "slime_rl.core.run.loop", module)
    return module


def test_train_hands_the_checked_config_to_the_loop(custom_config, fake_loop):
    result = run("train", custom_config, "rollout.temperature=0.3", "--resume")
    assert result.exit_code == 0, result.output
    (cfg,) = fake_loop.calls
    assert cfg.rollout.temperature == 0.3 and cfg.checkpoint.resume is True
    assert "slime-cli train: done" in result.stdout


def test_train_without_config_uses_the_cpu_default(tmp_path, custom_config, fake_loop, monkeypatch):
    from slime_rl.cli import default_run

    seen = []

    def prepare_default(workdir):
        seen.append(workdir)
        return custom_config

    monkeypatch.setattr(default_run, "prepare_default", prepare_default)
    result = run("train", "rollout.temperature=0.9", "--workdir", tmp_path / "wd")
    assert result.exit_code == 0, result.output
    assert seen == [tmp_path / "wd"] and fake_loop.calls[0].rollout.temperature == 0.9


@pytest.fixture(autouse=True)
def _umask_restored():
    """slime-cli train narrows the process's umask (private_files.py); these tests run in one process."""
    previous = os.umask(0o022)
    os.umask(previous)
    yield
    os.umask(previous)


UNRELATED = ("notes.txt", "mine/data.jsonl", "checkpoints/README.txt", "rollout_state/keep.txt", "rollouts/keep.txt",
             "tensorboard/keep.txt", "earlier_runs/keep.txt")


def put_unrelated_files(folder):
    """Files a user keeps in the folder, some in the subfolders a run writes to; returns name -> content."""
    for name in UNRELATED:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(f"the user's {name}\n")
    return {name: f"the user's {name}\n" for name in UNRELATED}


def contents(folder, names):
    return {name: (folder / name).read_text() if (folder / name).is_file() else None for name in names}


@pytest.fixture
def example_on_custom_config(monkeypatch, custom_config):
    """The built-in example writes its folder as usual but trains from custom_config (a fake backend)."""
    from slime_rl.cli import default_run

    real = default_run.prepare_default

    def prepare_default(workdir):
        real(workdir)
        return custom_config

    monkeypatch.setattr(default_run, "prepare_default", prepare_default)


EARLIER, OLDER = "20260101-000000-abcdef", "20251231-000000-abcdef"


def write_earlier_example_run(workdir):
    """What runs of the example leave in its folder (its logging.dir and checkpoint.save_dir), with the
    proof a run keeps of what it wrote: run.json (here and in earlier_runs/) and owner.json."""
    save_dir = workdir / "checkpoints"
    for run_id in (OLDER, EARLIER):  # the second run sets the first one's logs aside
        claim_logging_dir(workdir, run_id, resuming=False)
        checkpoint.prepare(save_dir, 30, run_id)
        checkpoint.commit(save_dir, 30, {"run_id": run_id}, keep_last=1)
        for name in ("metrics.jsonl", "rollouts/step_000001.jsonl", f"rollout_state/{run_id}/buffer.sqlite",
                     "tensorboard/events.out.tfevents.1.host"):
            (workdir / name).parent.mkdir(parents=True, exist_ok=True)
            (workdir / name).write_text("run output\n")
        record_logs(workdir)
        if run_id == OLDER:
            shutil.rmtree(checkpoint.step_dir(save_dir, 30))
            (save_dir / "latest").unlink()


def test_a_plain_rerun_of_the_cpu_default_starts_afresh_and_resume_keeps_the_run(tmp_path, fake_loop,
                                                                                 example_on_custom_config):
    workdir = tmp_path / "wd"
    workdir.mkdir()
    unrelated = put_unrelated_files(workdir)
    first = run("train", "--workdir", workdir)
    assert first.exit_code == 0, first.output
    assert "starts afresh" not in first.output  # not the example's folder before: nothing removed
    write_earlier_example_run(workdir)

    kept = run("train", "--resume", "--workdir", workdir)
    assert kept.exit_code == 0, kept.output
    assert checkpoint.latest(workdir / "checkpoints") is not None and (workdir / "metrics.jsonl").is_file()
    typo = run("train", "--workdir", workdir, "rollout.temprature=0.5")
    assert_user_error(typo, "rollout.temprature")
    assert checkpoint.latest(workdir / "checkpoints") is not None  # a config that fails removes nothing

    fresh = run("train", "--workdir", workdir)
    assert fresh.exit_code == 0, fresh.output
    assert "starts afresh" in fresh.output and checkpoint.latest(workdir / "checkpoints") is None
    assert not (workdir / "checkpoints" / "step_000030").exists() and not (workdir / "metrics.jsonl").exists()
    assert not (workdir / "rollout_state" / EARLIER).exists() and not (workdir / "earlier_runs" / OLDER).exists()
    assert not list((workdir / "tensorboard").glob("events.*")) and not (workdir / "run.json").exists()
    assert contents(workdir, unrelated) == unrelated  # everything else is as the user left it
    assert {p.name for p in workdir.iterdir()} == {"notes.txt", "mine", "checkpoints", "rollout_state", "rollouts",
                                                    "tensorboard", "earlier_runs", "train.jsonl", "eval.jsonl",
                                                    "config.yaml", ".slime-example.json"}


def test_a_rerun_of_the_cpu_default_removes_none_of_the_users_files_under_the_runs_names(
        tmp_path, fake_loop, example_on_custom_config):
    """The user's own metrics.jsonl, TensorBoard events and step_* folders, named as a run names its own,
    in the example's folder beside its earlier runs: a plain re-run removes only what those runs wrote."""
    workdir = tmp_path / "wd"
    assert run("train", "--workdir", workdir).exit_code == 0
    write_earlier_example_run(workdir)
    users = {"earlier_runs/unknown-1/metrics.jsonl": "my metrics\n",
             "tensorboard/events.out.tfevents.9.users-own": "my events\n",
             "checkpoints/step_000007/model.pt": "my weights\n", "checkpoints/step_000040/meta.json": "{}\n",
             "rollout_state/buffer.sqlite": "my buffer\n", "metrics.tmp": "mine\n"}
    for name, text in users.items():
        (workdir / name).parent.mkdir(parents=True, exist_ok=True)
        (workdir / name).write_text(text)
    os.utime(workdir / "tensorboard/events.out.tfevents.9.users-own", ns=(1, 1))  # put there before the runs
    result = run("train", "--workdir", workdir)
    assert result.exit_code == 0, result.output
    assert "starts afresh" in result.output and not (workdir / "checkpoints" / "step_000030").exists()
    assert contents(workdir, users) == users


def test_a_rerun_of_the_cpu_default_touches_nothing_through_a_symlinked_checkpoints_folder(
        tmp_path, fake_loop, example_on_custom_config):
    workdir, outside = tmp_path / "wd", tmp_path / "elsewhere"
    assert run("train", "--workdir", workdir).exit_code == 0
    write_earlier_example_run(workdir)
    shutil.move(workdir / "checkpoints", outside)  # the same checkpoints, now reached through a symlink
    (workdir / "checkpoints").symlink_to(outside)
    before = sorted(str(p.relative_to(outside)) for p in outside.rglob("*"))
    result = run("train", "--workdir", workdir)
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output
    assert sorted(str(p.relative_to(outside)) for p in outside.rglob("*")) == before
    assert (workdir / "checkpoints").is_symlink()


def test_the_cpu_defaults_files_are_private_under_umask_000(tmp_path, fake_loop, example_on_custom_config):
    """Under umask 000 the run's files would be 0666: slime-cli train keeps them the user's alone."""
    previous = os.umask(0)
    try:
        result = run("train", "--workdir", tmp_path / "wd")
        assert result.exit_code == 0, result.output
    finally:
        os.umask(previous)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "wd").rglob("*")}
    assert modes and {name: mode for name, mode in modes.items() if mode & 0o077} == {}


def test_the_cpu_default_refuses_to_overwrite_files_it_did_not_write(tmp_path, fake_loop, example_on_custom_config):
    workdir = tmp_path / "project"
    workdir.mkdir()
    (workdir / "config.yaml").write_text("model: {path: mine}\n")
    save_dir = workdir / "checkpoints"  # another run's checkpoints, not the example's
    checkpoint.step_dir(save_dir, 5).mkdir(parents=True)
    checkpoint.commit(save_dir, 5, {})
    line = assert_user_error(run("train", "--workdir", workdir), "--workdir")
    assert "config.yaml" in line and "new or empty --workdir" in line
    assert (workdir / "config.yaml").read_text() == "model: {path: mine}\n"
    assert sorted(p.name for p in workdir.iterdir()) == ["checkpoints", "config.yaml"]

    (workdir / "config.yaml").unlink()  # now the example may write its files, but the checkpoints stay the run's
    result = run("train", "--workdir", workdir)
    assert result.exit_code == 0, result.output
    assert "starts afresh" not in result.output and checkpoint.step_dir(save_dir, 5).is_dir()


def test_train_refuses_bad_config_before_the_loop(custom_config, fake_loop):
    assert_user_error(run("train", custom_config, "data.rollout_batch_size=0"), "data.rollout_batch_size")
    assert_user_error(run("train", custom_config, "rollout.temprature=1"), "rollout.temprature")
    assert fake_loop.calls == []


def test_train_names_a_missing_backend(custom_config, fake_loop):
    line = assert_user_error(run("train", custom_config, "rollout.engine=vllm"), "rollout.engine")
    assert "no slime_rl.rollout_engines named 'vllm'" in line and "installed:" in line
    line = assert_user_error(run("train", custom_config, "trainer.backend=my_pkg.trainers:Mine"), "trainer.backend")
    assert "cannot import module 'my_pkg.trainers'" in line
    line = assert_user_error(run("train", custom_config, "rollout.reward=slime_rl.core.sample:nope"), "rollout.reward")
    assert "has no attribute 'nope'" in line
    assert fake_loop.calls == []


def test_train_says_which_package_provides_a_backend(custom_config, fake_loop, monkeypatch):
    monkeypatch.setattr(plugins, "entry_points", lambda group: [])  # as if no backend package were installed
    line = assert_user_error(run("train", custom_config, "rollout.engine=sglang"), "rollout.engine")
    assert "pip install slime-rl-rollout-sglang" in line
    line = assert_user_error(run("train", custom_config, "trainer.backend=megatron"), "trainer.backend")
    assert "pip install slime-rl-trainer-megatron" in line


def test_train_resolves_builtin_models_to_folders(custom_config, fake_loop, monkeypatch, tmp_path):
    folder = tmp_path / "converted"
    folder.mkdir()  # checked like any model folder once resolved
    calls = []

    def resolve(spec, cache_dir=None):
        calls.append(spec)
        return folder

    monkeypatch.setattr(builtin_models, "resolve_model_path", resolve)
    result = run("train", custom_config, "model.path=builtin:smollm2-135m-instruct",
                 "model.ref_path=builtin:smollm2-135m-instruct")
    assert result.exit_code == 0, result.output
    (cfg,) = fake_loop.calls
    assert cfg.model.path == cfg.model.ref_path == str(folder) and cfg.model.tokenizer_path is None
    assert calls == ["builtin:smollm2-135m-instruct"] * 2


def test_train_refuses_an_unknown_builtin_model(custom_config, fake_loop):
    line = assert_user_error(run("train", custom_config, "model.path=builtin:gpt-9"), "model.path")
    assert "unknown built-in model 'gpt-9'" in line and "builtin:smollm2-135m-instruct" in line
    assert fake_loop.calls == []


def test_train_run_time_failures_exit_1(custom_config, fake_loop):
    fake_loop.error = RuntimeError("engine 3 died")
    result = run("train", custom_config)
    assert result.exit_code == 1
    assert result.stderr.splitlines()[-1] == "error: training failed: RuntimeError: engine 3 died"
    fake_loop.error = ConfigError("rollout.reward", "returned a string")  # a user's mistake found at run time
    assert_user_error(run("train", custom_config), "rollout.reward")
    # a run that stopped for a reason it states (every reward failed): exit 1, that reason in one line
    fake_loop.error = RunFailedError("rollout.max_failed_steps: 3 steps in a row failed (...)")
    result = run("train", custom_config)
    assert result.exit_code == 1
    assert result.stderr.splitlines() == ["error: rollout.max_failed_steps: 3 steps in a row failed (...)"]


# ------------------------------------------------------------------ train's output


def test_train_logs_a_line_a_step_when_stdout_is_no_terminal(custom_config, fake_loop):
    result = run("train", custom_config)
    assert result.exit_code == 0, result.output
    lines = step_lines(result.stdout)
    assert lines[0].startswith("started in ") and lines[0].endswith(" s: 3 steps")
    assert lines[1:] == [
        "eval @ step 0: addition/pass@1 0.000  addition/reward_mean 0.000",
        "step 1/3  reward 0.250 (avg10 0.250)  addition/pass@1 0.000 @0  0.50 s/step",
        "step 2/3  reward 0.500 (avg10 0.375)  addition/pass@1 0.000 @0  0.75 s/step",
        "step 3/3  reward 0.750 (avg10 0.500)  addition/pass@1 0.000 @0  1.00 s/step",
        "eval @ step 3: addition/pass@1 0.500  addition/reward_mean 0.500",
    ]


def test_train_ends_with_the_summary_table(custom_config, fake_loop, tmp_path):
    result = run("train", custom_config)
    assert result.exit_code == 0, result.output
    rows = table_rows(result.stdout)
    assert rows["addition/pass@1 (greedy accuracy)"] == "0.000 -> 0.500  (step 0 -> 3)"
    assert rows["addition/reward_mean"] == "0.000 -> 0.500  (step 0 -> 3)"
    assert rows["steps"] == "3 run (now at step 3)"
    assert rows["metrics (JSONL)"] == str(tmp_path / "logs" / "metrics.jsonl")
    assert rows["TensorBoard"] == f"tensorboard --logdir {tmp_path / 'logs' / 'tensorboard'}"
    assert rows["checkpoint"] == f"{tmp_path / 'ckpt' / 'step_000003'} (step 3; --resume continues from it)"
    wall = re.fullmatch(r"(\S+) s total: startup (\S+) s, training (\S+) s, median 1\.00 s/step", rows["wall time"])
    assert wall, rows["wall time"]
    total, startup, training = map(float, wall.groups())
    assert startup + training <= total + 0.2  # each printed to 0.1 s


def test_train_summary_of_a_resumed_run(custom_config, fake_loop):
    fake_loop.start_step, fake_loop.num_steps = 10, 12
    result = run("train", custom_config, "--resume", "logging.tensorboard=false", "eval.temperature=0.7")
    assert result.exit_code == 0, result.output
    assert step_lines(result.stdout)[0].endswith(" s: 12 steps, resumed from step 10")
    rows = table_rows(result.stdout)
    assert rows["steps"] == "2 run (now at step 12, resumed from step 10)"
    assert rows["addition/pass@1"] == "0.156 -> 0.500  (step 10 -> 12)"  # sampled eval: no "greedy accuracy"
    assert rows["TensorBoard"] == "off (logging.tensorboard=false)"
    assert rows["checkpoint"].endswith("step_000012 (step 12; --resume continues from it)")


ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def test_train_shows_a_progress_bar_on_a_terminal(custom_config, fake_loop):
    terminal = {"FORCE_COLOR": "1", "TTY_COMPATIBLE": "1", "COLUMNS": "200"}
    result = runner.invoke(app, ["train", str(custom_config)], env=terminal)
    assert result.exit_code == 0, result.output
    out = ANSI.sub("", result.stdout)
    assert step_lines(out) == []  # no plain lines: the bar
    bar = [line for line in out.splitlines() if "step 3/3" in line][-1]  # its final state stays on screen
    assert "reward 0.750 (avg10 0.500)  addition/pass@1 0.500 @3  1.00 s/step" in bar
    assert table_rows(out)["steps"] == "3 run (now at step 3)"
    # logging.progress_bar=false: plain lines even on a terminal
    result = runner.invoke(app, ["train", str(custom_config), "logging.progress_bar=false"], env=terminal)
    assert result.exit_code == 0, result.output
    assert len(step_lines(ANSI.sub("", result.stdout))) == 6


# ------------------------------------------------------------------ doctor


def doctor_sections(out):
    """{section: {name: status}} from doctor's output."""
    sections, current = {}, None
    for line in out.splitlines():
        if line.endswith(":") and not line.startswith(" "):
            current = sections.setdefault(line[:-1], {})
        elif line.startswith("  ") and current is not None:
            name, _, status = line.strip().partition(" ")
            current[name] = status.strip()
    return sections


def test_doctor_reports_what_is_installed():
    result = run("doctor")
    sections = doctor_sections(result.stdout)
    assert sections["torch"]["torch"] == version("torch")
    assert {"cuda", "devices"} <= set(sections["torch"])
    assert sections["slime-rl"]["slime-rl-core"] == f"{version('slime-rl-core')}, imports"
    assert set(plugins.GROUPS) <= set(sections)
    # every installed rollout engine with the distribution that registered it and the capabilities it claims
    engines = sections["slime_rl.rollout_engines"]
    assert set(plugins.installed("slime_rl.rollout_engines")) == set(engines)
    assert engines["hf"] == (f"slime_rl.rollout_hf.engine:HFEngine (slime-rl-rollout-hf {version('slime-rl-rollout-hf')}),"
                             " loads, capabilities: adapters, pause, release_memory, routed_experts")
    assert engines["sglang"].endswith(f"(slime-rl-rollout-sglang {version('slime-rl-rollout-sglang')}), loads, "
                                      "capabilities: release_memory, routed_experts")
    for dist in ("megatron-core", "sglang", "sglang-router", "ray"):
        try:
            expected = version(dist)
        except PackageNotFoundError:
            expected = "not installed"
        assert sections["libraries"][dist] == expected
    assert sections["sandbox"]["isolation"].startswith("namespaces") == (os.geteuid() == 0)  # root here and in CI
    assert sections["sandbox"]["trial_call"].startswith("works")
    assert sections["moe"]["experts"].startswith("grouped: torch._grouped_mm")  # this torch has it
    broken = "problems:" in result.stdout
    assert result.exit_code == (1 if broken else 0)
    assert result.stdout.rstrip().endswith("no problems found") != broken
