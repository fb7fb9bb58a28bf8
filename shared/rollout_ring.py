"""Rollouts through a same-host ring of preallocated slots (``actors.rollout_transport: "ring"``).

With ZeroMQ, every rollout's tensors cross the kernel twice (actor to socket, socket to learner);
for large observations on one host that is most of the cost. With the ring, the learner allocates,
for each actor, ``slots`` rollout buffers of the run's schema (:func:`shared.rollout.rollout_template`):
on the CPU in one shared-memory file (``/dev/shm/tandem-*.rollouts``), on CUDA in the learner's
device memory, shared by CUDA IPC (the handle travels as msgpack bytes inside the file, never
pickle). The actor writes its rollout into a free slot and sends over ZeroMQ only the usual meta
plus ``ring = {"slot", "generation", "epoch", "nonce"}``, with no tensor frame. The learner checks
the header, copies the slot into a private staging rollout, releases the slot, and then runs every
check :class:`learner.ingest.Intake` runs on a decoded message, on the private copy (checking
shared memory in place would let a producer change it between the check and the copy).

Ownership, per slot, is a state word in the file's control block (always in ``/dev/shm``, also with
CUDA payloads: the state must be visible to the CPU without a device sync)::

    FREE --actor claims (generation += 1)--> WRITING --actor, after its copy--> READY
    READY --learner, after its copy (or reclaiming a dead producer's slot)--> FREE

Each state has exactly one writer: the actor writes a slot only while it is FREE or WRITING, the
learner only while it is READY. So no compare-and-swap is needed, and a slot is never rewritten
before the learner released it: an actor with no FREE slot waits (bounded, checking its stop
event) and then raises :class:`RingFull`.

Every slot also records the ``generation`` of its last claim, the ``epoch`` of the producer that
claimed it and that producer's actor id. A header is taken only if its slot is READY and all three
match (plus the file's random ``nonce``): a stale header (a slot released and claimed again), a
header for another actor's slot or another learner's ring, a slot not READY, or a slot out of
range is a :class:`shared.wire.WireError`, dropped and counted like any malformed message.

A dead producer's slots. Each ring has an ``epoch`` word, written only by its actor: an actor
that attaches (a restart of the same id) increments it, and then returns to FREE the slots it left
in WRITING (its dead self was their only writer, and the learner never touches WRITING slots).
Slots the dead actor left READY may have their header still queued in ZeroMQ, so only the learner
(their owner while READY) may free them: whenever its receiver sees a ring's epoch change (it
looks at every receive-loop turn, and at every ring header), it frees the READY slots stamped with
another epoch. Their headers, if they arrive later, then fail the generation or state check and are
counted as malformed; the rollouts of a dead actor are lost, not mixed into another's. A producer
that is still alive while another attaches under its id (an operator's mistake) notices the epoch
change at its next claim and stops with an error.

The ring file is found through ``endpoints.json`` (``"rollout_ring": path``), and an actor checks
it like :mod:`shared.shm_weights` checks announcements: ``tandem-*.rollouts`` directly in the
shared-memory directory, a regular file (no symlink, no FIFO), its header's magic, format, number
of rings, slots, slot size and layout digest equal to what this actor computes from its own
config, and a size that is exactly what those numbers give. Across hosts the file is not there:
the config refuses ``ring`` where actors could be elsewhere (CURVE, a non-loopback
``learner.host``), and an actor given another host's endpoints fails at attach with a clear error.
The learner removes the file when it exits (and the launcher if the learner was killed). No
authentication beyond the file's mode (0600, this user): as for ``shm`` weights, a process of the
same user can write into the ring, and what it writes goes through the learner's checks.

Ordering relies on stores becoming visible in program order (x86-64's TSO), as in
:mod:`shared.shm_weights`; CUDA payloads are synchronised (the writer's stream, then READY; the
learner's copy, then FREE).
"""

from __future__ import annotations

import hashlib
import mmap
import os
import re
import secrets
import time
from pathlib import Path
from typing import Any, Callable

import msgpack
import torch
from tensordict import TensorDict, TensorDictBase

from shared.shm_weights import SHM_DIR, _align, _is_uint, _layout, map_untrusted, open_cuda_handle, pack_cuda_handle
from shared.wire import WireError

