"""SIGINT, SIGTERM, SIGHUP and SIGQUIT each end a run with its final line (run/stopping.py): real signals,
sent to this process around a stand-in for the run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from slime_rl.core.config import load_config
from slime_rl.core.run.stopping import STOP_SIGNALS, RunStoppedError, ending_on_signals


@pytest.fixture
def cfg(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"input": "1 + 1 = ", "label": "2"}\n')
    return load_config(None, [f"data.prompt_data={prompts}", f"checkpoint.save_dir={tmp_path / 'ckpt'}"])


def run_until_signal(cfg, signum: int, steps: int) -> tuple[RunStoppedError, list[str]]:
    """A stand-in run: start, ``steps`` steps, then the signal; what came out, and what cleaned up."""
    cleaned: list[str] = []
    with pytest.raises(RunStoppedError) as err, ending_on_signals(cfg) as stops:
        try:
            stops.arm()
            notify = stops.follow(lambda event, payload: None)
            notify("start", {"start_step": 0})
            for step in range(1, steps + 1):
                notify("step", {"step": step})
            os.kill(os.getpid(), signum)
            time.sleep(5)  # the handler raises in here
            pytest.fail("the signal did not stop the run")
        finally:
            cleaned.append("ray shut down")  # local_ray's exit runs before the final line is made
    return err.value, cleaned


@pytest.mark.parametrize("signum", STOP_SIGNALS, ids=lambda s: signal.Signals(s).name)
def test_each_stop_signal_ends_the_run_with_where_it_stopped_and_how_to_resume(cfg, signum):
    (cfg.checkpoint_dir / "step_000002").mkdir(parents=True)
    (cfg.checkpoint_dir / "latest").write_text("step_000002")
    before = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    err, cleaned = run_until_signal(cfg, signum, steps=3)
    name = signal.Signals(signum).name
    assert str(err) == (f"stopped by {name} during step 4 (3 done); last checkpoint: step 2 in {cfg.checkpoint_dir};"
                        " resume with --resume (checkpoint.resume=true)")
    assert err.exit_code == 128 + signum and cleaned == ["ray shut down"]
    assert {s: signal.getsignal(s) for s in STOP_SIGNALS} == before  # the caller's handlers are back


def test_without_a_checkpoint_the_line_says_a_new_run_starts_over(cfg):
    err, _ = run_until_signal(cfg, signal.SIGTERM, steps=1)
    assert str(err) == "stopped by SIGTERM during step 2 (1 done); no checkpoint was saved, so a new run starts from step 0"


def test_a_second_signal_while_shutting_down_ends_the_process_at_once(cfg):
    code = textwrap.dedent(f"""
        import os, signal, sys, time
        from slime_rl.core.config import load_config
        from slime_rl.core.run.stopping import ending_on_signals
        cfg = load_config(None, ["data.prompt_data={cfg.data.prompt_data}"])
        with ending_on_signals(cfg) as stops:
            try:
                stops.arm()
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)
            finally:
                os.kill(os.getpid(), signal.SIGINT)  # a cleanup that takes long: the user presses Ctrl-C
                time.sleep(5)
                print("cleanup finished")
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 128 + signal.SIGINT, result.stderr[-2000:]
    assert "cleanup finished" not in result.stdout
