"""Unit tests for the numeric ranges of ``shared.config`` (issue 12, "Config ranges"; STYLE.md habit 15).

Every int and float field declares a ``Range`` next to its default, and every float must be finite.
The tests pin the declaration itself (no numeric field without one), sweep NaN, infinities and the
values just outside every declared bound through ``--set``, and check a representative set of keys in
each block through a file on disk, each with ``match=`` on the file, the dotted key and the bound.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Optional, Union

import pytest

import shared.config as config_module
from shared.config import (AlgorithmConfig, ConfigError, GRPOConfig, PPOConfig, Range, config_from_dict,
                           load_config)

CONFIG_CLASSES = [c for c in vars(config_module).values()
                  if isinstance(c, type) and dataclasses.is_dataclass(c) and c.__module__ == config_module.__name__
                  and c is not Range]

BASE = {  # a small valid config per algorithm; every block not named takes its defaults
    "ppo": {"trainer": {"exp_name": "unit"}},
    "grpo": {"trainer": {"exp_name": "unit"}, "policy": {"name": "actor_only"}, "algorithm": {"name": "grpo"}},
}
NAN, INF = float("nan"), float("inf")
FINITE = "must be a finite number"


def write_config(tmp_path: Path, raw: dict, name: str = "bad.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(raw))  # NaN, Infinity and -Infinity are written as JSON literals
    return path


def with_value(raw: dict, key: str, value: Any) -> dict:
    """A deep copy of `raw` with the dotted `key` set to `value` (blocks created as needed)."""
    out = json.loads(json.dumps(raw))
    node = out
    *blocks, last = key.split(".")
    for block in blocks:
        node = node.setdefault(block, {})
    node[last] = value
    return out


def problem(key: str, text: str, path: str = "bad.json") -> str:
    """The regex of one problem line: file, dotted key, message."""
    return rf"{re.escape(path)}: {re.escape(key)}: {text}"


# ----------------------------------------------------------------------------- every field declares a range

def _unranged(tp: Any) -> bool:
    """True if an int or a float appears in the annotation `tp` without a Range around it."""
    if typing.get_origin(tp) is Annotated:
        inner, *meta = typing.get_args(tp)
        return not any(isinstance(m, Range) for m in meta) and _unranged(inner)
    if tp in (int, float):
        return True
    return any(_unranged(a) for a in typing.get_args(tp))


def test_unranged_detects_bare_numbers():
    assert _unranged(int) and _unranged(float) and _unranged(Optional[float]) and _unranged(list[int])
    assert _unranged(dict[str, float]) and _unranged(Annotated[int, "doc"])
    assert not _unranged(bool) and not _unranged(str) and not _unranged(Optional[Annotated[float, Range(gt=0)]])
    assert not _unranged(list[Annotated[int, Range(ge=1)]])


def test_the_walk_finds_every_config_class():
    assert {c.__name__ for c in CONFIG_CLASSES} >= {
        "TrainerConfig", "ActorsConfig", "LearnerConfig", "EnvConfig", "NetworkConfig", "NetConfig", "VLAConfig",
        "PolicyConfig", "ClippedPGConfig", "PPOConfig", "GRPOConfig", "AlgorithmConfig", "Config"}


@pytest.mark.parametrize("cls", CONFIG_CLASSES, ids=lambda c: c.__name__)
def test_every_numeric_field_declares_a_range(cls):
    hints = typing.get_type_hints(cls, include_extras=True)
    missing = [f.name for f in dataclasses.fields(cls) if _unranged(hints[f.name])]
    assert not missing, f"{cls.__name__}: numeric fields without a Range: {missing}"


@pytest.mark.parametrize("cls", CONFIG_CLASSES, ids=lambda c: c.__name__)
def test_every_default_is_in_its_range(cls):
    hints, obj = typing.get_type_hints(cls, include_extras=True), cls()
    for f in dataclasses.fields(cls):
        bounds = [m for m in getattr(_leaf(hints[f.name]), "__metadata__", ()) if isinstance(m, Range)]
        value = getattr(obj, f.name)
        for x in (value if isinstance(value, list) else [value]):
            assert x is None or all(b.holds(x) and math.isfinite(x) for b in bounds), (cls.__name__, f.name, x)


def test_grpo_defaults_load():
    cfg = config_from_dict(BASE["grpo"])
    assert cfg.algorithm.cfg == GRPOConfig()


# ----------------------------------------------------------------------------- the sweep over every numeric key

def _leaf(tp: Any) -> Any:
    """`tp` without Optional and list around it."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return _leaf(args[0])
    if typing.get_origin(tp) is list:
        return _leaf(typing.get_args(tp)[0])
    return tp


