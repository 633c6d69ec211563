import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "support"))  # helpers the tests (and their Ray workers) import
torch.set_num_threads(1)


@pytest.hookimpl(trylast=True)  # after `-m` has deselected: the counts are of the tests that run
def pytest_collection_modifyitems(config, items):
    """Files marked `heavy` first, then the files with the most tests: pytest-xdist (--dist loadfile
    --no-loadscope-reorder, the Makefile's) hands out whole files in this order, so a file of minutes does not
    start last and leave one worker running it alone."""
    files: dict[str, list] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::")[0], []).append(item)
    ranked = sorted(files.values(), key=lambda its: (not any(it.get_closest_marker("heavy") for it in its), -len(its)))
    items[:] = [item for its in ranked for item in its]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A random 2-layer Qwen2 (hidden 64) and a 1,024-id BPE trained offline."""
    from slime_rl.core.testing import tiny_model_folder

    return tiny_model_folder(tmp_path_factory.mktemp("tiny-qwen2"))
