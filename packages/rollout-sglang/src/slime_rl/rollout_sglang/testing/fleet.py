"""TEST DOUBLE: many stand-in SGLang servers (server.py's `StandinServer`, its request handling unchanged)
in one asyncio process, one port each, for the scale simulation (benchmarks/scale_sim.py, docs/scale.md):
128 server processes would need ~13 GB and measure only their contention on a 2-core machine.

Run as ``python -m slime_rl.rollout_sglang.testing.fleet --engines N --model-path DIR [--host H]
[--token-delay S]``. It prints one JSON line, ``{"urls": [...], "control": URL, "pid": P}``, once every
server listens. The control port answers:

- ``GET /fleet/state``: each engine's url, whether it listens, its weight version, and the requests it
  answered by path since it (re)started; the process's CPU seconds and RSS;
- ``POST /fleet/kill {"engine": i, "revive_after": s}``: the engine stops listening and its connections
  drop, as a crashed server's do; after ``s`` seconds (none: never) a fresh server, with the model folder's
  weights, listens on the same port, as a supervisor's restart of the process would.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

from aiohttp import web

from slime_rl.rollout_sglang.testing.server import StandinServer, build_app, parse_args


@dataclass
class FleetEngine:
    """One stand-in server of the fleet and what it answered since it last started."""

    index: int
    port: int
    flags: list[str]
    server: StandinServer | None = None
    runner: web.AppRunner | None = None
    requests: Counter = field(default_factory=Counter)  # path -> requests answered
    started_at: float = 0.0
    deaths: int = 0

    @property
    def alive(self) -> bool:
        return self.runner is not None


class Fleet:
    def __init__(self, engines: int, host: str, server_flags: list[str]):
        self.host = host
        self.engines = [FleetEngine(i, 0, server_flags) for i in range(engines)]

    def _counting(self, engine: FleetEngine):
        @web.middleware
        async def count(request: web.Request, handler):
            engine.requests[request.path] += 1
            return await handler(request)

        return count

    async def start(self, engine: FleetEngine) -> None:
        args, extra = parse_args([*engine.flags, "--host", self.host, "--port", str(engine.port)])
        engine.server = StandinServer(args, extra)
        app = build_app(engine.server)
        app.middlewares.append(self._counting(engine))
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        await runner.setup()
        site = web.TCPSite(runner, self.host, engine.port, reuse_address=True)
        await site.start()
        if not engine.port:  # the first start picks the port; a revival takes the same one
            engine.port = runner.addresses[0][1]
        engine.runner, engine.requests, engine.started_at = runner, Counter(), time.time()

    async def kill(self, engine: FleetEngine, revive_after: float | None) -> None:
        if engine.runner is not None:
            runner, engine.runner = engine.runner, None
            engine.deaths += 1
            for flag in engine.server.running.values():  # its requests end with it
                flag.set()
            await runner.cleanup()
        if revive_after is not None:
            asyncio.get_running_loop().call_later(revive_after, lambda: asyncio.ensure_future(self.start(engine)))

    def state(self) -> dict:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return {
            "cpu_s": usage.ru_utime + usage.ru_stime, "rss_mb": _rss_mb(),
            "engines": [{"index": e.index, "url": f"http://{self.host}:{e.port}", "alive": e.alive,
                         "weight_version": e.server.weight_version if e.server else None, "deaths": e.deaths,
                         "started_at": e.started_at, "requests": dict(e.requests)} for e in self.engines],
        }

    def control_app(self) -> web.Application:
        async def state(request: web.Request) -> web.Response:
            return web.json_response(self.state())

        async def kill(request: web.Request) -> web.Response:
            body = await request.json()
            await self.kill(self.engines[int(body["engine"])], body.get("revive_after"))
            return web.json_response({"killed": int(body["engine"]), "at": time.time()})

        app = web.Application()
        app.router.add_get("/fleet/state", state)
        app.router.add_post("/fleet/kill", kill)
        return app


def _rss_mb() -> float:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


async def serve(args: argparse.Namespace, server_flags: list[str]) -> None:
    fleet = Fleet(args.engines, args.host, server_flags)
    for engine in fleet.engines:
        await fleet.start(engine)
    control = web.AppRunner(fleet.control_app(), access_log=None)
    await control.setup()
    site = web.TCPSite(control, args.host, 0)
    await site.start()
    port = control.addresses[0][1]
    print(json.dumps({"urls": [f"http://{args.host}:{e.port}" for e in fleet.engines],
                      "control": f"http://{args.host}:{port}", "pid": os.getpid()}), flush=True)
    await asyncio.Event().wait()  # until killed


@dataclass
class FleetProcess:
    """The fleet as its starter sees it: the servers' URLs and the control calls."""

    urls: list[str]
    control: str
    popen: object  # subprocess.Popen

    @property
    def pid(self) -> int:
        return self.popen.pid

    def state(self) -> dict:
        import httpx

        return httpx.get(f"{self.control}/fleet/state", timeout=30).json()

    def kill(self, engine: int, revive_after: float | None = None) -> float:
        """Engine ``engine`` dies now (the time it died is returned); a fresh one listens after ``revive_after`` s."""
        import httpx

        return httpx.post(f"{self.control}/fleet/kill", json={"engine": engine, "revive_after": revive_after},
                          timeout=30).json()["at"]

    def stop(self) -> None:
        self.popen.terminate()
        try:
            self.popen.wait(10)
        except Exception:
            self.popen.kill()


def start_fleet(engines: int, model_path: str, log_path: str, *, token_delay: float = 0.0,
                timeout: float = 300.0) -> FleetProcess:
    """Start the fleet process (its output to ``log_path``) and wait for its first line."""
    import subprocess

    log = open(log_path, "w+")
    cmd = [sys.executable, "-m", "slime_rl.rollout_sglang.testing.fleet", "--engines", str(engines),
           "--model-path", str(model_path), "--token-delay", str(token_delay)]
    popen = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = popen.stdout.readline()
        if line.startswith("{"):
            info = json.loads(line)
            return FleetProcess(info["urls"], info["control"], popen)
        if not line and popen.poll() is not None:
            break
    popen.kill()
    log.seek(0)
    raise RuntimeError(f"the stand-in fleet did not start: {log.read()[-2000:]}")


def main(argv: list[str]) -> None:
    import torch

    torch.set_num_threads(1)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", type=int, required=True)
    p.add_argument("--model-path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--token-delay", type=float, default=0.0, help="seconds per generated token (each server)")
    args = p.parse_args(argv)
    flags = ["--model-path", args.model_path, "--skip-tokenizer-init", "--standin-token-delay", str(args.token_delay)]
    asyncio.run(serve(args, flags))


if __name__ == "__main__":
    main(sys.argv[1:])