def numeric_keys(cls: type, algo_cls: type, prefix: str = ""):
    """Yield (dotted key, Annotated type, is a list) for every numeric field under `cls`."""
    hints = typing.get_type_hints(cls, include_extras=True)
    for f in dataclasses.fields(cls):
        tp = algo_cls if cls is AlgorithmConfig and f.name == "cfg" else hints[f.name]
        leaf = _leaf(tp)
        if dataclasses.is_dataclass(leaf):
            yield from numeric_keys(leaf, algo_cls, f"{prefix}{f.name}.")
        elif typing.get_origin(leaf) is Annotated:
            yield f"{prefix}{f.name}", leaf, typing.get_origin(_strip_optional(tp)) is list


def _strip_optional(tp: Any) -> Any:
    """`tp` without Optional around it."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if typing.get_origin(tp) in (Union, types.UnionType) and len(args) == 1 else tp


def bad_values(tp: Any) -> list[tuple[Any, str]]:
    """(value, expected message regex) for NaN, the infinities and the values just outside the bounds."""
    inner, bounds = typing.get_args(tp)[0], typing.get_args(tp)[1]
    if inner is float:
        cases = [(NAN, "must be a finite number, got nan"), (INF, "must be a finite number, got inf"),
                 (-INF, "must be a finite number, got -inf")]
    else:
        cases = [(NAN, "expected an integer, got nan"), (INF, "expected an integer, got inf")]
    must = re.escape(f"must be {bounds}, got ")
    if bounds.ge is not None:
        cases.append((bounds.ge - 1, must))
    if bounds.gt is not None:
        cases += [(bounds.gt, must), (bounds.gt - 1, must)]
    if bounds.le is not None:
        cases.append((bounds.le + 1, must))
    return cases


SWEEP = [pytest.param(algo, key, tp, is_list, id=f"{algo}-{key}")
         for algo, algo_cls in (("ppo", PPOConfig), ("grpo", GRPOConfig))
         for key, tp, is_list in numeric_keys(config_module.Config, algo_cls)]


def test_sweep_covers_every_block():
    keys = {p.values[1] for p in SWEEP}
    for key in ("trainer.seed", "trainer.log_interval_s", "actors.weights_delay_s", "actors.slow_actor_ids",
                "learner.rollout_port", "policy.clip_obs", "policy.log_std_init",
                "policy.actor.network_cfg.hidden_sizes",
                "policy.critic.network_cfg.hidden_sizes", "algorithm.cfg.target_kl", "algorithm.cfg.vtrace_lambda",
                "algorithm.cfg.group_size", "algorithm.cfg.eps"):
        assert key in keys, key


@pytest.mark.parametrize("algo, key, tp, is_list", SWEEP)
def test_every_numeric_key_rejects_non_finite_and_out_of_range_values(algo, key, tp, is_list):
    for value, message in bad_values(tp):
        shown = f"{key}[0]" if is_list else key
        override = f"{key}={json.dumps([value] if is_list else value)}"  # json.dumps writes NaN, Infinity
        with pytest.raises(ConfigError, match=problem(shown, message, "sweep.json")):
            config_from_dict(BASE[algo], source="sweep.json", overrides=[override])


@pytest.mark.parametrize("algo, key, tp, is_list", SWEEP)
def test_every_numeric_key_accepts_its_closed_bounds(algo, key, tp, is_list):
    bounds = typing.get_args(tp)[1]
    for value in (b for b in (bounds.ge, bounds.le) if b is not None):
        try:
            config_from_dict(BASE[algo], overrides=[f"{key}={json.dumps([value] if is_list else value)}"])
        except ConfigError as err:  # a cross-field rule may object (num_envs=1 with GRPO groups); the range may not
            assert f": {key}: must be" not in str(err) and f": {key}[0]: must be" not in str(err), str(err)


# ----------------------------------------------------------------------------- from a file on disk

ISSUE_EXAMPLES = [  # the five the issue names: each was accepted before
    ("algorithm.cfg.learning_rate", NAN, "must be a finite number, got nan"),
    ("algorithm.cfg.clip_coef", -0.2, r"must be > 0, got -0\.2"),
    ("policy.clip_obs", 0, r"must be > 0, got 0\.0"),
    ("algorithm.cfg.target_kl", -0.01, r"must be > 0, got -0\.01"),
    ("algorithm.cfg.max_grad_norm", INF, "must be a finite number, got inf"),
]

FILE_CASES = [  # (algorithm, dotted key, value, expected message); representative keys of every block
    ("ppo", "trainer.total_steps", 0, "must be >= 1, got 0"),
    ("ppo", "trainer.seed", -1, r"must be in \[0, 4294967295\], got -1"),
    ("ppo", "trainer.seed", 2**32, r"must be in \[0, 4294967295\], got 4294967296"),
    ("ppo", "trainer.max_policy_lag", -1, "must be >= 0, got -1"),
    ("ppo", "trainer.eval_freq", -5, "must be >= 0, got -5"),
    ("ppo", "trainer.num_eval_episodes", 0, "must be >= 1, got 0"),
    ("ppo", "trainer.log_interval_s", 0, r"must be > 0, got 0\.0"),
    ("ppo", "trainer.log_interval_s", NAN, "must be a finite number, got nan"),
    ("ppo", "actors.num_envs", 0, "must be >= 1, got 0"),
    ("ppo", "actors.num_actors", -2, "must be >= 1, got -2"),
    ("ppo", "actors.sync_every", 0, "must be >= 1, got 0"),
    ("ppo", "actors.weights_delay_s", -INF, "must be a finite number, got -inf"),
    ("ppo", "actors.weights_delay_s", -0.5, r"must be >= 0, got -0\.5"),
    ("ppo", "actors.slowdown_s", NAN, "must be a finite number, got nan"),
    ("ppo", "actors.inference_latency_s", -1, r"must be >= 0, got -1\.0"),
    ("ppo", "actors.slow_actor_ids", [0, -1], "must be >= 0, got -1"),
    ("ppo", "learner.rollout_port", 65536, r"must be in \[0, 65535\], got 65536"),
    ("ppo", "learner.weights_port", -1, r"must be in \[0, 65535\], got -1"),
    ("ppo", "learner.recv_hwm", 0, "must be >= 1, got 0"),
    ("ppo", "learner.shm_slots", 0, "must be >= 1, got 0"),
    ("ppo", "learner.torch_threads", 0, "must be >= 1, got 0"),
    ("ppo", "policy.clip_obs", -INF, "must be a finite number, got -inf"),
    ("ppo", "policy.clip_obs", -1, r"must be > 0, got -1\.0"),
    ("ppo", "policy.log_std_init", 3, r"must be in \[-20, 2\], got 3\.0"),
    ("ppo", "policy.log_std_init", -INF, "must be a finite number, got -inf"),
    ("ppo", "policy.actor.network_cfg.hidden_sizes", [64, 0], "must be >= 1, got 0"),
    ("ppo", "algorithm.cfg.learning_rate", 0, r"must be > 0, got 0\.0"),
    ("ppo", "algorithm.cfg.learning_rate", -INF, "must be a finite number, got -inf"),
    ("ppo", "algorithm.cfg.n_epochs", 0, "must be >= 1, got 0"),
    ("ppo", "algorithm.cfg.batch_size", 0, "must be >= 1, got 0"),
    ("ppo", "algorithm.cfg.gamma", 1.01, r"must be in \[0, 1\], got 1\.01"),
    ("ppo", "algorithm.cfg.gamma", NAN, "must be a finite number, got nan"),
    ("ppo", "algorithm.cfg.gae_lambda", -0.1, r"must be in \[0, 1\], got -0\.1"),
    ("ppo", "algorithm.cfg.clip_coef", 0, r"must be > 0, got 0\.0"),
    ("ppo", "algorithm.cfg.ent_coef", -0.01, r"must be >= 0, got -0\.01"),
    ("ppo", "algorithm.cfg.vf_coef", -1, r"must be >= 0, got -1\.0"),
    ("ppo", "algorithm.cfg.max_grad_norm", -0.5, r"must be >= 0, got -0\.5"),
    ("ppo", "algorithm.cfg.target_kl", 0, r"must be > 0, got 0\.0"),
    ("ppo", "algorithm.cfg.target_kl", INF, "must be a finite number, got inf"),
    ("ppo", "algorithm.cfg.adam_eps", 0, r"must be > 0, got 0\.0"),
    ("ppo", "algorithm.cfg.rho_bar", 0, r"must be > 0, got 0\.0"),
    ("ppo", "algorithm.cfg.c_bar", INF, "must be a finite number, got inf"),
    ("ppo", "algorithm.cfg.vtrace_lambda", 1.5, r"must be in \[0, 1\], got 1\.5"),
    ("grpo", "algorithm.cfg.learning_rate", NAN, "must be a finite number, got nan"),
    ("grpo", "algorithm.cfg.clip_coef", -0.2, r"must be > 0, got -0\.2"),
    ("grpo", "algorithm.cfg.clip_coef", 0, r"must be > 0, got 0\.0"),
    ("grpo", "algorithm.cfg.max_grad_norm", INF, "must be a finite number, got inf"),
    ("grpo", "algorithm.cfg.target_kl", -0.01, r"must be > 0, got -0\.01"),
    ("grpo", "algorithm.cfg.gamma", -INF, "must be a finite number, got -inf"),
    ("grpo", "algorithm.cfg.n_epochs", 0, "must be >= 1, got 0"),
    ("grpo", "algorithm.cfg.group_size", 1, "must be >= 2, got 1"),
    ("grpo", "algorithm.cfg.kl_coef", -0.1, r"must be >= 0, got -0\.1"),
    ("grpo", "algorithm.cfg.kl_coef", NAN, "must be a finite number, got nan"),
    ("grpo", "algorithm.cfg.eps", 0, r"must be > 0, got 0\.0"),
    ("grpo", "algorithm.cfg.eps", -1e-8, r"must be > 0, got -1e-08"),
]


@pytest.mark.parametrize("key, value, message", ISSUE_EXAMPLES, ids=[k for k, _, _ in ISSUE_EXAMPLES])
@pytest.mark.parametrize("algo", ["ppo", "grpo"])
def test_issue_examples_are_rejected_from_a_file(tmp_path, algo, key, value, message):
    path = write_config(tmp_path, with_value(BASE[algo], key, value))
    with pytest.raises(ConfigError, match=r"\(1 problem\):\n  " + problem(key, message, str(path))):
        load_config(path)


@pytest.mark.parametrize("algo, key, value, message", FILE_CASES,
                         ids=[f"{a}-{k}={v}" for a, k, v, _ in FILE_CASES])
def test_out_of_range_value_in_a_file_names_the_file_and_key(tmp_path, algo, key, value, message):
    path = write_config(tmp_path, with_value(BASE[algo], key, value))
    shown = f"{key}[{len(value) - 1}]" if isinstance(value, list) else key
    with pytest.raises(ConfigError, match=problem(shown, message, str(path))):
        load_config(path)


def test_json_literals_nan_and_infinity_are_read_and_rejected(tmp_path):
    path = tmp_path / "literals.json"
    path.write_text('{"algorithm": {"cfg": {"learning_rate": NaN, "max_grad_norm": Infinity, "ent_coef": -Infinity}}}')
    with pytest.raises(ConfigError, match=r"3 problems") as err:
        load_config(path)
    for key, shown in (("learning_rate", "nan"), ("max_grad_norm", "inf"), ("ent_coef", "-inf")):
        assert f"literals.json: algorithm.cfg.{key}: must be a finite number, got {shown}" in str(err.value)


@pytest.mark.parametrize("raw, message", [
    ('{"algorithm": {"cfg": {"gamma": 1' + "0" * 400 + "}}}", "must be a finite number, got inf"),  # int past float
    ('{"algorithm": {"cfg": {"gamma": 1e400}}}', "must be a finite number, got inf"),              # float overflow
    ('{"trainer": {"seed": 1e400}}', "expected an integer, got inf"),
])
def test_huge_numbers_are_not_finite(tmp_path, raw, message):
    path = tmp_path / "huge.json"
    path.write_text(raw)
    with pytest.raises(ConfigError, match=rf"huge\.json: [a-z.]+: {message}"):
        load_config(path)


def test_integer_past_the_digit_limit_is_a_config_error(tmp_path):
    path = tmp_path / "digits.json"
    path.write_text('{"trainer": {"seed": ' + "9" * 5000 + "}}")
    with pytest.raises(ConfigError, match=r"digits\.json: not valid JSON"):
        load_config(path)


# ----------------------------------------------------------------------------- from --set overrides

@pytest.mark.parametrize("algo, override, match", [
    ("ppo", "algorithm.cfg.learning_rate=NaN", problem("algorithm.cfg.learning_rate", f"{FINITE}, got nan")),
    ("grpo", "algorithm.cfg.learning_rate=NaN", problem("algorithm.cfg.learning_rate", f"{FINITE}, got nan")),
    ("ppo", "algorithm.cfg.max_grad_norm=Infinity", problem("algorithm.cfg.max_grad_norm", f"{FINITE}, got inf")),
    ("ppo", "algorithm.cfg.clip_coef=-Infinity", problem("algorithm.cfg.clip_coef", f"{FINITE}, got -inf")),
    ("grpo", "algorithm.cfg.clip_coef=-0.2", problem("algorithm.cfg.clip_coef", r"must be > 0, got -0\.2")),
    ("ppo", "algorithm.cfg.target_kl=-0.01", problem("algorithm.cfg.target_kl", r"must be > 0, got -0\.01")),
    ("ppo", "policy.clip_obs=0", problem("policy.clip_obs", r"must be > 0, got 0\.0")),
    ("ppo", "trainer.total_steps=NaN", problem("trainer.total_steps", "expected an integer, got nan")),
    ("ppo", "trainer.total_steps=-1", problem("trainer.total_steps", "must be >= 1, got -1")),
    ("ppo", "learner.rollout_port=70000", problem("learner.rollout_port", r"must be in \[0, 65535\], got 70000")),
    ("ppo", "actors.slow_actor_ids=[0, -3]", problem("actors.slow_actor_ids[1]", "must be >= 0, got -3")),
])
def test_out_of_range_override_names_the_file_and_key(tmp_path, algo, override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(write_config(tmp_path, BASE[algo]), [override])


def test_override_fixes_an_out_of_range_value_in_the_file(tmp_path):
    path = write_config(tmp_path, with_value(BASE["ppo"], "algorithm.cfg.learning_rate", NAN))
    assert load_config(path, ["algorithm.cfg.learning_rate=0.001"]).algorithm.cfg.learning_rate == 0.001


# ----------------------------------------------------------------------------- all at once, and what is allowed

@pytest.mark.parametrize("algo", ["ppo", "grpo"])
def test_every_range_problem_is_reported_in_one_error(tmp_path, algo):
    raw = BASE[algo]
    for key, value, _ in ISSUE_EXAMPLES:
        raw = with_value(raw, key, value)
    path = write_config(tmp_path, raw)
    with pytest.raises(ConfigError, match=r"invalid config \(5 problems\):") as err:
        load_config(path)
    lines = str(err.value).splitlines()[1:]
    assert len(lines) == 5
    for key, _, message in ISSUE_EXAMPLES:
        assert any(re.fullmatch(r"  " + problem(key, message, str(path)), line) for line in lines), key


def test_range_problems_are_reported_with_type_problems(tmp_path):
    patch = with_value(with_value(BASE["ppo"], "trainer.seed", "one"), "algorithm.cfg.gamma", NAN)
    with pytest.raises(ConfigError, match=r"2 problems") as err:
        load_config(write_config(tmp_path, patch))
    message = str(err.value)
    assert "bad.json: trainer.seed: expected an integer, got 'one'" in message
    assert "bad.json: algorithm.cfg.gamma: must be a finite number, got nan" in message


def test_range_problems_are_reported_with_cross_field_problems(tmp_path):
    raw = with_value(with_value(BASE["ppo"], "algorithm.cfg.clip_coef", -0.2), "actors.devices", [])
    with pytest.raises(ConfigError, match=r"2 problems") as err:
        load_config(write_config(tmp_path, raw))
    assert "bad.json: algorithm.cfg.clip_coef: must be > 0, got -0.2" in str(err.value)
    assert "bad.json: actors.devices: must name at least one device" in str(err.value)


def test_zero_is_accepted_where_it_means_off_or_default():
    cfg = config_from_dict({"trainer": {"seed": 0, "max_policy_lag": 0, "rollouts_per_update": 0, "eval_freq": 0,
                                        "save_freq": 0},
                            "actors": {"weights_delay_s": 0, "slowdown_s": 0, "inference_latency_s": 0,
                                       "slow_actor_ids": [0]},
                            "learner": {"rollout_port": 0, "weights_port": 0},
                            "algorithm": {"cfg": {"gamma": 0, "gae_lambda": 0, "ent_coef": 0, "vf_coef": 0,
                                                  "max_grad_norm": 0, "vtrace_lambda": 0, "target_kl": None}}})
    assert cfg.algorithm.cfg.max_grad_norm == 0.0  # learner/minibatch.py clips only when > 0
    grpo = config_from_dict(with_value(BASE["grpo"], "algorithm.cfg.kl_coef", 0))
    assert grpo.algorithm.cfg.kl_coef == 0.0


def test_upper_bounds_are_inclusive():
    cfg = config_from_dict({"trainer": {"seed": 2**32 - 1}, "learner": {"rollout_port": 65535, "weights_port": 65534},
                            "policy": {"log_std_init": 2}, "algorithm": {"cfg": {"gamma": 1, "gae_lambda": 1}}})
    assert (cfg.learner.rollout_port, cfg.algorithm.cfg.gamma, cfg.policy.log_std_init) == (65535, 1.0, 2.0)


def test_rank_ports_must_stay_below_65536():
    with pytest.raises(ConfigError, match=r"learner\.rollout_port: 65535 \+ 1 .* past the last port, 65535"):
        config_from_dict({"learner": {"devices": ["cpu", "cpu"], "rollout_port": 65535}})


@pytest.mark.parametrize("bounds, text", [
    (Range(gt=0), "> 0"), (Range(ge=0), ">= 0"), (Range(le=2), "<= 2"), (Range(ge=0, le=1), "in [0, 1]"),
    (Range(gt=0, le=1), "in (0, 1]"), (Range(ge=-20, le=2), "in [-20, 2]"),
])
def test_range_describes_itself(bounds, text):
    assert str(bounds) == text
