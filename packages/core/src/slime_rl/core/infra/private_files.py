"""A run's files hold prompts, responses and weights: they are the user's alone, whatever the umask.

`keep_files_private` narrows the process's umask to 077 (folders 0700, files 0600 at most), early
in the driver (slime-cli train, the loop's start) and at every Ray actor's start (a cluster started
elsewhere has its own umask); the processes they start (Ray's, the SGLang servers) inherit it.
"""

from __future__ import annotations

import os

PRIVATE_UMASK = 0o077


def keep_files_private() -> None:
    """From now on this process creates nothing group- or world-accessible (a stricter umask stays)."""
    os.umask(os.umask(PRIVATE_UMASK) | PRIVATE_UMASK)
