"""`PromptDataSource`: JSONL or Parquet prompts in, groups of PENDING samples out.

Each prompt becomes a group of ``n_samples_per_prompt`` samples. An epoch is one
pass over the file in an order shuffled with ``(seed, epoch)``, so the order is a
pure function of the state: ``state_dict()`` (epoch, position in that order,
index counters, seed) is all a resumed run needs to continue with exactly the
next prompt.
"""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from slime_rl.buffer.records import SKIP_HINT, DataError, JsonlRecords, ParquetRecords, open_records
from slime_rl.core.contracts import DataSource
from slime_rl.core.sample import Sample
from slime_rl.core.vision.images import DEFAULT_MAX_IMAGE_PIXELS, check_images, image_refs

if TYPE_CHECKING:
    from slime_rl.core.config import Config

logger = logging.getLogger(__name__)

Prompt = str | list[dict[str, Any]]


def parse_prompt_record(
    record: dict[str, Any],
    where: str,
    *,
    input_key: str,
    label_key: str | None,
    metadata_key: str | None,
    tools_key: str | None,
) -> tuple[Prompt, Any, dict[str, Any]] | DataError:
    """(prompt, label, metadata) from one record, or the reason it is unusable."""
    if input_key not in record:
        return DataError(where, f"no input key {input_key!r} (keys: {', '.join(map(str, record)) or 'none'}); "
                                f"set data.input_key to the prompt field")
    prompt = record[input_key]
    if (problem := _prompt_problem(prompt)) is not None:
        return DataError(where, f"input {input_key!r} must be a string or a list of chat messages "
                                f"({{role, content}}), {problem}; {SKIP_HINT}")
    if isinstance(prompt, str) and not prompt.strip():
        return DataError(where, f"input {input_key!r} is {'empty' if not prompt else 'only whitespace'}; {SKIP_HINT}")
    label = None
    if label_key is not None:
        if label_key not in record:
            return DataError(where, f"no label key {label_key!r} (keys: {', '.join(map(str, record))}); set "
                                    f"data.label_key to the answer field, or to null for prompts without labels")
        label = record[label_key]
        if label is None or isinstance(label, bool) or not isinstance(label, str | int | float | list | dict):
            return DataError(where, f"label {label_key!r} is {_json_type(label)}; a label must be a string, number, list or "
                                    f"object; {SKIP_HINT}")
    metadata: dict[str, Any] = {}
    if metadata_key is not None and record.get(metadata_key) is not None:
        metadata = record[metadata_key]
        if not isinstance(metadata, dict):
            return DataError(where, f"metadata {metadata_key!r} must be an object, got "
                                    f"{_json_type(metadata)}; {SKIP_HINT}")
        metadata = dict(metadata)
    if tools_key is not None and record.get(tools_key) is not None:
        tools = record[tools_key]
        if not isinstance(tools, list):
            return DataError(where, f"tools {tools_key!r} must be a list of tool schemas, got "
                                    f"{_json_type(tools)}; {SKIP_HINT}")
        metadata["tools"] = tools
    return prompt, label, metadata


