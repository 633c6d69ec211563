"""Backends add lines to `slime-cli doctor` through the `slime_rl.doctor_checks` entry point group; one that
fails is one line under its section, counted as a problem."""

from __future__ import annotations

import pytest

from slime_rl.cli.doctor import DOCTOR_CHECKS, Report, add_contributed_lines, render
from slime_rl.core.testing.distributions import write_distribution

CHECKS = '''
def good():
    return [("kernels", "fused (this build has them)"), ("cache", "warm")]

def raises():
    raise RuntimeError("cannot query\\nthe device")

def wrong_shape():
    return ["kernels: fused"]
'''


@pytest.fixture
def contributions(tmp_path, monkeypatch):
    """A distribution registering four doctor checks (one good, three broken), found on sys.path."""
    (tmp_path / "extra_checks.py").write_text(CHECKS)
    write_distribution(tmp_path, "slime-rl-extra", "0.2.0", {DOCTOR_CHECKS: {
        "extra": "extra_checks:good", "raising": "extra_checks:raises", "shapeless": "extra_checks:wrong_shape",
        "missing": "no_such_module:lines"}})
    monkeypatch.syspath_prepend(str(tmp_path))


def section_lines(text: str, section: str) -> list[str]:
    """The lines under ``section:``, white space folded (render pads names to one width)."""
    lines = text.splitlines()
    start = lines.index(f"{section}:") + 1
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("  ")), len(lines))
    return [" ".join(line.split()) for line in lines[start:end]]


def test_contributions_show_up_and_a_failing_one_is_one_line(contributions):
    report = Report()
    add_contributed_lines(report)
    text = render(report)
    assert section_lines(text, "extra") == ["kernels fused (this build has them)", "cache warm"]
    (raising,) = section_lines(text, "raising")
    assert raising == ("raising extra_checks:raises (slime-rl-extra 0.2.0), does not run: RuntimeError: cannot"
                       " query the device")
    (shapeless,) = section_lines(text, "shapeless")
    assert "does not run: TypeError: returned ['kernels: fused'], not a list of (name, status)" in shapeless
    (missing,) = section_lines(text, "missing")
    assert "no_such_module:lines (slime-rl-extra 0.2.0), does not run: No module named 'no_such_module'" in missing
    assert "Traceback" not in text
    assert report.broken == [f"{DOCTOR_CHECKS}:{name}" for name in ("missing", "raising", "shapeless")]
    assert text.splitlines()[-1].startswith("problems: ")


def test_the_megatron_trainer_contributes_its_expert_backend():
    report = Report()
    add_contributed_lines(report)
    assert ("moe", "experts") in [(section, name) for section, name, _ in report.lines]
    assert not report.broken
