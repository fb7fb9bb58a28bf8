"""Wire codec: a TensorDict as ZeroMQ multipart frames, with no pickle anywhere.

Frame 0 is a msgpack map::

    {"v": PROTOCOL_VERSION, "batch": [N, T], "meta": {...},
     "tensors": [[["observation", "rgb"], "uint8", [N, T, 64, 64, 3]], ...]}

``meta`` holds the keyword arguments given to :func:`encode` (by convention ``kind``, ``sender``,
``seq``, ``policy_version``; actors send ``actor=<id>``), returned unchanged by :func:`decode`.
Frames 1..k are the tensors' raw C-contiguous bytes, in header order, sent without copying.

:func:`decode` checks everything before it touches tensor memory: protocol version, dtype
allow-list, frame count, byte length = numel x itemsize, batch size a prefix of every shape,
header and message size limits, and element counts. Anything wrong raises :class:`WireError`
and nothing else: decoding is total, whatever the bytes.

Byte counts alone do not bound a shape: a zero dimension makes any shape 0 bytes, and torch then
overflows int64 computing the numel or strides of ``[2**40, 2**40, 0]``. So every shape (and the
batch size) must *span* at most :data:`MAX_ELEMENTS`, the product of its dimensions with zeros
counted as ones, checked with exact Python ints before torch sees it: its numel, its strides and
its byte count then all stay far inside int64. The header is unpacked with msgpack's length limits,
no ext types (so no ``ExtType`` or ``Timestamp`` in meta), and meta nested at most
:data:`MAX_META_DEPTH` deep.
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
MAX_ELEMENTS = 1 << 36            # span of a shape or batch: 64 Gi elements (8 GiB of bool is 2**33)
MAX_META_DEPTH = 32               # lists and maps inside meta
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


def encode(td: TensorDictBase, /, **meta: Any) -> list:
    """Encode a TensorDict and metadata as multipart frames.

    Args:
        td: any TensorDict (nested keys allowed); tensors on another device are copied to CPU.
        **meta: msgpack-able scalars, strings, lists and maps, returned as-is by :func:`decode`.

    Returns:
        ``[header_bytes, memoryview, ...]``: pass to ``socket.send_multipart(frames, copy=False)``.
        The memoryviews alias the tensors: do not modify them until ZeroMQ has sent them.

    Raises:
        WireError: a dtype outside the allow-list, a shape, batch size, key depth or tensor count
            over the bounds, meta that msgpack cannot encode (or that :func:`decode` would refuse),
            or a header over the limit: encode refuses what decode would.
    """
    leaves = [(k if isinstance(k, tuple) else (k,), t) for k, t in td.items(include_nested=True, leaves_only=True)]
    return encode_leaves(list(td.batch_size), leaves, **meta)


def encode_leaves(batch: list[int], leaves: Sequence[tuple[tuple[str, ...], torch.Tensor]], /,
                  **meta: Any) -> list:
    """:func:`encode` without a TensorDict: `leaves` are ``(key path, tensor)`` pairs whose shapes
    start with `batch` (not checked here: :func:`decode` refuses them). The frames are the same as
    encode's for a TensorDict of these leaves. For small messages sent often (the inference
    server's requests and replies), where building a TensorDict costs more than the message."""
    leaves = sorted(leaves, key=lambda kv: kv[0])
    if len(leaves) > MAX_TENSORS:
        raise WireError(f"encode: {len(leaves)} tensors, over the limit of {MAX_TENSORS}")
    if not _is_dims(batch):
        raise WireError(f"encode: batch size {batch} spans more than {MAX_ELEMENTS} elements")
    entries = []
    for path, t in leaves:
        name = _DTYPE_NAME.get(t.dtype)
        if name is None:
            raise WireError(f"encode: tensor {'/'.join(path)!r} has dtype {t.dtype}, which is not on the "
                            f"allow-list ({', '.join(_DTYPES)})")
        if len(path) > MAX_DIMS:
            raise WireError(f"encode: tensor {_name(path)!r} is nested more than {MAX_DIMS} deep")
        if not _is_dims(list(t.shape)):   # e.g. [0, 2**40, 2**40]: 0 bytes, but decode refuses it
            raise WireError(f"encode: tensor {'/'.join(path)!r} of shape {list(t.shape)} has more than "
                            f"{MAX_DIMS} dims or spans more than {MAX_ELEMENTS} elements (zeros count as ones)")
        entries.append([list(path), name, list(t.shape)])
    header = {"v": PROTOCOL_VERSION, "batch": batch, "meta": meta, "tensors": entries}
    try:
        head = msgpack.packb(header, use_bin_type=True)
        # msgpack packs what decode refuses (maps with non-string keys, ext types): refuse it here
        _unpack(msgpack.packb(meta, use_bin_type=True))
    except (TypeError, ValueError, OverflowError) as e:
        raise WireError(f"encode: meta is not msgpack-able: {e}") from None
    if not _depth_ok(meta, MAX_META_DEPTH):
        raise WireError(f"encode: meta nests lists and maps more than {MAX_META_DEPTH} deep")
    if len(head) > MAX_HEADER_BYTES:
        raise WireError(f"encode: header is {len(head)} bytes, over the {MAX_HEADER_BYTES}-byte limit")
    return [head, *(_raw(t) for _, t in leaves)]


