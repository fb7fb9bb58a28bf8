"""The one reader of a run directory: what ``launch/run_local.sh`` (or ``launch/replay.py --out``) leaves.

    run = RunDir("outputs/cartpole_ppo/20261122-150000")
    run.summary()                  # summary.json, None while the run has not finished
    run.metrics()                  # metrics.jsonl rows
    run.versions("consume")        # versions.jsonl rows of one event (or several: ("consume", "drop"))
    run.config(); run.setting("actors", "sync_every", default=1)
    run.record_index(); run.record_threads()    # record/ (``--record``)
    run.checkpoints()              # checkpoints/ckpt_N.pt, oldest first

JSON-lines files (``metrics.jsonl``, ``versions.jsonl``, ``record/*.jsonl``) are appended a line at a
time, so a run killed while writing leaves at most one partial last line, without its newline: that
line is skipped (and counted in :attr:`RunDir.skipped`). Any other line that is not a JSON object
raises :class:`RunDirError` naming the file and line, unless the caller reads ``lenient=True`` (a
report over many runs), which skips and counts it too. Every error names the file.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

SUMMARY = "summary.json"
CONFIG = "config.json"
METRICS = "metrics.jsonl"
VERSIONS = "versions.jsonl"
RECORD = "record"
CHECKPOINTS = "checkpoints"
_CHECKPOINT = re.compile(r"^ckpt_(\d+)\.pt$")


class RunDirError(ValueError):
    """A run directory, or one of its files, is missing or malformed; the message names the path."""


def _parse_line(raw: bytes) -> tuple[dict[str, Any] | None, str]:
    """One line of a JSON-lines file as a JSON object, or (None, why it is not one)."""
    try:
        row = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        return None, f"not UTF-8 ({e.reason} at byte {e.start})"
    except (ValueError, RecursionError) as e:   # JSONDecodeError, an int too long, nesting too deep
        return None, f"not JSON ({str(e) or type(e).__name__})"
    if not isinstance(row, dict):
        return None, f"not a JSON object (a {type(row).__name__})"
    return row, ""


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise RunDirError(f"{path}: not found") from None
    except OSError as e:
        raise RunDirError(f"{path}: cannot read: {e.strerror or e}") from None


def iter_jsonl(path: str | Path, *, lenient: bool = False,
               skipped: list[int] | None = None) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, JSON object) of each line of the JSON-lines file `path`; blank lines are ignored.

    A last line without its newline that is not a JSON object (a run killed while writing it) is
    skipped; any other bad line raises :class:`RunDirError` ``path:line: why``, or with `lenient`
    is skipped too. The numbers of skipped lines are appended to `skipped` when given. Raises
    RunDirError when the file cannot be read."""
    path = Path(path)
    lines = _read_bytes(path).split(b"\n")
    for n, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        row, why = _parse_line(raw)
        if row is not None:
            yield n, row
            continue
        if not (lenient or n == len(lines)):   # the last piece has no newline: a partial line
            raise RunDirError(f"{path}:{n}: {why}")
        if skipped is not None:
            skipped.append(n)


def read_jsonl(path: str | Path, *, lenient: bool = False,
               skipped: list[int] | None = None) -> list[dict[str, Any]]:
    """The JSON objects of the JSON-lines file `path`, in order: :func:`iter_jsonl` without line numbers."""
    return [row for _, row in iter_jsonl(path, lenient=lenient, skipped=skipped)]


def read_json_object(path: str | Path) -> dict[str, Any]:
    """A file holding one JSON object (``summary.json``, ``config.json``); RunDirError naming the
    file when it is missing, unreadable or something else."""
    path = Path(path)
    raw = _read_bytes(path)
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise RunDirError(f"{path}: not JSON ({e})") from None
    if not isinstance(data, dict):
        raise RunDirError(f"{path}: not a JSON object (a {type(data).__name__})")
    return data


def setting(config: dict[str, Any], *keys: str, default: Any = None) -> Any:
    """The value at `keys` of a config dict (``"actors", "sync_every"``), or `default` when any level
    is missing or null."""
    node: Any = config
    for key in keys:
        if not isinstance(node, dict) or node.get(key) is None:
            return default
        node = node[key]
    return node


def _is_int(x: Any, low: int = 0) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= low


def _is_index_row(row: dict[str, Any]) -> bool:
    return (_is_int(row.get("update")) and _is_int(row.get("version")) and isinstance(row.get("dir"), str)
            and isinstance(row.get("rollouts"), list) and all(isinstance(r, dict) for r in row["rollouts"]))


def _is_threads_row(row: dict[str, Any]) -> bool:
    runs = row.get("threads")
    return (_is_int(row.get("update")) and isinstance(runs, list)
            and all(isinstance(r, list) and len(r) == 2 and all(_is_int(x, 1) for x in r) for r in runs))


