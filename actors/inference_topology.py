"""Which inference server acts for which actor, and how a server announces itself to them.

``actors.inference: server`` runs one server per distinct entry of ``actors.devices``,
``actors.servers_per_device`` times. Each writes ``inference/server_<id>.json`` in the run directory
(its endpoint and incarnation); its actors read that file to find it, and find a restarted one by
its new incarnation. No torch here: the launchers import it to count the servers.
"""

from __future__ import annotations

import json
import os
import socket
import uuid
from pathlib import Path

import torch

from shared.config import Config
from shared.files import write_json_atomic


def server_devices(cfg: Config) -> list[str]:
    """Each server's device, by server id: ``actors.devices`` without repeats, in order, each
    ``actors.servers_per_device`` times (launch/run_local.sh counts them the same way)."""
    k = cfg.actors.servers_per_device
    return [d for d in dict.fromkeys(cfg.actors.devices) for _ in range(k)]


def server_of(cfg: Config, actor_id: int) -> int:
    """The server that acts for actor `actor_id`: one of its device's, the actors of a device dealt
    out to its ``actors.servers_per_device`` servers in turn."""
    devices, k = cfg.actors.devices, cfg.actors.servers_per_device
    mine = devices[actor_id % len(devices)]
    first = list(dict.fromkeys(devices)).index(mine) * k
    turn = sum(1 for i in range(actor_id) if devices[i % len(devices)] == mine)
    return first + turn % k


def served_actors(cfg: Config, server_id: int) -> list[int]:
    return [i for i in range(cfg.actors.num_actors) if server_of(cfg, i) == server_id]


def endpoint_path(run_dir: str | Path, server_id: int) -> Path:
    return Path(run_dir) / "inference" / f"server_{server_id}.json"


def read_endpoint(path: Path) -> dict | None:
    """``{"endpoint", "incarnation"}`` from a server's file, or None while there is none (or it is
    not a file a server of ours wrote)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not (isinstance(data, dict) and isinstance(data.get("endpoint"), str)
            and isinstance(data.get("incarnation"), str)):
        return None
    return data


def write_endpoint(path: Path, endpoint: str, critic: bool, base_digest: str, unix: Path | None = None,
                   layout: dict | None = None) -> str:
    """Announce a server to its actors (atomically); returns its new incarnation. `unix`: the Unix
    socket it also listens on (actors on this host use it). `layout`: what the policy adds to the
    rollout schema (:func:`layout_json`), which the actors, holding no copy of it, take from here."""
    incarnation = uuid.uuid4().hex[:12]
    info = {"endpoint": endpoint, "incarnation": incarnation, "pid": os.getpid(), "critic": critic,
            "base_digest": base_digest, "layout": layout or {"chunk": 1, "extras": {}, "actions_per_call": 1}}
    if unix is not None:
        info.update(unix=str(unix), host=socket.gethostname())
    write_json_atomic(path, info)
    return incarnation


_DTYPES = {str(d): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
                               torch.int32, torch.uint8, torch.bool)}


def layout_json(policy) -> dict:
    """A policy's rollout layout (``shared.rollout.policy_layout``) and ``actions_per_call``, as JSON."""
    from shared.rollout import policy_layout
    lay = policy_layout(policy)
    return {"chunk": lay["chunk"], "actions_per_call": int(getattr(policy, "actions_per_call", 0) or lay["chunk"]),
            "extras": {k: [list(shape), str(dtype)] for k, (shape, dtype) in lay["extras"].items()}}


def layout_from_json(data) -> tuple[int, int, dict[str, tuple[tuple[int, ...], torch.dtype]]]:
    """``(chunk, actions_per_call, extras)`` from a server's endpoint file (:func:`layout_json`);
    a file without one (an older server): one action per call, no extras."""
    if not isinstance(data, dict):
        return 1, 1, {}
    chunk, per_call, extras = data.get("chunk", 1), data.get("actions_per_call", 1), data.get("extras", {})
    ok = (isinstance(chunk, int) and isinstance(per_call, int) and 1 <= per_call <= chunk and isinstance(extras, dict)
          and all(isinstance(v, list) and len(v) == 2 and isinstance(v[0], list) and v[1] in _DTYPES
                  and all(isinstance(d, int) and d >= 0 for d in v[0]) for v in extras.values()))
    if not ok:
        raise ValueError(f"the inference server's endpoint file holds a malformed rollout layout: {str(data)[:200]}")
    return chunk, per_call, {k: (tuple(v[0]), _DTYPES[v[1]]) for k, v in extras.items()}
