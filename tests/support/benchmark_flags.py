"""For tests/unit/test_gpu_stages.py: each GPU stage's benchmark command parsed by the benchmark's own argparse
parser, and nothing run: parse_known_args (which parse_args calls, as do subcommands) is wrapped so that, once the
arguments parse, the script stops; arguments left over are an error even where the script takes parse_known_args
(there a misspelt flag would be ignored on the GPU machine).

    python tests/support/benchmark_flags.py COMMANDS.json RESULTS.json

COMMANDS.json: ``[[stage, script path, [arg, ...]], ...]``; RESULTS.json: ``{stage: "ok" or what went wrong}``.
All run in this one process (imports are paid once); a script is run as ``__main__`` with its folder on sys.path.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import runpy
import sys
from pathlib import Path


class Parsed(Exception):
    """The arguments parsed: stop before the script does anything."""


class LeftOver(Exception):
    """Arguments no parser took."""


def _stop_after(original):
    def parse_known(self, args=None, namespace=None):
        _, extras = original(self, args, namespace)  # a bad value exits here, as on the GPU machine
        if extras:
            raise LeftOver(extras)
        raise Parsed
    return parse_known


def check(script: Path, argv: list[str]) -> str:
    sys.argv = [str(script), *argv]
    sys.path.insert(0, str(script.parent))
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            runpy.run_path(str(script), run_name="__main__")
    except Parsed:
        return "ok"
    except LeftOver as extras:
        return f"arguments no option takes: {extras}"
    except SystemExit as stop:
        return f"exit {stop.code}: {err.getvalue().strip()[-400:]}"
    except Exception as failure:  # noqa: BLE001 - reported, with the stage, by the test
        return f"{type(failure).__name__}: {failure}"
    finally:
        sys.path.remove(str(script.parent))
    return "the script returned without parsing its arguments"


def main() -> None:
    commands, out = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])  # check() sets sys.argv
    argparse.ArgumentParser.parse_known_args = _stop_after(argparse.ArgumentParser.parse_known_args)
    results = {stage: check(Path(script), argv) for stage, script, argv in commands}
    out.write_text(json.dumps(results))


if __name__ == "__main__":
    main()