class RunDir:
    """One run directory, read on demand (nothing is cached: a live run keeps writing).

    Raises RunDirError at once when `path` is not a directory."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise RunDirError(f"{self.path}: no such run directory")
        self.skipped: dict[str, list[int]] = {}   # file name -> lines skipped by its last read

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    def has(self, name: str) -> bool:
        """Whether the file `name` (relative to the run directory) exists."""
        return (self.path / name).is_file()

    def require(self, name: str, why: str = "not found (not a Tandem run directory?)") -> Path:
        """The path of `name`, or RunDirError ``path: why`` when there is no such file."""
        path = self.path / name
        if not path.is_file():
            raise RunDirError(f"{path}: {why}")
        return path

    def _jsonl(self, name: str, missing_ok: bool, lenient: bool) -> list[dict[str, Any]]:
        if missing_ok and not self.has(name):
            self.skipped[name] = []
            return []
        skipped: list[int] = []
        rows = read_jsonl(self.require(name), lenient=lenient, skipped=skipped)
        self.skipped[name] = skipped
        return rows

    # ------------------------------------------------------------------------------------ the run's files
    def summary(self) -> dict[str, Any] | None:
        """``summary.json`` (written when the run ends), or None when there is none."""
        return read_json_object(self.path / SUMMARY) if self.has(SUMMARY) else None

    def config(self) -> dict[str, Any]:
        """``config.json`` as written (the raw dict, not a validated config)."""
        return read_json_object(self.require(CONFIG))

    def setting(self, *keys: str, default: Any = None) -> Any:
        """A value of ``config.json`` (``run.setting("actors", "sync_every", default=1)``)."""
        return setting(self.config(), *keys, default=default)

    @staticmethod
    def rank_file(stem: str, rank: int = 0) -> str:
        """``metrics.jsonl`` for rank 0, ``metrics.rank1.jsonl`` for learner rank 1 (``RunLogger``'s suffix)."""
        return f"{stem}.jsonl" if rank == 0 else f"{stem}.rank{rank}.jsonl"

    def metrics(self, *, rank: int = 0, missing_ok: bool = False, lenient: bool = False) -> list[dict[str, Any]]:
        """``metrics.jsonl`` rows: one per update and one per evaluation. `missing_ok`: no file reads
        as no rows; `lenient`: skip every bad line (counted in :attr:`skipped`) instead of raising."""
        return self._jsonl(self.rank_file("metrics", rank), missing_ok, lenient)

    def versions(self, event: str | Iterable[str] | None = None, *, rank: int = 0, missing_ok: bool = False,
                 lenient: bool = False) -> list[dict[str, Any]]:
        """``versions.jsonl`` rows, only those of `event` (a name or several) when given."""
        rows = self._jsonl(self.rank_file("versions", rank), missing_ok, lenient)
        if event is None:
            return rows
        wanted = {event} if isinstance(event, str) else set(event)
        return [r for r in rows if r.get("event") in wanted]

    def _record_rows(self, name: str, valid: Callable[[dict[str, Any]], bool], shape: str,
                     missing_ok: bool) -> list[dict[str, Any]]:
        """The rows of ``record/<name>``, each checked by `valid` (else RunDirError ``file:line: not shape``)."""
        path = self.path / RECORD / name
        if not path.is_file():
            if missing_ok:
                return []
            raise RunDirError(f"{path}: no record (was the run started with --record?)")
        skipped: list[int] = []
        rows = []
        for n, row in iter_jsonl(path, skipped=skipped):
            if not valid(row):
                raise RunDirError(f"{path}:{n}: not {shape}")
            rows.append(row)
        self.skipped[f"{RECORD}/{name}"] = skipped
        return rows

    def record_index(self) -> list[dict[str, Any]]:
        """``record/index.jsonl`` (``--record``): per update, its number, the learner's version before
        it, the batch's folder under ``record/`` and the rollouts it trained on."""
        return self._record_rows("index.jsonl", _is_index_row,
                                 "{update: int, version: int, dir: str, rollouts: [...], ...}", missing_ok=False)

    def record_threads(self) -> dict[int, list[int]]:
        """``record/threads.jsonl``: per update, the intra-op threads of each of its minibatches, one
        entry per minibatch (a run with ``learner.torch_threads: "idle"``); empty when there is none."""
        rows = self._record_rows("threads.jsonl", _is_threads_row,
                                 "{update: int, threads: [[threads, count], ...]}", missing_ok=True)
        return {row["update"]: [t for t, count in row["threads"] for _ in range(count)] for row in rows}

    def checkpoints(self) -> list[Path]:
        """``checkpoints/ckpt_N.pt``, oldest (smallest N) first; empty when there are none."""
        directory = self.path / CHECKPOINTS
        if not directory.is_dir():
            return []
        found = sorted((int(m.group(1)), p) for p in directory.iterdir() if (m := _CHECKPOINT.match(p.name)))
        return [p for _, p in found]
