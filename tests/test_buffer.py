"""Unit tests for ``learner.buffer.CircularBuffer`` (DESIGN.md, "Modes"; STYLE.md section 10).

Every rollout is tagged with an integer id that fills its reward and determines every other field, so
a returned slice can be traced back to exactly one ``put`` and checked field by field. The contract
under test: FIFO order, every rollout leaves exactly once (taken, overwritten or stale), taken data is
an owned copy, and unwritten slots are poisoned.
"""

from __future__ import annotations

import random
import threading
import time
from collections import deque

import pytest
import torch
from tensordict import TensorDict, TensorDictBase

from learner.buffer import CircularBuffer
from shared import keys

N, T = 2, 4


def make_rollout(rid: int, version: int = 0, nested: bool = False) -> TensorDict:
    """A ``[N, T]`` rollout whose every field is a function of `rid` (and `version`)."""
    steps = torch.arange(N * T, dtype=torch.float32).reshape(N, T)
    if nested:
        obs = TensorDict({
            "rgb": ((torch.arange(N * T * 3 * 2 * 2).reshape(N, T, 3, 2, 2) + rid) % 256).to(torch.uint8),
            "proprio": rid + 0.25 * torch.arange(N * T * 5, dtype=torch.float32).reshape(N, T, 5),
        }, batch_size=[N, T])
    else:
        obs = rid + 0.5 * torch.arange(N * T * 3, dtype=torch.float32).reshape(N, T, 3)
    done = (steps.long() + rid) % 3 == 0
    return TensorDict({
        keys.OBS: obs,
        keys.ACTION: torch.full((N, T, 2), float(rid)) + steps[..., None],
        keys.LOG_PROB: -rid - 0.01 * steps,
        keys.VALUE: rid + 0.1 * steps,
        keys.NEXT_VALUE: rid + 0.2 * steps,
        keys.REWARD: torch.full((N, T), float(rid)),
        keys.TERMINATED: done & (steps.long() % 2 == 0),
        keys.TRUNCATED: done & (steps.long() % 2 == 1),
        keys.DONE: done,
        keys.POLICY_VERSION: torch.full((N, T), version, dtype=torch.int64),
    }, batch_size=[N, T])


def assert_same(actual: TensorDictBase, expected: TensorDictBase) -> None:
    """Same keys, shapes, dtypes and values, leaf by leaf (nested keys included)."""
    assert set(actual.keys(True, True)) == set(expected.keys(True, True))
    assert actual.batch_size == expected.batch_size
    for key in expected.keys(True, True):
        torch.testing.assert_close(actual[key], expected[key], rtol=0, atol=0, msg=lambda m: f"{key}: {m}")


def ids_of(taken_data: TensorDictBase | None, nested: bool = False, check_fields: bool = True) -> list[int]:
    """Ids of the stacked ``[k, N, T]`` rollouts; with `check_fields`, each slice must be exactly the
    rollout with that id (the thread test skips this to keep the taker fast)."""
    if taken_data is None:
        return []
    assert taken_data.batch_size == (taken_data.batch_size[0], N, T)
    ids = [int(r) for r in taken_data[keys.REWARD][:, 0, 0].tolist()]
    for i, rid in enumerate(ids if check_fields else []):
        version = int(taken_data[keys.POLICY_VERSION][i, 0, 0])
        assert_same(taken_data[i], make_rollout(rid, version=version, nested=nested))
    return ids


def info_ids(infos) -> list[int]:
    return [info["id"] for info in infos]


def put_ids(buf: CircularBuffer, ids, version: int = 0, nested: bool = False) -> list[int]:
    """Put one rollout per id; return the ids whose infos came back as overwritten."""
    overwritten = []
    for rid in ids:
        info = buf.put(make_rollout(rid, version=version, nested=nested), {"id": rid})
        if info is not None:
            overwritten.append(info["id"])
    return overwritten


# ---------------------------------------------------------------- poison


@pytest.mark.parametrize("nested", [False, True], ids=["flat", "nested"])
def test_slots_start_poisoned(nested):
    buf = CircularBuffer(3, make_rollout(0, nested=nested))
    slots = buf._slots
    assert slots.batch_size == (3, N, T)
    for key, t in slots.items(include_nested=True, leaves_only=True):
        if t.dtype.is_floating_point:
            assert t.isnan().all(), key
        elif t.dtype == torch.bool:
            assert t.all(), key
        elif t.dtype == torch.uint8:
            assert (t == 255).all(), key      # -1 wraps
        else:
            assert (t == -1).all(), key
    dtypes = {t.dtype for t in slots.values(include_nested=True, leaves_only=True)}
    assert {torch.float32, torch.bool, torch.int64} <= dtypes


