"""Progress output that a closed pipe cannot break.

Under a launcher, a process's stdout and stderr are pipes into ``tee``. When a group signal (Slurm,
Kubernetes, Ctrl-C in a terminal) reaches the tees as well, they may exit first, and the next
``print`` raises ``BrokenPipeError`` in the middle of a shutdown that still has a checkpoint and a
summary to write. :func:`say` never raises: on a broken pipe it points both streams at /dev/null
for the rest of the process's life, so later prints, log records and the interpreter's final
flush are silently discarded instead.
"""

from __future__ import annotations

import os
import sys


def _silence() -> None:
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        for fd in (1, 2):
            os.dup2(null, fd)
        os.close(null)
    except OSError:
        pass


def say(message: str) -> None:
    """Print `message` and flush, unless stdout is gone (then nothing, and nothing again)."""
    try:
        print(message, flush=True)
    except (BrokenPipeError, OSError, ValueError):   # ValueError: the stream was closed
        _silence()


def dump_stacks_on_signal() -> None:
    """SIGUSR1 prints every thread's Python stack to stderr (the process's log) and the process goes
    on. ``launch/run_local.sh`` asks it of a process that did not stop in time before it kills it, so
    a hang says where it was; a user can ask a run that seems stuck the same (``kill -USR1 PID``)."""
    import faulthandler
    import signal
    if hasattr(signal, "SIGUSR1"):   # not on Windows
        faulthandler.register(signal.SIGUSR1, all_threads=True)


def install() -> None:
    """Make the logging module quiet on a broken stderr too (it would print a traceback per record)."""
    import logging
    logging.raiseExceptions = False
    if hasattr(sys.stdout, "reconfigure"):
        try:
            sys.stdout.reconfigure(line_buffering=True)
        except (ValueError, OSError):
            pass
