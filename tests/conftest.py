import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "support"))  # helpers the tests (and their Ray workers) import
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A random 2-layer Qwen2 (hidden 64) and a 1,024-id BPE trained offline."""
    from slime_rl.core.testing import tiny_model_folder

    return tiny_model_folder(tmp_path_factory.mktemp("tiny-qwen2"))
