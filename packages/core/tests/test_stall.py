"""The driver's waits (infra/stall.py) on a fake clock: a party that answers at a given second, or never."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from slime_rl.core.config import ConfigError, load_config
from slime_rl.core.infra.stall import FIRST_GRACE, Party, StallBounds, StallError, StallWatch, process_state

NEVER = float("inf")
BOUNDS = StallBounds(warn_factor=3.0, fail_factor=20.0, fail_floor_s=60.0)


class FakeRay:
    """References that answer at set times on a clock that ``wait`` moves forward."""

    def __init__(self) -> None:
        self.now = 0.0
        self.answers: dict[str, tuple[float, object]] = {}  # ref -> (when, value or exception)

    def call(self, name: str, after_s: float, value: object = None) -> str:
        ref = f"{name}@{self.now}"
        self.answers[ref] = (self.now + after_s, value)
        return ref

    def wait(self, refs: list[str], timeout: float) -> tuple[list[str], list[str]]:
        soonest = min(self.answers[r][0] for r in refs)
        self.now = min(self.now + timeout, soonest) if soonest > self.now else self.now
        ready = [r for r in refs if self.answers[r][0] <= self.now]
        return ready, [r for r in refs if r not in ready]

    def get(self, refs: list[str]) -> list[object]:
        values = [self.answers[r][1] for r in refs]
        for value in values:
            if isinstance(value, Exception):
                raise value
        return values


def watch_of(fake: FakeRay, bounds: StallBounds = BOUNDS) -> tuple[StallWatch, list[str]]:
    lines: list[str] = []
    watch = StallWatch(bounds, clock=lambda: fake.now, wait=fake.wait, get=fake.get, report=lines.append)
    for rank in range(2):
        watch.register(f"rank{rank}", Party(f"trainer rank {rank}", pid=4240 + rank))
    return watch, lines


def step(watch: StallWatch, fake: FakeRay, phase: str, seconds: tuple[float, float]) -> list[object]:
    refs = [fake.call(f"rank{r}", s, value=f"r{r}") for r, s in enumerate(seconds)]
    return watch.get(phase, refs, ["rank0", "rank1"])


def test_results_come_back_in_order_and_a_phase_keeps_its_durations():
    fake = FakeRay()
    watch, lines = watch_of(fake)
    assert step(watch, fake, "train", (2.0, 3.0)) == ["r0", "r1"]
    assert list(watch.history["train"]) == [3.0]
    assert lines == []


def test_a_slow_wait_warns_naming_the_ranks_still_pending_then_fails_past_floor_and_multiple():
    fake = FakeRay()
    watch, lines = watch_of(fake)
    for _ in range(3):
        step(watch, fake, "train", (4.0, 5.0))  # median 5 s: warn past 15 s, fail past max(100 s, 60 s)
    started = fake.now
    with pytest.raises(StallError) as err:
        step(watch, fake, "train", (6.0, NEVER))
    failed_after = fake.now - started
    assert 100.0 <= failed_after < 100.0 + 1.0 + 1e-9  # the larger bound, and within one poll of it
    assert len(lines) >= 2  # at 15 s, then each time the wait doubles (30 s, 60 s)
    first = lines[0]
    assert "the train wait has taken 15 s, 3.0x its median of 5.0 s" in first
    assert "not answered: trainer rank 1 (pid 4241)" in first and "rank 0" not in first
    message = str(err.value)
    assert message.startswith("cluster.stall_fail_floor_s: the train wait stalled (100 s, 20.0x its median")
    assert "not answered: trainer rank 1 (pid 4241)" in message and "\n" not in message


def test_the_floor_holds_a_short_phase_and_a_long_phase_gets_its_multiple():
    fake = FakeRay()
    watch, _ = watch_of(fake)
    step(watch, fake, "weight_sync", (0.4, 0.4))
    assert BOUNDS.limits(watch.history["weight_sync"]) == (10.0, 60.0)  # 3 x 0.4 and 20 x 0.4 are below the floors
    assert BOUNDS.limits([30.0, 31.0, 29.0]) == (90.0, 600.0)


def test_a_first_wait_does_not_trip_at_what_would_fail_a_later_one():
    fake = FakeRay()
    watch, lines = watch_of(fake, StallBounds(warn_factor=3.0, fail_factor=20.0, fail_floor_s=600.0))  # the defaults
    assert step(watch, fake, "train", (80.0, 88.0)) == ["r0", "r1"]  # a 3B model's step 1: no warning, no failure
    assert lines == []
    for _ in range(3):
        step(watch, fake, "train", (28.0, 30.0))
    # The median is 30 s now: the same 88 s warns (past 90 s would; 88 s does not), 610 s fails.
    step(watch, fake, "train", (88.0, 88.0))
    assert lines == []
    with pytest.raises(StallError):
        step(watch, fake, "train", (30.0, 610.0))
    # A first wait warns past the floor and fails only past FIRST_GRACE x the floor.
    started = fake.now
    with pytest.raises(StallError) as err:
        step(watch, fake, "save", (NEVER, NEVER))
    assert FIRST_GRACE * 600.0 <= fake.now - started < FIRST_GRACE * 600.0 + 1.0 + 1e-9
    assert "its first (no earlier one to compare with)" in str(err.value)
    assert "trainer rank 0 (pid 4240), trainer rank 1 (pid 4241)" in str(err.value)
    assert any("the save wait has taken 600 s, its first" in line for line in lines)


def test_a_party_error_comes_out_while_its_peer_still_hangs():
    fake = FakeRay()
    watch, _ = watch_of(fake)
    refs = [fake.call("rank0", NEVER), fake.call("rank1", 2.0, value=RuntimeError("rank 1 broke"))]
    with pytest.raises(RuntimeError, match="rank 1 broke"):
        watch.get("train", refs, ["rank0", "rank1"])
    assert fake.now == pytest.approx(2.0)


def test_a_local_party_says_its_process_state():
    proc = subprocess.Popen(["sleep", "30"])
    try:
        os.kill(proc.pid, signal.SIGSTOP)
        deadline = time.time() + 5
        while process_state(proc.pid) != "stopped (SIGSTOP)" and time.time() < deadline:
            time.sleep(0.01)
        assert Party("trainer rank 1", pid=proc.pid, local=True).describe() == \
            f"trainer rank 1 (pid {proc.pid}, stopped (SIGSTOP))"
        assert Party("trainer rank 1", pid=proc.pid).describe() == f"trainer rank 1 (pid {proc.pid})"  # another node
    finally:
        proc.kill()
        proc.wait()


def test_the_bounds_are_config_keys_checked_positive_and_fail_above_warn(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"input": "1 + 1 = ", "label": "2"}\n')
    data = [f"data.prompt_data={prompts}"]
    cfg = load_config(None, [*data, "cluster.stall_fail_floor_s=5", "cluster.stall_warn_factor=2"])
    assert StallBounds.from_config(cfg) == StallBounds(2.0, 20.0, 5.0)
    with pytest.raises(ConfigError, match=r"cluster\.stall_fail_factor: 3 must be above cluster\.stall_warn_factor = 3"):
        load_config(None, [*data, "cluster.stall_fail_factor=3"])
    with pytest.raises(ConfigError, match=r"cluster\.stall_fail_floor_s"):
        load_config(None, [*data, "cluster.stall_fail_floor_s=0"])
