"""Unit tests for ``shared.wire``: the TensorDict <-> ZeroMQ multipart codec (DESIGN.md, "Wire format").

Round trips are checked bit for bit (random bytes reinterpreted as each dtype, so NaN payloads,
-0.0 and infinities all travel), for every dtype on the allow-list, nested keys, odd shapes and
non-contiguous input, from bytes, memoryview and real ``zmq.Frame`` frames. The decoder's promise
is then held to: malformed input raises ``WireError`` and nothing else, whether the damage is
hand-made (one parametrized case per check) or random (a seeded fuzz loop), including shapes whose
zero dimension hides an element count torch cannot compute (issue 12). The weights path's other
input, a shared-memory announcement, is held to the same rule by ``load_published_``.
tests/test_wire_fuzz.py fuzzes both at volume.
"""

from __future__ import annotations

import copy
import os
import random
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import msgpack
import pytest
import torch
import zmq
from tensordict import TensorDict, TensorDictBase
from torch import nn

import shared.shm_weights as shm
import shared.wire as wire
from shared.policies import weights_td
from shared.wire import (MAX_DIMS, MAX_ELEMENTS, MAX_HEADER_BYTES, MAX_META_DEPTH, PROTOCOL_VERSION,
                         WireError, decode, encode)

ALLOWED_DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                  torch.float16, torch.bfloat16, torch.float32, torch.float64]
REJECTED_DTYPES = [getattr(torch, name) for name in
                   ("complex64", "complex128", "uint16", "uint32", "uint64", "float8_e4m3fn")
                   if hasattr(torch, name)]


# ----------------------------------------------------------------------------- helpers

