"""The rollout worker builds what the config names: the engine, the data source, the sample buffer
(``data.buffer``) and the source of the eval sets (``eval.source``), each by name or module:attr."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from slime_rl.core.config import Config
from slime_rl.core.contracts import Buffer, DataSource, GenerateOutput, RolloutEngine, SamplingParams
from slime_rl.core.run.actors import RolloutWorker
from slime_rl.core.sample import Sample
from slime_rl.core.testing import train_tokenizer

torch.set_num_threads(1)


class IdleEngine(RolloutEngine):
    @classmethod
    def from_config(cls, cfg: Config) -> IdleEngine:
        return cls()

    async def generate(self, input_ids: list[int], params: SamplingParams, request_id: str | None = None
                       ) -> GenerateOutput:
        raise AssertionError("nothing generates here")

    async def abort(self, request_id: str | None = None) -> None: ...

    async def update_weights(self, named_tensors: Any, *, version: int, last: bool) -> None: ...

    @property
    def weight_version(self) -> int:
        return 0


class NamedSource(DataSource):
    """One group whose prompt names the set it came from: ``train``, or the eval set's name."""

    def __init__(self, name: str):
        self.name = name

    @classmethod
    def from_config(cls, cfg: Config, tokenizer: Any = None) -> NamedSource:
        return cls("train")

    @classmethod
    def for_eval(cls, cfg: Config, name: str, tokenizer: Any = None) -> NamedSource:
        return cls(f"{name}: {cfg.eval.prompt_data[name]}")

    def get_groups(self, num_groups: int) -> list[list[Sample]]:
        return [[Sample(index=0, group_index=0, prompt=self.name)]]

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class ListBuffer(Buffer):
    def __init__(self, directory: str):
        self.directory, self.groups = directory, []

    @classmethod
    def from_config(cls, cfg: Config, directory: str) -> ListBuffer:
        return cls(directory)

    def add(self, groups: list[list[Sample]]) -> None:
        self.groups += groups

    def take(self, num_groups: int, *, current_version: int | None = None, partial: bool = False
             ) -> list[list[Sample]]:
        taken, self.groups = self.groups[:num_groups], self.groups[num_groups:]
        return taken

    def __len__(self) -> int:
        return len(self.groups)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def test_the_buffer_and_the_eval_source_come_from_the_config(tmp_path):
    train_tokenizer(["one two three four"] * 10, vocab_size=280).save_pretrained(tmp_path / "tokenizer")
    cfg = Config()
    cfg.model.path = str(tmp_path / "tokenizer")
    cfg.rollout.engine = f"{__name__}:IdleEngine"
    cfg.data.source = cfg.eval.source = f"{__name__}:NamedSource"
    cfg.data.buffer = f"{__name__}:ListBuffer"
    cfg.eval.prompt_data = {"aime": "aime-2024"}
    manager = RolloutWorker(cfg.to_dict(), str(tmp_path / "state"))
    manager.raise_init_mistake()
    assert type(manager.buffer) is ListBuffer and Path(manager.buffer.directory) == tmp_path / "state"
    assert [s.prompt for g in manager.data_source.get_groups(1) for s in g] == ["train"]
    assert {name: [s.prompt for g in groups for s in g] for name, groups in manager.eval_sets.items()} == {
        "aime": ["aime: aime-2024"]}
