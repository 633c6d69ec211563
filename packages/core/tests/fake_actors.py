"""Ray actors as fakes for tests of the driver side: ``actor.method.remote(*args)`` records the call
and answers at once; `fake_get` (set as `ray.get`) unwraps the answers, and `fake_watch` waits on them."""

from __future__ import annotations

from collections import Counter
from typing import Any

from slime_rl.core.infra.stall import StallBounds, StallWatch


class Answer:
    """What a fake actor's ``.remote()`` returns: a value `ray.get` gives back."""

    def __init__(self, value: Any):
        self.value = value


class FakeActor:
    """``actor.method.remote(*args)`` records ``prefix + method`` and answers with ``answers[method](*args)``
    (or the value itself when not callable); ``.options(num_returns=n)`` answers a tuple as n references."""

    def __init__(self, calls: Counter, log: list, prefix: str = "", **answers: Any):
        self.calls, self.log, self.prefix, self.answers = calls, log, prefix, answers

    def __getattr__(self, method: str):
        actor = self

        class Method:
            @staticmethod
            def remote(*args: Any, _num_returns: int = 1) -> Answer | list[Answer]:
                args = tuple(a.value if isinstance(a, Answer) else a for a in args)  # Ray resolves refs in args
                actor.calls[actor.prefix + method] += 1
                actor.log.append((actor.prefix + method, args))
                answer = actor.answers[method]
                value = answer(*args) if callable(answer) else answer
                return [Answer(v) for v in value] if _num_returns > 1 else Answer(value)

            @staticmethod
            def options(num_returns: int = 1):
                class WithOptions:
                    @staticmethod
                    def remote(*args: Any) -> Answer | list[Answer]:
                        return Method.remote(*args, _num_returns=num_returns)

                return WithOptions

        return Method


def fake_get(refs: Any) -> Any:
    return [r.value for r in refs] if isinstance(refs, list) else refs.value


def fake_watch() -> StallWatch:
    """The driver's bounded waits (infra/stall.py) over fake answers: every one is ready at once."""
    return StallWatch(StallBounds(3.0, 20.0, 600.0), wait=lambda refs, timeout: (list(refs), []), get=fake_get)
