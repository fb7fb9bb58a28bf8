"""Retrain from a recorded run, deterministically, on exactly the data the learner trained on.

    launch/run_local.sh --config configs/pendulum_ppo.json --out RUN --record --set trainer.buffer_type=async
    python launch/replay.py RUN [--out DIR] [--set algorithm.cfg.correction=vtrace ...] [--updates N]

``--record`` makes the learner store every batch it trains on (``RUN/record/update_NNNNNNN``, a
tensordict memmap ``[k, N, T]`` as received, with the weight versions that acted) and one line per
update in ``RUN/record/index.jsonl`` (the learner's version before the update, the rollouts' actors,
sequence numbers and versions, and the reward scaler's std at that moment). ``replay.py`` builds a
fresh learner from ``RUN/config.json`` (plus ``--set`` overrides, e.g. another off-policy
correction) and runs the same updates in the same order with the same versions, so lags are the
recorded ones. The learner's seed fixes its initial weights and minibatch order, so replaying a
record twice with the same overrides gives bit-identical weights; a different correction gives a
comparison on exactly the same data. With ``--out`` it writes metrics.jsonl, versions.jsonl,
TensorBoard events and a final checkpoint there; it always prints the final weights' SHA-256.
Sampling decisions (what the actors did) are not replayed: the data is fixed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from tensordict import TensorDict  # noqa: E402

from learner.learner import Learner, ListPublisher, learner_threads  # noqa: E402
from learner.logs import RunLogger  # noqa: E402
from shared import keys  # noqa: E402
from shared.chunks import env_steps_of  # noqa: E402
from shared.config import ConfigError, load_config, save_config  # noqa: E402
from shared.policies import weights_digest  # noqa: E402
from shared.run_dir import RunDir, RunDirError  # noqa: E402


class ReplayError(RunDirError):
    """The record is missing or inconsistent; the message names the file. The reader's own errors
    (a missing or malformed file) are RunDirError, this class's base."""


def _infos(entry: dict, data: TensorDict) -> list[dict]:
    """The learner's per-rollout bookkeeping, rebuilt from the index and the data."""
    infos = []
    for i, r in enumerate(entry["rollouts"]):
        versions = data[i][keys.POLICY_VERSION]
        uniq, counts = torch.unique(versions, return_counts=True)
        infos.append({"actor": r["actor"], "seq": r["seq"], "policy_version": int(versions.min()),
                      "policy_version_max": int(versions.max()), "env_steps": env_steps_of(data[i]),
                      "version_counts": list(zip(uniq.tolist(), counts.tolist())), "episodes": 0,
                      "episode_length_mean": None, "received": None, "sent": None})
    return infos


def inexact_reason(cfg, record_dir: Path | None = None) -> str | None:
    """Why replaying this run's record cannot reproduce its weights bit for bit (None: it can)."""
    if (cfg.learner.torch_threads == "idle" and torch.device(cfg.learner.device).type == "cpu"
            and not (record_dir is not None and (Path(record_dir) / "threads.jsonl").is_file())):
        return ("the run used learner.torch_threads \"idle\" and its record has no threads.jsonl (recorded before "
                "2026-11-27): its update widened its intra-op threads while the actors idled, and CPU float sums "
                "depend on the thread count, so this replay trains on the same data but does not reproduce the "
                "run's weights bit for bit")
    return None


_WARNED: set[Path] = set()   # run directories whose inexact replay this process has reported


def warn_inexact(run_dir: Path, why: str | None) -> bool:
    """Say why a replay of `run_dir` is not bit for bit: once per run directory and process (a
    sweep such as replay_corrections.py replays one record many times). True if it printed."""
    key = Path(run_dir).resolve()
    if why is None or key in _WARNED:
        return False
    _WARNED.add(key)
    print(f"[replay] {run_dir}: {why}", file=sys.stderr, flush=True)
    return True


def replay(run_dir: Path, overrides: list[str] | None = None, out_dir: Path | None = None,
           max_updates: int | None = None, progress: bool = False) -> Learner:
    """Retrain on `run_dir`'s record; returns the learner after the last replayed update."""
    run = RunDir(run_dir)
    config_path = run.require("config.json")
    cfg = load_config(config_path, overrides or [])
    record_dir = run.path / "record"
    warn_inexact(run.path, inexact_reason(load_config(config_path), record_dir))
    cfg.trainer.record = False
    cfg.learner.weights_transport = "zmq"       # nobody listens: no shared-memory ring
    entries = run.record_index()
    if entries and entries[0]["version"] != 0:
        raise ReplayError(f"{record_dir / 'index.jsonl'}: the record starts at version {entries[0]['version']} "
                          f"(a resumed run): replaying it from fresh weights would not be the same training")
    if max_updates is not None:
        entries = entries[:max_updates]
    threads = run.record_threads()
    torch.set_num_threads(learner_threads(cfg))   # as the learner process: same float sums, same bits
    logger = None
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, out_dir / "config.json")
        logger = RunLogger(out_dir, config=cfg.to_dict())
    learner = Learner(cfg, out_dir, ListPublisher(), logger=logger)
    learner.publish()
    t0 = time.time()
    for n, entry in enumerate(entries, 1):
        path = record_dir / entry["dir"]
        try:
            data = TensorDict.load_memmap(path)
        except Exception as e:  # noqa: BLE001 - any failure to read is reported with its path
            raise ReplayError(f"{path}: cannot load the recorded batch: {e}") from e
        if entry["version"] < learner.version:
            raise ReplayError(f"{record_dir / 'index.jsonl'}: update {entry['update']} has version "
                              f"{entry['version']}, before the previous one ({learner.version})")
        learner.version = entry["version"]       # a resumed run's record starts later
        if learner.cpu.idle_threads is not None and entry["update"] in threads:
            learner.cpu.replay_schedule = list(threads[entry["update"]])   # the run's threads, minibatch by minibatch
        learner.update_once(data, _infos(entry, data), reward_std=entry.get("reward_std"))
        learner.publisher.published.clear()      # nobody listens; keep memory flat
        if progress and (n % 50 == 0 or n == len(entries)):
            print(f"[replay] {n}/{len(entries)} updates, v{learner.version}, {time.time() - t0:.1f} s", flush=True)
    if out_dir is not None:
        learner.save()
    return learner


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", type=Path)
    p.add_argument("--out", type=Path, default=None, help="write logs and a final checkpoint here")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="config override, e.g. algorithm.cfg.correction=vtrace (repeatable)")
    p.add_argument("--updates", type=int, default=None, help="replay only the first N updates")
    args = p.parse_args(argv)
    try:
        learner = replay(args.run_dir, args.sets, args.out, args.updates, progress=True)
    except (RunDirError, ConfigError) as e:
        print(f"replay.py: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"updates": learner.updates, "version": learner.version,
                      "env_steps_trained": learner.env_steps_trained,
                      "weights_sha256": weights_digest(learner.policy)}))
    return 0


if __name__ == "__main__":
    from shared.teardown import exit_now
    exit_now(main())
