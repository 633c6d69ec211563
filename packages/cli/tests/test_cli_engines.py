"""`slime-cli engines` against a run's control endpoint (core/run/control.py) over an `EnginePool` of stand-in
engines: list, add, remove, the key it needs, one-line refusals; and `NodeWatch` naming only new GPU nodes."""

from __future__ import annotations

import asyncio
import json
import stat
import threading
import urllib.error
import urllib.request

import pytest
from typer.testing import CliRunner

from slime_rl.cli.app import app
from slime_rl.cli.engines import ControlError, call
from slime_rl.core.run.control import CONTROL_FILE, ControlEndpoint, NodeWatch
from slime_rl.core.run.engine_pool import EnginePool
from slime_rl.core.testing.standins import InstantEngine


@pytest.fixture
def running(tmp_path):
    """A control endpoint on its own event loop thread, as in the rollout worker."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    pool = EnginePool(InstantEngine, InstantEngine(), max_engines=3)
    endpoint = ControlEndpoint(pool, run_key="sk-run", folder=tmp_path)
    asyncio.run_coroutine_threadsafe(endpoint.start(), loop).result(10)
    yield tmp_path, pool
    asyncio.run_coroutine_threadsafe(endpoint.stop(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


def test_engines_are_added_listed_and_removed_through_the_cli(running):
    run_dir, pool = running
    assert stat.S_IMODE((run_dir / CONTROL_FILE).stat().st_mode) == 0o600
    cli = CliRunner()
    added = cli.invoke(app, ["engines", "add", "2", "--run-dir", str(run_dir)])
    assert added.exit_code == 0, added.output
    assert "added engine-1, engine-2" in added.output and list(pool.members) == ["engine-0", "engine-1", "engine-2"]
    removed = cli.invoke(app, ["engines", "remove", "engine-0", "--run-dir", str(run_dir)])
    assert removed.exit_code == 0 and "removed engine-0 (0 requests moved" in removed.output
    listed = call(run_dir, "list")
    assert [e["name"] for e in listed["engines"]] == ["engine-1", "engine-2"]
    too_many = cli.invoke(app, ["engines", "add", "5", "--run-dir", str(run_dir)])
    assert too_many.exit_code == 1 and "max_engines=3" in too_many.output
    with pytest.raises(ControlError, match="no engine 'engine-9'"):
        call(run_dir, "remove", "engine-9")


def test_the_endpoint_needs_the_runs_control_key(running):
    run_dir, _ = running
    url = json.loads((run_dir / CONTROL_FILE).read_text())["url"]
    for key in (None, "sk-run"):  # the run's key itself (an agent's, under the gateway) does not open it
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(urllib.request.Request(url + "/engines", headers=headers), timeout=10)
        assert err.value.code == 401


def test_no_control_file_says_what_is_missing(tmp_path):
    result = CliRunner().invoke(app, ["engines", "list", "--run-dir", str(tmp_path)])
    assert result.exit_code == 2 and "rollout.elastic.enabled=true" in result.output


def test_node_watch_names_only_gpu_nodes_that_joined():
    nodes = [{"NodeID": "a", "Alive": True, "Resources": {"GPU": 1.0}}]
    watch = NodeWatch(lambda: nodes)
    assert watch.new_nodes() == []
    nodes += [{"NodeID": "b", "Alive": True, "Resources": {"GPU": 8.0}}, {"NodeID": "c", "Alive": True, "Resources": {}}]
    assert watch.new_nodes() == ["b"] and watch.new_nodes() == []