def test_put_writes_only_its_slot():
    buf = CircularBuffer(2, make_rollout(0))
    put_ids(buf, [7])
    assert_same(buf._slots[0], make_rollout(7))
    assert buf._slots[1][keys.REWARD].isnan().all()
    assert buf._slots[1][keys.DONE].all()
    assert (buf._slots[1][keys.POLICY_VERSION] == -1).all()


def test_capacity_below_one_is_rejected():
    with pytest.raises(ValueError, match="capacity must be >= 1"):
        CircularBuffer(0, make_rollout(0))


# ---------------------------------------------------------------- FIFO and overwrite


def test_take_is_fifo():
    buf = CircularBuffer(5, make_rollout(0))
    assert put_ids(buf, [1, 2, 3]) == []
    assert len(buf) == 3

    first = buf.take(2)
    assert ids_of(first.data) == [1, 2]
    assert info_ids(first.infos) == [1, 2]
    assert first.stale == []

    rest = buf.take(5)
    assert ids_of(rest.data) == [3]
    assert info_ids(rest.infos) == [3]
    assert len(buf) == 0


def test_take_from_empty_returns_nothing():
    buf = CircularBuffer(2, make_rollout(0))
    empty = buf.take(4)
    assert empty.data is None and empty.infos == [] and empty.stale == []
    put_ids(buf, [1])
    buf.take(1)
    assert buf.take(1).data is None
    assert buf.total_taken == 1


def test_full_buffer_overwrites_oldest():
    buf = CircularBuffer(3, make_rollout(0))
    returned = [buf.put(make_rollout(rid), {"id": rid}) for rid in range(1, 6)]
    assert returned == [None, None, None, {"id": 1}, {"id": 2}]
    assert buf.total_overwritten == 2
    assert buf.total_put == 5
    assert len(buf) == 3

    taken = buf.take(10)
    assert ids_of(taken.data) == [3, 4, 5]
    assert info_ids(taken.infos) == [3, 4, 5]
    assert buf.total_taken == 3 and len(buf) == 0


def test_fifo_holds_across_wraparound():
    buf = CircularBuffer(3, make_rollout(0))
    put_ids(buf, [1, 2])
    assert ids_of(buf.take(1).data) == [1]
    assert put_ids(buf, [3, 4]) == []          # the write index wraps to slot 0
    assert put_ids(buf, [5]) == [2]
    assert ids_of(buf.take(3).data) == [3, 4, 5]


@pytest.mark.parametrize("seed", range(5))
def test_random_interleaving_never_reuses_a_rollout(seed):
    """Against a deque model: every id is taken once, overwritten once or still held, never two of these."""
    rng = random.Random(seed)
    capacity = rng.randint(1, 5)
    buf = CircularBuffer(capacity, make_rollout(0))
    model: deque[int] = deque()
    taken, overwritten, next_id = [], [], 1
    for _ in range(150):
        if rng.random() < 0.55:
            expected = [model.popleft()] if len(model) == capacity else []
            assert put_ids(buf, [next_id]) == expected
            model.append(next_id)
            overwritten += expected
            next_id += 1
        else:
            k = rng.randint(1, capacity + 1)
            got = buf.take(k)
            expected = [model.popleft() for _ in range(min(k, len(model)))]
            assert ids_of(got.data) == info_ids(got.infos) == expected
            taken += expected
        assert len(buf) == len(model)

    held = ids_of(buf.take(capacity).data)
    assert held == list(model)
    assert len(taken) == len(set(taken))
    assert sorted(taken + overwritten + held) == list(range(1, next_id))
    assert (buf.total_put, buf.total_taken, buf.total_overwritten) == (next_id - 1, len(taken) + len(held),
                                                                        len(overwritten))


# ---------------------------------------------------------------- ownership and staleness


def test_taken_data_is_a_copy():
    buf = CircularBuffer(2, make_rollout(0))
    put_ids(buf, [1, 2])
    taken = buf.take(2)
    put_ids(buf, [3, 4, 5])                    # rewrites both slots
    assert ids_of(taken.data) == [1, 2]


