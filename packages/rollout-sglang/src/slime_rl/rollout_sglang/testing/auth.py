"""TEST DOUBLE (CPU tests only): SGLang 0.5.17's API-key rules, for the stand-in server (server.py).

`auth_decision` is a copy of ``srt/utils/auth.py``'s ``decide_request_auth`` with the endpoint levels of
``srt/entrypoints/http_server.py`` (test_sglang_gpu.py checks both against the real module on the GPU machine).
"""

from __future__ import annotations

import secrets

from aiohttp import web

# SGLang 0.5.17's endpoints marked @auth_level(AuthLevel.ADMIN_OPTIONAL) (http_server.py); every other
# endpoint is NORMAL. With an admin key set, these take only the admin key.
ADMIN_OPTIONAL = {
    "/set_internal_state", "/flush_cache", "/add_external_corpus", "/remove_external_corpus",
    "/list_external_corpora", "/clear_hicache_storage_backend", "/hicache/storage-backend/clear",
    "/hicache/storage-backend", "/start_profile", "/stop_profile", "/freeze_gc",
    "/start_expert_distribution_record", "/stop_expert_distribution_record",
    "/dump_expert_distribution_record", "/update_weights_from_disk",
    "/init_weights_send_group_for_remote_instance", "/send_weights_to_remote_instance",
    "/get_remote_instance_transfer_engine_info", "/remote_instance_transfer_engine_info",
    "/init_weights_update_group", "/destroy_weights_update_group", "/update_weights_from_tensor",
    "/update_weights_from_distributed", "/update_weights_from_ipc", "/update_weight_version",
    "/get_weights_by_name", "/release_memory_occupation", "/resume_memory_occupation", "/weights_checker",
    "/slow_down", "/load_lora_adapter", "/unload_lora_adapter", "/configure_logging", "/abort_request",
    "/pause_generation", "/continue_generation",
}


def auth_decision(method: str, path: str, authorization: str | None, api_key: str | None,
                  admin_api_key: str | None) -> int | None:
    """None if allowed, else the HTTP status (SGLang's decide_request_auth: /health* and /metrics
    always open; admin endpoints take the admin key when one is set, else the api key; the others
    take the api key when one is set)."""
    if method == "OPTIONS" or path.startswith("/health") or path.startswith("/metrics"):
        return None
    if path.startswith("/standin/"):  # the test double's own inspection endpoint, not SGLang's
        return None

    def matches(expected: str) -> bool:
        parts = (authorization or "").split(" ", 1)
        return len(parts) == 2 and parts[0].lower() == "bearer" and secrets.compare_digest(parts[1], expected)

    if path in ADMIN_OPTIONAL or path.startswith("/dumper/"):
        expected = admin_api_key or api_key
    else:
        expected = api_key
    return None if expected is None or matches(expected) else 401


def auth_middleware(server):
    @web.middleware
    async def check(request: web.Request, handler):
        status = auth_decision(request.method, request.path, request.headers.get("Authorization"),
                               server.args.api_key, server.args.admin_api_key)
        if status is not None:
            server.record("refused", path=request.path, status=status)
            print(f"[standin-sglang] refused {request.method} {request.path}: HTTP {status}", flush=True)
            return web.json_response({"error": "Unauthorized" if status == 401 else "Forbidden"}, status=status)
        return await handler(request)

    return check