def _json_type(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _prompt_problem(prompt: Any) -> str | None:
    if isinstance(prompt, str):
        return None
    if not isinstance(prompt, list):
        return f"got {_json_type(prompt)}"
    if not prompt:
        return "got an empty list"
    for k, message in enumerate(prompt):
        # content null: an assistant turn that only calls tools
        if not (isinstance(message, dict) and isinstance(message.get("role"), str) and "content" in message
                and (message["content"] is None or isinstance(message["content"], str | list))):
            return (f"but message {k} is {json.dumps(message, default=str)[:80]} (role a string; content a string, "
                    "list or null)")
    return None


class PromptDataSource(DataSource):
    """Prompt groups from a JSONL or Parquet file (see the module docstring).

    ``num_epoch=None`` cycles over the data without end (the run stops after
    ``data.num_rollout`` steps). For an eval set, ``shuffle=False, num_epoch=1``
    reads every prompt once, in file order.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        tokenizer: Any = None,
        input_key: str = "input",
        label_key: str | None = "label",
        metadata_key: str | None = "metadata",
        tools_key: str | None = "tools",
        apply_chat_template: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        n_samples_per_prompt: int = 1,
        shuffle: bool = True,
        seed: int = 42,
        num_epoch: int | None = 1,
        skip_bad_lines: bool = False,
        max_prompt_len: int | None = None,
        format: str | None = None,
        image_key: str | None = None,
        max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
        processor_path: str | None = None,
    ):
        # The arguments, to rebuild in another process (__getstate__).
        self._init_args = {k: v for k, v in locals().items() if k != "self"}
        if n_samples_per_prompt < 1:
            raise DataError("data.n_samples_per_prompt", f"must be >= 1, got {n_samples_per_prompt}")
        if num_epoch is not None and num_epoch < 1:
            raise DataError("data.num_epoch", f"must be >= 1, got {num_epoch}")
        self.tokenizer = tokenizer
        self.input_key, self.label_key = input_key, label_key
        self.metadata_key, self.tools_key = metadata_key, tools_key
        self.apply_chat_template = apply_chat_template
        self.chat_template_kwargs = chat_template_kwargs or {}
        self.n_samples_per_prompt = n_samples_per_prompt
        self.shuffle, self.seed, self.num_epoch = shuffle, seed, num_epoch
        self.skip_bad_lines = skip_bad_lines
        self.max_prompt_len = max_prompt_len
        # Images (docs/vlm.md): the model's processor, loaded at the first image prompt tokenized.
        self.image_key, self.max_image_pixels = image_key, max_image_pixels
        self.processor_path, self._processor = processor_path, None
        if tokenizer is not None and apply_chat_template and getattr(tokenizer, "chat_template", None) is None:
            raise DataError("data.apply_chat_template", "the tokenizer has no chat template; set "
                                                        "model.tokenizer_path to one that has, or turn it off")
        if tokenizer is None and max_prompt_len is not None:
            logger.warning("rollout.max_prompt_len=%d is not enforced: the data source has no tokenizer",
                           max_prompt_len)
        columns = [k for k in (input_key, label_key, metadata_key, tools_key, image_key) if k is not None]
        self.records = open_records(path, format, columns)
        self.path = str(self.records.path)
        if self.records.num_nonblank == 0:
            raise DataError(self.path, "the file is empty; give a file with one prompt per line (or row)")
        if isinstance(self.records, ParquetRecords):
            for key, field in ((input_key, "data.input_key"), (label_key, "data.label_key")):
                if key is not None and key not in self.records.columns:
                    raise DataError(field, f"no column {key!r} in {self.path} (columns: "
                                           f"{', '.join(self.records.all_columns)}); set {field}")
        # Where we are. Everything a resumed run needs is in these and the seed.
        self.epoch = 0
        self.position = 0  # records of this epoch's order already consumed
        self.next_group_index = 0
        self.next_sample_index = 0
        self.num_skipped = 0  # bad lines skipped (skip_bad_lines)
        self.num_too_long = 0  # prompts over max_prompt_len, left out
        self._order: np.ndarray | None = None
        self._order_epoch = -1

    @classmethod
    def from_config(cls, cfg: Config, tokenizer: Any = None) -> PromptDataSource:
        return cls(tokenizer=tokenizer, **cls._train_args(cfg))

    @classmethod
    def for_eval(cls, cfg: Config, name: str, tokenizer: Any = None) -> PromptDataSource:
        """Eval set ``cfg.eval.prompt_data[name]``: every prompt once, in file order."""
        return cls(tokenizer=tokenizer, **cls._eval_args(cfg, name))

    @classmethod
    def check(cls, cfg: Config) -> None:
        """``data.prompt_data`` read through once, as `from_config`'s source will read it (`DataSource.check`)."""
        cls._check_file(cls._train_args(cfg))

    @classmethod
    def check_eval(cls, cfg: Config) -> None:
        """Every ``eval.prompt_data`` file read through once, as `for_eval`'s sources will read them."""
        for name in cfg.eval.prompt_data:
            cls._check_file(cls._eval_args(cfg, name))

    @classmethod
    def _check_file(cls, args: dict[str, Any]) -> None:
        source = cls(**{**args, "max_prompt_len": None})  # no tokenizer here: lengths are checked as the run reads
        try:
            source.check_records()
        finally:
            source.close()

    @staticmethod
    def _train_args(cfg: Config) -> dict[str, Any]:
        d = cfg.data
        if d.prompt_data is None:
            raise DataError("data.prompt_data", "set it to a JSONL or Parquet file of prompts")
        return dict(
            path=d.prompt_data, input_key=d.input_key, label_key=d.label_key,
            metadata_key=d.metadata_key, tools_key=d.tools_key, apply_chat_template=d.apply_chat_template,
            n_samples_per_prompt=d.n_samples_per_prompt, shuffle=d.shuffle, seed=d.seed,
            num_epoch=None if d.num_rollout is not None else d.num_epoch,  # num_rollout wins, as in slime
            skip_bad_lines=d.skip_bad_lines, max_prompt_len=cfg.rollout.max_prompt_len,
            format=d.source if d.source in ("jsonl", "parquet") and _suffix_unknown(d.prompt_data) else None,
            **_image_args(cfg),
        )

    @staticmethod
    def _eval_args(cfg: Config, name: str) -> dict[str, Any]:
        if name not in cfg.eval.prompt_data:
            raise DataError(f"eval.prompt_data.{name}", f"no eval set named {name!r} "
                                                        f"(have: {', '.join(cfg.eval.prompt_data) or 'none'})")
        d = cfg.data
        return dict(
            path=cfg.eval.prompt_data[name], input_key=d.input_key, label_key=d.label_key,
            metadata_key=d.metadata_key, tools_key=d.tools_key, apply_chat_template=d.apply_chat_template,
            n_samples_per_prompt=cfg.eval.n_samples_per_prompt, shuffle=False, num_epoch=1,
            skip_bad_lines=d.skip_bad_lines, max_prompt_len=cfg.rollout.max_prompt_len, **_image_args(cfg),
        )

    def check_records(self) -> int:
        """Parse every record in file order as `get_groups` does; return how many are usable. Raises
        the first bad one, or with ``skip_bad_lines`` a DataError when none is usable. Streams: memory
        stays flat however large the file (about 6 CPU-seconds per million short lines; json is half)."""
        usable = bad = 0
        first_bad: DataError | None = None
        keys = dict(input_key=self.input_key, label_key=self.label_key, metadata_key=self.metadata_key,
                    tools_key=self.tools_key)
        for i, record in self.records.scan():
            if record is None:  # blank line
                continue
            parsed = record if isinstance(record, DataError) else parse_prompt_record(
                record, self.records.where(i), **keys)
            if not isinstance(parsed, DataError) and self.image_key is not None:
                parsed = self._check_images(record, self.records.where(i)) or parsed
            if not isinstance(parsed, DataError):
                usable += 1
            elif not self.skip_bad_lines:
                raise parsed
            else:
                bad += 1
                first_bad = first_bad or parsed
        if usable == 0 and first_bad is not None:
            reason = first_bad.message.removesuffix(f"; {SKIP_HINT}")
            raise DataError(first_bad.where, f"no line of the file is usable ({bad} bad, skipped by "
                                             f"data.skip_bad_lines); the first: {reason}; fix the data")
        if usable == 0:
            raise DataError(self.path, "the file holds no prompt (only blank lines); give a file with one prompt "
                                       "per line (or row)")
        if bad:
            logger.warning("%s: %d bad line(s) will be skipped (data.skip_bad_lines); first: %s",
                           self.path, bad, first_bad)
        return usable

    def __len__(self) -> int:
        """Prompts in the file (non-blank lines or rows; bad ones included)."""
        return self.records.num_nonblank

    @property
    def exhausted(self) -> bool:
        """True once ``num_epoch`` passes are done (never with ``num_epoch=None``)."""
        return self.num_epoch is not None and self.epoch >= self.num_epoch

    def get_groups(self, num_groups: int) -> list[list[Sample]]:
        """The next ``num_groups`` groups; fewer (or none) once the data is exhausted.

        State only advances when the call succeeds: a bad line (without skipping)
        raises and leaves the source where it was.
        """
        n = len(self.records)
        epoch, position = self.epoch, self.position
        group_index, sample_index = self.next_group_index, self.next_sample_index
        skipped: list[DataError] = []
        too_long = 0
        consumed_without_group = 0
        out: list[list[Sample]] = []
        while len(out) < num_groups and (self.num_epoch is None or epoch < self.num_epoch):
            order = self._epoch_order(epoch)
            stop = min(n, position + num_groups - len(out))
            ids = [int(order[p]) if order is not None else p for p in range(position, stop)]
            for i, record in zip(ids, self.records.read(ids), strict=True):
                position += 1
                consumed_without_group += 1
                if record is None:  # blank line
                    continue
                parsed = record if isinstance(record, DataError) else parse_prompt_record(
                    record, self.records.where(i), input_key=self.input_key, label_key=self.label_key,
                    metadata_key=self.metadata_key, tools_key=self.tools_key)
                if isinstance(parsed, DataError):
                    if not self.skip_bad_lines:
                        raise parsed
                    skipped.append(parsed)
                    continue
                prompt, label, metadata = parsed
                try:
                    tokens, multimodal = self._tokenize_record(record, self.records.where(i), prompt, metadata)
                except DataError as err:
                    if not self.skip_bad_lines or err.where != self.records.where(i):  # not this line's fault
                        raise
                    skipped.append(err)
                    continue
                if self.max_prompt_len is not None and self.tokenizer is not None and len(tokens) > self.max_prompt_len:
                    too_long += 1
                    continue
                out.append(self._group(prompt, label, metadata, tokens, group_index, sample_index, multimodal))
                group_index += 1
                sample_index += self.n_samples_per_prompt
                consumed_without_group = 0
            if position == n:
                epoch, position = epoch + 1, 0
            # 2n consecutive records cover one whole epoch; a source that ran out without ever giving a group
            if consumed_without_group >= 2 * n or (group_index == 0 and not out and self.num_epoch is not None
                                                   and epoch >= self.num_epoch):
                raise DataError(self.path, f"no usable prompt in a whole pass over the file ({len(skipped)} bad "
                                           f"lines skipped, {too_long} over rollout.max_prompt_len)")
        self.epoch, self.position = epoch, position
        self.next_group_index, self.next_sample_index = group_index, sample_index
        self.num_skipped += len(skipped)
        self.num_too_long += too_long
        if skipped:
            logger.warning("%s: skipped %d bad line(s), %d so far (data.skip_bad_lines); first: %s",
                           self.path, len(skipped), self.num_skipped, skipped[0])
        if too_long:
            logger.warning("%s: left out %d prompt(s) longer than rollout.max_prompt_len=%d, %d so far",
                           self.path, too_long, self.max_prompt_len, self.num_too_long)
        return out

    def _epoch_order(self, epoch: int) -> np.ndarray | None:
        """Record ids in the order of ``epoch`` (None: file order)."""
        if not self.shuffle:
            return None
        if self._order_epoch != epoch:
            self._order = np.random.default_rng([self.seed, epoch]).permutation(len(self.records))
            self._order_epoch = epoch
        return self._order

    def _image_refs(self, record: dict[str, Any], where: str) -> list[str]:
        """The record's image references (core/vision/images.py); [] without images."""
        value = record.get(self.image_key) if self.image_key is not None else None
        if value is None:
            return []
        return image_refs(value, where, base_dir=self.records.path.parent, key=self.image_key)

    def _check_images(self, record: dict[str, Any], where: str) -> DataError | None:
        """The up-front check of a record's images: each there, readable, not too large."""
        try:
            check_images(self._image_refs(record, where), where, max_pixels=self.max_image_pixels)
        except DataError as err:
            if not self.skip_bad_lines:
                raise
            return err
        return None

    def _tokenize_record(self, record: dict[str, Any], where: str, prompt: Prompt, metadata: dict[str, Any]
                         ) -> tuple[list[int], tuple[dict[str, Any], Any] | None]:
        """The prompt's ids, and for a record with images its (multimodal_inputs, multimodal_train_inputs)."""
        refs = self._image_refs(record, where)
        if not refs:
            return self._tokenize(prompt, metadata.get("tools")), None
        if self.tokenizer is None:
            return [], ({"images": refs}, None)
        from slime_rl.core.vision.prompt import encode_prompt, prompt_text

        processor = self.processor()
        text = prompt_text(prompt, len(refs), processor, where, apply_chat_template=self.apply_chat_template,
                           tools=metadata.get("tools"), chat_template_kwargs=self.chat_template_kwargs)
        encoded = encode_prompt(text, refs, processor, where, max_pixels=self.max_image_pixels)
        return encoded.token_ids, ({"images": refs}, encoded.train_inputs)

    def processor(self) -> Any:
        """The model's processor (core/vision/processor.py), loaded once."""
        if self._processor is None:
            if self.processor_path is None:
                raise DataError("data.image_key", "image prompts need the model's processor; give the data source "
                                                  "processor_path (from_config sets the model's path)")
            from slime_rl.core.vision.processor import load_processor

            self._processor = load_processor(self.processor_path)
        return self._processor

    def _tokenize(self, prompt: Prompt, tools: list[Any] | None) -> list[int]:
        tok = self.tokenizer
        if tok is None:
            return []
        if isinstance(prompt, str) and not self.apply_chat_template:
            return list(tok.encode(prompt))
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        if getattr(tok, "chat_template", None) is None:
            raise DataError("model.tokenizer_path", "chat-message prompts need a tokenizer with a chat template; "
                                                    "give one, or plain-text prompts")
        text = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False,
                                       **self.chat_template_kwargs)
        return list(tok.encode(text, add_special_tokens=False))  # the template already holds any BOS

    def _group(self, prompt: Prompt, label: Any, metadata: dict[str, Any], tokens: list[int],
               group_index: int, first_index: int, multimodal: tuple[dict[str, Any], Any] | None = None
               ) -> list[Sample]:
        inputs, train = multimodal or (None, None)
        return [  # a group's samples share the processor's tensors (read only); each has its own refs
            Sample(index=first_index + k, group_index=group_index, prompt=copy.deepcopy(prompt),
                   label=copy.deepcopy(label), tokens=list(tokens), metadata=copy.deepcopy(metadata),
                   multimodal_inputs=copy.deepcopy(inputs), multimodal_train_inputs=train)
            for k in range(self.n_samples_per_prompt)
        ]

    def state_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "num_records": len(self.records),
            "file_size": self.records.file_size,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "epoch": self.epoch,
            "position": self.position,
            "next_group_index": self.next_group_index,
            "next_sample_index": self.next_sample_index,
            "num_skipped": self.num_skipped,
            "num_too_long": self.num_too_long,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if (state["num_records"], state["file_size"]) != (len(self.records), self.records.file_size):
            raise DataError(self.path, f"changed since the state was saved ({state['num_records']} lines, "
                                       f"{state['file_size']} bytes then; {len(self.records)} lines, "
                                       f"{self.records.file_size} bytes now); resume with the same file")
        self.seed, self.shuffle = state["seed"], state["shuffle"]  # the saved order wins
        self.epoch, self.position = state["epoch"], state["position"]
        self.next_group_index, self.next_sample_index = state["next_group_index"], state["next_sample_index"]
        self.num_skipped, self.num_too_long = state["num_skipped"], state["num_too_long"]
        self._order_epoch = -1

    def close(self) -> None:
        self.records.close()

    def __getstate__(self) -> dict[str, Any]:
        """Pickles as its arguments and position (for Ray): the other process reopens the file."""
        return {"args": self._init_args, "state": self.state_dict()}

    def __setstate__(self, pickled: dict[str, Any]) -> None:
        args = dict(pickled["args"])
        self.__init__(args.pop("path"), **args)
        self.load_state_dict(pickled["state"])


def _image_args(cfg: Config) -> dict[str, Any]:
    d = cfg.data
    return dict(image_key=d.image_key, max_image_pixels=d.max_image_pixels,
                processor_path=cfg.model.tokenizer_path or cfg.model.path)


def _suffix_unknown(path: str) -> bool:
    return Path(path).suffix.lower() not in (".jsonl", ".json", ".parquet", ".pq")


__all__ = ["DataError", "JsonlRecords", "ParquetRecords", "PromptDataSource", "parse_prompt_record"]
