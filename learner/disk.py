"""The learner's own disk: a full run directory (ENOSPC) or any other I/O error on the files the learner
writes ends the run cleanly, within seconds, instead of hanging it or being blamed on an actor.

Every writer of the run directory (``versions.jsonl`` and ``metrics.jsonl``, TensorBoard, checkpoints,
``--record``, ``summary.json``) hands its ``OSError`` to :data:`DISK` instead of raising it into the
thread that wrote: the intake then never counts a local disk error as a rejected message, and a
background writer that died cannot block the next write. The first failure is kept; the main loop sees
:attr:`DiskFailure.failed`, says in one line which file could not be written and why, and where the last
intact checkpoint is, and stops the run with exit code 1 (no final checkpoint is attempted, so no
temporary file is left). After space is freed, ``--resume`` goes on from that checkpoint.

A disk that is nearly full is warned about first: after each checkpoint, when the free space left is
less than two more checkpoints.
"""

from __future__ import annotations

import logging
import shutil
import threading
from pathlib import Path

log = logging.getLogger("tandem.learner")


class RunDirWriteError(RuntimeError):
    """Raised by a loop that cannot go on because its run directory could not be written (the
    serial runner); its message is :meth:`DiskFailure.line`'s."""


class DiskFailure:
    """The first failed write of this process's run directory (thread-safe; one per process)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.event = threading.Event()
        self.path: Path | None = None
        self.error: OSError | None = None

    @property
    def failed(self) -> bool:
        return self.event.is_set()

    def record(self, path: str | Path, error: OSError) -> None:
        """`path` could not be written (`error`); the first failure is logged and kept, later ones ignored."""
        with self._lock:
            if self.event.is_set():
                return
            self.path, self.error = Path(path), error
            self.event.set()
        log.error("cannot write %s: %s", path, _reason(error))

    def line(self, last_checkpoint: Path | None) -> str:
        """The one line that says why the run stops, and where to resume from."""
        where = (f"the last intact checkpoint is {last_checkpoint} (--resume goes on from it once space is freed)"
                 if last_checkpoint is not None else "no checkpoint was written")
        return f"[learner] stopping: cannot write {self.path}: {_reason(self.error)}; {where}"

    def reset(self) -> None:
        """Forget the failure (tests; a new learner life in the same process)."""
        with self._lock:
            self.path, self.error = None, None
            self.event.clear()


def _reason(error: OSError | None) -> str:
    if error is None:
        return "unknown error"
    return f"[Errno {error.errno}] {error.strerror}" if error.strerror else f"{type(error).__name__}: {error}"


DISK = DiskFailure()


def catch_background_write_errors() -> None:
    """Route an ``OSError`` that ends a background thread (TensorBoard's event writer) to :data:`DISK`
    as one line, instead of the thread's traceback; any other exception is printed as before."""
    default = threading.excepthook

    def hook(args: threading.ExceptHookArgs) -> None:
        if isinstance(args.exc_value, OSError):
            DISK.record(args.exc_value.filename or f"(thread {args.thread.name if args.thread else '?'})",
                        args.exc_value)
        else:
            default(args)
    threading.excepthook = hook


def warn_if_nearly_full(directory: Path, checkpoint_bytes: int) -> bool:
    """Warn when the free space in `directory` is less than two more checkpoints of `checkpoint_bytes`
    (a user would rather be warned before the last checkpoint fails). True when it warned."""
    try:
        free = shutil.disk_usage(directory).free
    except OSError:
        return False
    if free >= 2 * checkpoint_bytes:
        return False
    log.warning("the run directory's disk is nearly full: %.1f MB free in %s, a checkpoint takes %.1f MB; "
                "the run stops cleanly if it fills (free space, then --resume)",
                free / 1e6, directory, checkpoint_bytes / 1e6)
    return True
