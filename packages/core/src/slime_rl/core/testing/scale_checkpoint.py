"""The metadata of a torch distributed checkpoint of hundreds of ranks, made by torch's own checkpoint code
(`torch.distributed.checkpoint`: the coordinator's global plan, ``FileSystemWriter.finish``'s ``.metadata``,
the load planning against it) from the save plans the ranks of a MoE under TP x PP x EP x DP would send,
for the scale simulation (docs/scale.md). No rank writes tensor data: each rank's shard file is empty,
which is all `run.checkpoint_contents` and `infra.safe_pickle` (what a commit and a resume check) read.

What each rank's plan holds follows megatron-core's sharded state dict: every model tensor's shard
(attention split over TP, experts over EP, layers over PP; written by data-parallel rank 0 only, as
megatron's replica ids choose), and the distributed optimizer's fp32 main weight and two Adam moments,
each data-parallel rank holding a contiguous 1/DP range of its model-parallel shard (one item per
parameter the range touches).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter, _StorageInfo
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.checkpoint.storage import WriteResult

OPTIMIZER_STATES = ("param", "exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class MoEShape:
    """A Qwen3-MoE-like model's tensor shapes (default: Qwen3-235B-A22B's, with ``layers`` of its 94)."""

    layers: int = 94
    hidden: int = 4096
    heads: int = 64
    kv_heads: int = 4
    head_dim: int = 128
    experts: int = 128
    expert_ffn: int = 1536
    vocab: int = 151936


@dataclass(frozen=True)
class Shard:
    fqn: str
    shape: tuple[int, ...]  # the whole tensor's
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    block: int = 0  # which of the equal parts of the whole tensor it is (flattened, as the optimizer sees it)


@dataclass(frozen=True)
class RankGrid:
    world: int
    tp: int
    pp: int
    ep: int

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp)

    @property
    def replicas(self) -> int:
        """Ranks holding the same model shards (same tp, pp and ep rank): the optimizer's sharding group."""
        return self.dp // self.ep

    def coords(self, rank: int) -> tuple[int, int, int, int]:
        """(tp, replica, pp, ep) rank; the expert-parallel rank is taken within the data-parallel ranks, and
        the replica is which of the ranks with the same model shards it is."""
        tp, dp = rank % self.tp, (rank // self.tp) % self.dp
        return tp, dp // self.ep, rank // (self.tp * self.dp), dp % self.ep


def _split(fqn: str, shape: tuple[int, ...], dim: int, parts: int, index: int) -> Shard:
    size = shape[dim] // parts
    offsets = tuple(index * size if d == dim else 0 for d in range(len(shape)))
    sizes = tuple(size if d == dim else n for d, n in enumerate(shape))
    return Shard(fqn, shape, offsets, sizes, index)


def model_shards(shape: MoEShape, grid: RankGrid, rank: int) -> list[Shard]:
    """The model tensors' shards rank ``rank`` holds, in megatron-core's names."""
    tp, _, pp, ep = grid.coords(rank)
    s = shape
    qkv = ((s.heads + 2 * s.kv_heads) * s.head_dim, s.hidden)
    per_stage = -(-s.layers // grid.pp)
    shards: list[Shard] = []
    if pp == 0:
        shards.append(_split("embedding.word_embeddings.weight", (s.vocab, s.hidden), 0, grid.tp, tp))
    for layer in range(pp * per_stage, min((pp + 1) * per_stage, s.layers)):
        at = f"decoder.layers.{layer}"
        shards += [
            _split(f"{at}.self_attention.linear_qkv.weight", qkv, 0, grid.tp, tp),
            _split(f"{at}.self_attention.linear_proj.weight", (s.hidden, s.heads * s.head_dim), 1, grid.tp, tp),
            Shard(f"{at}.self_attention.linear_qkv.layer_norm_weight", (s.hidden,), (0,), (s.hidden,)),
            Shard(f"{at}.self_attention.q_layernorm.weight", (s.head_dim,), (0,), (s.head_dim,)),
            Shard(f"{at}.self_attention.k_layernorm.weight", (s.head_dim,), (0,), (s.head_dim,)),
            Shard(f"{at}.pre_mlp_layernorm.weight", (s.hidden,), (0,), (s.hidden,)),
            Shard(f"{at}.mlp.router.weight", (s.experts, s.hidden), (0, 0), (s.experts, s.hidden)),
        ]
        local = s.experts // grid.ep
        for expert in range(ep * local, (ep + 1) * local):
            for name, dims in (("linear_fc1", (2 * s.expert_ffn, s.hidden)), ("linear_fc2", (s.hidden, s.expert_ffn))):
                fqn = f"{at}.mlp.experts.local_experts.{expert}.{name}.weight"
                shards.append(Shard(fqn, dims, (0, 0), dims))
    if pp == grid.pp - 1:
        shards.append(Shard("decoder.final_layernorm.weight", (s.hidden,), (0,), (s.hidden,)))
        shards.append(_split("output_layer.weight", (s.vocab, s.hidden), 0, grid.tp, tp))
    return shards


def _numel(dims: tuple[int, ...]) -> int:
    n = 1
    for d in dims:
        n *= d
    return n


def optimizer_shards(model: list[Shard], grid: RankGrid, replica: int) -> list[Shard]:
    """The distributed optimizer's states of replica ``replica``: its 1/replicas range of the flat buffer
    of ``model`` (one model-parallel rank's shards), each piece a range of the parameter's flat tensor."""
    sizes = [_numel(s.sizes) for s in model]
    total = sum(sizes)
    start, end = replica * total // grid.replicas, (replica + 1) * total // grid.replicas
    shards, at = [], 0
    for shard, n in zip(model, sizes, strict=True):
        lo, hi = max(start, at), min(end, at + n)
        if lo < hi:  # the shard's own place in the whole tensor, flattened: its first element's offset
            base = shard.block * n
            for state in OPTIMIZER_STATES:
                fqn = f"optimizer.state.{state}.{shard.fqn}"
                shards.append(Shard(fqn, (_numel(shard.shape),), (base + lo - at,), (hi - lo,)))
        at += n
    return shards


def rank_shards(shape: MoEShape, grid: RankGrid, rank: int) -> list[Shard]:
    """What rank ``rank`` saves: its model shards when it is their first replica, and its optimizer range."""
    model = model_shards(shape, grid, rank)
    replica = grid.coords(rank)[1]
    return (model if replica == 0 else []) + optimizer_shards(model, grid, replica)


def save_plan(shards: list[Shard]) -> SavePlan:
    items = []
    for s in shards:
        dtype = torch.float32 if s.fqn.startswith("optimizer.") else torch.bfloat16
        items.append(WriteItem(
            index=MetadataIndex(s.fqn, torch.Size(s.offsets)), type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size(s.offsets), torch.Size(s.sizes)),
                                        properties=TensorProperties(dtype=dtype), size=torch.Size(s.shape))))
    return SavePlan(items, planner_data={})  # no flattening mappings: the names are flat already