def _buffer(frame: Any) -> memoryview:
    try:  # zmq.Frame exposes .buffer; bytes/memoryview pass through
        return memoryview(getattr(frame, "buffer", frame)).cast("B")
    except Exception:  # TypeError; ValueError for a released memoryview; BufferError...
        raise WireError(f"frame of type {type(frame).__name__} is not a bytes-like object") from None


def _is_uint(x: Any, limit: int = MAX_ELEMENTS + 1) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < limit


def _is_dims(x: Any) -> bool:
    """A list of at most MAX_DIMS sizes that spans at most MAX_ELEMENTS (zeros count as ones)."""
    return (isinstance(x, list) and len(x) <= MAX_DIMS and all(_is_uint(s) for s in x)
            and math.prod(max(s, 1) for s in x) <= MAX_ELEMENTS)


def _depth_ok(value: Any, limit: int) -> bool:
    """Whether lists and maps in `value` nest at most `limit` deep (iterative: no recursion limit)."""
    stack = [(value, 0)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, (list, tuple, dict)):   # encode packs tuples as lists
            if depth >= limit:
                return False
            stack.extend((c, depth + 1) for c in (v.values() if isinstance(v, dict) else v))
    return True


def _unpack(head: Any) -> Any:
    """msgpack with bounded lengths, str or bytes map keys only, and no ext types."""
    return msgpack.unpackb(head, raw=False, strict_map_key=True, max_str_len=MAX_HEADER_BYTES,
                           max_bin_len=MAX_HEADER_BYTES, max_array_len=MAX_HEADER_BYTES,
                           max_map_len=MAX_HEADER_BYTES, max_ext_len=0)


def _short(x: Any, limit: int = 120) -> str:
    """repr(x), cut to `limit` characters: error messages get logged, and a header is up to 8 MiB."""
    r = repr(x)
    return r if len(r) <= limit else r[:limit - 3] + "..."


def _name(path: Sequence[str], limit: int = 100) -> str:
    """A key path for error messages, cut to `limit` characters."""
    name = "/".join(path)
    return name if len(name) <= limit else name[:limit - 3] + "..."


def check_tensor_entry(i: int, path: Any, dtype_name: Any, shape: Any, seen: set,
                       dtypes: dict[str, torch.dtype] | None = None, what: str = "tensor"
                       ) -> tuple[tuple[str, ...], str, torch.dtype]:
    """Check one ``[path, dtype, shape]`` entry of a header (or a shared-memory layout) against
    `seen` (the paths so far, added to). Returns ``(path, name for messages, dtype)``.

    Raises:
        WireError: a bad key path, a duplicate, a dtype not in `dtypes` (default: the allow-list) or a
            shape outside the bounds (at most MAX_DIMS ints >= 0 spanning at most MAX_ELEMENTS).
    """
    if not (isinstance(path, list) and 0 < len(path) <= MAX_DIMS and all(isinstance(p, str) and p for p in path)):
        raise WireError(f"{what} entry {i}: bad key path {_short(path)}")
    path = tuple(path)
    name = _name(path)
    if path in seen:
        raise WireError(f"{what} {name!r}: duplicate key path")
    seen.add(path)
    dtype = (dtypes or _DTYPES).get(dtype_name) if isinstance(dtype_name, str) else None
    if dtype is None:
        raise WireError(f"{what} {name!r}: dtype {_short(dtype_name)} is not allowed (an unknown dtype, or one "
                        f"outside the allow-list)")
    if not _is_dims(shape):
        raise WireError(f"{what} {name!r}: bad shape {_short(shape)}: at most {MAX_DIMS} ints >= 0 spanning "
                        f"at most {MAX_ELEMENTS} elements (zeros count as ones)")
    return path, name, dtype


