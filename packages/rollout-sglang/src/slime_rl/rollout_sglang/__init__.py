"""slime-rl rollout-sglang: SGLang servers behind sglang-router as one `RolloutEngine`.

- `engine.SGLangEngine`: generate, abort, weight sync, memory, faults
- `launch`: where the servers start (the placement plan's GPUs), launching or attaching them with the router
- `server`: SGLang server subprocesses and the health wait
- `router`: sglang-router on loopback, worker registration
- `client`: the async ``/generate`` client
- `weight_sync`: CUDA-IPC tensors, NCCL broadcast, HF folder on disk (trainer-side functions too)
- `transport.BucketPusher`: one bucket into every server by the sync's transport (engine and trainer side)
- `trainer_sync`: the trainer ranks' `WeightSender`
"""

from slime_rl.rollout_sglang.client import GenerateClient, GenerateError
from slime_rl.rollout_sglang.engine import SGLangEngine
from slime_rl.rollout_sglang.router import Router, RouterError, launch_router
from slime_rl.rollout_sglang.server import ServerStartError, SGLangServer
from slime_rl.rollout_sglang.weight_sync import Target, WeightSyncError

__all__ = [
    "GenerateClient", "GenerateError", "Router", "RouterError", "SGLangEngine", "SGLangServer", "ServerStartError",
    "Target", "WeightSyncError", "launch_router",
]