MAGIC = 0x54414E44454D5252          # "TANDEMRR"
FORMAT = 1
META_BYTES = 4096                   # file header: 16 int64 words, then the msgpack CUDA handle blob
CTRL_BYTES = 64                     # one cache line per control record (a ring's epoch, a slot's state)
MAX_BLOB_BYTES = META_BYTES - 128
WAIT_S = 0.0005                     # a producer's pause while every slot is taken
FREE, WRITING, READY = 0, 1, 2
_FILE_NAME = re.compile(r"tandem-[A-Za-z0-9_-]+\.rollouts")
# file header words
_W_MAGIC, _W_FORMAT, _W_RINGS, _W_SLOTS, _W_SLOT_BYTES, _W_DIGEST, _W_NONCE, _W_CUDA, _W_BLOB = range(9)
# slot control words
_S_STATE, _S_GEN, _S_EPOCH, _S_ACTOR = range(4)


class RingFull(TimeoutError):
    """Every slot of an actor's ring stayed taken for the whole wait: the learner released none."""


def _base_dir() -> Path:
    return SHM_DIR or Path(os.environ.get("TMPDIR", "/tmp"))


def default_path(tag: str) -> Path:
    return _base_dir() / f"tandem-{os.getpid()}-{tag}.rollouts"


def layout_digest(template: TensorDictBase) -> int:
    """A 63-bit digest of the slot layout (key paths, dtypes, shapes, offsets) of `template`."""
    entries, size = _layout(template)
    raw = msgpack.packb([sorted(entries, key=lambda e: e[0]), size], use_bin_type=True)
    return int.from_bytes(hashlib.sha256(raw).digest()[:8], "little") >> 1


def _file_bytes(rings: int, slots: int, slot_bytes: int, cuda: bool) -> tuple[int, int, int]:
    """(control offset, payload offset, file size) of a ring file."""
    ctrl = META_BYTES
    payload = _align(ctrl + rings * (1 + slots) * CTRL_BYTES)
    return ctrl, payload, payload + (0 if cuda else rings * slots * slot_bytes)


