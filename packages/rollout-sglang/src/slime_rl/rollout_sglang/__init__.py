"""slime-rl rollout-sglang: SGLang servers behind sglang-router as one `RolloutEngine`.

- `engine.SGLangEngine`: generate, abort, memory; it holds `weights.engine_sync.EngineWeightSync` (its weight
  syncs) and `recovery.EngineRecovery` (dead servers restarted), over `control.ServerControl` and `hold.GenerationHold`
- `settings`: ``rollout.sglang``, the engine's own config keys (light: the config loader imports it)
- `launch`: where the servers start (the placement plan's GPUs), launching or attaching them with the router
- `server`: SGLang server subprocesses and the health wait
- `model_fixes`: what SGLang's own model classes get wrong for weight syncs, fixed by the classes of
  `sglang_models` (SGLang's external model package, imported only by SGLang's processes)
- `router`: sglang-router on loopback, worker registration
- `client`: the async ``/generate`` client
- `weights`: the weight path into the servers (docs/backends.md, "How weights reach the engines"): SGLang's
  control API (`server_api`), one module per transport (`ipc`, `nccl`, `disk`), `verify`, the dispatch
  (`pusher.BucketPusher`), the trainer ranks' sender (`trainer_sender`), `restore_copy`, `adapters`
"""


import importlib
from typing import Any

# Imported when first used, so that the config loader's import of `settings` (rollout.sglang's model) stays
# light: the engine's modules import torch.
_HOMES = {
    "GenerateClient": "client", "GenerateError": "client", "SGLangEngine": "engine", "Router": "router",
    "RouterError": "router", "launch_router": "router", "ServerStartError": "server", "SGLangServer": "server",
    "Target": "weights.server_api", "WeightSyncError": "weights.server_api",
}
__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
