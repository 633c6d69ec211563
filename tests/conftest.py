import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"))
