"""Hostile input for the learner, shared by the fuzz tests and the real-socket attack test.

:func:`valid_rollout` makes a rollout that matches a learner's schema and holds values an actor
of that run could have produced. :func:`schema_attacks` returns rollouts that fit the schema
exactly but carry what no policy produces (the classes issue 12 names). :func:`mutate` changes a
valid message field by field (tensor values, dtypes, shapes, keys, header fields, meta, frames),
seeded, so that a run of mutations is reproducible.
"""

from __future__ import annotations

import math
import random
from typing import Any

import msgpack
import torch
from tensordict import TensorDict, TensorDictBase

from shared import keys, wire
from shared.envs import EnvSpec
from shared.rollout import RolloutMeta

FORGER_SEQ = 10**9   # forged messages carry seq >= this, so the versions log tells them apart


def valid_rollout(template: TensorDictBase, spec: EnvSpec, version: int, seed: int = 0) -> TensorDict:
    """A rollout of `template`'s schema with plausible values, all acted by `version`."""
    g = torch.Generator().manual_seed(seed)
    td = template.clone()
    n, t = td.batch_size
    for k, v in td.items(include_nested=True, leaves_only=True):
        if k == keys.OBS or (isinstance(k, tuple) and k[0] == keys.OBS):
            if v.dtype.is_floating_point:
                v.copy_(torch.randn(v.shape, generator=g))
            else:
                v.copy_(torch.randint(0, 2, v.shape, generator=g).to(v.dtype))
    act = spec.action
    if act.kind == "discrete":
        td[keys.ACTION].copy_(torch.randint(0, act.n, td[keys.ACTION].shape, generator=g))
        td[keys.LOG_PROB].fill_(-math.log(act.n))
    else:
        z = torch.randn(td[keys.ACTION].shape, generator=g)
        td[keys.ACTION].copy_(z)
        td[keys.LOG_PROB].copy_((-0.5 * z ** 2 - 0.5 * math.log(2 * math.pi)).reshape(n, t, -1).sum(-1))
    for k in (keys.VALUE, keys.NEXT_VALUE):
        if k in td.keys():
            td[k].copy_(torch.randn(n, t, generator=g))
    td[keys.REWARD].copy_(torch.rand(n, t, generator=g))
    term = torch.rand(n, t, generator=g) < 0.05
    trunc = (torch.rand(n, t, generator=g) < 0.05) & ~term
    td[keys.TERMINATED].copy_(term)
    td[keys.TRUNCATED].copy_(trunc)
    td[keys.DONE].copy_(term | trunc)
    td[keys.POLICY_VERSION].fill_(version)
    return td


def rollout_meta(actor: int, seq: int, version: int, **fields: Any) -> dict:
    """A well-formed rollout meta (:class:`~shared.rollout.RolloutMeta`), the base that mutations change."""
    return RolloutMeta(actor=actor, seq=seq, policy_version=version, **fields).to_meta()


def schema_attacks(template: TensorDictBase, spec: EnvSpec, version: int) -> list[tuple[str, TensorDict]]:
    """Rollouts that match the schema exactly but hold what no policy of the run produces."""
    out = []

    def one(name: str, key, value, where=(0, 0)):
        td = valid_rollout(template, spec, version, seed=len(out))
        td[key][where] = value
        out.append((name, td))

    one("extreme log-prob", keys.LOG_PROB, -1000.0)
    one("positive log-prob", keys.LOG_PROB, 50.0)
    one("NaN log-prob", keys.LOG_PROB, float("nan"))
    one("NaN reward", keys.REWARD, float("nan"))
    one("1e30 reward", keys.REWARD, 1e30)
    one("-inf reward", keys.REWARD, float("-inf"))
    if not spec.multimodal and template[keys.OBS].dtype.is_floating_point:
        one("NaN observation", keys.OBS, float("nan"))
        one("1e30 observation", keys.OBS, 1e30)
    if spec.action.kind == "discrete":
        one("action out of range", keys.ACTION, spec.action.n)
        one("negative action", keys.ACTION, -1)
    else:
        one("1e30 action", keys.ACTION, 1e30)
    one("version from the future", keys.POLICY_VERSION, version + 1000)
    one("negative version", keys.POLICY_VERSION, -5)
    if keys.VALUE in template.keys():
        one("NaN value", keys.VALUE, float("nan"))
    one("inconsistent done", keys.DONE, True)    # terminated and truncated stay False there
    return out


# ---------------------------------------------------------------------------- mutations
_SPECIALS = [float("nan"), float("inf"), float("-inf"), 1e30, -1e30, 1.1e8, -1.1e8, 1e8, -1e8, -104.0,
             -103.0, 0.0, -0.0, 1.0, -1.0, 1e-45, 2**31, -(2**31), 2**62, -(2**62), 5, -1, 3]
_META_VALUES = [None, True, False, 0, -1, 1, 2**63 - 1, -(2**63), 2**64 - 1, 1.5, float("nan"), float("inf"), "",
                "x" * 300, b"\x00\xff", [], [1, "a", None], {}, {"a": [1, 2]}, [[0, 1.0, 2.0]] * 20,
                [float("nan")] * 5, list(range(100))]
_DTYPES = ["bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64"]


def _leaves(td: TensorDictBase) -> list:
    return sorted(td.keys(include_nested=True, leaves_only=True), key=str)


