"""The scale simulation (benchmarks/scale_sim.py, docs/scale.md) at two sizes, 32 and 128 simulated GPUs (8 and
16 stand-in engines), with an engine killed mid-rollout at each: the engine is detected, replaced and serves
the current weights again, the step trains every sample once, and the control plane's message counts grow no
faster than the ranks and engines. Behaviour and counts only: the timings are the benchmark's to print."""

from __future__ import annotations

from scale_sim import run_scale_sim


def test_two_sizes_replace_a_dead_engine_and_grow_at_most_linearly_by_counts(tmp_path):
    small, large = run_scale_sim(tmp_path, "--sizes", "small,128", "--steps", "2", "--health-window", "10",
                                 timeout=1800)
    for r in (small, large):
        assert r["placement"]["problems"] == []
        rec = r["recovery"]
        assert rec["detected_s"] is not None and rec["replaced_s"] is not None, rec
        # restored to the version the engines served when it came back, then served requests again
        assert rec["engine_version_at_replacement"] == str(rec["version_at_replacement"]), rec
        assert rec["victim_generates_after"] > 0 and rec["victim_version_after"] == str(rec["version_after"]), rec
        # nothing lost: the step the engine died in trained every sample, each once
        assert rec["step_samples"] == rec["expected_samples"] and rec["positions_trained_once"] == 1.0, rec
        for step in r["steps"]:
            assert step["samples"] == step["expected_samples"] and step["positions_trained_once"] == 1.0
    # per rank and per engine, the control plane's messages stay the same from 32 to 128 simulated GPUs
    for r in (small, large):
        step = r["steps"][-1]
        assert step["rank_calls"] == 3 * r["ranks"] + 1  # prepare, train, weight sync a rank; rank 0's sync metrics
        assert step["sync"]["http"] == {"/update_weights_from_tensor": r["engines"], "/flush_cache": r["engines"]}
        assert sum(r["startup"]["http"].values()) <= 6 * r["engines"]
        assert r["health"]["checks"] <= 3 * r["engines"]  # the monitor: one check per engine per 5 s, the router's
    assert large["steps"][-1]["host_calls"] <= 2 * small["steps"][-1]["host_calls"]  # hosts, not ranks
    ratio = large["ranks"] / small["ranks"]
    assert large["checkpoint"]["items"] <= ratio * small["checkpoint"]["items"]
