"""Unit tests for ``shared.wire``: the TensorDict <-> ZeroMQ multipart codec (DESIGN.md, "Wire format").

Round trips are checked bit for bit (random bytes reinterpreted as each dtype, so NaN payloads,
-0.0 and infinities all travel), for every dtype on the allow-list, nested keys, odd shapes and
non-contiguous input, from bytes, memoryview and real ``zmq.Frame`` frames. The decoder's promise
is then held to: malformed input raises ``WireError`` and nothing else, whether the damage is
hand-made (one parametrized case per check) or random (a seeded fuzz loop).
"""

from __future__ import annotations

import random
from collections import Counter
from typing import Any, Callable

import msgpack
import pytest
import torch
import zmq
from tensordict import TensorDict, TensorDictBase

from shared.wire import MAX_HEADER_BYTES, PROTOCOL_VERSION, WireError, decode, encode

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
    "shape_absurd": (lambda f: edit_entry(f, 0, shape=[2, 3, 2**39, 2**39]), "message limit"),
    "shape_absurd_no_batch": (lambda f: edit_entry(edit_header(f, batch=[]), 0, shape=[2**39, 2**39]),
                              "message limit"),
    "shape_large_but_under_limit": (lambda f: edit_entry(f, 0, shape=[2, 3, 2**28]), r"expected 6442450944"),
    "shape_dim_too_big": (lambda f: edit_entry(f, 0, shape=[2, 3, 2**40]), "bad shape"),
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
