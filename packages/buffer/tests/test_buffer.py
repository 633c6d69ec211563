"""SampleBuffer: groups in and out, partial groups, staleness, filters, persistence."""

from __future__ import annotations

import pickle

import pytest
from buffer_testdata import finished_group

from slime_rl.buffer import SampleBuffer
from slime_rl.core.config import Config
from slime_rl.core.infra.plugins import PluginError, load_plugin
from slime_rl.core.sample import Sample, SampleStatus


def dicts(groups):
    return [[s.to_dict() for s in g] for g in groups]


def partial_group(group_index: int, *, version: int = 0) -> list[Sample]:
    """One sample cut short after 2 tokens, one never started, one finished."""
    aborted = Sample(index=10 * group_index, group_index=group_index, prompt="p", tokens=[1, 2, 3],
                     weight_version=version)
    aborted.append_response([7, 8], [-0.1, -0.2], trained=True)
    aborted.status = SampleStatus.ABORTED
    pending = Sample(index=10 * group_index + 1, group_index=group_index, prompt="p", tokens=[1, 2, 3])
    done = finished_group(group_index, 1, version=version)[0]
    return [aborted, pending, done]


def test_groups_go_out_oldest_first_exactly_as_they_came_in(tmp_path):
    buffer = SampleBuffer(tmp_path)
    groups = [finished_group(i, 3, version=i) for i in range(5)]
    buffer.add(groups[:2])
    buffer.add(groups[2:])
    assert len(buffer) == 5 and buffer.take(0) == []
    assert dicts(buffer.take(2)) == dicts(groups[:2])
    assert dicts(buffer.take(10)) == dicts(groups[2:])  # fewer than asked when it holds fewer
    assert len(buffer) == 0 and buffer.take(1) == []
    assert buffer.stats == {"added_groups": 5, "taken_groups": 5, "dropped_stale_samples": 0,
                            "restarted_stale_samples": 0}
    with pytest.raises(TypeError, match="non-empty list of Sample"):
        buffer.add([[]])


def test_partial_groups_come_back_with_their_tokens_and_version(tmp_path):
    buffer = SampleBuffer(tmp_path)
    buffer.add([finished_group(0), partial_group(1, version=3), finished_group(2)])
    assert (len(buffer), buffer.num_partial, buffer.num_finished) == (3, 1, 2)
    assert [g[0].group_index for g in buffer.take(5)] == [0, 2]  # the trainer never sees a partial group
    (resumed,) = buffer.take(5, partial=True)
    assert dicts([resumed]) == dicts([partial_group(1, version=3)])
    aborted = resumed[0]
    assert (aborted.response_tokens, aborted.rollout_log_probs, aborted.weight_version) == ([7, 8], [-0.1, -0.2], 3)
    assert len(buffer) == 0


def test_without_partial_rollout_a_cut_short_sample_starts_over(tmp_path):
    buffer = SampleBuffer(tmp_path, partial_rollout=False)
    buffer.add([partial_group(0, version=2)])
    aborted, pending, done = buffer.take(1, partial=True)[0]
    assert (aborted.tokens, aborted.response_length, aborted.status) == ([1, 2, 3], 0, SampleStatus.PENDING)
    assert aborted.loss_mask == [] and aborted.rollout_log_probs == []
    assert done.status == SampleStatus.COMPLETED and done.response_length == 2  # finished samples are kept


# ---------------------------------------------------------------- staleness


def mixed_version_groups() -> list[list[Sample]]:
    versions = [[5, 5, 4, 4], [2, 2, 2, 2], [3, 1, 5, 0], [4, 3, 3, 2], [0, 0, 1, 6]]
    groups = []
    for gi, vs in enumerate(versions):
        group = finished_group(gi, len(vs))
        for s, v in zip(group, vs, strict=True):
            s.weight_version = v
        groups.append(group)
    return groups


