"""actors/weights_gate.py: which received weights an actor loads, newest or held back on purpose."""

from __future__ import annotations

from actors.weights_gate import DelayedWeights, LaggedWeights, weights_gate
from shared.config import ActorsConfig


def msg(version, incarnation="a"):
    return (None, {"kind": "weights", "version": version, "incarnation": incarnation})


def test_no_delay_loads_the_newest_at_once():
    gate = DelayedWeights(0.0)
    for v in range(3):
        gate.offer(10.0 + v, msg(v))
    assert [m[1]["version"] for _, m in gate.queue] == [2]
    assert gate.due(12.0, 1, "a", False)[1][1]["version"] == 2 and not gate.queue


def test_a_delay_holds_each_message_that_long():
    gate = DelayedWeights(1.0)
    gate.offer(10.0, msg(1))
    gate.offer(10.5, msg(2))
    assert gate.due(10.9, 0, "a", False) is None                 # nothing is a second old yet
    assert gate.due(11.2, 0, "a", False)[1][1]["version"] == 1   # version 1 is, version 2 is not
    assert gate.due(11.6, 1, "a", False)[1][1]["version"] == 2


def test_a_lag_of_k_versions_acts_k_behind_the_newest():
    gate = LaggedWeights(2)
    gate.offer(0.0, msg(0))
    assert gate.due(0.0, -1, None, False)[1][1]["version"] == 0     # the first weights at once
    for v in range(1, 6):
        gate.offer(float(v), msg(v))
    assert [m[1]["version"] for _, m in gate.queue] == [3, 4, 5]    # only what may still become due
    assert gate.due(6.0, 0, "a", False)[1][1]["version"] == 3
    gate.offer(7.0, msg(4))                                          # old or repeated: ignored
    assert [m[1]["version"] for _, m in gate.queue] == [4, 5]


def test_a_restarted_learner_replaces_the_queue_and_is_loaded_at_once():
    gate = LaggedWeights(3)
    for v in range(5):
        gate.offer(float(v), msg(v, "old"))
    gate.offer(9.0, msg(0, "new"))
    assert [m[1]["incarnation"] for _, m in gate.queue] == ["new"]
    assert gate.due(9.0, 4, "old", False)[1][1]["incarnation"] == "new"


def test_the_config_chooses_the_gate():
    assert isinstance(weights_gate(ActorsConfig()), DelayedWeights)
    assert weights_gate(ActorsConfig(weights_delay_s=0.5)).delay_s == 0.5
    assert weights_gate(ActorsConfig(weights_lag_versions=3)).k == 3
