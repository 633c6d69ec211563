"""``rollout.reward: code_tests``: run the code block of a response against the label's test cases in
the sandbox (core/sandbox); the reward is the fraction of test cases that pass.

The label (a mapping, or that mapping as a JSON string) holds the test cases in one of two forms:

- ``{"tests": [...]}`` (or the list itself): each case is either a string of Python run after the
  code, which passes when it runs to the end (``"assert add(1, 2) == 3"``, MBPP / HumanEval style),
  or ``{"input": "...", "output": "..."}``: the code reads ``input`` on stdin and passes when what it
  prints equals ``output`` (line by line, trailing whitespace ignored);
- ``{"inputs": [...], "outputs": [...]}``: stdin/stdout cases side by side (APPS / TACO style).

The code is the last fenced block tagged ``python`` (or ``py``) in the response, else its last
fenced block of any kind; a response without one scores 0. Each case is its own sandboxed call,
so a case that loops or crashes fails alone. A label in none of these forms fails the sample with
an error saying what is wrong (``metadata["error"]``), never a silent 0.
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from slime_rl.core.sample import Sample
from slime_rl.core.sandbox import SandboxSettings, arun_python

FENCE = re.compile(r"```([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)
LABEL_FORMS = ('{"tests": ["assert f(1) == 2", {"input": "1\\n", "output": "2\\n"}, ...]}'
               ' or {"inputs": ["1\\n"], "outputs": ["2\\n"]}')


class CodeTestsLabelError(ValueError):
    """The label does not hold test cases in a form code_tests reads."""


@dataclass(frozen=True)
class CodeTest:
    script: str | None = None  # Python run after the code (must run to the end)
    stdin: str | None = None  # or: stdin for the code ...
    stdout: str | None = None  # ... and the output it must print


def extract_code(response: str) -> str | None:
    """The last ```python block of the response, else its last fenced block, else None."""
    blocks = FENCE.findall(response)
    if not blocks:
        return None
    python_blocks = [body for lang, body in blocks if lang.lower() in ("python", "py", "python3")]
    return (python_blocks or [body for _, body in blocks])[-1]


def parse_tests(label: Any) -> list[CodeTest]:
    """The label's test cases; CodeTestsLabelError saying what is wrong and which forms work."""
    if isinstance(label, str):
        try:
            label = json.loads(label)
        except json.JSONDecodeError as err:
            raise CodeTestsLabelError(f"code_tests: the label is a string but not JSON ({err.msg}); give {LABEL_FORMS}"
                                      ) from None
    if isinstance(label, dict) and "inputs" in label:
        inputs, outputs = label.get("inputs"), label.get("outputs")
        if not isinstance(inputs, list) or not isinstance(outputs, list) or len(inputs) != len(outputs):
            raise CodeTestsLabelError(f"code_tests: label.inputs and label.outputs must be lists of equal length, got"
                                      f" {_shape(inputs)} and {_shape(outputs)}")
        label = {"tests": [{"input": i, "output": o} for i, o in zip(inputs, outputs, strict=True)]}
    tests = label.get("tests") if isinstance(label, dict) else label
    if not isinstance(tests, list) or not tests:
        raise CodeTestsLabelError(f"code_tests: the label has no test cases ({_shape(label)}); give {LABEL_FORMS}")
    return [_parse_case(case, k) for k, case in enumerate(tests)]


def _parse_case(case: Any, k: int) -> CodeTest:
    if isinstance(case, str) and case.strip():
        return CodeTest(script=case)
    if isinstance(case, dict) and set(case) == {"input", "output"}:
        if not all(isinstance(v, str) for v in case.values()):
            raise CodeTestsLabelError(f"code_tests: test case {k}: input and output must be strings, got"
                                      f" {_shape(case['input'])} and {_shape(case['output'])}")
        return CodeTest(stdin=case["input"], stdout=case["output"])
    raise CodeTestsLabelError(f"code_tests: test case {k} is {_shape(case)}; give a Python string (e.g. an assert)"
                              ' or {"input": "...", "output": "..."}')


def _shape(value: Any) -> str:
    return f"{type(value).__name__} {json.dumps(value, default=str)[:60]}"


def same_output(printed: str, expected: str) -> bool:
    """Equal line by line, trailing whitespace and trailing empty lines ignored."""
    def lines(text: str) -> list[str]:
        return [line.rstrip() for line in text.rstrip().splitlines()]

    return lines(printed) == lines(expected)


class CodeTestsReward:
    """The ``code_tests`` reward, bound to the run's sandbox settings (rollout.sandbox)."""

    def __init__(self, settings: SandboxSettings | None = None):
        self.settings = settings or SandboxSettings()

    async def __call__(self, sample: Sample) -> float:
        tests = parse_tests(sample.label)  # a bad label fails the sample, before any code runs
        code = extract_code(sample.response or "")
        if code is None:
            return 0.0
        passed = await asyncio.gather(*(self.run_case(code, case) for case in tests))
        return sum(passed) / len(tests)

    async def run_case(self, code: str, case: CodeTest) -> bool:
        if case.script is None:
            result = await arun_python(code, self.settings, stdin=case.stdin)
            return result.ok and same_output(result.stdout, case.stdout or "")
        # The case passes only if the run gets past it: a code that exits early (sys.exit(0),
        # os._exit(0)) never prints the marker printed after the case.
        marker = f"code_tests-passed-{secrets.token_hex(8)}"
        result = await arun_python(f"{code}\n\n{case.script}\nprint({marker!r})\n", self.settings)
        return result.ok and result.stdout.rstrip().endswith(marker)
