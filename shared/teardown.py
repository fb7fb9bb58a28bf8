"""A process that imported torch and tensordict spends about a second leaving: the interpreter's
last garbage collections walk their module graphs (torch._dynamo, sympy, ...). Measured on the
2-core VM: 0.9 s from the last line of ``main`` to the exit, 0.15 s after :func:`freeze_for_exit`.
Every run pays it once per process, on the learner's critical path at the end of a run and as CPU
taken from the others while the actors leave.

``gc.freeze()`` moves every live object to the permanent generation, which those collections skip;
atexit handlers, ``logging.shutdown`` and the flushing of open files still run as usual (unlike
``os._exit``). Call it only when the process is about to exit: nothing it holds is freed after it.
"""

from __future__ import annotations

import gc
import sys
from typing import NoReturn


def exit_now(code: int | None) -> NoReturn:
    """``sys.exit(code)`` without the interpreter's slow final collections."""
    gc.freeze()
    sys.exit(code)


def stop_on_signals(stop, noted: list[str] | None = None) -> None:
    """SIGINT and SIGTERM set the ``threading.Event`` `stop` (and append their name to `noted`).

    The handler never takes the event's lock itself: it runs in the main thread, between any two
    bytecodes, and ``Event.set`` holds a lock that is not re-entrant, so a handler calling it while the
    main thread was inside ``stop.set()`` (an actor or server told to stop by a message at the moment a
    signal comes) or inside an earlier handler's ``set`` (a group signal plus the launcher's forward)
    would wait on it for ever. The first signal sets the event from a short thread of its own."""
    import signal
    import threading
    seen: list[str] = []

    def on_signal(signum, frame) -> None:   # only set a flag: never raise inside a ZeroMQ call
        first = not seen
        seen.append(signal.Signals(signum).name)
        if noted is not None:
            noted.append(seen[-1])
        if first:
            threading.Thread(target=stop.set, name="stop-on-signal", daemon=True).start()
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
