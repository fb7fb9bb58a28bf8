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

Announcements are untrusted input, like any message off a socket. :func:`load_published_` and the
reader check every field before they touch memory: types, the file's place (``tandem-*.weights``
directly in ``/dev/shm``, or in ``$TMPDIR`` where there is no ``/dev/shm``), a regular file whose
size is a whole number of slots, the slot inside it, shapes bounded as :mod:`shared.wire` bounds
them, offsets exactly where the writer packs them (so no tensor reads another's bytes or past its
slot), and the layout equal to the policy's parameters. Anything wrong raises
:class:`shared.wire.WireError` (the caller drops the message, as it drops one that does not decode);
``False`` stays reserved for a torn read, after which the next version is awaited. Not covered: a
file truncated after it was mapped (SIGBUS on read; only its owner, the learner, could do that).

The seqlock relies on stores becoming visible in program order (x86-64's TSO). On weakly ordered
CPUs (aarch64) a reader could in principle see the end marker before the payload; there, add a
checksum per slot before trusting this path.
"""

from __future__ import annotations

import math
import mmap
import os
import re
import stat
from pathlib import Path
from typing import Any, Callable, NamedTuple

import msgpack
import torch
from tensordict import TensorDict, TensorDictBase

from shared.wire import WireError, check_tensor_entry

ALIGN = 64
HEADER_BYTES = 64          # per slot: begin version, end version, progress bytes (int64), padding
CHUNK_BYTES = 8 << 20      # the writer publishes progress, and readers copy, in pieces of this size
WAIT_S = 0.0002            # a reader's pause while the writer catches up (no busy spinning)
SHM_DIR = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
MAX_LAYOUT_ENTRIES = 65_536      # tensors in one announcement (a policy's parameters and buffers)
DEVICE_META_BYTES = 4096         # learner.weights_transport "cuda_ipc": the file's header before the slot headers
DEVICE_MAGIC = 0x54414E44454D5744   # "TANDEMWD"
DEVICE_FORMAT = 1
MAX_DEVICE_SLOTS = 1 << 16
MAX_SLOT_BYTES = 1 << 44         # 16 TiB: bounds the offsets before any arithmetic on them
_FILE_NAME = re.compile(r"tandem-[A-Za-z0-9_-]+\.weights")   # what default_path makes; no dots, no slashes
_TORCH_DTYPES = {str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)}


def map_untrusted(path: str, what: str, size_for: Callable[[int, os.stat_result], int], writable: bool,
                  open_hint: str = "") -> mmap.mmap:
    """Map the file at `path`, a name from a message or a file: a regular file only (no symlink
    followed, and O_NONBLOCK, so that a FIFO planted under the name cannot block the open), of the
    size `size_for(fd, stat)` returns after its own checks. Every failure is a WireError naming
    `what` and the path (`open_hint` is added when the file cannot be opened)."""
    flags = (os.O_RDWR if writable else os.O_RDONLY) | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
    except (OSError, ValueError) as e:
        raise WireError(f"{what} {path[:200]!r}: cannot open ({e}){open_hint}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise WireError(f"{what} {path[:200]!r}: not a regular file")
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        return mmap.mmap(fd, size_for(fd, st), prot=prot)
    except WireError:
        raise
    except (OSError, ValueError, OverflowError) as e:
        raise WireError(f"{what} {path[:200]!r}: cannot map ({e})") from None
    finally:
        os.close(fd)


MAX_BLOB_BYTES = 4096 - 128      # a msgpack CUDA IPC handle, inside a file's 4 KiB header


def pack_cuda_handle(payload: torch.Tensor) -> bytes:
    """The CUDA IPC handle of `payload`'s storage as msgpack (bytes and ints only, never pickle)."""
    (device, handle, size, offset, ref_handle, ref_offset, event_handle,
     event_sync) = payload.untyped_storage()._share_cuda_()
    return msgpack.packb({"device": int(device), "handle": bytes(handle), "size": int(size),
                          "offset": int(offset), "ref_handle": bytes(ref_handle), "ref_offset": int(ref_offset),
                          "event_handle": bytes(event_handle) if event_handle else b"",
                          "event_sync": bool(event_sync)}, use_bin_type=True)


def open_cuda_handle(blob: bytes, nbytes: int, what: str) -> torch.Tensor:
    """Another process's CUDA memory (`nbytes` of it), opened from its msgpack handle (`what` names
    it in errors). Raises WireError."""
    try:
        h = msgpack.unpackb(blob, raw=False, strict_map_key=True, max_bin_len=MAX_BLOB_BYTES, max_ext_len=0)
        ok = (isinstance(h, dict) and all(isinstance(h.get(k), bytes) for k in ("handle", "ref_handle", "event_handle"))
              and all(_is_uint(h.get(k), 1 << 62) for k in ("device", "size", "offset", "ref_offset"))
              and isinstance(h.get("event_sync"), bool) and h["size"] == nbytes)
    except Exception as e:
        raise WireError(f"{what}: bad CUDA handle ({type(e).__name__})") from None
    if not ok:
        raise WireError(f"{what}: bad CUDA handle (fields, or a size other than {nbytes} bytes)")
    try:
        # The CUDA context first, as torch.multiprocessing does before opening a handle. On an H100
        # (2026-11-27) a test's child that had not touched CUDA before attaching died of SIGSEGV
        # here, while actors that had built their policy on the device attached fine.
        torch.cuda._lazy_init()
        storage = torch.UntypedStorage._new_shared_cuda(
            h["device"], h["handle"], h["size"], h["offset"], h["ref_handle"], h["ref_offset"],
            h["event_handle"] or None, h["event_sync"])
    except Exception as e:
        raise WireError(f"{what}: cannot open the learner's CUDA memory ({e})") from None
    return torch.empty(0, dtype=torch.uint8, device=f"cuda:{h['device']}").set_(storage)


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _layout(td: TensorDictBase) -> tuple[list[list], int]:
    """[[key path, dtype name, shape, offset], ...] and the payload size of one slot."""
    entries, offset = [], 0
    for key, t in td.items(include_nested=True, leaves_only=True):
        path = list(key) if isinstance(key, tuple) else [key]
        offset = _align(offset)
        entries.append([path, str(t.dtype).removeprefix("torch."), list(t.shape), offset])
        offset += t.numel() * t.element_size()
    return entries, _align(offset)


def _base_dir() -> Path:
    return SHM_DIR or Path(os.environ.get("TMPDIR", "/tmp"))


def default_path(tag: str) -> Path:
    return _base_dir() / f"tandem-{os.getpid()}-{tag}.weights"


class _Entry(NamedTuple):
    path: tuple[str, ...]
    dtype: torch.dtype
    shape: list[int]
    offset: int          # bytes after the slot's header
    nbytes: int


class _Announcement(NamedTuple):
    file: str
    slot: int
    slot_bytes: int
    entries: list[_Entry]
    device: bool         # the payload is in the learner's device memory (CUDA IPC), not in the file


def _is_uint(x: Any, limit: int) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < limit


def _parse(meta: Any) -> _Announcement:
    """The fields of a shared-memory announcement, checked without touching the file. Raises WireError."""
    if not isinstance(meta, dict):
        raise WireError(f"shared-memory announcement must be a map, got {type(meta).__name__}")
    missing = sorted({"shm", "slot", "slot_bytes", "layout"} - meta.keys())
    if missing:
        raise WireError(f"shared-memory announcement lacks {missing}")
    file, slot, slot_bytes, layout = meta["shm"], meta["slot"], meta["slot_bytes"], meta["layout"]
    device = meta.get("device", False)
    if not isinstance(device, bool):
        raise WireError(f"shared-memory announcement: 'device' must be true or false, got {str(device)[:40]!r}")
    if not (isinstance(file, str) and 0 < len(file) < 4096 and "\0" not in file):
        raise WireError(f"shared-memory announcement: 'shm' must be a file path, got {str(file)[:100]!r}")
    if not _is_uint(slot, 1 << 32):
        raise WireError(f"shared-memory announcement: bad slot {str(slot)[:40]}")
    if not (_is_uint(slot_bytes, MAX_SLOT_BYTES + 1) and slot_bytes >= HEADER_BYTES and slot_bytes % ALIGN == 0):
        raise WireError(f"shared-memory announcement: bad slot_bytes {str(slot_bytes)[:40]} (a multiple of {ALIGN}, "
                        f"{HEADER_BYTES} to {MAX_SLOT_BYTES})")
    if not (isinstance(layout, list) and len(layout) <= MAX_LAYOUT_ENTRIES):
        raise WireError(f"shared-memory announcement: 'layout' must be a list of at most {MAX_LAYOUT_ENTRIES} entries")
    entries, paths, end = [], set(), 0
    for i, e in enumerate(layout):
        if not (isinstance(e, list) and len(e) == 4):
            raise WireError(f"shared-memory layout entry {i} must be [path, dtype, shape, offset]")
        path, dtype_name, shape, offset = e
        path, name, dtype = check_tensor_entry(i, path, dtype_name, shape, paths, _TORCH_DTYPES,
                                               what="shared-memory weights")
        # the writer packs the tensors in layout order, each at the next multiple of ALIGN (see
        # _layout): any other offset would read another tensor's bytes, or past the slot
        nbytes, packed = math.prod(shape) * dtype.itemsize, _align(end)
        if type(offset) is not int or offset != packed:
            raise WireError(f"shared-memory weights {name}: offset {str(offset)[:40]}, but the layout packs it at "
                            f"{packed}")
        entries.append(_Entry(path, dtype, shape, offset, nbytes))
        end = offset + nbytes
    if slot_bytes != HEADER_BYTES + _align(end):
        raise WireError(f"shared-memory announcement: slot_bytes {slot_bytes}, but the layout fills "
                        f"{HEADER_BYTES + _align(end)}")
    for path in paths:
        if any(path[:j] in paths for j in range(1, len(path))):
            raise WireError(f"shared-memory weights {'.'.join(path)[:100]}: key path runs through another tensor")
    return _Announcement(file, slot, slot_bytes, entries, device)


def check_announcement(meta: Any, policy_weights: TensorDictBase) -> int:
    """Check a weights message's shared-memory announcement against the expected file location and
    the policy's parameters (``weights_td(policy)``), without touching the file. Returns its version.

    Raises:
        WireError: a field missing or of the wrong type, a path that is not ``tandem-*.weights``
            directly in the shared-memory directory, or a layout that is not the policy's.
    """
    ann = _parse(meta)
    version = meta.get("version")
    if not _is_uint(version, 1 << 63):
        raise WireError(f"shared-memory announcement: bad version {str(version)[:40]}")
    file = Path(ann.file)
    if not (file.is_absolute() and file.parent == _base_dir() and _FILE_NAME.fullmatch(file.name)):
        raise WireError(f"shared-memory announcement: {ann.file[:200]!r} is not a tandem-*.weights file in "
                        f"{_base_dir()}")
    _check_layout([e[:3] for e in ann.entries], policy_weights)
    return version


def _check_layout(entries: list[tuple[tuple[str, ...], torch.dtype, list[int]]], dst: TensorDictBase) -> None:
    """``(path, dtype, shape)`` of each tensor are exactly `dst`'s leaves. Raises WireError."""
    want = {k if isinstance(k, tuple) else (k,): t for k, t in dst.items(include_nested=True, leaves_only=True)}
    got = {path for path, _, _ in entries}
    if got != want.keys() or len(entries) != len(got):
        missing, unexpected = sorted(map(".".join, want.keys() - got)), sorted(map(".".join, got - want.keys()))
        raise WireError(f"weights do not match the policy: missing {str(missing)[:200]}, "
                        f"unexpected {str(unexpected)[:200]}")
    for path, dtype, shape in entries:
        t = want[path]
        if t.dtype != dtype or list(t.shape) != shape:
            raise WireError(f"weights {'.'.join(path)[:100]}: {dtype} {shape}, the policy has {t.dtype} "
                            f"{list(t.shape)}")


class ShmWeightsWriter:
    """The learner's side: a ring of `slots` copies of the weights in one shared-memory file.

    With `device` (``learner.weights_transport: "cuda_ipc"``) the copies live in that device's
    memory instead, shared by CUDA IPC: the file then holds only a header (magic, format, slots,
    payload bytes and the msgpack IPC handle) and the slot headers, and the same seqlock guards
    each slot. Actors on the learner's host map the memory once and copy device to device."""

    def __init__(self, template: TensorDictBase, path: Path, slots: int = 3, device: torch.device | str | None = None):
        self.layout, self.payload = _layout(template)
        self.slots, self.path = slots, Path(path)
        self.slot_bytes = HEADER_BYTES + self.payload
        self.device = torch.device(device) if device is not None else None
        file_bytes = self.slot_bytes * slots if self.device is None else DEVICE_META_BYTES + HEADER_BYTES * slots
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            try:   # reserve the memory now: a too-small /dev/shm fails here, clearly, not with SIGBUS later
                os.posix_fallocate(fd, 0, file_bytes)
            except OSError as e:
                os.close(fd)
                fd = -1
                self.path.unlink(missing_ok=True)
                raise OSError(f"{self.path}: cannot reserve {file_bytes / 2**20:.0f} MiB of shared "
                              f"memory for {slots} weight slots ({e.strerror}); enlarge /dev/shm or lower "
                              f"learner.shm_slots") from e
            self._mm = mmap.mmap(fd, file_bytes)
        finally:
            if fd >= 0:
                os.close(fd)
        self._buf = torch.frombuffer(self._mm, dtype=torch.uint8)
        self._dev: torch.Tensor | None = None
        if self.device is None:
            starts = [i * self.slot_bytes for i in range(slots)]
        else:
            self._dev = torch.zeros(slots * self.payload, dtype=torch.uint8, device=self.device)
            blob = pack_cuda_handle(self._dev)
            if len(blob) > MAX_BLOB_BYTES:
                self.close()
                raise RuntimeError(f"CUDA IPC handle of {len(blob)} bytes does not fit the weights file's header")
            words = self._buf[:40].view(torch.int64)
            words.copy_(torch.tensor([DEVICE_MAGIC, DEVICE_FORMAT, slots, self.payload, len(blob)]))
            self._buf[64:64 + len(blob)].copy_(torch.frombuffer(bytearray(blob), dtype=torch.uint8))
            starts = [DEVICE_META_BYTES + i * HEADER_BYTES for i in range(slots)]
        self._headers = [self._buf[a:a + 24].view(torch.int64) for a in starts]
        for h in self._headers:
            h.fill_(-1)

    def begin(self, version: int) -> dict:
        """Claim the slot of `version` (readers of its old version now see a mismatch); returns the
        meta the control message carries. Send it, then :meth:`write_body`: readers start at once."""
        slot = version % self.slots
        header = self._headers[slot]
        header[0] = version
        header[2] = 0
        meta = {"shm": str(self.path), "slot": slot, "slot_bytes": self.slot_bytes, "layout": self.layout}
        if self._dev is not None:
            meta["device"] = True
        return meta

    def write_body(self, td: TensorDictBase, version: int) -> None:
        """Copy `td` into the slot claimed by :meth:`begin`, advancing ``progress`` chunk by chunk."""
        slot = version % self.slots
        header = self._headers[slot]
        if self._dev is not None:   # device to device in one go; the slot is whole once the copies are done
            base = slot * self.payload
            for path, _, _, offset in self.layout:
                src = td.get(tuple(path)).detach().reshape(-1)
                n = src.numel() * src.element_size()
                self._dev[base + offset:base + offset + n].view(src.dtype).copy_(src)
            if self._dev.device.type == "cuda":
                torch.cuda.synchronize(self._dev.device)
            header[2] = self.payload
            header[1] = version
            return
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
        self._headers, self._buf, self._dev = [], None, None
        self._mm.close()
        if unlink:
            self.path.unlink(missing_ok=True)


class ShmWeightsReader:
    """An actor's side: maps the learner's file once and copies a slot into a policy.

    Every method checks the announcement `meta` it is given against the mapped file first (see
    :func:`_parse`) and raises :class:`WireError` if it does not fit; :meth:`copy_into` and
    :meth:`stream_into` return False only for a torn read."""

    def __init__(self):
        self._mm: mmap.mmap | None = None
        self._path: str | None = None
        self._buf: torch.Tensor | None = None
        self._dev: torch.Tensor | None = None      # the learner's device payload ("cuda_ipc"), once opened
        self._dev_slots = self._dev_payload = 0

    def _map(self, path: str, device: bool = False) -> None:
        if self._path == path and (self._dev is not None) == device:
            return
        self.close()

        def whole_file(fd: int, st: os.stat_result) -> int:
            if st.st_size == 0:
                raise WireError(f"shared-memory weights {path[:200]!r}: not a regular, non-empty file")
            return st.st_size
        self._mm = map_untrusted(path, "shared-memory weights", whole_file, writable=False)
        # torch.frombuffer wants a writable buffer; the mapping is read-only, so go through numpy.
        import warnings

        import numpy as np
        with warnings.catch_warnings():   # read-only on purpose: nothing here writes through it
            warnings.simplefilter("ignore", UserWarning)
            self._buf = torch.from_numpy(np.frombuffer(self._mm, dtype=np.uint8))
        if device:
            try:
                self._open_device(path)
            except WireError:
                self.close()
                raise
        self._path = path

    def _open_device(self, path: str) -> None:
        """The header of a "cuda_ipc" file, checked, and the learner's device memory it names."""
        size = len(self._buf)
        if size < DEVICE_META_BYTES:
            raise WireError(f"shared-memory weights {path[:200]!r}: {size} bytes, too small for a device header")
        magic, fmt, slots, payload, blob_len = (int(x) for x in self._buf[:40].view(torch.int64))
        if magic != DEVICE_MAGIC or fmt != DEVICE_FORMAT:
            raise WireError(f"shared-memory weights {path[:200]!r}: not a device-memory weights file (magic or "
                            f"format)")
        if not (0 < slots <= MAX_DEVICE_SLOTS and 0 <= payload <= MAX_SLOT_BYTES and 0 < blob_len <= MAX_BLOB_BYTES
                and size == DEVICE_META_BYTES + slots * HEADER_BYTES):
            raise WireError(f"shared-memory weights {path[:200]!r}: device header ({slots} slots, {payload} bytes "
                            f"each, a {blob_len}-byte handle) does not fit its {size} bytes")
        blob = self._buf[64:64 + blob_len].numpy().tobytes()
        self._dev = open_cuda_handle(blob, slots * payload, "shared-memory weights")
        self._dev_slots, self._dev_payload = slots, payload

    def _open(self, meta: Any) -> _Announcement:
        """Parse `meta`, map its file, and check that the slot lies inside it. Raises WireError."""
        ann = _parse(meta)
        self._map(ann.file, ann.device)
        if ann.device:
            if ann.slot_bytes - HEADER_BYTES != self._dev_payload or ann.slot >= self._dev_slots:
                raise WireError(f"shared-memory weights {ann.file[:200]!r}: slot {ann.slot} of {ann.slot_bytes} bytes, "
                                f"but the device memory holds {self._dev_slots} slots of "
                                f"{self._dev_payload + HEADER_BYTES}")
            return ann
        size = len(self._buf)
        if size % ann.slot_bytes or (ann.slot + 1) * ann.slot_bytes > size:
            raise WireError(f"shared-memory weights {ann.file[:200]!r}: {size} bytes is not a whole number of "
                            f"{ann.slot_bytes}-byte slots with a slot {ann.slot}")
        return ann

    def _header(self, ann: _Announcement) -> torch.Tensor:
        start = DEVICE_META_BYTES + ann.slot * HEADER_BYTES if ann.device else ann.slot * ann.slot_bytes
        return self._buf[start:start + 24].view(torch.int64)

    def _src(self, ann: _Announcement, e: _Entry) -> torch.Tensor:
        """Entry `e` of the announced slot, flat: in the file, or in the learner's device memory."""
        if ann.device:
            base = ann.slot * self._dev_payload + e.offset
            return self._dev[base:base + e.nbytes].view(e.dtype)
        base = ann.slot * ann.slot_bytes + HEADER_BYTES + e.offset
        return self._buf[base:base + e.nbytes].view(e.dtype)

    def _settle(self, dst: TensorDictBase | None = None) -> None:
        """Wait for this process's copies out of the device memory (before the seqlock's last check)."""
        devices = {self._dev.device} if self._dev is not None and self._dev.device.type == "cuda" else set()
        if dst is not None:
            devices |= {t.device for t in dst.values(include_nested=True, leaves_only=True) if t.device.type == "cuda"}
        for d in devices:
            torch.cuda.synchronize(d)

    def views(self, meta: dict) -> TensorDict:
        """Zero-copy tensors over the slot `meta` names (valid until the slot is rewritten)."""
        ann = self._open(meta)
        out = TensorDict({}, batch_size=[])
        for e in ann.entries:
            out.set(e.path, self._src(ann, e).view(e.shape))
        return out

    def slot_version(self, meta: dict) -> tuple[int, int]:
        h = self._header(self._open(meta))
        return int(h[0]), int(h[1])

    def stream_into(self, dst: TensorDictBase, meta: dict, version: int, timeout_s: float = 120.0) -> bool:
        """Copy the slot into `dst` (same keys, shapes, dtypes: e.g. a policy's ``weights_td``) chunk
        by chunk as the writer produces it. False if the slot was rewritten (or never finished in
        `timeout_s`): `dst` then holds a mix and must not be used. WireError (before anything is
        copied) if `meta` does not fit the file or `dst`."""
        import time
        ann = self._open(meta)
        _check_layout([e[:3] for e in ann.entries], dst)
        header = self._header(ann)
        deadline = time.monotonic() + timeout_s
        for e in ann.entries:
            target = dst.get(e.path)
            n, dt, offset = e.nbytes, e.dtype, e.offset
            src = self._src(ann, e)
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
        if ann.device:
            self._settle(dst)
        return int(header[0]) == version

    def copy_into(self, load, meta: dict, version: int) -> bool:
        """``load(views)`` (which copies the views into the policy) if the slot holds `version` whole,
        before and after. Returns False (torn or overwritten) when the caller must not use the result."""
        if self.slot_version(meta) != (version, version):
            return False
        load(self.views(meta))
        self._settle()
        return self.slot_version(meta)[0] == version

    def close(self) -> None:
        self._buf = self._dev = None
        self._dev_slots = self._dev_payload = 0
        if self._mm is not None:
            self._mm.close()
            self._mm = None
        self._path = None


def load_published_(policy: torch.nn.Module, td: TensorDictBase, meta: dict, reader: ShmWeightsReader | None,
                    device: torch.device | str) -> bool:
    """Load a weights message into `policy`, whichever transport carried it.

    Returns:
        True when the policy holds the message's weights; False when a shared-memory slot was torn
        or already rewritten (the policy must then not be used until the next version loads).

    Raises:
        WireError: a malformed message, checked before the policy is touched: tensors (zmq) or a
            shared-memory announcement (see :func:`check_announcement`) that do not match the
            policy's parameters, a bad version, or an announced file that is missing, misplaced,
            or of the wrong size. Drop the message and wait for the next, as for a torn read.
        ValueError: weights came through shared memory and `reader` is None (a caller's bug).
    """
    from shared.policies import load_weights_, weights_td
    own = weights_td(policy)      # the live parameters and buffers: copied into in place
    if "shm" not in meta:
        _check_layout([(k if isinstance(k, tuple) else (k,), t.dtype, list(t.shape))
                       for k, t in td.items(include_nested=True, leaves_only=True)], own)
        load_weights_(policy, td.to(device))
        return True
    if reader is None:
        raise ValueError("weights came through shared memory, but this process has no ShmWeightsReader")
    version = check_announcement(meta, own)
    return reader.stream_into(own, meta, version)