class _Mapped:
    """The words and payload of a mapped ring file (both sides)."""

    def _setup(self, mm: mmap.mmap, rings: int, slots: int, slot_bytes: int, cuda: bool) -> None:
        self._mm = mm
        self.rings, self.slots, self.slot_bytes = rings, slots, slot_bytes
        self._buf = torch.frombuffer(mm, dtype=torch.uint8)
        self.words = self._buf[:META_BYTES].view(torch.int64)
        ctrl, payload, _ = _file_bytes(rings, slots, slot_bytes, cuda)
        records = self._buf[ctrl:ctrl + rings * (1 + slots) * CTRL_BYTES].view(torch.int64).view(
            rings, 1 + slots, CTRL_BYTES // 8)
        self.epochs = records[:, 0, 0]           # [rings]
        self.ctl = records[:, 1:, :4]            # [rings, slots, (state, generation, epoch, actor)]
        self._payload_off = payload

    def _slot_bytes_view(self, payload: torch.Tensor, ring: int, slot: int) -> torch.Tensor:
        start = (ring * self.slots + slot) * self.slot_bytes
        return payload[start:start + self.slot_bytes]

    def _views(self, raw: torch.Tensor) -> TensorDict:
        """Tensors of the run's schema over one slot's bytes `raw` (no copy)."""
        out = TensorDict({}, batch_size=self.template.batch_size, device=raw.device)
        for path, dtype, shape, offset in self.layout:
            dt = self.template.get(tuple(path)).dtype
            n = self.template.get(tuple(path)).numel() * dt.itemsize
            out.set(tuple(path), raw[offset:offset + n].view(dt).view(shape))
        return out

    def _close_map(self) -> None:
        for name in ("words", "epochs", "ctl", "_buf"):
            self.__dict__.pop(name, None)
        if getattr(self, "_mm", None) is not None:
            self._mm.close()
            self._mm = None


class RolloutRing(_Mapped):
    """The learner's side: owns the file (and a CUDA payload), takes and releases slots.

    Args:
        template: one rollout of the run's schema (``Learner.template``).
        rings: one ring per actor (``actors.num_actors``).
        slots: slots per ring (``actors.rollout_ring_slots``).
        path: the control file (``default_path``).
        device: ``cpu`` (payload in the file) or a CUDA device (payload in its memory, shared by IPC).
    """

    def __init__(self, template: TensorDictBase, rings: int, slots: int, path: Path,
                 device: torch.device | str = "cpu"):
        self.template = template.to("cpu")
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        self.layout, payload = _layout(self.template)
        slot_bytes = payload
        _, _, size = _file_bytes(rings, slots, slot_bytes, cuda)
        self.path = Path(path)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            try:   # reserve the memory now: a too-small /dev/shm fails here, clearly, not with SIGBUS later
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                self.path.unlink(missing_ok=True)
                raise OSError(f"{self.path}: cannot reserve {size / 2**20:.0f} MiB of shared memory for "
                              f"{rings} x {slots} rollout slots ({e.strerror}); enlarge /dev/shm or lower "
                              f"actors.rollout_ring_slots") from e
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._setup(mm, rings, slots, slot_bytes, cuda)
        self.nonce = secrets.randbits(62) + 1
        self._payload = None
        blob = b""
        if cuda:
            self._payload = torch.zeros(rings * slots * slot_bytes, dtype=torch.uint8, device=self.device)
            blob = pack_cuda_handle(self._payload)
            if len(blob) > MAX_BLOB_BYTES:
                raise RuntimeError(f"CUDA IPC handle of {len(blob)} bytes does not fit the ring file's header")
            self._buf[128:128 + len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        else:
            self._payload = self._buf[self._payload_off:]
        self.ctl.zero_()
        self.epochs.zero_()
        w = self.words
        w[_W_FORMAT], w[_W_RINGS], w[_W_SLOTS], w[_W_SLOT_BYTES] = FORMAT, rings, slots, slot_bytes
        w[_W_DIGEST], w[_W_NONCE], w[_W_CUDA], w[_W_BLOB] = layout_digest(self.template), self.nonce, int(cuda), len(blob)
        w[_W_MAGIC] = MAGIC          # last: a reader that sees it sees the rest
        self._seen_epoch = [0] * rings
        self.reclaimed = 0           # READY slots of dead producers freed
        self.staging = self.template.to(self.device).clone()   # what checks and the buffer copy read

    def take(self, actor: int, header: Any) -> TensorDict:
        """Copy the slot `header` names (actor `actor`'s ring) into the learner's staging rollout and
        release the slot. Returns the staging rollout (valid until the next call).

        Raises:
            WireError: a malformed header, another ring's, a slot out of range, a slot not READY, or
                one whose generation, epoch or producer differs; nothing was copied or released.
        """
        if not _is_uint(actor, self.rings):
            raise WireError(f"ring header from actor {str(actor)[:40]}: no ring for it ({self.rings} rings)")
        if not isinstance(header, dict) or set(header) != {"slot", "generation", "epoch", "nonce"}:
            raise WireError("ring header must be a map of slot, generation, epoch and nonce")
        slot, gen, epoch, nonce = header["slot"], header["generation"], header["epoch"], header["nonce"]
        if not all(_is_uint(x, 1 << 63) for x in (slot, gen, epoch, nonce)):
            raise WireError("ring header: slot, generation, epoch and nonce must be ints in [0, 2**63)")
        if nonce != self.nonce:
            raise WireError("ring header names another rollout ring (a learner that has exited?)")
        if slot >= self.slots:
            raise WireError(f"ring header: slot {slot} out of range (actor {actor}'s ring has {self.slots})")
        self.reclaim(actor)
        state, s_gen, s_epoch, s_actor = self.ctl[actor, slot].tolist()
        if state != READY:
            raise WireError(f"ring header: actor {actor}'s slot {slot} is not ready "
                            f"({ {FREE: 'free', WRITING: 'being written'}.get(state, state)})")
        if (s_gen, s_epoch, s_actor) != (gen, epoch, actor):
            raise WireError(f"ring header: actor {actor}'s slot {slot} holds generation {s_gen} of epoch {s_epoch} "
                            f"from actor {s_actor}, the header says generation {gen} of epoch {epoch} (stale)")
        raw = self._slot_bytes_view(self._payload, actor, slot)
        self.staging.update_(self._views(raw))
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self.ctl[actor, slot, _S_STATE] = FREE
        for k, t in self.staging.items(include_nested=True, leaves_only=True):
            if t.dtype is torch.bool and t.numel() and bool(t.view(torch.uint8).gt(1).any()):
                raise WireError(f"ring rollout {k!r}: bool bytes must be 0 or 1")
        return self.staging

    def reclaim(self, actor: int | None = None) -> int:
        """Free the READY slots a dead producer left, in every ring whose epoch changed (or only
        `actor`'s). Returns how many were freed."""
        freed = 0
        for i in range(self.rings) if actor is None else (actor,):
            epoch = int(self.epochs[i])
            if epoch == self._seen_epoch[i]:
                continue
            self._seen_epoch[i] = epoch
            ctl = self.ctl[i]
            dead = (ctl[:, _S_STATE] == READY) & (ctl[:, _S_EPOCH] != epoch)
            n = int(dead.sum())
            if n:
                ctl[dead, _S_STATE] = FREE
                freed += n
        self.reclaimed += freed
        return freed

    def close(self, unlink: bool = True, unmap: bool = True) -> None:
        if unlink:
            self.path.unlink(missing_ok=True)
        if unmap:
            self.__dict__.pop("staging", None)
            self._payload = None
            self._close_map()


def attach_producer(cfg, spec, with_value: bool, actor_id: int, path: str | None,
                    layout: dict | None = None) -> RingProducer | None:
    """An actor's :class:`RingProducer` for ``actors.rollout_transport: "ring"`` (None with "zmq"),
    attached to the ring at `path` (from the learner's endpoints), for this run's rollout layout
    (with `layout`, the policy's: ``shared.rollout.policy_layout``)."""
    if cfg.actors.rollout_transport != "ring":
        return None
    if path is None:
        raise WireError("actors.rollout_transport is \"ring\", but the learner's endpoints name no rollout "
                        "ring (is the learner's config the same, and is it on this host?)")
    from shared.rollout import rollout_template, sends_bootstrap_obs
    template = rollout_template(spec, cfg.actors.num_envs, cfg.trainer.buffer_size, with_value=with_value,
                                with_bootstrap_obs=sends_bootstrap_obs(cfg, with_value), **(layout or {}))
    return RingProducer(path, actor_id, cfg.actors.num_actors, cfg.actors.rollout_ring_slots, template)


class RingProducer(_Mapped):
    """An actor's side: attaches to its ring in the learner's file, claims, fills and hands over slots.

    Raises (constructor):
        WireError: the file is misplaced, not a regular file, or its header, layout or size is not
            what this actor's config gives (another run, another host's endpoints, a stale file).
    """

    def __init__(self, path: Any, actor: int, rings: int, slots: int, template: TensorDictBase):
        self.template = template.to("cpu")
        self.actor = actor
        self.layout, slot_bytes = _layout(self.template)
        if not (isinstance(path, str) and 0 < len(path) < 4096 and "\0" not in path):
            raise WireError(f"rollout ring: {str(path)[:100]!r} is not a file path")
        file = Path(path)
        if not (file.is_absolute() and file.parent == _base_dir() and _FILE_NAME.fullmatch(file.name)):
            raise WireError(f"rollout ring: {path[:200]!r} is not a tandem-*.rollouts file in {_base_dir()}")
        header: dict[str, Any] = {}

        def checked_size(fd: int, st: os.stat_result) -> int:
            """The file's header against this actor's config; the size the header gives."""
            if st.st_size < META_BYTES:
                raise WireError(f"rollout ring {path[:200]!r}: not a regular file of at least {META_BYTES} bytes")
            with mmap.mmap(fd, META_BYTES, prot=mmap.PROT_READ) as head:
                words = torch.frombuffer(bytearray(head[:META_BYTES]), dtype=torch.int64).tolist()
                header.update(words=words, blob=bytes(head[128:META_BYTES]))
            cuda = words[_W_CUDA] == 1
            want = {_W_MAGIC: MAGIC, _W_FORMAT: FORMAT, _W_RINGS: rings, _W_SLOTS: slots,
                    _W_SLOT_BYTES: slot_bytes, _W_DIGEST: layout_digest(self.template)}
            names = {_W_MAGIC: "magic", _W_FORMAT: "format", _W_RINGS: "rings (actors.num_actors)",
                     _W_SLOTS: "slots (actors.rollout_ring_slots)", _W_SLOT_BYTES: "slot size",
                     _W_DIGEST: "rollout layout"}
            bad = [names[w] for w, v in want.items() if words[w] != v]
            if bad or words[_W_CUDA] not in (0, 1) or not 0 <= words[_W_BLOB] <= MAX_BLOB_BYTES:
                raise WireError(f"rollout ring {path[:200]!r}: its {', '.join(bad) or 'header'} differ(s) from this "
                                f"actor's config (another run's file, or another config?)")
            if not _is_uint(actor, rings):
                raise WireError(f"rollout ring: actor {actor} has no ring ({rings} rings)")
            _, _, size = _file_bytes(rings, slots, slot_bytes, cuda)
            if st.st_size != size:
                raise WireError(f"rollout ring {path[:200]!r}: {st.st_size} bytes, the header gives {size}")
            return size

        mm = map_untrusted(path, "rollout ring", checked_size, writable=True,
                           open_hint="; is the learner on this host? actors.rollout_transport \"ring\" needs it")
        words, blob_all = header["words"], header["blob"]
        cuda = words[_W_CUDA] == 1
        self._setup(mm, rings, slots, slot_bytes, cuda)
        self.nonce = words[_W_NONCE]
        if cuda:
            self._payload = open_cuda_handle(blob_all[:words[_W_BLOB]], rings * slots * slot_bytes, "rollout ring")
        else:
            self._payload = self._buf[self._payload_off:]
        self._attach()

    def _attach(self) -> None:
        """A new producer for this ring: a new epoch, and the slots a dead predecessor was writing freed
        (READY ones are the learner's to reclaim: their headers may still be on the way)."""
        self.epoch = int(self.epochs[self.actor]) + 1
        self.epochs[self.actor] = self.epoch
        ctl = self.ctl[self.actor]
        ctl[ctl[:, _S_STATE] == WRITING, _S_STATE] = FREE
        self._next = 0

    def claim(self, timeout_s: float, should_stop: Callable[[], bool] = lambda: False) -> int | None:
        """A FREE slot, now WRITING (generation + 1). Waits while every slot is taken; None if
        `should_stop` said so while waiting.

        Raises:
            RingFull: no slot came free within `timeout_s`.
            RuntimeError: another producer attached to this ring (a second actor with our id).
        """
        deadline = time.monotonic() + timeout_s
        ctl = self.ctl[self.actor]
        while True:
            if int(self.epochs[self.actor]) != self.epoch:
                raise RuntimeError(f"rollout ring of actor {self.actor}: another actor with this id attached "
                                   f"(epoch {int(self.epochs[self.actor])}, ours {self.epoch})")
            for k in range(self.slots):
                slot = (self._next + k) % self.slots
                if int(ctl[slot, _S_STATE]) == FREE:
                    ctl[slot, _S_GEN] += 1
                    ctl[slot, _S_EPOCH] = self.epoch
                    ctl[slot, _S_ACTOR] = self.actor
                    ctl[slot, _S_STATE] = WRITING
                    self._next = (slot + 1) % self.slots
                    return slot
            if should_stop():
                return None
            if time.monotonic() > deadline:
                raise RingFull(f"actor {self.actor}: all {self.slots} rollout ring slots stayed taken for "
                               f"{timeout_s:.0f} s (the learner released none)")
            time.sleep(WAIT_S)

    def write(self, slot: int, rollout: TensorDictBase) -> dict:
        """Copy `rollout` (the run's schema) into the claimed `slot`, mark it READY, and return the
        header to send (``ring=`` in the rollout meta)."""
        ctl = self.ctl[self.actor, slot]
        assert int(ctl[_S_STATE]) == WRITING, "write() needs a slot from claim()"
        raw = self._slot_bytes_view(self._payload, self.actor, slot)
        self._views(raw).update_(rollout)
        if raw.device.type == "cuda":
            torch.cuda.current_stream(raw.device).synchronize()
        ctl[_S_STATE] = READY
        return {"slot": slot, "generation": int(ctl[_S_GEN]), "epoch": self.epoch, "nonce": self.nonce}

    def release(self, slot: int) -> None:
        """Give back a claimed slot that will not be sent (WRITING only)."""
        ctl = self.ctl[self.actor, slot]
        if int(ctl[_S_STATE]) == WRITING:
            ctl[_S_STATE] = FREE

    def close(self) -> None:
        self._payload = None
        self._close_map()
