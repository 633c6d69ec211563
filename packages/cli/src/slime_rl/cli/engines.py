"""`slime-cli engines`: list, add and remove a running job's rollout engines through its control endpoint
(core/run/control.py; rollout.elastic.enabled). The endpoint's URL and key are in the run folder's
``control.json``, readable by the run's user only."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from slime_rl.core.run.control import read_control_file


class ControlError(RuntimeError):
    """The endpoint refused the request (its message says why) or could not be reached."""


def call(run_dir: str | Path, action: str, target: str | None = None, timeout: float = 600.0) -> dict[str, Any]:
    """``list``, ``add`` (``target``: how many) or ``remove`` (``target``: an engine's name) on the run."""
    url, key = read_control_file(run_dir)
    if action == "list":
        method, path, body = "GET", "/engines", None
    elif action == "add":
        try:
            count = int(target if target is not None else 1)
        except ValueError:
            raise ControlError(f"engines add: {target!r} is not a number of engines; e.g. `engines add 2`") from None
        method, path, body = "POST", "/engines/add", {"count": count}
    elif action == "remove":
        if not target:
            raise ControlError("engines remove: name the engine, e.g. `engines remove engine-1` (see `engines list`)")
        method, path, body = "POST", "/engines/remove", {"name": target}
    else:
        raise ControlError(f"engines: unknown action {action!r}; use list, add or remove")
    request = urllib.request.Request(url + path, method=method, data=json.dumps(body).encode() if body else None,
                                     headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            return json.loads(answer.read())
    except urllib.error.HTTPError as err:
        try:
            message = json.loads(err.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = f"HTTP {err.code}"
        raise ControlError(message) from None
    except urllib.error.URLError as err:
        raise ControlError(f"{url}: the run's control endpoint does not answer ({err.reason}); has the run ended?"
                           ) from None


def render(answer: dict[str, Any]) -> str:
    lines = []
    if "added" in answer:
        lines.append(f"added {', '.join(answer['added'])}")
    if "removed" in answer:
        lines.append(f"removed {answer['removed']} ({answer['requests_moved']} requests moved to other engines)")
    lines.append(f"{'engine':<12} {'state':<9} {'version':>7} {'in flight':>9}")
    for e in answer.get("engines", []):
        lines.append(f"{e['name']:<12} {e['state']:<9} {e['weight_version']:>7} {e['in_flight']:>9}")
    return "\n".join(lines)
