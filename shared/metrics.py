"""Per-episode env metrics (success, distances, reward components), bounded so that no env and no
peer can flood the logs: at most ``MAX_KEYS`` names per episode and per log line, names of at most
``MAX_NAME`` characters from a safe alphabet, finite numbers only (booleans count as 0/1).

Envs report them at the end of each episode (``StepResult.episode_metrics``); actors send them with
the rollout (``episode_metrics`` in the message meta); the learner averages the last 100 episodes'
into ``train/metrics/<key>`` and the evaluator's into ``eval/metrics/<key>``.
"""

from __future__ import annotations

import math
import re
from typing import Any, Iterable

import numpy as np
import torch

MAX_KEYS = 32
MAX_NAME = 64
_NAME = re.compile(r"^[A-Za-z0-9_.\-/]+$")


def _number(x: Any) -> float | None:
    """A finite float from a Python, NumPy or 0-d torch number (or a bool); None otherwise."""
    if isinstance(x, (np.generic, torch.Tensor)) and getattr(x, "ndim", 1) == 0:
        x = x.item()
    if isinstance(x, (bool, int, float)):
        x = float(x)
        return x if math.isfinite(x) else None
    return None


def clean_metrics(d: Any) -> dict[str, float]:
    """The valid part of one episode's metrics: a dict of at most MAX_KEYS names (the first in
    sorted order) with finite number values; anything else (wrong types, long or odd names,
    NaN) is left out."""
    if not isinstance(d, dict):
        return {}
    out: dict[str, float] = {}
    for k in sorted(k for k in d if isinstance(k, str) and 0 < len(k) <= MAX_NAME and _NAME.match(k)):
        v = _number(d[k])
        if v is not None:
            out[k] = v
            if len(out) == MAX_KEYS:
                break
    return out


def mean_metrics(episodes: Iterable[dict[str, float]]) -> dict[str, float]:
    """Per name, the mean over the episodes that report it (at most MAX_KEYS names, sorted)."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for ep in episodes:
        for k, v in ep.items():
            sums[k] = sums.get(k, 0.0) + v
            counts[k] = counts.get(k, 0) + 1
    return {k: sums[k] / counts[k] for k in sorted(sums)[:MAX_KEYS]}
