"""sglang-router on loopback: start it, register and remove workers, wait until it routes.

Measured behaviour (notes/sglang-router.md): workers join through ``POST /workers``
and are in rotation ~0.4 s later; ``GET /readiness`` counts healthy workers; the
Prometheus exporter must get its own port or a second router dies on 29000.

Keys (measured on the 0.3.2 binary, docs/multi-node.md): the router's ``--api-key`` guards its
``/generate`` and ``/v1/*``; ``--control-plane-api-keys`` with an admin role guards ``/workers``,
``/flush_cache`` and ``/get_loads``; a worker registered at run time gets the key the router
sends it from ``POST /workers {"api_key"}`` (not from ``--api-key``). ``/health``, ``/readiness``,
``/health_generate``, ``/get_server_info``, ``/get_model_info``, ``/v1/models`` and the
Prometheus port stay open. The router has no weight, memory or abort endpoints (404).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from slime_rl.core.infra.net import free_port
from slime_rl.rollout_sglang.keys import bearer
from slime_rl.rollout_sglang.process import ChildProcess, start_process

# The router's key travels in its environment, not on its command line (which every user can list).
_KEY_ENV = "SLIME_RL_ROUTER_KEY"
_LAUNCH_WITH_KEY = (
    "import os, sys\n"
    "from sglang_router.launch_router import main\n"
    f"key = os.environ.pop({_KEY_ENV!r})\n"
    "sys.argv[1:] += ['--api-key', key, '--control-plane-api-keys', 'slime-rl:slime-rl:admin:' + key]\n"
    "main()\n")


class RouterError(RuntimeError):
    pass


@dataclass
class Router:
    url: str
    process: ChildProcess | None = None
    worker_ids: dict[str, str] = field(default_factory=dict)  # worker url -> router's worker id
    key: str | None = field(default=None, repr=False)  # its --api-key and admin control-plane key

    def _request(self, method: str, path: str, timeout: float = 30.0, **kwargs) -> httpx.Response:
        try:
            return httpx.request(method, f"{self.url}{path}", headers=bearer(self.key), timeout=timeout, **kwargs)
        except httpx.HTTPError as err:
            raise RouterError(f"sglang-router at {self.url}: {method} {path} failed: {err}{self._tail()}") from None

    def _tail(self) -> str:
        if self.process is None:
            return ""
        state = "running" if self.process.alive() else f"exited with code {self.process.popen.returncode}"
        return f" (router {state}; last lines of {self.process.log_path}:\n{self.process.log_tail(15)})"

    def workers(self) -> list[dict]:
        """The router's view: ``[{"id", "url", "is_healthy", ...}]``."""
        resp = self._request("GET", "/workers")
        resp.raise_for_status()
        return resp.json()["workers"]

    def add_worker(self, url: str, timeout: float = 60.0, api_key: str | None = None) -> None:
        """Register ``url`` and wait until the router routes to it; ``api_key`` is the key the router
        sends to this worker (its ``--api-key``)."""
        body = {"url": url, **({"api_key": api_key} if api_key else {})}
        resp = self._request("POST", "/workers", json=body)
        if resp.status_code not in (200, 202):
            raise RouterError(f"sglang-router refused worker {url}: HTTP {resp.status_code} {resp.text[:300]}")
        self.worker_ids[url] = resp.json().get("worker_id", "")
        self._wait(lambda ws: any(w["url"] == url and w.get("is_healthy") for w in ws), timeout,
                   f"worker {url} to become healthy in the router")

    def remove_worker(self, url: str, timeout: float = 30.0) -> None:
        """Take ``url`` out of rotation (``DELETE /workers/{id}``); no-op if it is not registered."""
        known = {w["url"]: w["id"] for w in self.workers()}
        worker_id = known.get(url) or self.worker_ids.get(url)
        if url not in known:
            self.worker_ids.pop(url, None)
            return
        resp = self._request("DELETE", f"/workers/{worker_id}")
        if resp.status_code not in (200, 202, 204):
            raise RouterError(f"sglang-router refused to remove worker {url}: HTTP {resp.status_code} {resp.text[:300]}")
        self._wait(lambda ws: all(w["url"] != url for w in ws), timeout, f"worker {url} to leave the router")
        self.worker_ids.pop(url, None)

    def wait_ready(self, num_workers: int, timeout: float = 60.0) -> None:
        """Until ``GET /readiness`` reports ``num_workers`` healthy workers."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                resp = httpx.get(f"{self.url}/readiness", timeout=5)
                if resp.status_code == 200 and resp.json().get("healthy_workers", 0) >= num_workers:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() >= deadline:
                raise RouterError(f"sglang-router at {self.url} not ready with {num_workers} healthy workers "
                                  f"after {timeout:.0f} s{self._tail()}")
            time.sleep(0.1)

    def _wait(self, done, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not done(self.workers()):
            if time.monotonic() >= deadline:
                raise RouterError(f"timed out after {timeout:.0f} s waiting for {what}{self._tail()}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()


def launch_router(log_dir: str | Path, *, policy: str = "round_robin", host: str = "127.0.0.1",
                  extra_args: list[str] | None = None, timeout: float = 60.0, attempts: int = 3,
                  key: str | None = None) -> Router:
    """Start ``sglang_router.launch_router`` on loopback with no workers and wait for ``/health``.
    With ``key``, its routing and control endpoints refuse requests without it.
    A port taken between picking and binding it is retried with fresh ports."""
    last_error = ""
    launcher = ["-c", _LAUNCH_WITH_KEY] if key else ["-m", "sglang_router.launch_router"]
    env = {**os.environ, _KEY_ENV: key} if key else None
    for _ in range(attempts):
        port, metrics_port = free_port(host), free_port(host)
        cmd = [sys.executable, *launcher, "--host", host, "--port", str(port),
               "--policy", policy, "--prometheus-host", host, "--prometheus-port", str(metrics_port),
               "--log-level", "warn", *(extra_args or [])]
        process = start_process("sglang-router", cmd, Path(log_dir) / f"sglang-router-port{port}.log", env=env)
        router = Router(url=f"http://{host}:{port}", process=process, key=key)
        deadline = time.monotonic() + timeout
        while process.alive() and time.monotonic() < deadline:
            try:
                if httpx.get(f"{router.url}/health", timeout=2).status_code == 200:
                    return router
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        last_error = router._tail()
        process.stop()
        if "Address already in use" not in last_error:
            break
    raise RouterError(f"sglang-router did not start{last_error}")