@dataclass
class MetadataCost:
    ranks: int
    items: int  # write items over all ranks
    local_plans_cpu_s: float  # every rank's plan (each rank makes its own; summed here)
    coordinator_cpu_s: float  # rank 0: the global plan and the .metadata file
    metadata_bytes: int
    load_cpu_s: float  # reading .metadata and every rank's read plan against it (summed)
    load_coordinator_cpu_s: float  # the load's global plan (rank 0)


def write_checkpoint_metadata(folder: Path, shape: MoEShape, grid: RankGrid) -> MetadataCost:
    """``.metadata`` and an empty shard file per rank in ``folder``, by torch's writer; then the load
    planning of every rank against it. Returns the CPU each part took."""
    folder.mkdir(parents=True, exist_ok=True)
    started = time.process_time()
    shards = [rank_shards(shape, grid, rank) for rank in range(grid.world)]
    plans = [save_plan(s) for s in shards]
    local_s = time.process_time() - started

    started = time.process_time()
    planner = DefaultSavePlanner(flatten_state_dict=False)  # as MCoreSavePlanner
    writer = FileSystemWriter(str(folder), single_file_per_rank=True, thread_count=1)
    writer.set_up_storage_writer(True)
    global_plans, metadata = planner.create_global_plan(plans)
    global_plans = writer.prepare_global_plan(global_plans)
    results = []
    for rank, plan in enumerate(global_plans):
        name, offset, written = f"__{rank}_0.distcp", 0, []
        for item in plan.items:
            length = _numel(tuple(item.tensor_data.chunk.sizes)) * (4 if item.index.fqn.startswith("optimizer.") else 2)
            written.append(WriteResult(index=item.index, size_in_bytes=length,
                                       storage_data=_StorageInfo(name, offset, length)))
            offset += length
        results.append(written)
    writer.finish(metadata, results)
    coordinator_s = time.process_time() - started
    for rank in range(grid.world):
        (folder / f"__{rank}_0.distcp").touch()

    started = time.process_time()
    loaded = FileSystemReader(str(folder)).read_metadata()
    load_plans = []
    for rank_items in shards:
        items = []
        for s in rank_items:
            chunk = ChunkStorageMetadata(torch.Size(s.offsets), torch.Size(s.sizes))
            items += create_read_items_for_chunk_list(s.fqn, loaded.state_dict_metadata[s.fqn], [chunk])
        load_plans.append(LoadPlan(items))
    load_s = time.process_time() - started
    started = time.process_time()
    DefaultLoadPlanner().create_global_plan(load_plans)
    load_coordinator_s = time.process_time() - started
    return MetadataCost(grid.world, sum(len(p.items) for p in plans), local_s, coordinator_s,
                        (folder / ".metadata").stat().st_size, load_s, load_coordinator_s)
