"""Rewards: the scorer's failure handling, the built-ins, and the remote reward against a real HTTP server."""

import asyncio
import json
import os
import textwrap
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from math_verify import parse, verify

from slime_rl.core.config import RolloutConfig
from slime_rl.core.infra.net import free_port
from slime_rl.core.infra.plugins import PluginError
from slime_rl.core.infra.workers import close_user_code_pools
from slime_rl.core.rewards import BUILTIN_REWARDS, load_reward, score_samples
from slime_rl.core.rewards.math_answer import (
    MathVerifier,
    dapo_reward,
    deepscaler_reward,
    label_text,
    last_boxed,
    math_reward,
)
from slime_rl.core.rewards.remote import RemoteReward, RemoteRewardError
from slime_rl.core.rewards.text_match import exact_match_reward, f1_reward, token_f1
from slime_rl.core.sample import Sample, SampleStatus

torch.set_num_threads(1)

USER_REWARDS = textwrap.dedent('''
    import asyncio, json, os, threading, time

    async def flaky(sample):
        mode = sample.metadata.get("mode")
        if mode == "raise":
            raise ValueError("cannot score\\nthis one")
        if mode == "sleep":
            await asyncio.sleep(30)
        if mode == "nan":
            return float("nan")
        return float(len(sample.response))

    def blocking(sample):  # a plain function: runs in a worker process, not on the event loop
        if sample.metadata.get("mode") == "raise":
            raise RuntimeError("sync failure")
        time.sleep(0.05)
        return {"acc": 1.0, "len": float(len(sample.response)), "pid": float(os.getpid())}

    async def counting(sample):  # records when it ran, for the concurrency test
        start = time.time()
        await asyncio.sleep(0.3)
        with open(sample.metadata["log"], "a") as log:
            log.write(json.dumps([start, time.time()]) + "\\n")
        return 1.0

    async def blocks_its_loop(sample):  # time.sleep in async code: blocks the event loop it runs in
        if sample.metadata.get("mode") == "hang":
            time.sleep(3600)
        return 1.0

    def hangs(sample):
        if sample.metadata.get("mode") == "hang":
            time.sleep(3600)
        return 2.0

    def garbage(sample):
        return {"str": "a reward that is not a number", "lambda": lambda: 1}[sample.metadata["mode"]]

    async def routed(sample):  # the remote reward, with the URL taken from the sample
        from slime_rl.core.rewards.remote import RemoteReward
        return await RemoteReward(sample.metadata["url"], backoff_s=0.01)(sample)

    def outsized(sample):  # finite, around the bound on |reward|
        return {"at_bound": -1e30, "over": -1e31, "int": 10**400, "dict": {"acc": 1e200, "len": 1.0},
                "dict_int": {"acc": 1.0, "len": 10**400}}[sample.metadata["mode"]]

    async def by_rank(samples):
        if samples[0].metadata.get("mode") == "short":
            return [1.0]
        order = sorted(range(len(samples)), key=lambda i: len(samples[i].response))
        return [float(order.index(i)) for i in range(len(samples))]
''')


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "user_rewards_for_test.py").write_text(USER_REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib

    import user_rewards_for_test

    yield importlib.reload(user_rewards_for_test)
    close_user_code_pools()  # the next test's module may differ: fresh workers import it anew


def samples_with(modes, group=None):
    return [Sample(index=i, group_index=group[i] if group else i, response="x" * (i + 1),
                   status=SampleStatus.COMPLETED, metadata={"mode": m} if m else {})
            for i, m in enumerate(modes)]


def score(samples, **cfg):
    asyncio.run(score_samples(samples, RolloutConfig(**cfg)))
    return samples


# ---------------------------------------------------------------- the scorer


@pytest.mark.parametrize("policy, failed_reward", [("zero", 0.0), ("drop", None)])
def test_raising_and_sleeping_rewards_fail_their_samples_only(user_module, policy, failed_reward):
    samples = samples_with([None, "raise", None, "sleep", "nan"])
    start = time.monotonic()
    # the healthy calls share the bound: 2 s leaves them room on a loaded machine (see the hanging-reward test)
    score(samples, reward="user_rewards_for_test:flaky", reward_timeout=2.0, on_reward_failure=policy)
    assert time.monotonic() - start < 10  # the sleeper was cut at its timeout, not awaited for 30 s
    assert [s.reward for s in samples[::2][:2]] == [1.0, 3.0]
    assert [s.status for s in samples] == [SampleStatus.COMPLETED, SampleStatus.FAILED, SampleStatus.COMPLETED,
                                           SampleStatus.FAILED, SampleStatus.FAILED]
    assert samples[1].metadata["error"] == (
        "reward 'user_rewards_for_test:flaky' raised ValueError: cannot score this one")
    assert samples[3].metadata["error"] == "reward 'user_rewards_for_test:flaky' timed out after 2 s"
    assert "nan" in samples[4].metadata["error"]
    assert all(samples[i].reward == failed_reward for i in (1, 3, 4))
    assert all("\n" not in s.metadata.get("error", "") for s in samples)


def test_sync_reward_runs_in_a_worker_process_and_dict_rewards_need_the_key(user_module):
    samples = score(samples_with([None, "raise", None]), reward="user_rewards_for_test:blocking",
                    reward_key="acc")
    pid = samples[0].reward["pid"]
    assert samples[0].reward == {"acc": 1.0, "len": 1.0, "pid": pid} and samples[2].reward["len"] == 3.0
    assert pid != os.getpid()
    assert samples[1].status == SampleStatus.FAILED and "RuntimeError: sync failure" in samples[1].metadata["error"]
    unkeyed = score(samples_with([None]), reward="user_rewards_for_test:blocking")
    assert unkeyed[0].status == SampleStatus.FAILED and "set rollout.reward_key" in unkeyed[0].metadata["error"]


def test_concurrency_is_bounded(user_module, tmp_path):
    log = tmp_path / "calls.jsonl"
    samples = samples_with([None] * 12)
    for s in samples:
        s.metadata["log"] = str(log)
    score(samples, reward="user_rewards_for_test:counting", reward_concurrency=3, reward_workers=4)
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    overlap = max(sum(start <= t < end for start, end in calls) for t, _ in calls)
    assert len(calls) == 12 and overlap == 3


@pytest.mark.parametrize("reward", ["blocks_its_loop", "hangs"])
def test_a_hanging_reward_is_killed_at_its_timeout_and_only_its_samples_fail(user_module, reward):
    """An async reward that blocks its event loop, or a plain one that never returns: the
    worker running it is killed at reward_timeout; the scorer's loop and the other samples go on."""
    samples = samples_with(["hang", None, "hang", None, None])
    start = time.monotonic()
    # 3 s, not 1: the healthy samples share the bound, and on the loaded CI machine one took over 1 s (2026-12-06)
    score(samples, reward=f"user_rewards_for_test:{reward}", reward_timeout=3.0, reward_workers=2)
    assert time.monotonic() - start < 20
    assert [s.status for s in samples] == [SampleStatus.FAILED, SampleStatus.COMPLETED] * 2 + [SampleStatus.COMPLETED]
    assert samples[0].metadata["error"] == f"reward 'user_rewards_for_test:{reward}' timed out after 3 s"
    assert all(s.reward == (1.0 if reward == "blocks_its_loop" else 2.0) for s in samples[1::2])
    # nothing is left running: the killed workers are gone, and later calls get fresh ones
    score(samples_with([None]), reward=f"user_rewards_for_test:{reward}")


def test_a_reward_returning_garbage_fails_its_sample(user_module):
    samples = score(samples_with(["str", "lambda"]), reward="user_rewards_for_test:garbage")
    assert "a reward is a number or a dict of numbers, got str" in samples[0].metadata["error"]
    assert samples[1].metadata["error"] == ("reward 'user_rewards_for_test:garbage' returned a function, "
                                            "which cannot be sent back (AttributeError: Can't pickle local object "
                                            "'garbage.<locals>.<lambda>')")
    assert all(s.status == SampleStatus.FAILED for s in samples)


def test_a_reward_beyond_the_bound_fails_its_sample_naming_the_reward_and_value(user_module):
    samples = score(samples_with(["at_bound", "over", "int", "dict", "dict_int"]),
                    reward="user_rewards_for_test:outsized", reward_key="acc")
    assert samples[0].status == SampleStatus.COMPLETED and samples[0].reward == -1e30
    assert all(s.status == SampleStatus.FAILED and s.reward == 0.0 for s in samples[1:])
    bound = "beyond the bound |reward| <= 1e+30 that keeps advantages and metrics finite; scale the reward down"
    prefix = "reward 'user_rewards_for_test:outsized' returned an unusable result:"
    assert samples[1].metadata["error"] == f"{prefix} reward is -1e+31, {bound}"
    assert samples[2].metadata["error"] == f"{prefix} reward is an integer of 1329 bits, {bound}"
    assert samples[3].metadata["error"] == f"{prefix} reward['acc'] is 1e+200, {bound}"
    assert samples[4].metadata["error"] == f"{prefix} reward['len'] is an integer too large for a float"


def test_group_reward_sees_whole_groups(user_module):
    samples = samples_with([None, None, None, "short", None], group=[0, 0, 0, 1, 1])
    score(samples, reward="user_rewards_for_test:by_rank", group_reward=True)
    assert [s.reward for s in samples[:3]] == [0.0, 1.0, 2.0]
    assert all(s.status == SampleStatus.FAILED for s in samples[3:])
    assert "list of 2 rewards, got 1 rewards" in samples[3].metadata["error"]


def test_load_reward_by_name_and_errors(user_module):
    assert load_reward("math", group=False) is BUILTIN_REWARDS["math"]
    assert load_reward("user_rewards_for_test:flaky", group=False) is user_module.flaky
    with pytest.raises(PluginError, match="no built-in reward named 'maths'"):
        load_reward("maths", group=False)
    with pytest.raises(PluginError, match="rollout.group_reward"):
        load_reward("f1", group=True)
    with pytest.raises(PluginError, match="rollout.reward_url"):
        load_reward("remote", group=False)
    with pytest.raises(PluginError, match="has no attribute 'nope'"):
        asyncio.run(score_samples(samples_with([None]), RolloutConfig(reward="user_rewards_for_test:nope")))


# ---------------------------------------------------------------- math


# (response, label, verdict). Each must agree with math-verify run directly on the whole response.
MATH_FORMS = [
    ("So the result is \\boxed{42}.", "42", 1.0),
    ("\\boxed{-7}", "-7", 1.0),
    ("We get $\\boxed{\\frac{1}{2}}$", "0.5", 1.0),  # fraction vs decimal
    ("\\boxed{\\dfrac{3}{4}}", "\\frac{3}{4}", 1.0),
    ("\\boxed{0.25}", "\\frac14", 1.0),
    ("\\boxed{\\{2, 1\\}}", "\\{1,2\\}", 1.0),  # sets, any order
    ("\\boxed{(1, 2]}", "(1,2]", 1.0),  # intervals
    ("\\boxed{(3, -1)}", "(3,-1)", 1.0),  # tuples
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1.0),  # radicals
    ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt{2}}", 1.0),
    ("\\boxed{2\\pi}", "2\\pi", 1.0),
    ("\\boxed{(x+1)^2}", "x^2+2x+1", 1.0),  # expressions
    ("\\boxed{1.5 \\times 10^{3}}", "1500", 1.0),
    ("The answer is 42.", "42", 1.0),  # no box
    ("Answer: $\\frac{2}{3}$", "2/3", 1.0),
    ("\\boxed{x = 3}", "3", 1.0),  # an equation's right-hand side
    ("\\boxed{30^\\circ}", "30", 1.0),
    ("\\boxed{10\\%}", "10", 1.0),
    ("\\boxed{\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}}", "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", 1.0),
    ("\\boxed 5", "5", 1.0),
    ("\\boxed{\\infty}", "\\infty", 1.0),
    ("\\boxed{1,2,3}", "1, 2, 3", 1.0),
    ("\\boxed{4}", "3", 0.0),
    ("\\boxed{0.33}", "\\frac{1}{3}", 0.0),
    ("\\boxed{\\{1,2,3\\}}", "\\{1,2\\}", 0.0),
    ("\\boxed{x^2+1}", "x^2-1", 0.0),
    ("\\boxed{[1, 2]}", "(1,2]", 0.0),
    ("\\boxed{\\sqrt{3}}", "3", 0.0),
    ("I cannot solve this.", "12", 0.0),
]


