"""slime-rl buffer: prompt data sources and durable sample buffers.

- :class:`PromptDataSource`: JSONL/Parquet prompts -> groups of PENDING samples, resumable.
- :class:`SampleBuffer`: finished and partial groups between rollout and training, in SQLite.

The filters (DAPO's ``nonzero_std``, the buffer filters) are in ``slime_rl.core.algorithms.filters``.
"""

from slime_rl.buffer.buffer import SampleBuffer
from slime_rl.buffer.data_source import PromptDataSource
from slime_rl.buffer.records import DataError

__all__ = ["DataError", "PromptDataSource", "SampleBuffer"]