def test_staleness_bound_drops_exactly_the_stale_samples(tmp_path):
    buffer = SampleBuffer(tmp_path, max_staleness=2)
    groups = mixed_version_groups()
    buffer.add(groups)
    current = 5  # stale: 5 - version > 2, i.e. version < 3
    expected = [[s.index for s in g if s.weight_version >= 3] for g in groups]
    expected = [ids for ids in expected if ids]  # group 1 was all stale and is gone
    first = buffer.take(2, current_version=current)
    # every stale sample left the buffer at once, including those of groups not taken yet
    assert len(buffer) == len(expected) - 2
    rest = buffer.take(10, current_version=current)
    assert [[s.index for s in g] for g in first + rest] == expected
    n_stale = sum(s.weight_version < 3 for g in groups for s in g)
    assert buffer.stats["dropped_stale_samples"] == n_stale == 10
    assert all(s.metadata["staleness"] == current - s.weight_version for g in first + rest for s in g)
    assert all("loss_weight" not in s.metadata for g in first + rest for s in g)


def test_without_a_current_version_nothing_is_dropped(tmp_path):
    buffer = SampleBuffer(tmp_path, max_staleness=0)
    buffer.add(mixed_version_groups())
    assert sum(len(g) for g in buffer.take(10)) == 20


def test_downweight_keeps_stale_samples_with_a_smaller_loss_weight(tmp_path):
    buffer = SampleBuffer(tmp_path, max_staleness=1, staleness_policy="downweight")
    buffer.add(mixed_version_groups())
    taken = buffer.take(10, current_version=4)
    samples = [s for g in taken for s in g]
    assert len(samples) == 20 and buffer.stats["dropped_stale_samples"] == 0
    for s in samples:
        staleness = 4 - s.weight_version
        assert s.metadata["staleness"] == staleness
        if staleness > 1:
            assert s.metadata["loss_weight"] == pytest.approx(2 / (staleness + 1))
        else:
            assert "loss_weight" not in s.metadata


def test_stale_partial_samples_restart_from_their_prompt(tmp_path):
    buffer = SampleBuffer(tmp_path, max_staleness=1)
    buffer.add([partial_group(0, version=1), partial_group(1, version=4)])
    old, fresh = buffer.take(2, current_version=4, partial=True)
    assert old[0].response_length == 0 and old[0].status == SampleStatus.PENDING and old[0].weight_version == 4
    assert old[2].response_length == 0  # the finished one from version 1 is as stale
    assert fresh[0].response_tokens == [7, 8] and fresh[0].status == SampleStatus.ABORTED
    assert buffer.stats["restarted_stale_samples"] == 2


# ---------------------------------------------------------------- filters


def test_a_buffer_filter_name_that_is_not_built_in_is_refused():
    with pytest.raises(PluginError, match="no built-in buffer filter named 'newest'"):
        SampleBuffer(filter="newest")


def pick_odd_groups(groups: list[list[Sample]], num_groups: int) -> list[int]:
    """A user's buffer filter (loaded below as test_buffer:pick_odd_groups)."""
    return [i for i, g in enumerate(groups) if g[0].group_index % 2][:num_groups]


def test_a_buffer_filter_chooses_which_groups_go_out(tmp_path):
    buffer = SampleBuffer(tmp_path, filter="test_buffer:pick_odd_groups")
    buffer.add([finished_group(i, 2) for i in range(6)])
    assert [g[0].group_index for g in buffer.take(2)] == [1, 3]
    assert [g[0].group_index for g in buffer.take(5)] == [5]
    assert [g[0].group_index for g in SampleBuffer(tmp_path).take(5)] == [0, 2, 4]  # the rest stayed put

    fresh = SampleBuffer(tmp_path / "b", filter="freshest_first")
    fresh.add([finished_group(i, 2, version=v) for i, v in enumerate([1, 3, 2, 3])])
    assert [g[0].group_index for g in fresh.take(3)] == [1, 3, 2]

    broken = SampleBuffer(tmp_path / "c", filter=lambda groups, n: [0, 0])
    broken.add([finished_group(0, 2)])
    with pytest.raises(ValueError, match="must return at most 2 distinct positions"):
        broken.take(2)
    assert len(broken) == 1  # the failed take removed nothing


