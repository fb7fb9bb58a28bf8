"""An emulated inference device for CPU studies of slow models: latency ``a + b * batch`` per acting
call, and actors that share a device taking turns on it.

A large model's forward pass takes time that grows with the batch, and actors that share one GPU
do not infer at once: the GPU runs one forward after another (or batches them, which the actors'
separate processes here do not). With real CUDA actors the device does this by itself. On a CPU
machine, ``actors.inference_latency_s`` (a), ``actors.inference_latency_per_env_s`` (b) and
``actors.emulated_devices`` stand in for it:

- every acting call sleeps ``a + b * num_envs`` after the policy's own forward pass;
- actor ``i`` uses the device named ``emulated_devices[i % len]``; actors given the same name hold
  an exclusive lock on it (``flock`` on ``RUN_DIR/devices/NAME.lock``, so it works across
  processes on one host) for the forward pass and the sleep together. Four actors of 16 envs on one
  device then take as long per round as one actor of 64 envs, or longer when ``a > 0``: a device
  shared this way never batches across actors.

Calibrate ``a`` and ``b`` from a real model's forward time at two batch sizes (the action-token VLA:
``benchmarks/vla_weights.py`` prints them). The emulation is for CPU studies; on GPUs, use the
real devices and leave these at their defaults.

:class:`EmulatedInference` and :class:`SlowEnv` wrap the policy and the env with these knobs, so the
collector's step loop runs the same code with or without them.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import time
from pathlib import Path

NAME_PATTERN = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


class EmulatedDevice:
    """One named device: ``with device:`` holds it exclusively against every other holder of the
    same lock file (other processes, or other ``EmulatedDevice`` objects in this one).
    Records how long callers waited for it (``wait_s``)."""

    def __init__(self, name: str, lock_dir: str | Path):
        if not NAME_PATTERN.match(name):
            raise ValueError(f"emulated device name {name!r}: use 1-64 letters, digits, '_', '.' or '-'")
        self.name = name
        self.path = Path(lock_dir) / f"{name}.lock"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        self.wait_s = 0.0

    def __enter__(self) -> "EmulatedDevice":
        if self._fd is None:
            raise RuntimeError(f"emulated device {self.name!r} is closed")
        t0 = time.perf_counter()
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        self.wait_s += time.perf_counter() - t0
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)       # also releases the lock, should a holder be interrupted
            self._fd = None


def device_for(names: list[str], actor_id: int, lock_dir: str | Path) -> EmulatedDevice | None:
    """Actor `actor_id`'s emulated device (``names[actor_id % len(names)]``), or None without any."""
    if not names:
        return None
    return EmulatedDevice(names[actor_id % len(names)], Path(lock_dir) / "devices")


def latency_s(a: float, b: float, batch: int) -> float:
    """The emulated latency of one acting call on `batch` envs."""
    return a + b * batch


class EmulatedInference:
    """The acting policy on an emulated device: each call on N envs holds `device` (None: this
    actor's alone) for the forward pass and then ``latency_s + per_env_s * N`` of sleep (an
    inference server's batches grow and shrink). Everything else (``get_value``, ``critic``,
    ``parameters``) is the policy's own."""

    def __init__(self, policy, latency_s: float, device: EmulatedDevice | None = None, per_env_s: float = 0.0):
        self.policy, self.latency_s, self.per_env_s = policy, latency_s, per_env_s
        self.device = device if device is not None else contextlib.nullcontext()

    def __call__(self, td):
        with self.device:
            out = self.policy(td)
            pause = latency_s(self.latency_s, self.per_env_s, td.batch_size[0])
            if pause:
                time.sleep(pause)
        return out

    def __getattr__(self, name: str):
        return getattr(self.policy, name)


class SlowEnv:
    """An env whose every step takes `delay_s` longer: a slow actor, for tests and studies
    (``actors.slowdown_s``). Everything else is the env's own."""

    def __init__(self, env, delay_s: float):
        self.env, self.delay_s = env, delay_s

    def step(self, action):
        out = self.env.step(action)
        time.sleep(self.delay_s)
        return out

    def __getattr__(self, name: str):
        return getattr(self.env, name)