def test_modifying_taken_data_leaves_buffer_untouched():
    buf = CircularBuffer(3, make_rollout(0))
    put_ids(buf, [1, 2])
    buf.take(1).data.apply_(lambda t: t.zero_())
    assert ids_of(buf.take(1).data) == [2]
    assert_same(buf._slots[0], make_rollout(1))


def test_min_version_moves_old_rollouts_to_stale():
    buf = CircularBuffer(6, make_rollout(0))
    mixed = make_rollout(4, version=5)
    mixed[keys.POLICY_VERSION][1, 2] = 2      # one old step makes the whole rollout stale
    for rid, rollout in [(1, make_rollout(1, version=3)), (2, make_rollout(2, version=1)),
                         (3, make_rollout(3, version=4)), (4, mixed), (5, make_rollout(5, version=3))]:
        buf.put(rollout, {"id": rid})

    got = buf.take(10, min_version=3)
    assert ids_of(got.data) == info_ids(got.infos) == [1, 3, 5]
    assert info_ids(got.stale) == [2, 4]
    assert buf.total_stale == 2 and buf.total_taken == 3
    assert len(buf) == 0


def test_stale_rollouts_do_not_count_towards_k():
    buf = CircularBuffer(4, make_rollout(0))
    put_ids(buf, [1, 2], version=0)
    put_ids(buf, [3, 4], version=2)
    got = buf.take(1, min_version=1)
    assert ids_of(got.data) == [3]
    assert info_ids(got.stale) == [1, 2]
    assert ids_of(buf.take(5).data) == [4]


def test_all_stale_returns_no_data():
    buf = CircularBuffer(2, make_rollout(0))
    put_ids(buf, [1, 2], version=0)
    got = buf.take(2, min_version=1)
    assert got.data is None and got.infos == []
    assert info_ids(got.stale) == [1, 2]
    assert buf.total_taken == 0 and len(buf) == 0


def test_nested_observation_round_trips():
    template = make_rollout(0, nested=True)
    buf = CircularBuffer(2, template)
    put_ids(buf, [9, 300], nested=True)        # 300 makes the uint8 pattern wrap
    data = buf.take(2).data
    assert ids_of(data, nested=True) == [9, 300]
    assert data[keys.OBS, "rgb"].dtype == torch.uint8
    assert data[keys.OBS, "proprio"].dtype == torch.float32
    assert isinstance(data[keys.OBS], TensorDictBase)
    assert data[keys.OBS].batch_size == (2, N, T)


# ---------------------------------------------------------------- threads


def test_concurrent_put_and_take_account_for_every_rollout():
    """A receiver thread puts while the training thread takes; no id is lost, duplicated or reordered."""
    n_rollouts, capacity = 500, 8
    rollouts = [make_rollout(rid) for rid in range(1, n_rollouts + 1)]
    buf = CircularBuffer(capacity, make_rollout(0))
    overwritten: list[int] = []
    errors: list[BaseException] = []
    stop = threading.Event()                   # set if the main thread fails, so the producer ends too
    took = threading.Event()                   # set once the consumer has taken a rollout

    def produce():
        try:
            for rid, rollout in enumerate(rollouts, start=1):
                if stop.is_set():
                    return
                if rid == n_rollouts // 2:     # the scheduler may run this thread to the end before
                    took.wait(timeout=10)      # the consumer takes once: hold half the puts until it has
                info = buf.put(rollout, {"id": rid})
                if info is not None:
                    overwritten.append(info["id"])
        except BaseException as e:             # surfaced by the main thread
            errors.append(e)

    producer = threading.Thread(target=produce, daemon=True)
    rng = random.Random(0)
    taken: list[int] = []
    deadline = time.monotonic() + 10
    producer.start()
    try:
        while producer.is_alive() and time.monotonic() < deadline:
            got = buf.take(rng.randint(1, 4))
            rollout_ids = ids_of(got.data, check_fields=False)
            assert rollout_ids == info_ids(got.infos)
            taken += rollout_ids
            if taken:
                took.set()
    finally:
        stop.set()
        took.set()                             # a producer still waiting on the consumer ends at once
        producer.join(timeout=10)
    assert not producer.is_alive(), "producer did not finish"
    assert errors == []

    remaining = ids_of(buf.take(capacity).data)
    assert taken == sorted(taken) and len(taken) > 0      # FIFO: ids leave in the order they came
    assert sorted(taken + overwritten + remaining) == list(range(1, n_rollouts + 1))
    assert buf.total_put == n_rollouts
    assert buf.total_taken == len(taken) + len(remaining)
    assert buf.total_overwritten == len(overwritten)
