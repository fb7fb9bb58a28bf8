"""What verifying checkpoints costs: a checkpoint of a 0.5B-parameter policy (float32, 2 GB) written and
loaded with and without its SHA-256, each against the bare ``torch.save`` / ``torch.load`` measured in
the same run, in alternation.

    python benchmarks/checkpoint_verify.py [--params 5e8] [--repeats 3] [--dir /tmp] [--json OUT.json]

The digested write (``learner.checkpoint.save_atomic``) is ``torch.save`` to a temp file, fsynced, its
bytes read back and hashed (SHA-256), the digest file written and both renamed into place; the bare
write is ``torch.save`` to a file, fsynced. The verified load
(``learner.checkpoint.load_checkpoint``) reads the file once to hash it, then ``torch.load``s it; the
bare load is ``torch.load`` alone. The page cache is warm for both loads (the file was just written),
as it is for a learner resuming on the machine that wrote the checkpoint.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks._common import write_results  # noqa: E402
from learner.checkpoint import digest_path, load_checkpoint, save_atomic  # noqa: E402


def make_state(params: int) -> dict:
    """A policy of `params` float32 parameters in tensors of 16M (a transformer's weight shapes)."""
    chunk = 1 << 24
    tensors, left, i = {}, params, 0
    while left > 0:
        n = min(chunk, left)
        tensors[f"layers.{i}.weight"] = torch.empty(n).uniform_(-0.05, 0.05)
        left -= n
        i += 1
    return {"policy": tensors, "version": 1, "env_steps": 0}


def bare_save(state: dict, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(state: dict, directory: Path, repeats: int) -> list[dict]:
    """`repeats` rounds of the four timings; odd rounds run the digested write and load first, even
    rounds the bare ones, so that neither always follows the other's writeback."""
    bare, verified = directory / "bare.pt", directory / "ckpt_00000001.pt"
    steps = {"write_bare_s": lambda: bare_save(state, bare), "write_digest_s": lambda: save_atomic(verified, state),
             "load_bare_s": lambda: torch.load(bare, weights_only=True),
             "load_verified_s": lambda: load_checkpoint(verified)}
    rows = []
    for r in range(repeats):
        order = (["write_digest_s", "write_bare_s", "load_verified_s", "load_bare_s"] if r % 2 == 0
                 else ["write_bare_s", "write_digest_s", "load_bare_s", "load_verified_s"])
        row = {"repeat": r + 1}
        for key in order:
            row[key] = timed(steps[key])
        rows.append(row)
        print(f"[checkpoint_verify] repeat {r + 1}: " + ", ".join(f"{k} {row[k]:.2f}" for k in steps), flush=True)
    for p in (bare, verified, digest_path(verified)):
        p.unlink(missing_ok=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=float, default=5e8, help="policy parameters (float32)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()), help="where the files are written")
    p.add_argument("--json", type=Path, help="write the records here")
    a = p.parse_args(argv)
    state = make_state(int(a.params))
    size = sum(t.numel() * t.element_size() for t in state["policy"].values())
    with tempfile.TemporaryDirectory(dir=a.dir) as d:
        rows = measure(state, Path(d), a.repeats)
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "repeat"}
    print(f"[checkpoint_verify] {int(a.params):,} parameters, {size / 1e9:.2f} GB; medians: write "
          f"{med['write_bare_s']:.2f} s bare, {med['write_digest_s']:.2f} s with the digest "
          f"({med['write_digest_s'] / med['write_bare_s']:.2f}x); load {med['load_bare_s']:.2f} s bare, "
          f"{med['load_verified_s']:.2f} s verified ({med['load_verified_s'] / med['load_bare_s']:.2f}x)")
    if a.json:
        write_results(a.json, {"params": int(a.params), "bytes": size, "records": rows, "median": med},
                      "checkpoint_verify")
    return 0


if __name__ == "__main__":
    sys.exit(main())
