"""Weights through shared memory, for actors on the learner's host (``learner.weights_transport: "shm"``).

Broadcasting a large model's weights (a 1B-parameter policy is 2 GB in bf16) through TCP costs a
kernel copy per subscriber and serialises them on one socket. On one host the learner instead writes
each published version once into a ring of ``slots`` in a shared-memory file (``/dev/shm``), and the
ZeroMQ weights socket carries only a small control message (version, slot, layout); every actor copies
the slot straight into its own parameters. ZeroMQ stays the control channel (and the weights channel
for actors on other hosts, ``weights_transport: "zmq"``).

Consistency is a seqlock per slot: the writer stores ``begin = version``, the tensors, then
``end = version``; a reader copies only if ``begin == end == version`` and checks ``begin`` again after
copying. A reader that falls ``slots - 1`` versions behind can see its slot being rewritten; it then
reports the copy as torn (its caller keeps its old weights and takes the next version). The file is
removed by the learner when it exits (and by the launcher if the learner was killed).

The seqlock relies on stores becoming visible in program order (x86-64's TSO). On weakly ordered
CPUs (aarch64) a reader could in principle see the end marker before the payload; there, add a
checksum per slot before trusting this path.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import torch
from tensordict import TensorDict, TensorDictBase

ALIGN = 64
HEADER_BYTES = 64          # per slot: begin version, end version (int64), padding
SHM_DIR = Path("/dev/shm") if Path("/dev/shm").is_dir() else None


def _layout(td: TensorDictBase) -> tuple[list[list], int]:
    """[[key path, dtype name, shape, offset], ...] and the payload size of one slot."""
    entries, offset = [], 0
    for key, t in td.items(include_nested=True, leaves_only=True):
        path = list(key) if isinstance(key, tuple) else [key]
        offset = (offset + ALIGN - 1) // ALIGN * ALIGN
        entries.append([path, str(t.dtype).removeprefix("torch."), list(t.shape), offset])
        offset += t.numel() * t.element_size()
    return entries, (offset + ALIGN - 1) // ALIGN * ALIGN


def default_path(tag: str) -> Path:
    base = SHM_DIR or Path(os.environ.get("TMPDIR", "/tmp"))
    return base / f"tandem-{os.getpid()}-{tag}.weights"


class ShmWeightsWriter:
    """The learner's side: a ring of `slots` copies of the weights in one shared-memory file."""

    def __init__(self, template: TensorDictBase, path: Path, slots: int = 3):
        self.layout, self.payload = _layout(template)
        self.slots, self.path = slots, Path(path)
        self.slot_bytes = HEADER_BYTES + self.payload
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            try:   # reserve the memory now: a too-small /dev/shm fails here, clearly, not with SIGBUS later
                os.posix_fallocate(fd, 0, self.slot_bytes * slots)
            except OSError as e:
                os.close(fd)
                fd = -1
                self.path.unlink(missing_ok=True)
                raise OSError(f"{self.path}: cannot reserve {self.slot_bytes * slots / 2**20:.0f} MiB of shared "
                              f"memory for {slots} weight slots ({e.strerror}); enlarge /dev/shm or lower "
                              f"learner.shm_slots") from e
            self._mm = mmap.mmap(fd, self.slot_bytes * slots)
        finally:
            if fd >= 0:
                os.close(fd)
        self._buf = torch.frombuffer(self._mm, dtype=torch.uint8)
        self._headers = [self._buf[i * self.slot_bytes:i * self.slot_bytes + 16].view(torch.int64)
                         for i in range(slots)]
        for h in self._headers:
            h.fill_(-1)

    def write(self, td: TensorDictBase, version: int) -> dict:
        """Copy `td` into the slot of `version`; returns the meta the control message carries."""
        slot = version % self.slots
        header = self._headers[slot]
        header[0] = version            # begin: readers of the old version in this slot now see a mismatch
        base = slot * self.slot_bytes + HEADER_BYTES
        for path, dtype, shape, offset in self.layout:
            t = td.get(tuple(path))
            n = t.numel() * t.element_size()
            dst = self._buf[base + offset:base + offset + n].view(t.dtype).view(t.shape)
            dst.copy_(t.detach())
        header[1] = version            # end: the slot is whole
        return {"shm": str(self.path), "slot": slot, "slot_bytes": self.slot_bytes, "layout": self.layout}

    def close(self, unlink: bool = True) -> None:
        del self._headers, self._buf
        self._mm.close()
        if unlink:
            self.path.unlink(missing_ok=True)


class ShmWeightsReader:
    """An actor's side: maps the learner's file once and copies a slot into a policy."""

    def __init__(self):
        self._mm: mmap.mmap | None = None
        self._path: str | None = None
        self._buf: torch.Tensor | None = None

    def _map(self, path: str) -> None:
        if self._path == path:
            return
        self.close()
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            self._mm = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        # torch.frombuffer wants a writable buffer; the mapping is read-only, so go through numpy.
        import warnings

        import numpy as np
        with warnings.catch_warnings():   # read-only on purpose: nothing here writes through it
            warnings.simplefilter("ignore", UserWarning)
            self._buf = torch.from_numpy(np.frombuffer(self._mm, dtype=np.uint8))
        self._path = path

    def views(self, meta: dict) -> TensorDict:
        """Zero-copy tensors over the slot `meta` names (valid until the slot is rewritten)."""
        self._map(meta["shm"])
        base = meta["slot"] * meta["slot_bytes"] + HEADER_BYTES
        out = TensorDict({}, batch_size=[])
        for path, dtype, shape, offset in meta["layout"]:
            dt = getattr(torch, dtype)
            n = dt.itemsize
            for s in shape:
                n *= s
            out.set(tuple(path), self._buf[base + offset:base + offset + n].view(dt).view(shape))
        return out

    def slot_version(self, meta: dict) -> tuple[int, int]:
        h = self._buf[meta["slot"] * meta["slot_bytes"]:meta["slot"] * meta["slot_bytes"] + 16].view(torch.int64)
        return int(h[0]), int(h[1])

    def copy_into(self, load, meta: dict, version: int) -> bool:
        """``load(views)`` (which copies the views into the policy) if the slot holds `version` whole,
        before and after. Returns False (torn or overwritten) when the caller must not use the result."""
        self._map(meta["shm"])
        if self.slot_version(meta) != (version, version):
            return False
        load(self.views(meta))
        return self.slot_version(meta)[0] == version

    def close(self) -> None:
        self._buf = None
        if self._mm is not None:
            self._mm.close()
            self._mm = None
        self._path = None


def load_published_(policy: torch.nn.Module, td: TensorDictBase, meta: dict, reader: ShmWeightsReader | None,
                    device: torch.device | str) -> bool:
    """Load a weights message into `policy`, whichever transport carried it. Returns False when a
    shared-memory slot was torn or already rewritten (the policy must then not be used until the
    next version loads)."""
    from shared.policies import load_weights_
    if "shm" not in meta:
        load_weights_(policy, td.to(device))
        return True
    if reader is None:
        raise ValueError("weights came through shared memory, but this process has no ShmWeightsReader")
    return reader.copy_into(lambda views: load_weights_(policy, views.to(device)), meta, int(meta["version"]))
