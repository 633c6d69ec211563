"""slime-rl rollout-sglang: SGLang servers behind sglang-router as one `RolloutEngine`.

- `engine.SGLangEngine`: generate, abort, memory; it holds `weights.engine_sync.EngineWeightSync` (its weight
  syncs) and `recovery.EngineRecovery` (dead servers restarted), over `control.ServerControl` and `hold.GenerationHold`
- `launch`: where the servers start (the placement plan's GPUs), launching or attaching them with the router
- `server`: SGLang server subprocesses and the health wait
- `router`: sglang-router on loopback, worker registration
- `client`: the async ``/generate`` client
- `weights`: the weight path into the servers (docs/backends.md, "How weights reach the engines"): SGLang's
  control API (`server_api`), one module per transport (`ipc`, `nccl`, `disk`), `verify`, the dispatch
  (`pusher.BucketPusher`), the trainer ranks' sender (`trainer_sender`), `restore_copy`, `adapters`
"""

from slime_rl.rollout_sglang.client import GenerateClient, GenerateError
from slime_rl.rollout_sglang.engine import SGLangEngine
from slime_rl.rollout_sglang.router import Router, RouterError, launch_router
from slime_rl.rollout_sglang.server import ServerStartError, SGLangServer
from slime_rl.rollout_sglang.weights.server_api import Target, WeightSyncError

__all__ = [
    "GenerateClient", "GenerateError", "Router", "RouterError", "SGLangEngine", "SGLangServer", "ServerStartError",
    "Target", "WeightSyncError", "launch_router",
]
