"""Several learner ranks training one policy: ``torch.distributed`` DDP, started by ``torchrun``.

``learner.devices: ["cuda:0", "cuda:1"]`` (or ``["cpu", "cpu"]``: gloo, for tests) makes
``launch/run_local.sh`` start the learner as ``torchrun --standalone --nproc_per_node W -m learner``;
each process finds its rank in the environment torchrun sets and joins the process group here
(NCCL on GPUs, gloo on CPU). ``launch/run_ray.py`` sets the same variables (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) itself, with ranks on several nodes.

How data is split -- actors are assigned to ranks, not scattered by rank 0: every rank binds its
own rollouts socket and actor ``i`` sends to rank ``i % W``. Scattering from rank 0 would pass every
byte through one process twice (receive, then send on), and rank 0 would need the whole batch's
memory; with assignment each rank receives, decodes and checks only its share, so ingest scales
with the ranks. The price is that an update needs every rank to have its share: the training loop
agrees on that each iteration (one small all-gather) and all ranks update together, so versions
stay in lock step. Each rank computes advantages on its own rollouts (GAE and GRPO groups never
span rollouts), DDP averages the gradients, observation-normaliser and reward-scale statistics are
combined exactly over ranks, and early stopping on KL uses the mean over ranks: every rank applies
the same update and holds the same weights. Rank 0 publishes weights, runs the evaluator and writes
the logs, the checkpoints and ``endpoints.json`` (with every rank's rollouts address).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


@dataclass
class Ranks:
    rank: int
    world: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        out = t.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        return out

    def all_gather_ints(self, values: list[int]) -> list[list[int]]:
        """Every rank's `values` (same length on all ranks), in rank order."""
        t = torch.tensor(values, dtype=torch.int64)
        out = [torch.zeros_like(t) for _ in range(self.world)]
        dist.all_gather(out, t)
        return [o.tolist() for o in out]

    def all_gather_text(self, text: str, max_bytes: int = 1024) -> list[str]:
        """Every rank's `text` (UTF-8, at most `max_bytes`), in rank order: raw bytes through gloo,
        never a pickled object (``all_gather_object`` would unpickle what a peer sent)."""
        data = text.encode()
        if len(data) > max_bytes:
            raise ValueError(f"all_gather_text: {len(data)} bytes, more than {max_bytes}")
        row = torch.zeros(max_bytes + 1, dtype=torch.int64)
        row[0] = len(data)
        row[1:1 + len(data)] = torch.tensor(list(data), dtype=torch.int64)
        out = [torch.zeros_like(row) for _ in range(self.world)]
        dist.all_gather(out, row)
        return [bytes(o[1:1 + int(o[0])].tolist()).decode() for o in out]


def ranks_from_env(devices: list[str]) -> Ranks | None:
    """Join the process group when started by torchrun with ``WORLD_SIZE > 1``; None otherwise."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return None
    rank = int(os.environ["RANK"])
    if len(devices) != world:
        raise ValueError(f"learner.devices lists {len(devices)} devices but torchrun started {world} ranks")
    device = torch.device(devices[rank])
    # On GPUs: NCCL for the gradients, gloo for the small CPU-side agreements (counters, KL, statistics).
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # The collectives here are small and frequent; a stuck peer fails the run instead of hanging it.
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=300))
    return Ranks(rank, world, device)


class _EvaluateActions(nn.Module):
    """DDP synchronises gradients of what runs through its ``forward``: route ``evaluate_actions`` there."""

    def __init__(self, policy: nn.Module):
        super().__init__()
        self.policy = policy

    def forward(self, td):
        return self.policy.evaluate_actions(td)


class DDPPolicy:
    """What the update loops see in place of the policy: ``evaluate_actions`` through DDP."""

    def __init__(self, policy: nn.Module, ranks: Ranks, find_unused: bool):
        ids = [ranks.device.index] if ranks.device.type == "cuda" else None
        # broadcast_buffers=False: the normaliser statistics are kept equal by exact combination,
        # and must not be overwritten with rank 0's in the middle of an update.
        self.ddp = DistributedDataParallel(_EvaluateActions(policy), device_ids=ids, broadcast_buffers=False,
                                           find_unused_parameters=find_unused)
        self.policy = policy

    def evaluate_actions(self, td):
        return self.ddp(td)

    def parameters(self):
        return self.policy.parameters()
