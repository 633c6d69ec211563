"""A SIGKILL at a random moment loses no acknowledged group and leaves no half-written one."""

from __future__ import annotations

import multiprocessing
import os
import random
import select
import signal
import sqlite3
import time

import pytest

from slime_rl.buffer import SampleBuffer
from slime_rl.core.sample import Sample, SampleStatus

KILLS = 20
SAMPLES_PER_GROUP = 2


def response_len(group_id: int) -> int:
    return (group_id * 7919) % 600 + 1  # 1..600 tokens: commits of very different sizes


def make_group(group_id: int) -> list[Sample]:
    """Content is a function of the id, so a reader can check every field it gets back."""
    group = []
    for k in range(SAMPLES_PER_GROUP):
        s = Sample(index=group_id * SAMPLES_PER_GROUP + k, group_index=group_id, prompt=f"prompt {group_id}",
                   label=str(group_id), tokens=[group_id % 50_000] * 5)
        n = response_len(group_id)
        s.append_response([k + 1] * n, [-(group_id % 97) / 10] * n, trained=True)
        s.status, s.reward = SampleStatus.COMPLETED, float(k)
        group.append(s)
    return group


def producer(db: str, ack_fd: int, first_id: int, seed: int) -> None:
    """Adds groups forever; writes each group id to the pipe only after add() returned."""
    rng = random.Random(seed)
    buffer = SampleBuffer(db)
    next_id = first_id
    while True:
        ids = list(range(next_id, next_id + rng.randint(1, 4)))
        next_id += len(ids)
        buffer.add([make_group(i) for i in ids])
        os.write(ack_fd, "".join(f"{i}\n" for i in ids).encode())


def read_acks(fd: int) -> list[int]:
    data = b""
    while chunk := os.read(fd, 1 << 16):
        data += chunk
    assert data.endswith(b"\n") or not data  # the pipe write of one add is atomic (< PIPE_BUF)
    return [int(x) for x in data.split()]


@pytest.mark.slow  # 20 killed writer processes: ~17 s on 2 cores
def test_sigkill_at_20_random_moments_loses_no_acknowledged_group(tmp_path):
    db = str(tmp_path / "run")
    rng = random.Random(20261130)
    fork = multiprocessing.get_context("fork")
    acknowledged: set[int] = set()
    for round_ in range(KILLS):
        read_fd, write_fd = os.pipe()
        first_id = round_ * 1_000_000
        child = fork.Process(target=producer, args=(db, write_fd, first_id, round_), daemon=True)
        child.start()
        os.close(write_fd)
        ready, _, _ = select.select([read_fd], [], [], 60)  # the first add returned
        assert ready, "the producer never acknowledged an add"
        time.sleep(rng.uniform(0.0, 0.15))
        os.kill(child.pid, signal.SIGKILL)
        child.join(30)
        assert child.exitcode == -signal.SIGKILL
        acks = read_acks(read_fd)
        os.close(read_fd)
        assert acks, "killed before any add returned; the test did not exercise anything"
        acknowledged.update(acks)
        attempted_max = max(acks) + 4  # at most one more add, of up to 4 groups, may have committed

        with SampleBuffer(db) as buffer:  # recovery happens on open
            stored = buffer.store.select()
        ids = [g.samples[0].group_index for g in stored]
        assert len(ids) == len(set(ids)), "a group is stored twice"
        missing = acknowledged - set(ids)
        assert not missing, f"round {round_}: acknowledged groups lost: {sorted(missing)[:5]}"
        unacked = set(ids) - acknowledged
        assert all(first_id <= i <= attempted_max for i in unacked), f"unexpected groups {sorted(unacked)}"
        for g in stored:  # every record read back is whole
            assert g.samples == make_group(g.samples[0].group_index)
        acknowledged.update(unacked)  # committed, so from now on they must stay too

    conn = sqlite3.connect(str(tmp_path / "run" / "buffer.sqlite"))
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    conn.close()
    assert len(acknowledged) >= KILLS


@pytest.mark.slow  # two processes trading groups through the file: ~32 s on 2 cores
def test_a_producer_and_a_consumer_process_share_the_file(tmp_path):
    """The rollout side adds while the trainer side takes: every group comes out exactly once."""
    db = str(tmp_path / "shared")
    SampleBuffer(db).close()

    def produce():
        buffer = SampleBuffer(db)
        for i in range(0, 120, 3):
            buffer.add([make_group(j) for j in range(i, i + 3)])

    child = multiprocessing.get_context("fork").Process(target=produce)
    child.start()
    buffer, taken = SampleBuffer(db), []
    deadline = time.monotonic() + 60
    while len(taken) < 120 and time.monotonic() < deadline:
        taken += [g[0].group_index for g in buffer.take(7)]
    child.join(30)
    assert child.exitcode == 0 and taken == list(range(120)) and len(buffer) == 0  # FIFO, once each
