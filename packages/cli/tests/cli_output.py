"""Reading `slime-cli train`'s output in tests: its plain log lines and its closing summary table.

(A plain module, not conftest: 'conftest' resolves to another package's in a whole-repo run.)
"""


def table_rows(stdout: str) -> dict[str, str]:
    """{what: value} from the summary table, which must end stdout."""
    lines = stdout.rstrip("\n").splitlines()
    assert lines[-1].startswith("└") and lines[-1].endswith("┘"), stdout  # nothing after the table
    top = max(i for i, line in enumerate(lines) if line.startswith("┌"))
    assert lines[top - 1].strip() == "slime-cli train: done"
    rows = [line.strip("│ ").split("│") for line in lines[top:] if line.startswith("│")]
    return {what.strip(): value.strip() for what, value in rows}


def step_lines(stdout: str) -> list[str]:
    """The plain log lines (a bar's frames, split at their carriage returns, have bar characters)."""
    return [line for line in stdout.splitlines() if line.startswith(("started", "eval @", "step ")) and "━" not in line]