def random_tensor(shape: list[int], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random bits reinterpreted as `dtype` (bool: 0 or 1), so every bit pattern is exercised."""
    g = torch.Generator().manual_seed(seed)
    if dtype is torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = 1
    for s in shape:
        numel *= s
    raw = torch.randint(0, 256, (numel * itemsize,), generator=g, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, for bit-exact comparison (NaN != NaN, -0.0 == 0.0 under ==)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_same_tensor(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype
    assert got.shape == want.shape
    assert torch.equal(bits(got), bits(want))


def assert_same_td(got: TensorDictBase, want: TensorDictBase) -> None:
    assert isinstance(got, TensorDict)
    assert got.batch_size == want.batch_size
    got_keys = sorted(got.keys(include_nested=True, leaves_only=True), key=str)
    want_keys = sorted(want.keys(include_nested=True, leaves_only=True), key=str)
    assert got_keys == want_keys
    for key in want_keys:
        assert_same_tensor(got.get(key), want.get(key))


def roundtrip(td: TensorDictBase, **meta: Any) -> tuple[TensorDict, dict]:
    return decode(encode(td, **meta))


def rollout_td(n: int = 2, t: int = 3) -> TensorDict:
    """A rollout-shaped [N, T] TensorDict with a multi-modal observation."""
    return TensorDict({
        "observation": {
            "rgb": random_tensor([n, t, 8, 8, 3], torch.uint8, seed=1),
            "proprio": random_tensor([n, t, 7], torch.float32, seed=2),
            "instruction": random_tensor([n, t, 12], torch.int64, seed=3),
        },
        "action": random_tensor([n, t, 2], torch.float32, seed=4),
        "reward": random_tensor([n, t], torch.float32, seed=5),
        "done": random_tensor([n, t], torch.bool, seed=6),
        "policy_version": torch.full((n, t), 5, dtype=torch.int64),
    }, batch_size=[n, t])


def valid_frames() -> list[bytes]:
    """A small valid message: batch [2, 3]; leaves in header order a (float32 [2, 3, 4],
    96 bytes), b/c (int64 [2, 3], 48 bytes), done (bool [2, 3], 6 bytes)."""
    td = TensorDict({
        "a": random_tensor([2, 3, 4], torch.float32, seed=7),
        "b": {"c": random_tensor([2, 3], torch.int64, seed=8)},
        "done": random_tensor([2, 3], torch.bool, seed=9),
    }, batch_size=[2, 3])
    return [bytes(f) for f in encode(td, kind="rollout", actor=0, seq=1)]


VALID_TOTAL_BYTES = 96 + 48 + 6


def header_of(frames: list) -> dict:
    return msgpack.unpackb(bytes(frames[0]), raw=False)


def with_header(frames: list, header: Any) -> list:
    return [msgpack.packb(header, use_bin_type=True), *frames[1:]]


_DROP = object()


def edit_header(frames: list, **fields: Any) -> list:
    """`frames` with header fields replaced; a value of `_DROP` removes the field."""
    header = header_of(frames)
    for k, v in fields.items():
        if v is _DROP:
            del header[k]
        else:
            header[k] = v
    return with_header(frames, header)


def edit_entry(frames: list, index: int, *, path: Any = _DROP, dtype: Any = _DROP, shape: Any = _DROP) -> list:
    """`frames` with parts of tensor entry `index` ([path, dtype, shape]) replaced."""
    header = header_of(frames)
    entry = header["tensors"][index]
    for i, v in enumerate((path, dtype, shape)):
        if v is not _DROP:
            entry[i] = v
    return with_header(frames, header)


def replace_frame(frames: list, index: int, frame: Any) -> list:
    frames = list(frames)
    frames[index] = frame
    return frames


# ----------------------------------------------------------------------------- round trips

@pytest.mark.parametrize("batch", [[], [3], [3, 4]], ids=["batch[]", "batch[N]", "batch[N,T]"])
@pytest.mark.parametrize("dtype", ALLOWED_DTYPES, ids=str)
def test_roundtrip_every_dtype_is_bit_exact(dtype, batch):
    td = TensorDict({
        "x": random_tensor([*batch, 2, 5], dtype, seed=1),
        "per_step": random_tensor(batch, dtype, seed=2),       # 0-dim after the batch dims
        "empty": random_tensor([*batch, 0], dtype, seed=3),    # numel 0
    }, batch_size=batch)
    out, meta = roundtrip(td)
    assert_same_td(out, td)
    assert meta == {}


@pytest.mark.parametrize("batch", [[0], [4, 0], [0, 3]])
def test_roundtrip_empty_batch(batch):
    td = TensorDict({"obs": torch.zeros(*batch, 5), "done": torch.zeros(*batch, dtype=torch.bool)},
                    batch_size=batch)
    out, _ = roundtrip(td)
    assert_same_td(out, td)


def test_roundtrip_empty_tensordict():
    out, meta = roundtrip(TensorDict({}, batch_size=[4, 2]), kind="ping")
    assert out.batch_size == torch.Size([4, 2])
    assert list(out.keys()) == []
    assert meta == {"kind": "ping"}


def test_roundtrip_nested_observation():
    td = rollout_td(n=4, t=5)
    out, _ = roundtrip(td)
    assert_same_td(out, td)
    assert isinstance(out["observation"], TensorDictBase)
    assert out["observation"].batch_size == torch.Size([4, 5])
    assert out["observation", "rgb"].shape == (4, 5, 8, 8, 3)


def test_the_leaf_functions_speak_the_same_frames_as_the_tensordict_ones():
    """encode_leaves/decode_leaves (the inference server's per-step path) make and read exactly the
    frames encode/decode do, in any leaf order."""
    td = rollout_td(n=4, t=5)
    leaves = [(k if isinstance(k, tuple) else (k,), v) for k, v in td.items(include_nested=True, leaves_only=True)]
    frames = wire.encode(td, kind="x", seq=3)
    same = wire.encode_leaves([4, 5], leaves[::-1], kind="x", seq=3)
    assert [bytes(f) for f in frames] == [bytes(f) for f in same]
    batch, got, meta = wire.decode_leaves([bytes(f) for f in frames])
    assert batch == [4, 5] and meta == {"kind": "x", "seq": 3}
    assert got.keys() == {p for p, _ in leaves}
    for path, t in leaves:
        assert got[path].dtype == t.dtype and got[path].shape == t.shape     # bit for bit (NaNs too)
        assert torch.equal(got[path].reshape(-1).view(torch.uint8), t.contiguous().reshape(-1).view(torch.uint8))
    with pytest.raises(wire.WireError, match="does not start with the batch size"):
        wire.decode_leaves(wire.encode_leaves([3], [(("a",), torch.zeros(4))]))


def test_roundtrip_deeply_nested_keys():
    td = TensorDict({"a": {"b": {"c": {"d": torch.arange(6).reshape(2, 3)}}}}, batch_size=[2])
    out, _ = roundtrip(td)
    assert_same_td(out, td)


def test_decoded_tensordict_is_usable():
    # The decoded tensors must be ordinary, writable CPU tensors (frombuffer on read-only bytes
    # would not be) that the learner can index, stack and write into.
    out, _ = decode(valid_frames())
    out["a"][0, 0, 0] = 123.0
    out["done"][:] = True
    assert out["a"][0, 0, 0] == 123.0
    assert torch.stack([out, out]).batch_size == torch.Size([2, 2, 3])


NON_CONTIGUOUS = {
    "transposed": lambda: torch.arange(24, dtype=torch.float32).reshape(4, 6).t(),
    "strided_slice": lambda: torch.arange(60, dtype=torch.int64).reshape(6, 10)[:, ::3],
    "offset_slice": lambda: torch.arange(60, dtype=torch.int16).reshape(6, 10)[1:, 2:7],
    "expanded": lambda: torch.arange(3, dtype=torch.float64).expand(5, 3),
    "bf16_transposed": lambda: torch.randn(4, 6, generator=torch.Generator().manual_seed(0))
                                    .to(torch.bfloat16).t(),
    "bool_transposed": lambda: (torch.arange(12).reshape(3, 4) % 3 == 0).t(),
}


@pytest.mark.parametrize("make", NON_CONTIGUOUS.values(), ids=NON_CONTIGUOUS.keys())
def test_roundtrip_non_contiguous(make):
    t = make()
    assert not t.is_contiguous()
    want = t.clone(memory_format=torch.contiguous_format)
    frames = encode(TensorDict({"x": t}, batch_size=t.shape[:1]))
    del t  # the frames must keep their bytes alive on their own
    assert len(frames[1]) == want.numel() * want.element_size()
    out, _ = decode(frames)
    assert_same_tensor(out["x"], want)


def test_encode_detaches_tensors_that_require_grad():
    w = torch.randn(3, 2, requires_grad=True)
    out, _ = roundtrip(TensorDict({"value": w * 2}, batch_size=[3]))
    assert not out["value"].requires_grad
    assert torch.equal(out["value"], (w * 2).detach())


def test_encode_writes_documented_header():
    td = rollout_td(n=2, t=3)
    frames = encode(td, kind="rollout", actor=1)
    header = header_of(frames)
    assert header["v"] == PROTOCOL_VERSION
    assert header["batch"] == [2, 3]
    assert header["meta"] == {"kind": "rollout", "actor": 1}
    paths = [entry[0] for entry in header["tensors"]]
    assert paths == sorted(paths)
    rgb = header["tensors"][paths.index(["observation", "rgb"])]
    assert rgb == [["observation", "rgb"], "uint8", [2, 3, 8, 8, 3]]
    assert len(frames) == 1 + len(paths)


# ----------------------------------------------------------------------------- meta

def test_meta_roundtrip_is_exact():
    meta_in = {"kind": "rollout", "actor": 3, "seq": 7, "policy_version": 2, "extra": {"a": [1, 2.5, "x"]}}
    _, meta = roundtrip(rollout_td(), **meta_in)
    assert meta == meta_in
    assert [type(v) for v in meta["extra"]["a"]] == [int, float, str]


def test_bare_encode_has_empty_meta():
    _, meta = roundtrip(rollout_td())
    assert meta == {}


def test_meta_does_not_collide_with_header_fields():
    # meta names that are also header field names must come back as meta, not corrupt the header
    td = rollout_td()
    out, meta = roundtrip(td, v=99, batch=[7], tensors="x", meta={"m": 1})
    assert meta == {"v": 99, "batch": [7], "tensors": "x", "meta": {"m": 1}}
    assert_same_td(out, td)


@pytest.mark.parametrize("bad", [object(), {1, 2}, 2**64, {1: "int key"}],
                         ids=["object", "set", "int_too_big", "non_string_map_key"])
def test_encode_rejects_meta_that_does_not_roundtrip(bad):
    with pytest.raises(WireError, match="meta"):
        encode(rollout_td(), extra=bad)


@pytest.mark.parametrize("dtype", REJECTED_DTYPES, ids=str)
def test_encode_rejects_dtype_outside_allow_list(dtype):
    td = TensorDict({"ok": torch.zeros(2), "z": torch.zeros(2, 3).to(dtype)}, batch_size=[2])
    with pytest.raises(WireError, match=r"'z'.*not on the allow-list"):
        encode(td)


# ----------------------------------------------------------------------------- frame types

FRAME_TYPES = {
    "bytes": bytes,
    "readonly_memoryview": lambda f: memoryview(bytes(f)),
    "bytearray": lambda f: bytearray(bytes(f)),
    "writable_memoryview": lambda f: memoryview(bytearray(bytes(f))),
    "encoder_output": lambda f: f,  # memoryviews aliasing the source tensors
}


@pytest.mark.parametrize("convert", FRAME_TYPES.values(), ids=FRAME_TYPES.keys())
def test_decode_accepts_bytes_like_frames(convert):
    td = rollout_td()
    out, meta = decode([convert(f) for f in encode(td, seq=4)])
    assert_same_td(out, td)
    assert meta == {"seq": 4}


@pytest.fixture(params=["inproc", "tcp"])
def push_pull(request):
    """A connected PUSH/PULL socket pair; everything is closed with linger=0 afterwards."""
    ctx = zmq.Context()
    push = pull = None
    try:
        pull = ctx.socket(zmq.PULL)
        pull.setsockopt(zmq.LINGER, 0)
        pull.setsockopt(zmq.RCVTIMEO, 5000)  # a lost message fails the test instead of hanging it
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.setsockopt(zmq.SNDTIMEO, 5000)
        if request.param == "inproc":
            address = f"inproc://test-wire-{id(pull)}"
            pull.bind(address)
        else:
            port = pull.bind_to_random_port("tcp://127.0.0.1")
            address = f"tcp://127.0.0.1:{port}"
        push.connect(address)
        yield push, pull
    finally:
        for sock in (push, pull):
            if sock is not None:
                sock.close(linger=0)
        ctx.term()


def test_decode_zmq_frames(push_pull):
    push, pull = push_pull
    td = rollout_td(n=3, t=4)
    want = td.clone()
    push.send_multipart(encode(td, kind="rollout", actor=3, seq=7), copy=False)
    frames = pull.recv_multipart(copy=False)
    assert all(isinstance(f, zmq.Frame) for f in frames)
    out, meta = decode(frames)
    del frames  # decoded tensors must keep the frame memory alive themselves
    assert_same_td(out, want)
    assert meta == {"kind": "rollout", "actor": 3, "seq": 7}


@pytest.mark.parametrize("shape", [[1, 3], [5, 300]], ids=["small", "large"])
def test_decode_zmq_frames_every_dtype(push_pull, shape):
    # small frames (<= 33 bytes) are ZeroMQ "very small messages", stored inline in the message
    # struct and not necessarily aligned for 8-byte dtypes; large ones are separate allocations
    td = TensorDict({str(dtype): random_tensor(shape, dtype, seed=i) for i, dtype in enumerate(ALLOWED_DTYPES)},
                    batch_size=shape[:1])
    push, pull = push_pull
    push.send_multipart(encode(td), copy=False)
    out, _ = decode(pull.recv_multipart(copy=False))
    assert_same_td(out, td)


def test_decode_zmq_frames_received_with_copy(push_pull):
    push, pull = push_pull
    td = rollout_td()
    push.send_multipart(encode(td), copy=False)
    out, _ = decode(pull.recv_multipart(copy=True))  # bytes frames
    assert_same_td(out, td)


# ----------------------------------------------------------------------------- malformed input

def _random_bytes(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


# (mutation of valid_frames(), regex the WireError message must match)
MALFORMED: dict[str, tuple[Callable[[list], Any], str]] = {
    # framing
    "empty_frame_list": (lambda f: [], "at least one frame"),
    "not_a_list": (lambda f: b"".join(f), "at least one frame"),
    "header_only": (lambda f: f[:1], r"3 tensors but 0 data frames"),
    "missing_last_frame": (lambda f: f[:-1], r"3 tensors but 2 data frames"),
    "extra_frame": (lambda f: [*f, b"\0" * 6], r"3 tensors but 4 data frames"),
    "duplicated_frame": (lambda f: [f[0], f[1], *f[1:]], r"3 tensors but 4 data frames"),
    "frame_too_short": (lambda f: replace_frame(f, 1, f[1][:-1]), r"'a'.*95 bytes, expected 96"),
    "frame_too_long": (lambda f: replace_frame(f, 2, f[2] + b"\0"), r"'b/c'.*49 bytes, expected 48"),
    "frame_empty": (lambda f: replace_frame(f, 3, b""), r"'done'.*0 bytes, expected 6"),
    "frames_swapped": (lambda f: [f[0], f[2], f[1], f[3]], r"'a'.*48 bytes, expected 96"),
    "frame_not_bytes": (lambda f: replace_frame(f, 1, 12345), "not a bytes-like object"),
    "frame_is_str": (lambda f: replace_frame(f, 1, "x" * 96), "not a bytes-like object"),
    "header_frame_none": (lambda f: replace_frame(f, 0, None), "not a bytes-like object"),
    "non_contiguous_memoryview": (lambda f: replace_frame(f, 1, memoryview(f[1] * 2)[::2]),
                                  "not a bytes-like object"),
    # header encoding
    "header_empty": (lambda f: replace_frame(f, 0, b""), "not valid msgpack"),
    "header_random_bytes": (lambda f: replace_frame(f, 0, _random_bytes(64, seed=1)), "msgpack|header"),
    "header_invalid_byte": (lambda f: replace_frame(f, 0, b"\xc1"), "not valid msgpack"),
    "header_truncated": (lambda f: replace_frame(f, 0, f[0][:-3]), "not valid msgpack"),
    "header_trailing_garbage": (lambda f: replace_frame(f, 0, f[0] + b"\x00"), "not valid msgpack"),
    "header_not_utf8": (lambda f: replace_frame(f, 0, b"\x81\xa1v\xa2\xff\xfe"), "not valid msgpack"),
    "header_int_map_key": (lambda f: with_header(f, {1: 2}), "not valid msgpack"),
    "header_too_big": (lambda f: replace_frame(f, 0, b"\x00" * (MAX_HEADER_BYTES + 1)), "byte limit"),
    "header_is_list": (lambda f: with_header(f, [1, 2, 3]), "must be a map"),
    "header_is_str": (lambda f: with_header(f, "hello"), "must be a map"),
    "header_is_nil": (lambda f: with_header(f, None), "must be a map"),
    # header content
    "version_wrong": (lambda f: edit_header(f, v=PROTOCOL_VERSION + 1), "protocol version"),
    "version_zero": (lambda f: edit_header(f, v=0), "protocol version"),
    "version_str": (lambda f: edit_header(f, v=str(PROTOCOL_VERSION)), "protocol version"),
    "version_true": (lambda f: edit_header(f, v=True), "protocol version"),
    "version_float": (lambda f: edit_header(f, v=float(PROTOCOL_VERSION)), "protocol version"),
    "version_missing": (lambda f: edit_header(f, v=_DROP), "protocol version"),
    "batch_missing": (lambda f: edit_header(f, batch=_DROP), r"lacks \['batch'\]"),
    "meta_missing": (lambda f: edit_header(f, meta=_DROP), r"lacks \['meta'\]"),
    "tensors_missing": (lambda f: edit_header(f, tensors=_DROP), r"lacks \['tensors'\]"),
    "all_keys_missing": (lambda f: with_header(f, {"v": PROTOCOL_VERSION}), r"lacks \['batch', 'meta', 'tensors'\]"),
    "meta_not_map": (lambda f: edit_header(f, meta=[1]), "'meta' must be a map"),
    "batch_negative": (lambda f: edit_header(f, batch=[-2, 3]), "bad batch size"),
    "batch_not_list": (lambda f: edit_header(f, batch="2x3"), "bad batch size"),
    "batch_bool": (lambda f: edit_header(f, batch=[True, 3]), "bad batch size"),
    "batch_float": (lambda f: edit_header(f, batch=[2.0, 3]), "bad batch size"),
    "batch_too_many_dims": (lambda f: edit_header(f, batch=[1] * 17), "bad batch size"),
    "batch_mismatch": (lambda f: edit_header(f, batch=[3, 2]), "does not start with the batch size"),
    "tensors_not_list": (lambda f: edit_header(f, tensors={"a": 1}), "'tensors' must be a list"),
    "entry_not_list": (lambda f: edit_header(f, tensors=["a", "b", "c"]), r"entry 0 must be \[path, dtype, shape\]"),
    "entry_too_short": (lambda f: edit_header(f, tensors=[[["a"], "float32"]] * 3), r"entry 0 must be"),
    "path_not_list": (lambda f: edit_entry(f, 0, path="a"), "bad key path"),
    "path_empty": (lambda f: edit_entry(f, 0, path=[]), "bad key path"),
    "path_empty_str": (lambda f: edit_entry(f, 0, path=[""]), "bad key path"),
    "path_int": (lambda f: edit_entry(f, 0, path=[1]), "bad key path"),
    "path_too_deep": (lambda f: edit_entry(f, 0, path=["a"] * 17), "bad key path"),
    "duplicate_path": (lambda f: edit_entry(f, 2, path=["b", "c"]), "duplicate key path"),
    "path_through_tensor": (lambda f: edit_entry(f, 1, path=["a", "c"]), "runs through another tensor"),
    "path_through_tensor_reversed": (lambda f: edit_entry(f, 0, path=["b"]), "runs through another tensor"),
    "dtype_unknown": (lambda f: edit_entry(f, 0, dtype="float128"), "dtype 'float128' is not allowed"),
    "dtype_complex": (lambda f: edit_entry(f, 0, dtype="complex64"), "dtype 'complex64' is not allowed"),
    "dtype_torch_spelling": (lambda f: edit_entry(f, 0, dtype="torch.float32"), "is not allowed"),
    "dtype_not_str": (lambda f: edit_entry(f, 0, dtype=7), "dtype 7 is not allowed"),
    "dtype_list": (lambda f: edit_entry(f, 0, dtype=["float32"]), "is not allowed"),
    "dtype_wrong_itemsize": (lambda f: edit_entry(f, 0, dtype="float64"), r"96 bytes, expected 192"),
    "shape_absurd": (lambda f: edit_entry(f, 0, shape=[2, 3, 2**16, 2**16]), "message limit"),
    "shape_absurd_no_batch": (lambda f: edit_entry(edit_header(f, batch=[]), 0, shape=[2**17, 2**17]),
                              "message limit"),
    "shape_large_but_under_limit": (lambda f: edit_entry(f, 0, shape=[2, 3, 2**28]), r"expected 6442450944"),
    "shape_dim_too_big": (lambda f: edit_entry(f, 0, shape=[2, 3, 2**40]), "bad shape"),
    "shape_spans_too_much": (lambda f: edit_entry(f, 0, shape=[2, 3, 2**18, 2**18]), "spanning at most"),
    "shape_dim_2_64": (lambda f: edit_entry(f, 0, shape=[2, 3, 2**64 - 1]), "bad shape"),
    "shape_negative": (lambda f: edit_entry(f, 0, shape=[2, 3, -4]), "bad shape"),
    "shape_negative_pair": (lambda f: edit_entry(f, 0, shape=[2, 3, -4, -1]), "bad shape"),
    "shape_float": (lambda f: edit_entry(f, 0, shape=[2, 3, 4.0]), "bad shape"),
    "shape_bool": (lambda f: edit_entry(f, 0, shape=[2, 3, True]), "bad shape"),
    "shape_not_list": (lambda f: edit_entry(f, 0, shape=24), "bad shape"),
    "shape_too_many_dims": (lambda f: edit_entry(f, 0, shape=[2, 3] + [1] * 15), "bad shape"),
    "shape_not_batch_first": (lambda f: edit_entry(f, 0, shape=[3, 2, 4]), "does not start with the batch size"),
    "shape_shorter_than_batch": (lambda f: edit_entry(f, 2, shape=[6]), "does not start with the batch size"),
    "shape_scalar_with_batch": (lambda f: edit_entry(f, 2, shape=[]), "does not start with the batch size"),
    # tensor contents
    "bool_value_2": (lambda f: replace_frame(f, 3, bytes([0, 1, 2, 0, 1, 0])), "bool bytes must be 0 or 1"),
    "bool_value_255": (lambda f: replace_frame(f, 3, bytes([255, 0, 0, 0, 0, 0])), "bool bytes must be 0 or 1"),
}


@pytest.mark.parametrize("mutate, match", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_message_raises_wire_error(mutate, match):
    frames = mutate(valid_frames())
    with pytest.raises(WireError, match=match):
        decode(frames)


def test_valid_frames_fixture_decodes():
    # guards the table above: every case must be one mutation away from a message that decodes
    out, meta = decode(valid_frames())
    assert out.batch_size == torch.Size([2, 3])
    assert meta == {"kind": "rollout", "actor": 0, "seq": 1}


def test_max_message_bytes_is_inclusive_limit():
    frames = valid_frames()
    decode(frames, max_message_bytes=VALID_TOTAL_BYTES)
    with pytest.raises(WireError, match=rf"{VALID_TOTAL_BYTES - 1}-byte message limit"):
        decode(frames, max_message_bytes=VALID_TOTAL_BYTES - 1)


def test_oversized_message_refused_before_frames_are_read():
    # a sender that claims 1 GiB but ships a few bytes must be refused by the size limit
    frames = edit_entry(valid_frames(), 0, shape=[2, 3, 2**26])
    with pytest.raises(WireError, match="message limit"):
        decode(frames, max_message_bytes=1 << 20)


# ----------------------------------------------------------------------------- element counts (issue 12)

def header_message(tensors: list, batch: list | None = None, meta: dict | None = None, data: list | None = None
                   ) -> list:
    """A hand-built message: `tensors` as header entries, and a frame per entry (empty by default)."""
    head = msgpack.packb({"v": PROTOCOL_VERSION, "batch": batch or [], "meta": meta or {}, "tensors": tensors},
                         use_bin_type=True)
    return [head, *(data if data is not None else [b""] * len(tensors))]


def test_issue_12_zero_byte_shape_with_huge_dims_is_a_wire_error():
    # the 60-byte message from the issue: 0 bytes, so the length check passed, then
    # t.view(shape) raised "RuntimeError: numel: integer multiplication overflow"
    frames = header_message([[["x"], "float32", [2**40 - 1, 2**40 - 1, 0]]])
    assert len(frames[0]) < 64
    with pytest.raises(WireError, match=r"tensor 'x': bad shape \[1099511627775, 1099511627775, 0\]"):
        decode(frames)


@pytest.mark.parametrize("shape", [
    [0, 2**40 - 1, 2**40 - 1],              # numel stays 0 in torch, but the strides overflow int64
    [2**40 - 1, 0, 2**40 - 1],
    [2**32, 2**32, 0],                      # each dim small, their product 2**64
    [0] + [2**4] * 10,                      # 2**40 spread over many dims
    [0, MAX_ELEMENTS + 1],                  # one dim just over the bound
    [0, 2**18, 2**18 + 1],                  # product just over the bound
    [0, 2**63], [0, 2**64 - 1],             # int64 and uint64 extremes msgpack can carry
], ids=str)
@pytest.mark.parametrize("dtype", ["bool", "bfloat16", "float64"])
def test_zero_dims_do_not_hide_huge_dims(shape, dtype):
    with pytest.raises(WireError, match="bad shape.*spanning at most"):
        decode(header_message([[["x"], dtype, shape]]))


@pytest.mark.parametrize("shape", [[0, MAX_ELEMENTS], [0, 2**18, 2**18], [2**18, 0, 2**18], [0] * MAX_DIMS,
                                   [0, 1, 2**36]], ids=str)
def test_zero_byte_shapes_up_to_the_span_bound_decode(shape):
    td, _ = decode(header_message([[["x"], "int64", shape]]))
    t = td["x"]
    assert list(t.shape) == shape and t.numel() == 0
    assert t.is_contiguous()
    assert all(0 <= s <= MAX_ELEMENTS for s in t.stride())


def test_element_bound_is_exact():
    # span = product of the dims with zeros counted as ones; MAX_ELEMENTS is allowed, one more is not
    half = 2**18
    assert half * half == MAX_ELEMENTS
    decode(header_message([[["x"], "uint8", [0, half, half]]]))
    with pytest.raises(WireError, match="spanning at most"):
        decode(header_message([[["x"], "uint8", [0, half, half, 2]]]))


@pytest.mark.parametrize("batch", [[2**40 - 1, 2**40 - 1, 0], [0, MAX_ELEMENTS + 1], [2**47] * 16, [1] * 17],
                         ids=["issue", "one_dim_over", "huge", "too_many_dims"])
def test_batch_size_is_bounded_like_a_shape(batch):
    # an empty TensorDict with such a batch size would overflow later, in td.numel() or a reshape
    with pytest.raises(WireError, match="bad batch size"):
        decode(header_message([], batch=batch))


def test_encode_refuses_shapes_decode_would_refuse():
    with pytest.raises(WireError, match="spans more than"):
        encode(TensorDict({"x": torch.empty(0, 2**20, 2**20)}, batch_size=[]))
    with pytest.raises(WireError, match="batch size"):
        encode(TensorDict({}, batch_size=[0, 2**20, 2**20]))
    with pytest.raises(WireError, match=f"nested more than {MAX_DIMS} deep"):
        encode(TensorDict({("k",) * (MAX_DIMS + 1): torch.zeros(1)}, batch_size=[]))
    deep: Any = 1
    for _ in range(MAX_META_DEPTH):
        deep = (deep,)                     # msgpack packs tuples as lists
    with pytest.raises(WireError, match="deep"):
        encode(TensorDict({}, batch_size=[]), x=deep)


# ----------------------------------------------------------------------------- header limits

@pytest.mark.parametrize("value", [msgpack.ExtType(5, b"xy"), msgpack.Timestamp(1, 2)], ids=["ext", "timestamp"])
def test_ext_types_in_meta_are_refused(value):
    head = msgpack.packb({"v": PROTOCOL_VERSION, "batch": [], "meta": {"x": value}, "tensors": []})
    with pytest.raises(WireError, match="max_ext_len"):
        decode([head])
    with pytest.raises(WireError, match="not msgpack-able"):
        encode(TensorDict({}, batch_size=[]), x=value)


def _nested(depth: int) -> Any:
    value: Any = 1
    for i in range(depth):
        value = [value] if i % 2 else {"k": value}
    return value


def test_meta_nesting_is_bounded():
    ok = header_message([], meta={"x": _nested(MAX_META_DEPTH - 1)})
    assert decode(ok)[1] == {"x": _nested(MAX_META_DEPTH - 1)}
    with pytest.raises(WireError, match=f"more than {MAX_META_DEPTH} deep"):
        decode(header_message([], meta={"x": _nested(MAX_META_DEPTH)}))
    with pytest.raises(WireError, match="not valid msgpack"):   # deeper than msgpack's own stack
        decode([b"\x81\xa1v" + b"\x91" * 5000 + b"\x00"])
    with pytest.raises(WireError, match=f"more than {MAX_META_DEPTH} deep"):
        encode(TensorDict({}, batch_size=[]), x=_nested(MAX_META_DEPTH))


@pytest.mark.parametrize("prefix", [b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff", b"\xdb\xff\xff\xff\xff",
                                    b"\xc6\xff\xff\xff\xff", b"\xc9\xff\xff\xff\xff\x05"],
                         ids=["array32", "map32", "str32", "bin32", "ext32"])
def test_header_lengths_claimed_beyond_the_frame_are_refused(prefix):
    with pytest.raises(WireError, match="not valid msgpack"):
        decode([prefix + b"\x00" * 16])


def test_error_messages_are_short_for_huge_headers():
    long_path = ["p" * 100_000]
    with pytest.raises(WireError) as err:
        decode(header_message([[long_path, "float32", [0, 2**40, 2**40]]]))
    assert len(str(err.value)) < 400
    with pytest.raises(WireError) as err:
        decode(header_message([[["x"], "f" * 100_000, [1]]]))
    assert len(str(err.value)) < 400


def test_released_memoryview_frame_is_a_wire_error():
    view = memoryview(b"\0" * 6)
    view.release()
    with pytest.raises(WireError, match="not a bytes-like object"):
        decode(header_message([[["x"], "uint8", [6]]], data=[view]))


@pytest.mark.parametrize("where", ["frombuffer", "set"])
def test_a_surprise_from_torch_or_tensordict_becomes_a_wire_error(monkeypatch, where):
    # decode's checks should leave nothing for torch to refuse; if they ever miss something,
    # the receive loop must still see a WireError, naming the tensor
    def boom(*args, **kwargs):
        raise RuntimeError("surprise")
    if where == "frombuffer":
        monkeypatch.setattr(wire.torch, "frombuffer", boom)
    else:
        monkeypatch.setattr(wire.TensorDict, "set", boom)
    with pytest.raises(WireError, match=r"tensor 'a': cannot be built \(RuntimeError: surprise\)"):
        decode(valid_frames())


# ----------------------------------------------------------------------------- fuzzing

def _random_value(rng: random.Random, depth: int = 0) -> Any:
    choices = [None, True, False, 0, -1, 1, 2, 3, 2**31, 2**40, 2**63 - 1, -(2**63), 0.5, float("nan"),
               "", "a", "float32", "bool", "v", "batch", "tensors", b"\x00\x01"]
    if depth < 2:
        choices += [[], {}, [rng.randint(-2, 4) for _ in range(rng.randint(0, 4))],
                    [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))],
                    {"k": _random_value(rng, depth + 1)}]
    return rng.choice(choices)


def _mutate_header_structure(frames: list, rng: random.Random) -> list:
    try:
        return with_header(frames, _mutated_header(header_of(frames), rng))
    except Exception:  # the header is already broken (an earlier mutation): leave it as it is
        return frames


def _mutated_header(header: dict, rng: random.Random) -> dict:
    target = rng.randrange(4)
    if target == 0 or not header["tensors"]:
        header[rng.choice(["v", "batch", "meta", "tensors", "extra"])] = _random_value(rng)
    elif target == 1:
        entry = rng.choice(header["tensors"])
        entry[rng.randrange(3)] = _random_value(rng)
    elif target == 2:
        shape = rng.choice(header["tensors"])[2]
        if shape:
            shape[rng.randrange(len(shape))] = rng.choice([0, 1, 2, 3, 7, -1, 2**20, 2**39, 2**48])
        else:
            shape.append(rng.randint(0, 3))
    else:
        entries = header["tensors"]
        i, j = rng.randrange(len(entries)), rng.randrange(len(entries))
        entries[i][0] = list(entries[j][0]) + rng.choice([[], ["x"]])
    return header


def _flip_header_bytes(frames: list, rng: random.Random) -> list:
    head = bytearray(frames[0])
    for _ in range(rng.randint(1, 4)):
        head[rng.randrange(len(head))] = rng.randrange(256)
    return replace_frame(frames, 0, bytes(head))


def _flip_data_bytes(frames: list, rng: random.Random) -> list:
    if len(frames) < 2:
        return frames
    i = rng.randrange(1, len(frames))
    data = bytearray(frames[i])
    if data:
        data[rng.randrange(len(data))] = rng.randrange(256)
    return replace_frame(frames, i, bytes(data))


def _truncate_frame(frames: list, rng: random.Random) -> list:
    i = rng.randrange(len(frames))
    return replace_frame(frames, i, frames[i][:rng.randint(0, max(len(frames[i]) - 1, 0))])


def _extend_frame(frames: list, rng: random.Random) -> list:
    i = rng.randrange(len(frames))
    return replace_frame(frames, i, frames[i] + rng.randbytes(rng.randint(1, 16)))


def _drop_frame(frames: list, rng: random.Random) -> list:
    frames = list(frames)
    del frames[rng.randrange(len(frames))]
    return frames


def _duplicate_frame(frames: list, rng: random.Random) -> list:
    frames = list(frames)
    i = rng.randrange(len(frames))
    frames.insert(rng.randrange(len(frames) + 1), frames[i])
    return frames


def _random_message(frames: list, rng: random.Random) -> list:
    return [rng.randbytes(rng.randint(0, 64)) for _ in range(rng.randint(0, 5))]


FUZZ_MUTATIONS = [_mutate_header_structure, _flip_header_bytes, _flip_data_bytes, _truncate_frame,
                  _extend_frame, _drop_frame, _duplicate_frame, _random_message]


def test_fuzzed_messages_decode_or_raise_wire_error():
    rng = random.Random(0)
    seeds = [valid_frames(),
             [bytes(f) for f in encode(rollout_td(n=2, t=2), kind="rollout", actor=1)],
             [bytes(f) for f in encode(TensorDict({"x": torch.arange(3.0)}, batch_size=[]))]]
    outcomes: Counter[str] = Counter()
    for _ in range(2000):
        frames = rng.choice(seeds)
        for _ in range(rng.randint(1, 2)):
            frames = rng.choice(FUZZ_MUTATIONS)(frames, rng) if frames else frames
        try:
            out, meta = decode(frames, max_message_bytes=1 << 24)
        except WireError:
            outcomes["rejected"] += 1
        else:  # anything else (TypeError, RuntimeError, MemoryError...) fails the test
            assert isinstance(out, TensorDict)
            assert isinstance(meta, dict)
            outcomes["accepted"] += 1
    # the loop must exercise both outcomes, or it tests nothing
    assert outcomes["rejected"] > 500, outcomes
    assert outcomes["accepted"] > 50, outcomes


# ----------------------------------------------------------------------------- shared-memory announcements (issue 12)
# A weights message through shared memory carries only an announcement (file, slot, layout, version).
# load_published_ must refuse a malformed one with WireError before touching the policy, and keep
# False for torn reads.

class TinyPolicy(nn.Module):
    """Parameters and buffers of several dtypes, nested names, a 0-dim tensor."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.actor = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
        self.log_std = nn.Parameter(torch.randn(2))
        self.register_buffer("count", torch.tensor(seed, dtype=torch.int64))
        self.register_buffer("scale", torch.randn(5).to(torch.bfloat16))


def weights_digest(policy: nn.Module) -> bytes:
    """Every parameter and buffer, bit for bit (shared.policies.weights_digest cannot view a 0-dim
    int64 buffer as bytes)."""
    return b"".join(k.encode() + bits(t).numpy().tobytes() for k, t in sorted(policy.state_dict().items()))


class ShmRing:
    """A writer's ring in `directory` (standing in for /dev/shm) holding versions 0 and 1 in its two slots."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.sources = [TinyPolicy(seed=v) for v in range(2)]
        self.writer = shm.ShmWeightsWriter(weights_td(self.sources[0]), directory / "tandem-123-test.weights", slots=2)
        self.metas = []
        for v, src in enumerate(self.sources):
            where = self.writer.write(weights_td(src), v)
            # what an actor gets: the message after encode and decode
            _, meta = decode([bytes(f) for f in encode(TensorDict({}, []), kind="weights", version=v, **where)])
            self.metas.append(meta)

    def close(self) -> None:
        self.writer.close()


@pytest.fixture
def ring(tmp_path, monkeypatch):
    monkeypatch.setattr(shm, "SHM_DIR", tmp_path)
    r = ShmRing(tmp_path)
    yield r
    r.close()


def test_valid_announcement_loads(ring):
    policy, reader = TinyPolicy(seed=7), shm.ShmWeightsReader()
    for v in (0, 1):
        assert shm.load_published_(policy, TensorDict({}, []), ring.metas[v], reader, "cpu")
        assert weights_digest(policy) == weights_digest(ring.sources[v])
    reader.close()


def _edit_layout(meta: dict, index: int, field: int, value: Any) -> dict:
    meta["layout"][index][field] = value
    return meta


def _file(ring: ShmRing, name: str, make: Callable[[Path], None]) -> Callable[[dict], dict]:
    def edit(meta: dict) -> dict:
        path = ring.directory / name
        make(path)
        meta["shm"] = str(path)
        return meta
    return edit


def _ring_bytes(ring: ShmRing) -> bytes:
    return ring.writer.path.read_bytes()


# (edit of a valid announcement, regex the WireError must match)
BAD_ANNOUNCEMENTS: dict[str, tuple[Callable[[ShmRing, dict], dict], str]] = {
    # without "shm" it is a weights message with the weights inside, here none
    "missing_shm": (lambda r, m: {k: v for k, v in m.items() if k != "shm"}, "do not match the policy: missing"),
    "missing_slot": (lambda r, m: {k: v for k, v in m.items() if k != "slot"}, r"lacks \['slot'\]"),
    "missing_slot_bytes": (lambda r, m: {k: v for k, v in m.items() if k != "slot_bytes"}, "lacks"),
    "missing_layout": (lambda r, m: {k: v for k, v in m.items() if k != "layout"}, "lacks"),
    "missing_version": (lambda r, m: {k: v for k, v in m.items() if k != "version"}, "bad version"),
    "shm_int": (lambda r, m: {**m, "shm": 7}, "'shm' must be a file path"),
    "shm_none": (lambda r, m: {**m, "shm": None}, "'shm' must be a file path"),
    "shm_empty": (lambda r, m: {**m, "shm": ""}, "'shm' must be a file path"),
    "shm_nul": (lambda r, m: {**m, "shm": m["shm"] + "\0"}, "'shm' must be a file path"),
    "shm_outside": (lambda r, m: {**m, "shm": "/etc/passwd"}, "not a tandem-\\*.weights file"),
    "shm_relative": (lambda r, m: {**m, "shm": "tandem-1-x.weights"}, "not a tandem"),
    "shm_wrong_name": (lambda r, m: {**m, "shm": str(r.directory / "other.weights")}, "not a tandem"),
    "shm_dotdot": (lambda r, m: {**m, "shm": str(r.directory / ".." / r.directory.name / "tandem-123-test.weights")},
                   "not a tandem"),
    "shm_dot_in_name": (lambda r, m: {**m, "shm": str(r.directory / "tandem-..weights")}, "not a tandem"),
    "shm_subdir": (lambda r, m: {**m, "shm": str(r.directory / "sub" / "tandem-1.weights")}, "not a tandem"),
    "shm_missing_file": (lambda r, m: {**m, "shm": str(r.directory / "tandem-1-gone.weights")}, "cannot open"),
    "shm_symlink": (lambda r, m: _file(r, "tandem-1-link.weights", lambda p: p.symlink_to(r.writer.path))(m),
                    "cannot open"),
    "shm_fifo": (lambda r, m: _file(r, "tandem-1-fifo.weights", lambda p: os.mkfifo(p))(m), "not a regular"),
    "shm_directory": (lambda r, m: _file(r, "tandem-1-dir.weights", lambda p: p.mkdir())(m), "not a regular"),
    "shm_empty_file": (lambda r, m: _file(r, "tandem-1-empty.weights", lambda p: p.write_bytes(b""))(m),
                       "not a regular, non-empty"),
    "shm_file_cut_short": (lambda r, m: _file(r, "tandem-1-short.weights",
                                              lambda p: p.write_bytes(_ring_bytes(r)[:-1]))(m),
                           "not a whole number of"),
    "shm_file_one_slot": (lambda r, m: _file(r, "tandem-1-one.weights",
                                             lambda p: p.write_bytes(_ring_bytes(r)[:m["slot_bytes"]]))(m),
                          "not a whole number of"),
    "slot_negative": (lambda r, m: {**m, "slot": -1}, "bad slot"),
    "slot_bool": (lambda r, m: {**m, "slot": True}, "bad slot"),
    "slot_float": (lambda r, m: {**m, "slot": 1.0}, "bad slot"),
    "slot_str": (lambda r, m: {**m, "slot": "1"}, "bad slot"),
    "slot_huge": (lambda r, m: {**m, "slot": 2**63 - 1}, "bad slot"),
    "slot_past_file": (lambda r, m: {**m, "slot": 2}, "not a whole number of"),
    "slot_bytes_zero": (lambda r, m: {**m, "slot_bytes": 0}, "bad slot_bytes"),
    "slot_bytes_unaligned": (lambda r, m: {**m, "slot_bytes": m["slot_bytes"] + 8}, "bad slot_bytes"),
    "slot_bytes_negative": (lambda r, m: {**m, "slot_bytes": -m["slot_bytes"]}, "bad slot_bytes"),
    "slot_bytes_huge": (lambda r, m: {**m, "slot_bytes": 2**64 - 64}, "bad slot_bytes"),
    "slot_bytes_doubled": (lambda r, m: {**m, "slot_bytes": 2 * m["slot_bytes"]}, "but the layout fills"),
    "slot_bytes_header_only": (lambda r, m: {**m, "slot_bytes": 64}, "but the layout fills"),
    "layout_none": (lambda r, m: {**m, "layout": None}, "'layout' must be a list"),
    "layout_map": (lambda r, m: {**m, "layout": {"a": 1}}, "'layout' must be a list"),
    "layout_empty": (lambda r, m: {**m, "layout": []}, "but the layout fills"),
    "layout_entry_short": (lambda r, m: {**m, "layout": [e[:3] for e in m["layout"]]}, r"must be \[path, dtype"),
    "layout_dropped_entry": (lambda r, m: {**m, "layout": m["layout"][1:]}, "but the layout packs it at"),
    "layout_dropped_last_entry": (lambda r, m: {**m, "layout": m["layout"][:-1]}, "but the layout fills"),
    "layout_duplicate_entry": (lambda r, m: {**m, "layout": m["layout"] + m["layout"][:1]}, "duplicate key path"),
    "path_str": (lambda r, m: _edit_layout(m, 0, 0, "actor.0.weight"), "bad key path"),
    "path_empty": (lambda r, m: _edit_layout(m, 0, 0, []), "bad key path"),
    "path_int": (lambda r, m: _edit_layout(m, 0, 0, [0]), "bad key path"),
    "path_unknown": (lambda r, m: _edit_layout(m, 0, 0, ["nope"]), "unexpected \\['nope'\\]"),
    "path_through_tensor": (lambda r, m: _edit_layout(m, 0, 0, m["layout"][1][0] + ["x"]),
                            "runs through another tensor"),
    "dtype_mismatch": (lambda r, m: _edit_layout(m, 0, 1, "float64"), "the policy has torch.float32"),
    "dtype_unknown": (lambda r, m: _edit_layout(m, 0, 1, "float128"), "unknown dtype"),
    "dtype_torch_attribute": (lambda r, m: _edit_layout(m, 0, 1, "_dynamo"), "unknown dtype"),
    "dtype_int": (lambda r, m: _edit_layout(m, 0, 1, 6), "unknown dtype"),
    "shape_mismatch": (lambda r, m: _edit_layout(m, 0, 2, [3, 4]), "the policy has"),
    "shape_issue_12": (lambda r, m: _edit_layout(m, 0, 2, [2**40 - 1, 2**40 - 1, 0]), "bad shape"),
    "shape_negative": (lambda r, m: _edit_layout(m, 0, 2, [-4, -3]), "bad shape"),
    "shape_not_list": (lambda r, m: _edit_layout(m, 0, 2, 12), "bad shape"),
    "offset_negative": (lambda r, m: _edit_layout(m, 0, 3, -64), "but the layout packs it at"),
    "offset_unaligned": (lambda r, m: _edit_layout(m, 0, 3, 4), "but the layout packs it at"),
    "offset_past_slot": (lambda r, m: _edit_layout(m, 0, 3, m["slot_bytes"]), "but the layout packs it at"),
    "offset_of_another_tensor": (lambda r, m: _edit_layout(m, 1, 3, 0), "but the layout packs it at"),
    "offsets_swapped": (lambda r, m: {**m, "layout": [m["layout"][1], m["layout"][0], *m["layout"][2:]]},
                        "but the layout packs it at"),
    "offset_huge": (lambda r, m: _edit_layout(m, 0, 3, 2**64 - 64), "but the layout packs it at"),
    "offset_float": (lambda r, m: _edit_layout(m, 0, 3, 0.0), "but the layout packs it at"),
    "version_negative": (lambda r, m: {**m, "version": -1}, "bad version"),
    "version_bool": (lambda r, m: {**m, "version": True}, "bad version"),
    "version_str": (lambda r, m: {**m, "version": "1"}, "bad version"),
    "version_uint64": (lambda r, m: {**m, "version": 2**64 - 1}, "bad version"),
}


@pytest.mark.parametrize("edit, match", BAD_ANNOUNCEMENTS.values(), ids=BAD_ANNOUNCEMENTS.keys())
def test_malformed_announcement_raises_wire_error_and_leaves_the_policy(ring, edit, match):
    policy, reader = TinyPolicy(seed=7), shm.ShmWeightsReader()
    before = weights_digest(policy)
    meta = edit(ring, copy.deepcopy(ring.metas[1]))
    with pytest.raises(WireError, match=match):
        shm.load_published_(policy, TensorDict({}, []), meta, reader, "cpu")
    assert weights_digest(policy) == before
    # the reader is still usable: the next, valid version loads
    assert shm.load_published_(policy, TensorDict({}, []), ring.metas[1], reader, "cpu")
    assert weights_digest(policy) == weights_digest(ring.sources[1])
    reader.close()


def test_torn_read_is_false_not_an_error(ring):
    policy, reader = TinyPolicy(seed=7), shm.ShmWeightsReader()
    ring.writer.write(weights_td(TinyPolicy(seed=2)), 2)            # version 2 takes slot 0 from version 0
    assert not shm.load_published_(policy, TensorDict({}, []), ring.metas[0], reader, "cpu")
    assert not shm.load_published_(policy, TensorDict({}, []), {**ring.metas[1], "version": 5}, reader, "cpu")
    reader.close()


def test_reader_methods_check_the_announcement_against_the_file(ring):
    reader = shm.ShmWeightsReader()
    for method in (reader.slot_version, reader.views, lambda m: reader.copy_into(lambda v: None, m, 1),
                   lambda m: reader.stream_into(weights_td(TinyPolicy()), m, 1)):
        with pytest.raises(WireError, match="not a whole number of"):
            method({**ring.metas[1], "slot": 5})
        with pytest.raises(WireError, match="but the layout packs it at"):
            method(_edit_layout(copy.deepcopy(ring.metas[1]), 0, 3, 2**40))
    with pytest.raises(WireError, match="do not match the policy"):   # dst is not what the slot holds
        reader.stream_into(TensorDict({k: torch.zeros(1) for k in ("a", "b")}, []), ring.metas[1], 1)
    reader.close()


@pytest.mark.parametrize("edit", [
    lambda td: td.exclude("log_std"),
    lambda td: td.set("extra", torch.zeros(1)),
    lambda td: td.set("log_std", torch.zeros(3)),
    lambda td: td.set("log_std", torch.zeros(2, dtype=torch.float64)),
    lambda td: td.set("count", torch.zeros(1, dtype=torch.int64)),
], ids=["missing", "extra", "shape", "dtype", "0-dim_vs_1-dim"])
def test_zmq_weights_that_do_not_fit_the_policy_raise_wire_error(edit):
    # the same check for weights carried in the message itself (weights_transport "zmq")
    policy = TinyPolicy(seed=7)
    before = weights_digest(policy)
    td = edit(weights_td(TinyPolicy(seed=1)).clone())
    got, meta = decode([bytes(f) for f in encode(td, kind="weights", version=1)])
    with pytest.raises(WireError, match="weights"):
        shm.load_published_(policy, got, meta, None, "cpu")
    assert weights_digest(policy) == before
    assert shm.load_published_(policy, weights_td(TinyPolicy(seed=1)), meta, None, "cpu")
    assert weights_digest(policy) == weights_digest(TinyPolicy(seed=1))


def test_seeded_random_announcements_load_or_raise_wire_error(ring):
    """Announcement fields replaced by random msgpack values: True (unchanged weights), False (torn)
    or WireError, nothing else, and a policy that is only ever touched by a full, valid version."""
    rng = random.Random(3)
    reader = shm.ShmWeightsReader()
    policy = TinyPolicy(seed=7)
    outcomes: Counter[str] = Counter()
    for _ in range(1500):
        v = rng.randrange(2)
        meta = copy.deepcopy(ring.metas[v])
        for _ in range(rng.randint(1, 2)):
            target = rng.randrange(3)
            if target == 0:
                meta[rng.choice(["shm", "slot", "slot_bytes", "layout", "version"])] = _random_value(rng)
            elif target == 1 and isinstance(meta.get("layout"), list) and meta["layout"]:
                entry = rng.choice(meta["layout"])
                if isinstance(entry, list) and entry:
                    entry[rng.randrange(len(entry))] = _random_value(rng)
            else:
                key = rng.choice(["slot", "slot_bytes", "version"])
                meta[key] = rng.choice([0, 1, 2, 63, 64, 128, -64, 2**31, 2**40 - 1, 2**63 - 1, 2**64 - 1])
        before = weights_digest(policy)
        try:
            ok = shm.load_published_(policy, TensorDict({}, []), meta, reader, "cpu")
        except WireError:
            outcomes["rejected"] += 1
            assert weights_digest(policy) == before
        else:
            outcomes["loaded" if ok else "torn"] += 1
            if ok:
                assert weights_digest(policy) == weights_digest(ring.sources[meta["version"]])
    reader.close()
    assert outcomes["rejected"] > 1000 and outcomes["loaded"] + outcomes["torn"] > 10, outcomes
