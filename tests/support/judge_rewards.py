"""A user's reward that asks the run's judge roles (tests/e2e/test_e2e_roles.py), through the client the run
hands every reward function (`slime_rl.core.roles.role_client`): it never sees the judge's URL or key."""

from __future__ import annotations

from slime_rl.core.roles import role_client
from slime_rl.core.sample import Sample


async def judged(sample: Sample) -> float:
    """Every fourth sample goes to the slow judge (its role's timeout is shorter than its answer takes: those
    samples fail as timed-out rewards), the rest to the judge; the verdict's length scores the response."""
    if sample.index % 4 == 0:
        await role_client("slow_judge").generate(f"Is this right? {sample.response}", max_new_tokens=400,
                                                 ignore_eos=True)
    verdict = await role_client("judge").generate(f"Question: {sample.prompt}\nAnswer: {sample.response}\n"
                                                  "Is the answer right? Reply yes or no:", max_new_tokens=4)
    return float(len(verdict) % 3) / 2
