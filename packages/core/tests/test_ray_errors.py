"""A user's mistake raised in a Ray actor reaches the driver as itself: it survives pickling, and
`local_ray` unwraps it from Ray's error (which carries the actor's whole traceback in its str)."""

from __future__ import annotations

import pickle

import pytest
from ray import cloudpickle
from ray.exceptions import RayTaskError

from slime_rl.core.config import ConfigError
from slime_rl.core.infra.plugins import PluginError
from slime_rl.core.infra.ray_cluster import (
    KeepsInitMistake,
    keep_init_mistake,
    mistakes_unwrapped,
    users_mistake,
)
from slime_rl.core.run.data import DataError


def from_actor(cause: BaseException, function: str = "RolloutWorker.run_step") -> RayTaskError:
    """What `ray.get` raises for an exception in an actor: the RayTaskError pickled in the actor, unpickled in
    the driver and made an instance of the cause's class too."""
    err = RayTaskError(function, f"Traceback (most recent call last):\n  ...\n{cause!r}", cause,
                       proctitle="ray::RolloutWorker", pid=1234, ip="127.0.0.1")
    return pickle.loads(cloudpickle.dumps(err)).as_instanceof_cause()  # cloudpickle, as Ray does


MISTAKES = [DataError("/data/p.jsonl:3", "malformed JSON (Expecting value); fix the line or set "
                                         "data.skip_bad_lines=true"),
            ConfigError("rollout.reward", "returned a str; return a float or a dict of floats"),
            PluginError("no slime_rl.trainers named 'megatrom' (installed: megatron); or give `module:attr`")]


@pytest.mark.parametrize("mistake", MISTAKES, ids=lambda e: type(e).__name__)
def test_a_mistake_from_an_actor_comes_out_as_itself(mistake):
    wrapped = from_actor(mistake)
    assert "\n" in str(wrapped)  # what the CLI printed before: the actor's traceback, many lines
    found = users_mistake(wrapped)
    assert type(found) is type(mistake) and str(found) == str(mistake)
    with pytest.raises(type(mistake)) as raised, mistakes_unwrapped():
        raise wrapped
    assert type(raised.value) is type(mistake) and str(raised.value) == str(mistake)
    assert "\n" not in str(raised.value)
    # an actor's call that called another actor: Ray nests the errors
    nested = from_actor(from_actor(mistake, "inner"), "outer")
    assert str(users_mistake(nested)) == str(mistake)


def test_other_errors_from_actors_stay_as_ray_raised_them():
    wrapped = from_actor(RuntimeError("engine 3 died"))
    assert users_mistake(wrapped) is None
    with pytest.raises(RayTaskError) as raised, mistakes_unwrapped():
        raise wrapped
    assert raised.value is wrapped


class Actor(KeepsInitMistake):
    @keep_init_mistake
    def __init__(self, error: Exception | None):
        self.tokenizer = "built"
        if error is not None:
            raise error
        self.data_source = "built"

    def ready(self) -> bool:
        self.raise_init_mistake()
        return True

    def generate(self) -> str:
        return self.data_source


def test_a_mistake_in_an_actors_init_is_raised_by_its_first_call():
    """Raised from __init__ it would kill the actor: Ray prints the traceback and raises ActorDiedError, text only."""
    mistake = DataError("data.apply_chat_template", "the tokenizer has no chat template; set model.tokenizer_path "
                                                    "to one that has, or turn it off")
    actor = Actor(mistake)
    with pytest.raises(DataError) as raised:
        actor.ready()
    assert raised.value is mistake
    with pytest.raises(DataError):
        actor.generate()  # needs what __init__ did not build
    assert not hasattr(actor, "__ray_probe__") and actor.tokenizer == "built"
    assert Actor(None).ready() and Actor(None).generate() == "built"
    with pytest.raises(RuntimeError):  # anything else is a failure, not the user's mistake: the actor dies
        Actor(RuntimeError("CUDA error"))