def _parse_header(head: memoryview) -> dict:
    if len(head) > MAX_HEADER_BYTES:
        raise WireError(f"header is {len(head)} bytes, over the {MAX_HEADER_BYTES}-byte limit")
    try:
        header = _unpack(head)
    except Exception as e:  # msgpack raises many types on garbage (ExtraData, FormatError, ValueError...)
        raise WireError(f"header is not valid msgpack: {type(e).__name__}: {str(e)[:200]}") from None
    if not isinstance(header, dict):
        raise WireError(f"header must be a map, got {type(header).__name__}")
    v = header.get("v")
    if type(v) is not int or v != PROTOCOL_VERSION:  # True == 1.0 == 1 in Python: check the type too
        raise WireError(f"unknown protocol version {_short(v)} (this side speaks {PROTOCOL_VERSION})")
    missing = {"batch", "meta", "tensors"} - header.keys()
    if missing:
        raise WireError(f"header lacks {sorted(missing)}")
    if not isinstance(header["meta"], dict):
        raise WireError("header 'meta' must be a map")
    if not _depth_ok(header["meta"], MAX_META_DEPTH):
        raise WireError(f"header 'meta' nests lists and maps more than {MAX_META_DEPTH} deep")
    batch = header["batch"]
    if not _is_dims(batch):
        raise WireError(f"bad batch size {_short(batch)}: at most {MAX_DIMS} ints >= 0 spanning at most "
                        f"{MAX_ELEMENTS} elements")
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
        WireError: on any malformed input, and only this. The header and frame sizes are checked
            before any tensor memory is touched; bool bytes other than 0 and 1 are found after.
    """
    batch, leaves, meta = decode_leaves(frames, max_message_bytes)
    name = "(batch)"
    try:
        td = TensorDict({}, batch_size=batch)
        for path, t in leaves.items():
            name = _name(path)
            td.set(path if len(path) > 1 else path[0], t)
    except Exception as e:   # a gap in decode_leaves' checks: still a WireError, never another type
        raise WireError(f"tensor {name!r}: cannot be built ({type(e).__name__}: {str(e)[:200]})") from e
    return td, meta


def decode_leaves(frames: Sequence[Any], max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
                  ) -> tuple[list[int], dict[tuple[str, ...], torch.Tensor], dict]:
    """:func:`decode` without building the TensorDict: ``(batch size, {key path: tensor}, meta)``,
    after the same checks (every shape starts with the batch size; no path runs through another)."""
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
        _, dtype_name, shape = entry
        path, name, dtype = check_tensor_entry(i, *entry, paths)
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
            raise WireError(f"tensor {_name(path)!r}: key path runs through another tensor")
    # Everything above was checked; torch refusing anything below would be a gap in those checks, and
    # is still reported as a WireError so that no receive loop can be stopped.
    name = "(batch)"
    leaves: dict[tuple[str, ...], torch.Tensor] = {}
    try:
        for path, dtype, shape, buf in specs:
            name = _name(path)
            if buf.readonly:
                buf = bytearray(buf)  # torch.frombuffer wants writable memory; bytes input is copied
            t = torch.frombuffer(buf, dtype=dtype) if len(buf) else torch.empty(0, dtype=dtype)
            t = t.view(shape)
            if dtype is torch.bool and t.numel() and bool(t.view(torch.uint8).gt(1).any()):
                raise WireError(f"tensor {name!r}: bool bytes must be 0 or 1")
            leaves[path] = t
    except WireError:
        raise
    except Exception as e:
        raise WireError(f"tensor {name!r}: cannot be built ({type(e).__name__}: {str(e)[:200]})") from e
    return batch, leaves, header["meta"]