def test_math_reward_agrees_with_math_verify():
    samples = [Sample(index=i, response=r, label=label) for i, (r, label, _) in enumerate(MATH_FORMS)]
    score(samples, reward="math")
    for sample, (response, label, verdict) in zip(samples, MATH_FORMS, strict=True):
        direct = verify(parse(label_text(sample), parsing_timeout=None), parse(response, parsing_timeout=None),
                        timeout_seconds=None)
        assert (sample.reward, direct) == (verdict, bool(verdict)), (response, label)
        assert sample.status != SampleStatus.FAILED
    assert len(MATH_FORMS) >= 20


def test_math_reward_takes_the_last_box_and_numeric_labels():
    assert last_boxed("\\boxed{1} no wait \\boxed{\\frac{a}{b}} done") == "\\frac{a}{b}"
    assert last_boxed("\\boxed{unfinished") is None
    assert asyncio.run(math_reward(Sample(response="\\boxed{1}, no: \\boxed{2}", label="2"))) == 1.0
    assert asyncio.run(math_reward(Sample(response="\\boxed{0.5}", label=0.5))) == 1.0
    with pytest.raises(ValueError, match="has no label"):
        asyncio.run(math_reward(Sample(response="\\boxed{1}")))


def test_dapo_and_deepscaler_formats():
    dapo = [("work...\nAnswer: 12", 1.0), ("Answer: 11", -1.0), ("\\boxed{12}", -1.0), ("Answer: $\\frac{24}{2}$", 1.0)]
    for response, expected in dapo:
        assert asyncio.run(dapo_reward(Sample(response=response, label="12"))) == expected, response
    deep = [("<think>hmm</think> so \\boxed{12}", 1.0), ("<think>\\boxed{12}", 0.0),
            ("<think>\\boxed{12}</think> \\boxed{13}", 0.0), ("<think>x</think> 12", 0.0)]
    for response, expected in deep:
        assert asyncio.run(deepscaler_reward(Sample(response=response, label="12"))) == expected, response


