"""Bad prompt data through `slime-cli train` and `plan`: one line ``error: <file:line>: <what and the fix>``,
exit 2, before anything starts (the driver reads every prompt file through before Ray); and a DataError
raised in a Ray actor mid-run reaches the terminal the same way."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import yaml
from refused_runs import assert_one_line, forbid_the_loop, run_config
from typer.testing import CliRunner

from slime_rl.cli.app import app

runner = CliRunner()
GOOD = [{"input": f"what is {i} + {i % 5} ?", "label": str(i + i % 5)} for i in range(12)]


def write_lines(path: Path, lines: list) -> Path:
    """Dicts as JSON, strings as they are, one a line."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in lines))
    return path


@pytest.fixture
def no_loop(monkeypatch):
    """The training loop stands in as a module that fails the test if a run starts."""
    forbid_the_loop(monkeypatch, "the run started despite bad data")


def deep(levels: int) -> str:
    return '{"input": "x", "label": "1", "metadata": {"a": ' + "[" * levels + "]" * levels + "}}"


CASES = {
    # name: (lines, extra data config, the bad line (0: the file), words in the message)
    "malformed line": ([*GOOD[:6], '{"input": "what is 2 + 2 ?", "label": ', *GOOD[6:]], {}, 7,
                       "malformed JSON (Expecting value); fix the line or set data.skip_bad_lines=true"),
    "deep nesting": ([*GOOD[:2], deep(100_000), *GOOD[2:]], {}, 3, "nested too deeply to parse"),
    "deep nesting json parses": ([*GOOD[:2], deep(500), *GOOD[2:]], {}, 3, "nested more than 100 levels deep"),
    "whitespace-only file": (["   ", "\t", ""], {}, 0, "the file holds no prompt (only blank lines); give a file"),
    "every line bad, skipping": (['{"input": 3, "label": "1"}', "{", deep(5000)], {"skip_bad_lines": True}, 1,
                                 "no line of the file is usable (3 bad, skipped by data.skip_bad_lines); the first: input 'input' must be"),
    "wrong types": ([*GOOD[:3], {"input": "x", "label": None}, *GOOD[3:]], {}, 4,
                    "label 'label' is null; a label must be a string, number, list or object"),
    "bad chat message": ([*GOOD[:1], {"input": [{"role": "user"}], "label": "1"}], {}, 2,
                         "must be a string or a list of chat messages ({role, content}), but message 0 is"),
    # rollout_batch_size=2 and no shuffle: the run would reach line 5 at step 3
    "bad line reached at step 3": ([*GOOD[:4], '{"input": "x" "label": "1"}', *GOOD[4:]], {"shuffle": False}, 5,
                                   "malformed JSON (Expecting ',' delimiter)"),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("command", ["train", "plan"])
def test_bad_prompt_data_is_one_line_before_anything_starts(case, command, tmp_path, no_loop):
    lines, data, bad_line, words = CASES[case]
    prompts = write_lines(tmp_path / "prompts.jsonl", lines)
    result = runner.invoke(app, [command, str(run_config(tmp_path, prompts, **data))])
    line = assert_one_line(result, f"{prompts}:{bad_line}" if bad_line else str(prompts))
    assert words in line
    assert result.stdout == ""


def test_a_bad_eval_file_is_named(tmp_path, no_loop):
    prompts = write_lines(tmp_path / "prompts.jsonl", GOOD)
    evals = write_lines(tmp_path / "eval.jsonl", [*GOOD[:5], {"input": "x", "answer": "1"}])
    cfg = run_config(tmp_path, prompts)
    for command in ("train", "plan"):
        line = assert_one_line(runner.invoke(app, [command, str(cfg), f"eval.prompt_data={{math: {evals}}}"]),
                               f"{evals}:6")
        assert "no label key 'label' (keys: input, answer); set data.label_key" in line


def test_good_data_with_some_bad_lines_skipped_goes_on(tmp_path, monkeypatch):
    prompts = write_lines(tmp_path / "prompts.jsonl", [*GOOD, "{broken", deep(100_000)])
    started = []
    module = types.ModuleType("slime_rl.core.run.loop")
    module.train = lambda cfg, callback=None: started.append(cfg) or {}
    monkeypatch.setitem(sys.modules, "slime_rl.core.run.loop", module)
    result = runner.invoke(app, ["train", str(run_config(tmp_path, prompts, skip_bad_lines=True))])
    assert result.exit_code == 0, result.output
    assert len(started) == 1


# ------------------------------------------------------------------ mid-run, through Ray


def metrics_rows(log_dir: Path) -> int:
    path = log_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.mark.slow
@pytest.mark.parametrize("cause", ["file changed", "custom source", "no chat template"])
def test_a_data_error_in_the_rollout_actor_mid_run_is_one_line_exit_2(cause, tiny_model_dir, tmp_path):
    """A DataError raised in the rollout actor mid-run (the prompt file rewritten under the job, or a user's
    data source refusing a record) or as it starts (the tokenizer, loaded only there, has no chat template)
    crosses Ray and reaches the terminal as one line, exit 2."""
    prompts = write_lines(tmp_path / "prompts.jsonl", GOOD * 4)
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump({
        "model": {"path": str(tiny_model_dir)},
        "data": {"prompt_data": str(prompts), "rollout_batch_size": 2, "n_samples_per_prompt": 2,
                 "num_rollout": 40, **({"source": "toy_data:FailsAtThirdCall"} if cause == "custom source" else {}),
                 "apply_chat_template": cause == "no chat template"},
        "rollout": {"max_response_len": 4, "reward": "toy_rewards:digit_token_fraction"},
        "cluster": {"device": "cpu"},
        "logging": {"dir": str(tmp_path / "logs"), "tensorboard": False},
    }))
    env = {**os.environ, "TOY_TOKENIZER": str(tiny_model_dir), "PYTHONPATH": str(Path(__file__).parents[1] / "support"),
           "SLIME_RL_TORCH_THREADS": "1", "OMP_NUM_THREADS": "1"}
    run = subprocess.Popen([sys.executable, "-m", "slime_rl.cli.app", "train", str(cfg)], env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        if cause == "file changed":
            deadline = time.time() + 400
            while metrics_rows(tmp_path / "logs") < 1:  # the run has trained a step
                assert run.poll() is None, run.stderr.read()[-3000:]
                assert time.time() < deadline, "no step in time"
                time.sleep(0.1)
            with open(prompts, "a") as f:  # e.g. a data pipeline still writing the file
                f.write(json.dumps({"input": "late", "label": "1"}) + "\n")
        stdout, stderr = run.communicate(timeout=400)
    finally:
        run.kill()
    assert run.returncode == 2, stderr[-3000:]
    # stderr also holds what the actors print (transformers' progress bars); the error is one line, the last
    errors = [line for line in stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and stderr.splitlines()[-1] == errors[0], stderr[-3000:]
    assert "Traceback" not in stderr
    if cause == "file changed":
        assert errors[0].startswith(f"error: {prompts}: changed while the run was reading it (")
        assert 1 <= metrics_rows(tmp_path / "logs") < 40
    elif cause == "custom source":
        assert errors[0] == f"error: {prompts}:99: the user's source refuses this record; fix it"
        assert metrics_rows(tmp_path / "logs") == 2  # steps 1 and 2 trained; step 3's rollout raised
    else:
        assert errors[0] == ("error: data.apply_chat_template: the tokenizer has no chat template; set "
                             "model.tokenizer_path to one that has, or turn it off")
        assert metrics_rows(tmp_path / "logs") == 0
