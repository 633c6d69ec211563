"""slime-rl buffer: prompt data sources and durable sample buffers.

- :class:`PromptDataSource`: JSONL/Parquet prompts -> groups of PENDING samples, resumable.
- :class:`SampleBuffer`: finished and partial groups between rollout and training, in SQLite.
- :mod:`slime_rl.buffer.filters`: ``nonzero_std`` (DAPO) and the buffer filters.
"""

from slime_rl.buffer.buffer import SampleBuffer
from slime_rl.buffer.data_source import PromptDataSource
from slime_rl.buffer.filters import BUFFER_FILTERS, DYNAMIC_SAMPLING_FILTERS, nonzero_std
from slime_rl.buffer.records import DataError

__all__ = [
    "BUFFER_FILTERS", "DYNAMIC_SAMPLING_FILTERS", "DataError", "PromptDataSource", "SampleBuffer",
    "nonzero_std",
]
