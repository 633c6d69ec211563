"""A user's data source for the end-to-end tests, loaded by module:attr inside the rollout actor."""

from __future__ import annotations

from slime_rl.buffer import PromptDataSource
from slime_rl.core.run.data import DataError
from slime_rl.core.sample import Sample


class FailsAtThirdCall(PromptDataSource):
    """Prompts from the file until its third `get_groups`, which raises a DataError (say, a record its own
    parsing refuses)."""

    calls = 0

    def get_groups(self, num_groups: int) -> list[list[Sample]]:
        self.calls += 1
        if self.calls == 3:
            raise DataError(f"{self.path}:99", "the user's source refuses this record; fix it")
        return super().get_groups(num_groups)
