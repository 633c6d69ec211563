"""A resume trusts nothing in a checkpoint folder: damaged bytes in any of its files stop it with
one line naming the file, and a crafted pickle (the torch distributed checkpoint's `.metadata`, or
a byte item such as the trainer's RNG state) is refused without running, even when the crafter
recomputed every checksum. Real Megatron checkpoints of the tiny model, `slime-cli train --resume`."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from slime_rl.core.infra.net import free_port
from slime_rl.core.run import checkpoint
from slime_rl.core.run.checkpoint import CheckpointError

# One trainer step of the tiny model, saved as step 1 of <save_dir> and committed as the loop does.
BUILD = """
import os, sys
import torch
torch.set_num_threads(1)
from slime_rl.core.run import checkpoint
from slime_rl.core.config import load_config
from slime_rl.core.batch import RolloutBatch
from slime_rl.core.sample import Sample
from slime_rl.trainer_megatron.trainer import MegatronTrainer
model, save_dir, port = sys.argv[1:4]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
trainer = MegatronTrainer.from_config(load_config(None, [f"model.path={model}", "cluster.device=cpu"], check=False))
g = torch.Generator().manual_seed(0)
samples = [Sample(index=i, tokens=torch.randint(0, 200, (9,), generator=g).tolist(), response_length=4,
                  loss_mask=[1] * 4, rollout_log_probs=[-1.0] * 4, reward=0.0) for i in range(4)]