def test_a_hanging_answer_is_killed_and_scored_wrong():
    verifier = MathVerifier(num_workers=1, timeout_s=2.0)
    try:
        assert verifier.verify("$5$", "\\boxed{5}") is True
        start = time.monotonic()
        assert verifier.verify("$5$", "\\boxed{9^{9^{9^{9}}}}") is False  # sympy never finishes this one
        assert time.monotonic() - start < 20
        assert verifier.verify("$5$", "\\boxed{5}") is True  # a fresh worker took over
    finally:
        verifier.close()


# ---------------------------------------------------------------- text


def test_exact_match_and_f1_by_hand():
    def em(response, label):
        return asyncio.run(exact_match_reward(Sample(response=response, label=label)))

    assert em("<answer>The Eiffel Tower.</answer>", "eiffel tower") == 1.0
    assert em("I think <answer>Paris</answer>", ["London", "paris"]) == 1.0
    assert em("\\boxed{Paris}", "Paris") == 1.0
    assert em("Paris, France", "Paris") == 0.0
    # prediction "big red dog" vs "the red dog": common {red, dog}: P = 2/3, R = 2/2 -> F1 = 0.8
    assert token_f1("big red dog", "the red dog") == pytest.approx(0.8)
    f1 = asyncio.run(f1_reward(Sample(response="<answer>big red dog</answer>", label=["cat", "the red dog"])))
    assert f1 == pytest.approx(0.8)


