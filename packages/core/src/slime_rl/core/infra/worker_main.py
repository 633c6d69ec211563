"""A worker process for code that may hang: it runs ``module:attr`` functions one call at a time.

Run as ``python -P path/to/worker_main.py`` (a file, so it imports nothing of slime_rl
itself; the functions it loads import what they need). The parent
(:mod:`slime_rl.core.infra.workers`) kills it when a call outlives its timeout: a thread cannot
be stopped, a process can. Async functions run in this process's own event loop, so a
blocking ``async def`` blocks only this worker.

Frames on the pipes are a 4-byte big-endian length and a pickle. The first frame in is
``{"path": [...], "preload": [...]}`` (the parent's ``sys.path``; modules to import
before saying ready); the first frame out is ``("ready",)``. Then requests
``("load", spec)`` -> ``("ok", None)`` | ``("error", text)``, and
``("call", spec, args)`` -> ``("ok", result)`` | ``("error", text)``, where the text
reads on from the function's name ("raised ValueError: ...", "returned a ...").
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import os
import pickle
import struct
import sys
import threading
import time
from typing import Any, BinaryIO

_LENGTH = struct.Struct(">I")


def read_frame(stream: BinaryIO) -> Any:
    header = stream.read(_LENGTH.size)
    if len(header) < _LENGTH.size:
        raise EOFError
    (size,) = _LENGTH.unpack(header)
    return pickle.loads(stream.read(size))


def write_frame(stream: BinaryIO, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_LENGTH.pack(len(data)) + data)
    stream.flush()


def describe(err: BaseException) -> str:
    return " ".join(f"{type(err).__name__}: {err}".split())[:500]


def load(spec: str) -> Any:
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"{spec!r}: expected the form `package.module:attribute`")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"{spec!r} is a {type(obj).__name__}, not a callable")
    return obj


def die_with_parent(parent: int) -> None:
    """Exit once the process that started this worker is gone: a killed rollout process must not
    leave a worker hung in user code behind. (Not PR_SET_PDEATHSIG: that fires when the parent's
    starting *thread* ends.)"""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def main() -> None:
    die_with_parent(os.getppid())
    # Replies go out on a private copy of stdout; fd 1 becomes stderr, so that whatever the user's
    # code prints (from Python or from C) cannot corrupt the protocol.
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    requests = sys.stdin.buffer
    init = read_frame(requests)
    sys.path[:] = list(init["path"])
    for module in init.get("preload", ()):
        importlib.import_module(module)
    write_frame(out, ("ready",))
    loop = asyncio.new_event_loop()
    functions: dict[str, Any] = {}
    while True:
        try:
            request = read_frame(requests)
        except EOFError:
            return
        if request[0] == "load":
            try:
                functions[request[1]] = load(request[1])
                reply: tuple = ("ok", None)
            except Exception as err:
                reply = ("error", describe(err))
        else:
            _, spec, args = request
            try:
                result = functions[spec](*args)  # the parent loads a function before calling it
                if inspect.isawaitable(result):
                    result = loop.run_until_complete(result)
                reply = ("ok", result)
            except Exception as err:  # the call's failure, not the worker's
                reply = ("error", f"raised {describe(err)}")
        try:
            write_frame(out, reply)
        except Exception as err:  # a result pickle cannot carry (a lambda, a generator, a lock)
            write_frame(out, ("error", f"returned a {type(reply[1]).__name__}, which cannot be sent back "
                                       f"({describe(err)})"))


if __name__ == "__main__":
    main()