batch = RolloutBatch.from_samples(samples)
batch.advantages = torch.tensor([(-1.0) ** i for i in range(4) for _ in range(4)])
trainer.train_step(batch)
folder = checkpoint.prepare(save_dir, 1)
trainer.save(str(folder / "actor"))
checkpoint.commit(save_dir, 1, {"rollout_state": {"data_source": {"epoch": 0, "position": 2}}})
"""

# The trainer's own loader, without the driver's check in front of it.
LOAD = """
import os, sys
import torch
from slime_rl.core.config import load_config
from slime_rl.trainer_megatron.trainer import MegatronTrainer
model, folder, port = sys.argv[1:4]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
trainer = MegatronTrainer.from_config(load_config(None, [f"model.path={model}", "cluster.device=cpu"], check=False))
trainer.load(folder)
"""


def python(script: str, *args) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-c", script, *map(str, args), str(free_port())], env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.fixture(scope="module")
def pristine(tiny_model_dir, tmp_path_factory) -> Path:
    save_dir = tmp_path_factory.mktemp("pristine") / "ckpt"
    built = python(BUILD, tiny_model_dir, save_dir)
    assert built.returncode == 0, built.stderr[-3000:]
    return save_dir


@pytest.fixture
def save_dir(pristine, tmp_path) -> Path:
    """A fresh copy of the checkpoint for a test to damage."""
    return Path(shutil.copytree(pristine, tmp_path / "ckpt"))


def resume_line(tiny_model_dir, save_dir: Path, tmp_path: Path, *, ray_started: bool = False) -> str:
    """``slime-cli train CONFIG --resume``: asserts exit 2 with one line on stderr (the last one, after the
    Ray actors' logs, when the refusal came from the trainer's loader); returns that line."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"input": "1 + 1 = ", "label": "2"}) + "\n")
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({
        "model": {"path": str(tiny_model_dir)}, "data": {"prompt_data": str(prompts)},
        "cluster": {"device": "cpu"}, "logging": {"dir": str(tmp_path / "run")},
        "checkpoint": {"save_dir": str(save_dir)},
    }))
    cli = Path(sys.executable).parent / "slime-cli"
    done = subprocess.run([str(cli), "train", str(config), "--resume"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-3000:]
    lines = done.stderr.splitlines()
    assert (ray_started or len(lines) == 1) and lines[-1].startswith("error: "), done.stderr[-3000:]
    assert "weights_only" not in lines[-1] and "Traceback" not in done.stderr
    return lines[-1].removeprefix("error: ")


def recommit(save_dir: Path) -> None:
    """What a crafter does after editing files: new checksums for everything, meta.json's own too."""
    _, meta = checkpoint.latest(save_dir)
    checkpoint.commit(save_dir, meta["step"], {k: v for k, v in meta.items() if k not in ("files", "checksum")})


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


def storage(save_dir: Path):
    """The torch distributed checkpoint index of the actor (our own fresh file: plain pickle is fine here)."""
    return pickle.loads((save_dir / "step_000001" / "actor" / ".metadata").read_bytes())


def item_offset(save_dir: Path, prefix: str) -> int:
    """An offset inside the shard bytes of an item whose key starts with ``prefix``."""
    md = storage(save_dir)
    info = next(i for k, i in md.storage_data.items() if k.fqn.startswith(prefix) and i.length > 256)
    return info.offset + info.length // 2


def test_an_intact_checkpoint_verifies(save_dir):
    folder, meta = checkpoint.resume_point(save_dir)
    assert {"actor/.metadata", "actor/__0_0.distcp", "actor/metadata.json", "actor/slime_rl_trainer.json"} <= set(
        meta["files"])  # and common.pt on megatron-core 0.16 (0.19 keeps the common state in the shard)


@pytest.mark.parametrize("target", ["model shard", "optimizer shard", "rng state", "common state", ".metadata",
                                    "metadata.json", "slime_rl_trainer.json", "meta.json rollout state"])
def test_a_flipped_byte_in_each_kind_of_file_stops_the_resume_naming_it(save_dir, target):
    actor = save_dir / "step_000001" / "actor"
    if target == "model shard":  # the bf16/fp32 model weights
        path, offset = actor / "__0_0.distcp", item_offset(save_dir, "decoder.")
    elif target == "optimizer shard":  # the fp32 master weights / Adam moments
        path, offset = actor / "__0_0.distcp", item_offset(save_dir, "optimizer.")
    elif target == "rng state":  # a pickled byte item
        path, offset = actor / "__0_0.distcp", item_offset(save_dir, "rng_state")
    elif target == "common state":  # common.pt on megatron-core 0.16, a byte item of the shard on 0.19
        path = actor / "common.pt"
        path, offset = (path, 40) if path.exists() else (actor / "__0_0.distcp", item_offset(save_dir, "common_state"))
    elif target == "meta.json rollout state":
        path = save_dir / "step_000001" / "meta.json"
        offset = path.read_bytes().index(b'"position": 2') + len('"position": ')
    else:
        path, offset = actor / target, 40
    flip(path, offset)
    with pytest.raises(CheckpointError) as err:
        checkpoint.resume_point(save_dir)
    assert str(err.value).startswith(f"{path}: is damaged"), str(err.value)


def test_slime_cli_resume_stops_at_a_damaged_shard_with_one_line(tiny_model_dir, save_dir, tmp_path):
    shard = save_dir / "step_000001" / "actor" / "__0_0.distcp"
    flip(shard, item_offset(save_dir, "optimizer."))
    line = resume_line(tiny_model_dir, save_dir, tmp_path)
    assert line.startswith(f"{shard}: is damaged: its CRC-32 differs from the one written at step 1")
    assert "to start afresh, run without --resume and with another checkpoint.save_dir" in line


class Payload:
    """Writes a marker file when unpickled (what an attacker's code would do instead)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def craft_metadata(save_dir: Path, marker: Path) -> Path:
    md = storage(save_dir)
    md.planner_data = Payload(marker)
    path = save_dir / "step_000001" / "actor" / ".metadata"
    path.write_bytes(pickle.dumps(md))
    recommit(save_dir)
    return path


def replace_item(save_dir: Path, md, index, payload) -> Path:
    """Item ``index`` of step 1's actor checkpoint (``md``: its storage metadata) pointed at ``payload``,
    torch.save'd onto the end of the item's shard; the metadata rewritten and the step recommitted. The shard."""
    actor = save_dir / "step_000001" / "actor"
    info = md.storage_data[index]
    blob = io.BytesIO()
    torch.save(payload, blob)
    shard = actor / info.relative_path
    end = shard.stat().st_size
    with shard.open("ab") as f:
        f.write(blob.getvalue())
    md.storage_data[index] = dataclasses.replace(info, offset=end, length=len(blob.getvalue()))
    (actor / ".metadata").write_bytes(pickle.dumps(md))
    recommit(save_dir)
    return shard


def craft_rng_item(save_dir: Path, marker: Path) -> tuple[Path, str]:
    """The trainer's RNG state (a ShardedObject: a torch.save blob in the shard) replaced."""
    md = storage(save_dir)
    index = next(k for k in md.storage_data if k.fqn.startswith("rng_state"))
    return replace_item(save_dir, md, index, [{"cpu": Payload(marker)}]), index.fqn


def craft_tensor_item(save_dir: Path, marker: Path) -> Path:
    """A model weight's bytes replaced. torch's reader loads tensor items weights-only, so this never
    ran; what matters is that the refusal names the checkpoint without torch's advice to turn it off."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = storage(save_dir)
    index = next(k for k in md.storage_data
                 if k.fqn.startswith("decoder.") and isinstance(md.state_dict_metadata[k.fqn], TensorStorageMetadata))
    replace_item(save_dir, md, index, Payload(marker))
    return save_dir / "step_000001" / "actor"


def test_the_crafted_files_are_live(save_dir, tmp_path):
    """The control: loaded as torch and Megatron would without the check, each payload runs."""
    marker = tmp_path / "ran"
    metadata = craft_metadata(save_dir, marker)
    pickle.loads(metadata.read_bytes())
    assert marker.exists()
    marker.unlink()

    other = Path(shutil.copytree(save_dir, tmp_path / "other"))
    shard, fqn = craft_rng_item(other, marker)
    md = storage(other)
    info = next(i for k, i in md.storage_data.items() if k.fqn == fqn)
    blob = shard.read_bytes()[info.offset: info.offset + info.length]
    torch.load(io.BytesIO(blob), weights_only=False)  # what torch's load planner does with byte items
    assert marker.exists()


@pytest.mark.slow
@pytest.mark.parametrize("crafted", ["metadata", "rng item", "tensor item"])
def test_a_crafted_pickle_is_refused_by_resume_and_by_the_loader_without_running(tiny_model_dir, save_dir, tmp_path,
                                                                                 crafted):
    marker = tmp_path / "ran"
    if crafted == "metadata":
        path = craft_metadata(save_dir, marker)
        where = f"{path}: refused: unpickling it would call posix.system"
    elif crafted == "rng item":
        shard, fqn = craft_rng_item(save_dir, marker)
        where = f"{shard} (item {fqn}): refused: unpickling it would call posix.system"
    else:  # not read before the trainer's loader: refused there, inside Ray, and still one line
        actor = craft_tensor_item(save_dir, marker)
        where = f"{actor}: refused: unpickling it would call posix.system"
    # the checksums were recomputed: only the pickle checks stand in the way
    line = resume_line(tiny_model_dir, save_dir, tmp_path, ray_started=crafted == "tensor item")
    assert line.startswith(where) and "resume from a checkpoint you trust" in line, line
    assert not marker.exists()
    # the trainer's loader refuses it on its own too (e.g. called by a user's script)
    loaded = python(LOAD, tiny_model_dir, save_dir / "step_000001" / "actor")
    assert loaded.returncode != 0 and f"CheckpointError: {where}" in loaded.stderr, loaded.stderr[-3000:]
    assert "weights_only" not in loaded.stderr
    assert not marker.exists()