# ---------------------------------------------------------------- persistence


def test_reopening_the_file_resumes_contents_counters_and_states(tmp_path):
    with SampleBuffer(tmp_path / "run") as buffer:
        buffer.add([finished_group(0), partial_group(1)], states={"data_source": {"epoch": 1, "position": 7}})
        buffer.take(1)
    with SampleBuffer(tmp_path / "run") as again:
        assert (len(again), again.num_partial) == (1, 1)
        assert again.get_state("data_source") == {"epoch": 1, "position": 7}
        assert again.stats["added_groups"] == 2 and again.stats["taken_groups"] == 1
        assert dicts(again.take(1, partial=True)) == dicts([partial_group(1)])


def test_a_failed_add_stores_nothing(tmp_path):
    buffer = SampleBuffer(tmp_path)
    bad = finished_group(1)
    bad[0].metadata["not_json"] = object()
    with pytest.raises(TypeError, match="JSON-serialisable"):
        buffer.add([finished_group(0), bad], states={"data_source": {"position": 1}})
    assert len(buffer) == 0 and buffer.get_state("data_source") is None


def test_state_dict_snapshot_restores_into_another_buffer(tmp_path):
    source = SampleBuffer(tmp_path / "a")
    source.add([finished_group(0), partial_group(1), finished_group(2)], states={"ds": {"epoch": 2}})
    snapshot = source.state_dict()
    target = SampleBuffer()  # in memory
    target.add([finished_group(9)])
    target.load_state_dict(snapshot)
    assert dicts(target.take(5)) == dicts([finished_group(0), finished_group(2)])
    assert dicts(target.take(5, partial=True)) == dicts([partial_group(1)])
    assert target.get_state("ds") == {"epoch": 2}


def test_compaction_gives_space_back(tmp_path):
    buffer = SampleBuffer(tmp_path)
    for i in range(20):
        buffer.add([finished_group(i * 10 + k, 8, response_len=500) for k in range(10)])
    full = buffer.store.file_bytes()
    assert buffer.take(1000) and len(buffer) == 0
    conn = buffer.store._conn
    pages, page_size = conn.execute("PRAGMA page_count").fetchone()[0], conn.execute("PRAGMA page_size").fetchone()[0]
    assert pages * page_size < full / 10  # take() already gave the free pages back
    buffer.compact()  # and compact() trims the WAL too
    assert buffer.store.file_bytes() < full / 10


def test_pickles_as_its_file_for_another_process(tmp_path):
    buffer = SampleBuffer(tmp_path, max_staleness=3, filter="freshest_first")
    buffer.add([finished_group(0)])
    clone = pickle.loads(pickle.dumps(buffer))
    assert (clone.max_staleness, clone.filter_spec, len(clone)) == (3, "freshest_first", 1)
    with pytest.raises(TypeError, match="in-memory SampleBuffer"):
        pickle.dumps(SampleBuffer())


def test_from_config_and_entry_point(tmp_path):
    cfg = Config()
    cfg.rollout.max_staleness, cfg.rollout.partial_rollout = 2, True
    buffer = load_plugin("slime_rl.buffers", "default").from_config(cfg, tmp_path)
    assert isinstance(buffer, SampleBuffer) and buffer.max_staleness == 2 and buffer.partial_rollout
    assert buffer.db_path == tmp_path / "buffer.sqlite" and buffer.db_path.exists()


def test_a_damaged_record_is_refused_not_read(tmp_path):
    import sqlite3

    from slime_rl.buffer.store import StoreError

    SampleBuffer(tmp_path).add([finished_group(0), finished_group(1)])
    conn = sqlite3.connect(tmp_path / "buffer.sqlite")
    conn.execute("UPDATE groups SET payload = substr(payload, 1, length(payload) - 3) WHERE id = 2")
    conn.commit()
    conn.close()
    buffer = SampleBuffer(tmp_path)
    assert dicts(buffer.take(1)) == dicts([finished_group(0)])
    with pytest.raises(StoreError, match="group row 2 fails its checksum; the file is damaged"):
        buffer.take(1)
