"""The progress state the train command's bar and log lines are made from."""

from slime_rl.cli.progress import WINDOW, RunState, headline_eval_key


def test_moving_averages_cover_the_last_window_of_steps():
    state = RunState()
    state.update("start", {"start_step": 5, "num_steps": 40, "startup_s": 1.0})
    assert state.step == 5 and state.status() == ""  # nothing to show before the first step
    for step in range(6, 6 + WINDOW + 2):
        state.update("step", {"step": step, "metrics": {"rollout/reward_mean": float(step), "time/step": 2.0}})
    assert state.step == 6 + WINDOW + 1
    assert state.reward_avg() == sum(range(8, 8 + WINDOW)) / WINDOW  # the first two steps fell out
    assert state.status() == f"reward 17.000 (avg{WINDOW} 12.500)  2.00 s/step"


def test_the_eval_headline_is_pass_at_k():
    assert headline_eval_key({"eval/gsm8k/reward_mean": 0.1, "eval/gsm8k/pass@4": 0.3}) == "eval/gsm8k/pass@4"
    assert headline_eval_key({"eval/qa/score": 0.2}) == "eval/qa/score"
    state = RunState()
    state.update("eval", {"step": 20, "metrics": {"eval/math/pass@1": 0.25, "eval/math/reward_mean": 0.2}})
    assert state.status() == "math/pass@1 0.250 @20"


def test_a_failed_step_says_why_in_its_line():
    from slime_rl.cli.progress import _line

    state = RunState()
    state.update("start", {"start_step": 0, "num_steps": 8, "startup_s": 1.0})
    payload = {"step": 1, "metrics": {"rollout/step_failed": 1.0}, "failure": "4 of 4 samples failed (...)"}
    state.update("step", payload)
    assert _line("step", payload, state) == "step 1/8  failed, not trained on: 4 of 4 samples failed (...)"