# ---------------------------------------------------------------- remote


class RewardServer:
    """A real HTTP reward server on localhost: /score (1 if response == label), /busy (503 twice, then 0.5),
    /bad (400), /garbage (not a reward)."""

    def __init__(self):
        self.calls: dict[str, int] = {}
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                server.calls[self.path] = server.calls.get(self.path, 0) + 1
                if self.path == "/score":
                    self.reply(200, {"reward": float(body["response"] == body["label"]), "prompt": body["prompt"]})
                elif self.path == "/busy":
                    self.reply(503, {"error": "busy"}) if server.calls["/busy"] <= 2 else self.reply(200, 0.5)
                elif self.path == "/bad":
                    self.reply(400, {"error": "label missing"})
                else:
                    self.reply(200, "hello")

            def reply(self, code, payload):
                data = json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    s = RewardServer()
    yield s
    s.close()


def test_remote_reward_scores_through_the_scorer(server):
    samples = [Sample(index=i, prompt="q", response=r, label="yes") for i, r in enumerate(["yes", "no"])]
    score(samples, reward="remote", reward_url=f"{server.url}/score")
    assert [s.reward for s in samples] == [1.0, 0.0]


def test_remote_reward_retries_busy_server_then_fails_clearly(server):
    fast = RemoteReward(f"{server.url}/busy", attempts=3, backoff_s=0.01)
    assert asyncio.run(fast(Sample(response="a"))) == 0.5 and server.calls["/busy"] == 3
    with pytest.raises(RemoteRewardError, match="refused the request: HTTP 400"):
        asyncio.run(RemoteReward(f"{server.url}/bad", backoff_s=0.01)(Sample()))
    assert server.calls["/bad"] == 1  # a client error is not retried
    with pytest.raises(RemoteRewardError, match="expected a number"):
        asyncio.run(RemoteReward(f"{server.url}/garbage")(Sample()))


def test_remote_reward_at_a_dead_port_fails_its_samples_with_a_reason(server, user_module):
    url = f"http://127.0.0.1:{free_port()}/score"  # free: nothing listens there
    samples = samples_with([None, None])
    score(samples, reward="remote", reward_url=url, on_reward_failure="drop")
    for s in samples:
        assert s.status == SampleStatus.FAILED and s.reward is None
        assert s.metadata["error"].startswith(f"reward 'remote' raised RemoteRewardError: remote reward {url}: "
                                              "no answer after 3 tries; last error ConnectError")


def test_dead_remote_fails_only_its_samples(server, user_module):
    """One scoring pass where some samples go to a live server and some to a dead port."""
    urls = [f"{server.url}/score", f"http://127.0.0.1:{free_port()}/score"] * 2  # nothing listens there
    samples = [Sample(index=i, response="yes", label="yes", metadata={"url": u}) for i, u in enumerate(urls)]
    score(samples, reward="user_rewards_for_test:routed")
    assert [s.status for s in samples] == [SampleStatus.PENDING, SampleStatus.FAILED] * 2
    assert [s.reward for s in samples] == [1.0, 0.0, 1.0, 0.0]
    assert "no answer after 3 tries; last error ConnectError" in samples[1].metadata["error"]
