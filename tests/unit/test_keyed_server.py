"""The run-owned keyed loopback server (core/infra/keyed_server.py): loopback only, every route behind its key
(Bearer or api-key header), open paths open, keys compared per path."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from slime_rl.core.config.secrets import redact
from slime_rl.core.infra.keyed_server import KeyedLoopbackServer, derived_key, new_key


def test_refuses_anything_but_loopback():
    with pytest.raises(ValueError, match="not loopback"):
        KeyedLoopbackServer([], key_for=lambda r: None, host="10.0.0.5")
    with pytest.raises(ValueError, match="not loopback"):
        KeyedLoopbackServer([], key_for=lambda r: None, host="0.0.0.0")


def test_every_route_needs_its_key():
    from aiohttp import web

    run_key = new_key()
    keys = {"a": derived_key(run_key, "a"), "b": derived_key(run_key, "b")}

    async def hello(request):
        return web.json_response({"part": request.match_info["part"]})

    async def health(request):
        return web.json_response({"ok": True})

    async def main():
        server = KeyedLoopbackServer([("GET", "/parts/{part}", hello), ("GET", "/health", health)],
                                     key_for=lambda r: keys.get(r.match_info.get("part", "")),
                                     open_paths=frozenset({"/health"}), name="test server")
        url = await server.start()
        async with httpx.AsyncClient() as http:
            out = {
                "bearer": await http.get(f"{url}/parts/a", headers={"Authorization": f"Bearer {keys['a']}"}),
                "api-key": await http.get(f"{url}/parts/b", headers={"api-key": keys["b"]}),
                "other part's key": await http.get(f"{url}/parts/b", headers={"Authorization": f"Bearer {keys['a']}"}),
                "run key": await http.get(f"{url}/parts/a", headers={"Authorization": f"Bearer {run_key}"}),
                "none": await http.get(f"{url}/parts/a"),
                "unknown part": await http.get(f"{url}/parts/c", headers={"Authorization": f"Bearer {keys['a']}"}),
                "health": await http.get(f"{url}/health"),
            }
        await server.stop()
        return url, out

    url, out = asyncio.run(main())
    assert url.startswith("http://127.0.0.1:")
    assert {k: r.status_code for k, r in out.items()} == {
        "bearer": 200, "api-key": 200, "other part's key": 401, "run key": 401, "none": 401, "unknown part": 401,
        "health": 200}
    assert out["none"].json()["error"]["code"] == "invalid_api_key"
    assert keys["a"] not in redact(f"the key was {keys['a']}")  # every key is a known secret
