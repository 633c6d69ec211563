"""A math-verify worker process: JSON lines in on stdin, JSON lines out on stdout.

Run as ``python path/to/math_worker.py`` (a file, so it imports math-verify and
nothing of slime_rl, whose package imports torch). It lives in its own
process so that the parent can kill it when sympy hangs (``9^{9^{9^9}}`` never
finishes, and no thread can be stopped). Request ``{"gold": str, "pred": str}``,
reply ``{"ok": bool}`` or ``{"error": str}``; the first line out is ``{"ready": true}``.
"""

from __future__ import annotations

import json
import logging
import os
import sys


def verify_answer(gold_text: str, pred_text: str) -> bool:
    """math-verify's verdict on ``pred_text`` against ``gold_text``, with its signal-based timeouts off."""
    from math_verify import parse, verify

    gold = parse(gold_text, parsing_timeout=None)
    pred = parse(pred_text, parsing_timeout=None)
    return bool(gold) and bool(pred) and bool(verify(gold, pred, timeout_seconds=None))


def main() -> None:
    # Reply on a private copy of stdout; anything a library prints goes to stderr instead.
    out = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    sys.stdout = sys.stderr
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # we enforce the timeout; its warning is noise
    import math_verify  # noqa: F401  (import before saying ready: the first request should not pay for it)

    out.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        try:
            request = json.loads(line)
            reply = {"ok": verify_answer(request["gold"], request["pred"])}
        except Exception as err:  # a bad expression is this request's problem, not the worker's
            reply = {"error": f"{type(err).__name__}: {err}".replace("\n", " ")[:500]}
        out.write(json.dumps(reply) + "\n")


if __name__ == "__main__":
    main()