def mutate_td(td: TensorDict, meta: dict, rng: random.Random) -> tuple[TensorDict, dict]:
    """One field-level change of a decoded rollout (values, dtype, shape, keys, meta)."""
    td, meta = td.clone(), dict(meta)
    leaves = _leaves(td)
    if not leaves:                                 # a one-tensor message whose tensor a change removed
        return td, meta
    key = rng.choice(leaves)
    t = td.get(key)
    op = rng.randrange(9)
    if op <= 2 and t.numel():                      # one or many elements set to a special value
        value = rng.choice(_SPECIALS)
        flat = t.reshape(-1)
        idx = [rng.randrange(flat.numel())] if op < 2 else list(range(0, flat.numel(), rng.randint(1, 7)))
        try:
            flat[idx] = torch.tensor(value).to(t.dtype) if t.dtype != torch.bool else bool(value)
        except (RuntimeError, OverflowError):
            flat[idx] = 0
    elif op == 3:                                  # another dtype
        td.del_(key)
        td.set(key, t.to(getattr(torch, rng.choice(_DTYPES))))
    elif op == 4:                                  # another trailing shape
        # (a tensor with no elements, e.g. one a change added as [N, 0], cannot infer a -1)
        new = t.reshape(*t.shape[:2], -1) if t.numel() else t.reshape(*t.shape[:2], 0)
        extra = rng.choice([0, 1, 2])
        new = torch.cat([new, torch.zeros(*new.shape[:2], extra, dtype=t.dtype)], -1) if extra else new[..., :0]
        td.del_(key)
        td.set(key, new)
    elif op == 5:                                  # a key dropped
        td.del_(key)
    elif op == 6:                                  # a key added
        name = rng.choice(["junk", ("extra", "nested"), "advantage", "value_target"])
        if name not in td.keys(include_nested=True):
            td.set(name, torch.zeros(*td.batch_size, rng.randint(0, 3)))
    else:                                          # a meta field changed
        field = rng.choice(["kind", "policy_version", "incarnation", "episode_returns", "episode_lengths",
                            "episode_successes", "synced", "time", "env_steps", "token", "returns"])
        meta[field] = rng.choice(_META_VALUES + ["rollout", "eval", "weights"])
    return td, meta


def mutate_frames(frames: list[bytes], rng: random.Random) -> list[bytes]:
    """One change to the encoded message: header fields, tensor entries, frame bytes or count."""
    frames = [bytes(f) for f in frames]
    header = msgpack.unpackb(frames[0], raw=False)
    op = rng.randrange(8)
    if op == 0:                                    # a header field replaced
        header[rng.choice(["v", "batch", "tensors", "meta"])] = rng.choice(_META_VALUES)
    elif op == 1 and header["tensors"]:            # a tensor entry's field replaced
        entry = rng.choice(header["tensors"])
        i = rng.randrange(3)
        entry[i] = rng.choice([rng.choice(_META_VALUES), rng.choice(_DTYPES), [2**40 - 1, 2**40 - 1, 0],
                               [0, 2**62], [-1], [2**31] * 3, ["observation", "x"], entry[i]])
    elif op == 2:                                  # the batch size
        header["batch"] = rng.choice([[], [0], [2**40, 0], [1, 1, 1], [-1, 2], [2**62, 2**62]])
    elif op == 3 and len(frames) > 1:              # a data frame truncated, extended or replaced
        i = rng.randrange(1, len(frames))
        f = frames[i]
        frames[i] = rng.choice([f[:-1], f + b"\x00", b"", bytes(rng.getrandbits(8) for _ in range(len(f)))])
    elif op == 4:                                  # a frame removed or added
        frames = frames[:-1] if rng.random() < 0.5 else [*frames, b"\x01" * rng.randint(0, 16)]
    elif op == 5:                                  # header bytes flipped
        b = bytearray(frames[0])
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] = rng.getrandbits(8)
        return [bytes(b), *frames[1:]]
    elif op == 6:                                  # the header cut short
        return [frames[0][:rng.randrange(len(frames[0]))], *frames[1:]]
    else:                                          # entries reordered
        rng.shuffle(header["tensors"])
    return [msgpack.packb(header, use_bin_type=True), *frames[1:]]


def mutated_message(td: TensorDict, meta: dict, rng: random.Random) -> list[bytes]:
    """A valid rollout changed 1-3 times at the tensor level and/or the frame level. The sender's
    ``actor`` and ``seq`` survive every change that still decodes, so each message can be accounted
    for (a change that would alter them is drawn again)."""
    while True:
        m_td, m_meta = td, meta
        for _ in range(rng.randint(0, 2)):
            m_td, m_meta = mutate_td(m_td, m_meta, rng)
        try:
            frames = [bytes(f) for f in wire.encode(m_td, **m_meta)]
        except wire.WireError:   # a dtype or meta value encode refuses: send the tensors changes only
            frames = [bytes(f) for f in wire.encode(m_td, **meta)]
        if rng.random() < 0.5 or m_td is td:
            frames = mutate_frames(frames, rng)
        try:
            _, got = wire.decode(frames)
        except wire.WireError:
            return frames
        if (got.get("actor"), got.get("seq")) == (meta["actor"], meta["seq"]):
            return frames
