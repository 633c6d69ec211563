"""An SGLang role's server flags and GPUs (role_server.py), without a GPU: a reward model is served with
--is-embedding, the run's dtype is concrete, the user's flags win, and planned GPUs read through
CUDA_VISIBLE_DEVICES when it lists them."""

from slime_rl.core.config import Config
from slime_rl.rollout_sglang.role_server import physical_gpus, role_server_args


def cfg(kind, **role):
    return Config.model_validate({"model": {"dtype": "bfloat16"},
                                  "roles": {"r": {"kind": kind, "path": "/m", "engine": "sglang", **role}}})


def test_a_reward_model_is_an_embedding_server_and_the_users_flags_win():
    assert role_server_args(cfg("reward_model"), "r") == {"is_embedding": True, "dtype": "bfloat16"}
    assert role_server_args(cfg("teacher", engine_args={"mem_fraction_static": 0.1, "dtype": "float16"},
                                tokenizer_path="/t"), "r") == {"mem_fraction_static": 0.1, "dtype": "float16",
                                                               "tokenizer_path": "/t"}


def test_planned_gpus_read_through_the_visible_devices():
    assert physical_gpus([1, 2], visible="4,5,6") == [5, 6]
    assert physical_gpus([1, 2], visible="") == [1, 2]
    assert physical_gpus([3], visible="0,1") == [3]  # a list too short to hold the plan: the plan's own indexes
