"""What a run writes: TensorBoard events, ``metrics.jsonl``, ``versions.jsonl``, progress lines.

Names are the same everywhere: a TensorBoard tag ``loss/policy`` is the key ``loss/policy`` in
``metrics.jsonl``. Thread-safe: the receiver thread logs consume/drop events while the training
thread logs updates.
"""

from __future__ import annotations

import json
import math
import threading
import time
from pathlib import Path
from typing import Any

import torch

from learner.disk import DISK


class JsonlWriter:
    """Append-only JSON-lines file, flushed per line so a crash loses at most one line. A write that
    fails (a full disk) goes to ``learner.disk.DISK``, which stops the run; later lines are dropped."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._f = open(path, "a", buffering=1)
        self._lock = threading.Lock()
        self._failed = False

    def write(self, **record: Any) -> None:
        line = json.dumps(record, allow_nan=True, separators=(",", ":"))
        with self._lock:
            if self._failed:
                return
            try:
                self._f.write(line + "\n")
            except OSError as e:
                self._failed = True
                DISK.record(self.path, e)

    def close(self) -> None:
        with self._lock:
            try:
                self._f.close()
            except OSError as e:       # the line still buffered could not be written
                DISK.record(self.path, e)


class RunLogger:
    """TensorBoard + ``metrics.jsonl`` + ``versions.jsonl`` for one run directory."""

    def __init__(self, run_dir: Path, use_tensorboard: bool = True, use_wandb: bool = False, config: dict | None = None,
                 suffix: str = ""):
        self.run_dir = Path(run_dir)
        # `suffix` (".rank1"): the files of a learner rank other than 0, beside rank 0's
        self.metrics = JsonlWriter(self.run_dir / f"metrics{suffix}.jsonl")
        self.versions = JsonlWriter(self.run_dir / f"versions{suffix}.jsonl")
        self.tb = None
        self._tb_lock = threading.Lock()
        if use_wandb:
            import wandb  # checked by the config loader
            wandb.init(project="tandem", name=self.run_dir.name, config=config, sync_tensorboard=True,
                       dir=str(self.run_dir))
        if use_tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(log_dir=str(self.run_dir), flush_secs=10)

    def scalars(self, step: int, values: dict[str, float], **extra: Any) -> None:
        """One ``metrics.jsonl`` line and one TensorBoard scalar per value, at env step `step`."""
        clean = {k: (float(v) if v is not None else None) for k, v in values.items()}
        self.metrics.write(**extra, env_steps=step, time=time.time(), **clean)
        with self._tb_lock:
            for k, v in clean.items():
                if self.tb is not None and v is not None and math.isfinite(v):
                    self._tb_call(self.tb.add_scalar, k, v, step)

    def histogram(self, tag: str, values: torch.Tensor, step: int) -> None:
        if self.tb is not None and values.numel():
            with self._tb_lock:
                self._tb_call(self.tb.add_histogram, tag, values.float(), step)

    def _tb_call(self, fn, *args) -> None:
        """A TensorBoard write; its writer thread's I/O error comes back from the next call: then
        the run directory failed (``learner.disk``) and TensorBoard is written no more."""
        try:
            fn(*args)
        except OSError as e:
            self.tb = None
            DISK.record(self.run_dir / "events.out.tfevents.*", e)

    def close(self) -> None:
        self.metrics.close()
        self.versions.close()
        if self.tb is not None:
            with self._tb_lock:
                self._tb_call(self.tb.close)


def fmt_num(x: float) -> str:
    return f"{x / 1e6:.2f}M" if x >= 1e6 else (f"{x / 1e3:.1f}k" if x >= 1e3 else f"{x:.0f}")

