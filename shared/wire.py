"""Wire codec: a TensorDict as ZeroMQ multipart frames, with no pickle anywhere.

Frame 0 is a msgpack map::

    {"v": PROTOCOL_VERSION, "batch": [N, T], "meta": {...},
     "tensors": [[["observation", "rgb"], "uint8", [N, T, 64, 64, 3]], ...]}

``meta`` holds the keyword arguments given to :func:`encode` (by convention ``kind``, ``sender``,
``seq``, ``policy_version``; actors send ``actor=<id>``), returned unchanged by :func:`decode`.
Frames 1..k are the tensors' raw C-contiguous bytes, in header order, sent without copying.

:func:`decode` checks everything before it touches tensor memory: protocol version, dtype
allow-list, frame count, byte length = numel x itemsize, batch size a prefix of every shape,
header and message size limits. Anything wrong raises :class:`WireError` and nothing else.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import msgpack
import torch
from tensordict import TensorDict, TensorDictBase

PROTOCOL_VERSION = 1
MAX_HEADER_BYTES = 8 << 20        # 8 MiB of msgpack: ~100k tensor entries
MAX_TENSORS = 65_536
MAX_DIMS = 16
DEFAULT_MAX_MESSAGE_BYTES = 8 << 30

_DTYPES: dict[str, torch.dtype] = {
    "bool": torch.bool, "uint8": torch.uint8, "int8": torch.int8, "int16": torch.int16,
    "int32": torch.int32, "int64": torch.int64, "float16": torch.float16,
    "bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64,
}
_DTYPE_NAME = {v: k for k, v in _DTYPES.items()}


class WireError(ValueError):
    """A message that cannot be encoded or decoded; the message says what is wrong."""


def _raw(t: torch.Tensor) -> memoryview:
    # bfloat16 has no numpy dtype and a 0-dim tensor cannot be viewed at another itemsize:
    # flatten, then reinterpret as bytes. No copy when the tensor is already contiguous on CPU.
    if t.device.type != "cpu":
        t = t.cpu()
    return memoryview(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


def encode(td: TensorDictBase, **meta: Any) -> list:
    """Encode a TensorDict and metadata as multipart frames.

    Args:
        td: any TensorDict (nested keys allowed); tensors on another device are copied to CPU.
        **meta: msgpack-able scalars, strings, lists and maps, returned as-is by :func:`decode`.

    Returns:
        ``[header_bytes, memoryview, ...]``: pass to ``socket.send_multipart(frames, copy=False)``.
        The memoryviews alias the tensors: do not modify them until ZeroMQ has sent them.

    Raises:
        WireError: a dtype outside the allow-list, or meta that msgpack cannot encode.
    """
    leaves = sorted(((k if isinstance(k, tuple) else (k,), t)
                     for k, t in td.items(include_nested=True, leaves_only=True)), key=lambda kv: kv[0])
    entries = []
    for path, t in leaves:
        name = _DTYPE_NAME.get(t.dtype)
        if name is None:
            raise WireError(f"encode: tensor {'/'.join(path)!r} has dtype {t.dtype}, which is not on the "
                            f"allow-list ({', '.join(_DTYPES)})")
        entries.append([list(path), name, list(t.shape)])
    header = {"v": PROTOCOL_VERSION, "batch": list(td.batch_size), "meta": meta, "tensors": entries}
    try:
        head = msgpack.packb(header, use_bin_type=True)
        # msgpack packs maps with non-string keys, which decode (strict_map_key) refuses: refuse here
        msgpack.unpackb(msgpack.packb(meta, use_bin_type=True), raw=False, strict_map_key=True)
    except (TypeError, ValueError, OverflowError) as e:
        raise WireError(f"encode: meta is not msgpack-able: {e}") from None
    return [head, *(_raw(t) for _, t in leaves)]


def _buffer(frame: Any) -> memoryview:
    buf = getattr(frame, "buffer", frame)  # zmq.Frame exposes .buffer; bytes/memoryview pass through
    try:
        return memoryview(buf).cast("B")
    except TypeError:
        raise WireError(f"frame of type {type(frame).__name__} is not a bytes-like object") from None


def _is_uint(x: Any, limit: int = 1 << 48) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < limit


def _parse_header(head: memoryview) -> dict:
    if len(head) > MAX_HEADER_BYTES:
        raise WireError(f"header is {len(head)} bytes, over the {MAX_HEADER_BYTES}-byte limit")
    try:
        header = msgpack.unpackb(head, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises many types on garbage (ExtraData, FormatError, ValueError...)
        raise WireError(f"header is not valid msgpack: {type(e).__name__}: {e}") from None
    if not isinstance(header, dict):
        raise WireError(f"header must be a map, got {type(header).__name__}")
    v = header.get("v")
    if type(v) is not int or v != PROTOCOL_VERSION:  # True == 1.0 == 1 in Python: check the type too
        raise WireError(f"unknown protocol version {v!r} (this side speaks {PROTOCOL_VERSION})")
    missing = {"batch", "meta", "tensors"} - header.keys()
    if missing:
        raise WireError(f"header lacks {sorted(missing)}")
    if not isinstance(header["meta"], dict):
        raise WireError("header 'meta' must be a map")
    batch = header["batch"]
    if not (isinstance(batch, list) and len(batch) <= MAX_DIMS and all(_is_uint(b) for b in batch)):
        raise WireError(f"bad batch size {batch!r}")
    tensors = header["tensors"]
    if not isinstance(tensors, list) or len(tensors) > MAX_TENSORS:
        raise WireError(f"'tensors' must be a list of at most {MAX_TENSORS} entries")
    return header


def decode(frames: Sequence[Any], max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
           ) -> tuple[TensorDict, dict]:
    """Decode frames made by :func:`encode`.

    Args:
        frames: bytes, memoryviews or ``zmq.Frame`` objects (``recv_multipart(copy=False)``).
            Writable frames are aliased without copying: copy out what you keep.
        max_message_bytes: refuse messages whose tensors add up to more than this.

    Returns:
        ``(td, meta)``: the TensorDict (batch size as sent) and the meta map given to encode.

    Raises:
        WireError: on any malformed input, before any tensor memory is touched.
    """
    if not isinstance(frames, (list, tuple)) or not frames:
        raise WireError("a message needs at least one frame (the header)")
    header = _parse_header(_buffer(frames[0]))
    entries, batch = header["tensors"], header["batch"]
    if len(frames) != 1 + len(entries):
        raise WireError(f"header lists {len(entries)} tensors but {len(frames) - 1} data frames arrived")
    paths: set[tuple] = set()
    specs = []
    total = 0
    for i, entry in enumerate(entries):
        if not (isinstance(entry, list) and len(entry) == 3):
            raise WireError(f"tensor entry {i} must be [path, dtype, shape]")
        path, dtype_name, shape = entry
        if not (isinstance(path, list) and 0 < len(path) <= MAX_DIMS
                and all(isinstance(p, str) and p for p in path)):
            raise WireError(f"tensor entry {i}: bad key path {path!r}")
        path = tuple(path)
        name = "/".join(path)
        if path in paths:
            raise WireError(f"tensor {name!r}: duplicate key path")
        paths.add(path)
        dtype = _DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
        if dtype is None:
            raise WireError(f"tensor {name!r}: dtype {dtype_name!r} is not allowed")
        if not (isinstance(shape, list) and len(shape) <= MAX_DIMS and all(_is_uint(s, 1 << 40) for s in shape)):
            raise WireError(f"tensor {name!r}: bad shape {shape!r}")
        if shape[:len(batch)] != batch:
            raise WireError(f"tensor {name!r}: shape {shape} does not start with the batch size {batch}")
        nbytes = math.prod(shape) * dtype.itemsize
        total += nbytes
        if total > max_message_bytes:
            raise WireError(f"tensors add up to more than the {max_message_bytes}-byte message limit")
        buf = _buffer(frames[i + 1])
        if len(buf) != nbytes:
            raise WireError(f"tensor {name!r}: frame has {len(buf)} bytes, expected {nbytes} "
                            f"({dtype_name} {shape})")
        specs.append((path, dtype, shape, buf))
    for path in paths:  # a leaf cannot also be a sub-dict of another leaf
        if any(path[:j] in paths for j in range(1, len(path))):
            raise WireError(f"tensor {'/'.join(path)!r}: key path runs through another tensor")
    td = TensorDict({}, batch_size=batch)
    for path, dtype, shape, buf in specs:
        if buf.readonly:
            buf = bytearray(buf)  # torch.frombuffer wants writable memory; bytes input is copied
        t = torch.frombuffer(buf, dtype=dtype) if len(buf) else torch.empty(0, dtype=dtype)
        t = t.view(shape)
        if dtype is torch.bool and t.numel() and bool(t.view(torch.uint8).gt(1).any()):
            raise WireError(f"tensor {'/'.join(path)!r}: bool bytes must be 0 or 1")
        td.set(path if len(path) > 1 else path[0], t)
    return td, header["meta"]
