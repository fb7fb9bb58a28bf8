"""Weights through shared memory, for actors on the learner's host (``learner.weights_transport: "shm"``).

Broadcasting a large model's weights (a 1B-parameter policy is 2 GB in bf16) through TCP costs a
kernel copy per subscriber and serialises them on one socket. On one host the learner instead writes
each published version once into a ring of ``slots`` in a shared-memory file (``/dev/shm``), and the
ZeroMQ weights socket carries only a small control message (version, slot, layout); every actor copies
the slot straight into its own parameters. ZeroMQ stays the control channel (and the weights channel
for actors on other hosts, ``weights_transport: "zmq"``).

Consistency is a seqlock per slot: the writer stores ``begin = version``, the tensors, then
``end = version``; a reader copies only if ``begin == version`` and checks ``begin`` again after
copying. The copies are pipelined: the learner announces a version before writing it and advances a
``progress`` word (bytes written) every few MiB; readers copy each chunk as soon as it is written, so
the learner's copy into the ring and the actors' copies out of it overlap instead of running back to
back. A reader that falls ``slots - 1`` versions behind can see its slot being rewritten; it then
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
HEADER_BYTES = 64          # per slot: begin version, end version, progress bytes (int64), padding
CHUNK_BYTES = 8 << 20      # the writer publishes progress, and readers copy, in pieces of this size
WAIT_S = 0.0002            # a reader's pause while the writer catches up (no busy spinning)
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
        self._headers = [self._buf[i * self.slot_bytes:i * self.slot_bytes + 24].view(torch.int64)
                         for i in range(slots)]
        for h in self._headers:
            h.fill_(-1)

    def begin(self, version: int) -> dict:
        """Claim the slot of `version` (readers of its old version now see a mismatch); returns the
        meta the control message carries. Send it, then :meth:`write_body`: readers start at once."""
        slot = version % self.slots
        header = self._headers[slot]
        header[0] = version
        header[2] = 0
        return {"shm": str(self.path), "slot": slot, "slot_bytes": self.slot_bytes, "layout": self.layout}

    def write_body(self, td: TensorDictBase, version: int) -> None:
        """Copy `td` into the slot claimed by :meth:`begin`, advancing ``progress`` chunk by chunk."""
        slot = version % self.slots
        header = self._headers[slot]
        base = slot * self.slot_bytes + HEADER_BYTES
        for path, _, _, offset in self.layout:
            src = td.get(tuple(path)).detach().reshape(-1)
            n = src.numel() * src.element_size()
            dst = self._buf[base + offset:base + offset + n].view(src.dtype)
            step = max(1, CHUNK_BYTES // src.element_size())
            for i in range(0, src.numel(), step):
                dst[i:i + step].copy_(src[i:i + step])
                header[2] = offset + min(n, (i + step) * src.element_size())
        header[1] = version            # end: the slot is whole

    def write(self, td: TensorDictBase, version: int) -> dict:
        """:meth:`begin` and :meth:`write_body` in one (nobody reads until the message is sent)."""
        meta = self.begin(version)
        self.write_body(td, version)
        return meta

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

    def _header(self, meta: dict) -> torch.Tensor:
        start = meta["slot"] * meta["slot_bytes"]
        return self._buf[start:start + 24].view(torch.int64)

    def slot_version(self, meta: dict) -> tuple[int, int]:
        h = self._header(meta)
        return int(h[0]), int(h[1])

    def stream_into(self, dst: TensorDictBase, meta: dict, version: int, timeout_s: float = 120.0) -> bool:
        """Copy the slot into `dst` (same keys, shapes, dtypes: e.g. a policy's ``weights_td``) chunk
        by chunk as the writer produces it. False if the slot was rewritten (or never finished in
        `timeout_s`): `dst` then holds a mix and must not be used."""
        import time
        self._map(meta["shm"])
        header = self._header(meta)
        base = meta["slot"] * meta["slot_bytes"] + HEADER_BYTES
        deadline = time.monotonic() + timeout_s
        for path, dtype, shape, offset in meta["layout"]:
            target = dst.get(tuple(path))
            dt = getattr(torch, dtype)
            if target.dtype != dt or list(target.shape) != list(shape):
                raise ValueError(f"shared-memory weights {'.'.join(path)}: {dtype} {shape}, the policy has "
                                 f"{target.dtype} {list(target.shape)}")
            n = target.numel() * dt.itemsize
            src = self._buf[base + offset:base + offset + n].view(dt)
            out = target.view(-1)
            step = max(1, CHUNK_BYTES // dt.itemsize)
            for i in range(0, target.numel(), step):
                need = offset + min(n, (i + step) * dt.itemsize)
                while int(header[2]) < need and int(header[1]) != version:
                    if int(header[0]) != version or time.monotonic() > deadline:
                        return False
                    time.sleep(WAIT_S)
                if int(header[0]) != version:
                    return False
                out[i:i + step].copy_(src[i:i + step], non_blocking=True)
        return int(header[0]) == version

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
    from shared.policies import weights_td
    dst = weights_td(policy)      # the live parameters and buffers: copied into in place
    if set(dst.keys(include_nested=True, leaves_only=True)) != {tuple(p) if len(p) > 1 else p[0]
                                                                 for p, *_ in meta["layout"]}:
        raise ValueError("shared-memory weights do not match the policy's parameters")
    return reader.stream_into(dst, meta, int(meta["version"]))
