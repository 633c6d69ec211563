"""The weight path into SGLang servers, one module per role (docs/backends.md, "How weights reach the engines"):

- `server_api`: SGLang's control API (`Target`, `post`, pause / continue / flush, release / resume memory)
- `buckets`: a bucket as one flat byte tensor plus metadata (SGLang's ``flattened_bucket``)
- `ipc`, `nccl`, `disk`: the three transports (CUDA-IPC handles, a broadcast in a weight-update group, an HF folder)
- `verify`: checksums of the trainer's tensors against the engine's parameters after a sync
- `pusher.BucketPusher`: one bucket into every server by the sync's transport (both sides)
- `trainer_sender.SGLangWeightSender`: trainer rank 0 pushes the buckets itself
- `engine_sync.EngineWeightSync`: the engine side of a sync, and what a restarted server is restored to
- `restore_copy`, `background_write`: the trainer's host copy a restarted server is restored from, written off the
  sync's path
- `adapters`, `adapter_roster`: LoRA adapters as weights (docs/lora-sglang.md)
"""
