"""Unit tests for ``shared.config``: the strict JSON loader (DESIGN.md, "Config"; STYLE.md habits 2, 3, 15).

Every shipped config must load. Every rejection must be a ``ConfigError`` whose message names the
file and the dotted key (checked with ``match=``), and one error must list every problem at once.
Cross-field rules, ``--set`` overrides, defaults and the no-mutation promise are each pinned down.
Numeric ranges (finite, in bounds, declared on every field) are in ``test_config_ranges.py``.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

import learner.corrections  # noqa: F401  (adds the correction's rule: the mode's default, the registry's names)
from shared.config import (ActorsConfig, AlgorithmConfig, Config, ConfigError, EnvConfig, LearnerConfig,
                           PolicyConfig, PPOConfig, TrainerConfig, config_from_dict, load_config, save_config)

ROOT = Path(__file__).resolve().parents[1]
CONFIG_FILES = sorted((ROOT / "configs").glob("**/*.json"))

# The example in DESIGN.md, "Config", verbatim.
DESIGN_EXAMPLE = {
    "trainer": {"exp_name": "cartpole_ppo", "seed": 1, "total_steps": 200000,
                "buffer_size": 128, "buffer_type": "vla", "buffer_capacity": 8,
                "max_policy_lag": 4, "eval_freq": 20000, "save_freq": 50000,
                "num_eval_episodes": 10, "output_dir": "outputs", "use_wandb": False},
    "actors": {"num_actors": 2, "num_envs": 8, "devices": ["cpu"], "sync_every": 1},
    "learner": {"device": "cpu", "host": "127.0.0.1"},
    "env": {"id": "CartPole-v1", "cfg": {}},
    "policy": {"name": "actor_critic",
               "actor": {"type": "mlp", "network_cfg": {"hidden_sizes": [64, 64], "activation": "tanh"}},
               "critic": {"type": "mlp", "network_cfg": {"hidden_sizes": [64, 64], "activation": "tanh"}}},
    "algorithm": {"name": "ppo", "cfg": {"learning_rate": 0.0003, "n_epochs": 10, "batch_size": 256,
                                         "gamma": 0.99, "gae_lambda": 0.95, "clip_coef": 0.2, "ent_coef": 0.0,
                                         "vf_coef": 0.5, "max_grad_norm": 0.5}},
}


def minimal_config() -> dict:
    """A small valid config: every block not named here takes its defaults."""
    return {"trainer": {"exp_name": "unit", "total_steps": 10_000}, "env": {"id": "CartPole-v1"}}


def merged(base: dict, patch: dict) -> dict:
    """`base` with `patch` merged in, block by block (a deep merge; a non-dict value replaces)."""
    out = copy.deepcopy(base)
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def write_config(tmp_path: Path, raw: Any, name: str = "bad.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(raw))
    return path


def load_patched(tmp_path: Path, patch: dict, **kwargs: Any) -> Config:
    """Load minimal_config() with `patch` merged in, from a file named bad.json."""
    return load_config(write_config(tmp_path, merged(minimal_config(), patch)), **kwargs)


# ----------------------------------------------------------------------------- valid configs

@pytest.mark.parametrize(
    "path",
    [pytest.param(p, id=str(p.relative_to(ROOT))) for p in CONFIG_FILES]
    or [pytest.param(None, id="no-configs", marks=pytest.mark.skip(reason="configs/ has no JSON files yet"))])
def test_shipped_config_loads(path):
    cfg = load_config(path)
    assert cfg.source == str(path)
    assert cfg.rollouts_per_update >= 1


def test_design_example_loads():
    cfg = config_from_dict(DESIGN_EXAMPLE, source="design.json")
    assert cfg.trainer.exp_name == "cartpole_ppo"
    assert cfg.trainer.buffer_type == "async"    # the design card's "vla", the older spelling, read as async
    assert cfg.actors.devices == ["cpu"]
    assert cfg.policy.critic.network_cfg.hidden_sizes == [64, 64]
    assert cfg.algorithm.cfg.learning_rate == pytest.approx(3e-4)
    assert cfg.source == "design.json"


def test_empty_dict_gives_all_defaults():
    expected = Config()
    expected.algorithm.cfg.correction = "trust"    # null, resolved at load: the one recommended for async mode
    assert config_from_dict({}) == expected


def test_missing_blocks_and_keys_get_defaults():
    cfg = config_from_dict({"trainer": {"seed": 7}, "algorithm": {"cfg": {"gamma": 0.9}}})
    assert cfg.trainer == TrainerConfig(seed=7)
    assert cfg.algorithm == AlgorithmConfig(cfg=PPOConfig(gamma=0.9, correction="trust"))
    assert cfg.actors == ActorsConfig()
    assert cfg.learner == LearnerConfig()
    assert cfg.env == EnvConfig()
    assert cfg.policy == PolicyConfig()


def test_defaults_are_not_shared_between_configs():
    a, b = config_from_dict({}), config_from_dict({})
    a.actors.devices.append("cuda")
    assert b.actors.devices == ["cpu"]


def test_config_from_dict_does_not_mutate_input():
    raw = merged(DESIGN_EXAMPLE, {"env": {"cfg": {"nested": {"k": [1, 2]}}}})
    snapshot = copy.deepcopy(raw)
    cfg = config_from_dict(raw, overrides=["trainer.seed=3", "learner.recv_hwm=4", "env.cfg.nested.k=[5]"])
    assert raw == snapshot
    cfg.actors.devices.append("cuda")  # the config owns its values: changing it leaves the input alone
    cfg.env.cfg["nested"]["k"].append(9)
    assert raw == snapshot


def test_config_from_dict_does_not_mutate_input_on_error():
    raw = merged(minimal_config(), {"trainer": {"seedd": 1}})
    snapshot = copy.deepcopy(raw)
    with pytest.raises(ConfigError):
        config_from_dict(raw, overrides=["actors.num_envs=2"])
    assert raw == snapshot


def test_int_is_accepted_where_a_number_is_expected():
    cfg = config_from_dict({"algorithm": {"cfg": {"gamma": 1, "learning_rate": 1}}})
    assert cfg.algorithm.cfg.gamma == 1.0 and isinstance(cfg.algorithm.cfg.gamma, float)


def test_null_is_accepted_where_optional():
    assert config_from_dict({"algorithm": {"cfg": {"target_kl": None}}}).algorithm.cfg.target_kl is None
    assert config_from_dict({"algorithm": {"cfg": {"target_kl": 0.02}}}).algorithm.cfg.target_kl == 0.02


def test_rollouts_per_update_defaults_to_num_actors():
    assert config_from_dict({"actors": {"num_actors": 3}, "trainer": {"buffer_capacity": 3}}).rollouts_per_update == 3
    cfg = config_from_dict({"actors": {"num_actors": 3}, "trainer": {"rollouts_per_update": 2}})
    assert cfg.rollouts_per_update == 2


def test_save_config_round_trips(tmp_path):
    cfg = config_from_dict(DESIGN_EXAMPLE)
    path = tmp_path / "saved.json"
    save_config(cfg, path)
    again = load_config(path)
    assert again == cfg
    assert again.source == str(path)
    assert "source" not in json.loads(path.read_text())


# ----------------------------------------------------------------------------- unknown keys and types

def test_unknown_key_names_file_and_key(tmp_path):
    path = write_config(tmp_path, {**minimal_config(), "trainer": {"seedd": 1}})
    with pytest.raises(ConfigError, match=r"bad\.json.*trainer\.seedd"):
        load_config(path)


@pytest.mark.parametrize("patch, key", [
    ({"trainr": {}}, r"trainr"),
    ({"trainer": {"seedd": 1}}, r"trainer\.seedd"),
    ({"algorithm": {"cfg": {"lr": 0.1}}}, r"algorithm\.cfg\.lr"),
    ({"policy": {"actor": {"network_cfg": {"hidden": [8]}}}}, r"policy\.actor\.network_cfg\.hidden"),
    ({"source": "x.json"}, r"source"),  # an attribute of Config, not a config key
])
def test_unknown_key_at_any_depth(tmp_path, patch, key):
    with pytest.raises(ConfigError, match=rf"bad\.json: {key}: unknown key \(known keys here: "):
        load_patched(tmp_path, patch)


def test_unknown_key_message_lists_the_known_keys(tmp_path):
    with pytest.raises(ConfigError, match=r"trainer\.seedd: unknown key.*\bseed\b.*\btotal_steps\b"):
        load_patched(tmp_path, {"trainer": {"seedd": 1}})


WRONG_TYPES = [  # (patch, dotted key regex, what the message says after "expected")
    ({"trainer": {"total_steps": "5000"}}, r"trainer\.total_steps", "an integer, got '5000'"),
    ({"trainer": {"seed": True}}, r"trainer\.seed", "an integer, got True"),
    ({"actors": {"num_envs": 2.5}}, r"actors\.num_envs", "an integer, got 2.5"),
    ({"trainer": {"seed": None}}, r"trainer\.seed", "an integer, got None"),
    ({"algorithm": {"cfg": {"gamma": "0.99"}}}, r"algorithm\.cfg\.gamma", "a number, got '0.99'"),
    ({"algorithm": {"cfg": {"gamma": False}}}, r"algorithm\.cfg\.gamma", "a number, got False"),
    ({"algorithm": {"cfg": {"gamma": None}}}, r"algorithm\.cfg\.gamma", "a number, got None"),
    ({"trainer": {"use_wandb": 1}}, r"trainer\.use_wandb", "boolean, got 1"),
    ({"trainer": {"exp_name": 3}}, r"trainer\.exp_name", "string, got 3"),
    ({"env": {"id": None}}, r"env\.id", "string, got None"),
    ({"env": {"cfg": []}}, r"env\.cfg", r"object, got \[\]"),
    ({"trainer": []}, r"trainer", "an object, got list"),
    ({"trainer": None}, r"trainer", "an object, got NoneType"),
    ({"policy": {"actor": [1]}}, r"policy\.actor", "an object, got list"),
    ({"policy": {"actor": None}}, r"policy\.actor", "an object, got NoneType"),
    ({"actors": {"devices": "cpu"}}, r"actors\.devices", "list of string, got str"),
    ({"actors": {"devices": ["cpu", 0]}}, r"actors\.devices\[1\]", "string, got 0"),
    ({"actors": {"slow_actor_ids": [0, "1"]}}, r"actors\.slow_actor_ids\[1\]", "an integer, got '1'"),
    ({"policy": {"actor": {"network_cfg": {"hidden_sizes": 64}}}}, r"policy\.actor\.network_cfg\.hidden_sizes",
     "list of integer, got int"),
    ({"policy": {"actor": {"network_cfg": {"activation": "sigmoid"}}}}, r"policy\.actor\.network_cfg\.activation",
     "one of 'tanh' | 'relu' | 'elu' | 'gelu', got 'sigmoid'"),
    ({"algorithm": {"name": "sac"}}, r"algorithm\.name", "one of 'ppo' | 'grpo', got 'sac'"),
]


@pytest.mark.parametrize("patch, key, expected", WRONG_TYPES,
                         ids=[f"{key.replace(chr(92), '')}-{i}" for i, (_, key, _) in enumerate(WRONG_TYPES)])
def test_wrong_type_names_file_and_key(tmp_path, patch, key, expected):
    with pytest.raises(ConfigError, match=rf"bad\.json: {key}: expected {expected}"):
        load_patched(tmp_path, patch)


def test_every_problem_is_reported_in_one_error(tmp_path):
    patch = {"trainer": {"seedd": 1, "total_steps": "x"},
             "actors": {"num_envs": True, "devices": ["cpu", 3]},
             "algorithm": {"cfg": {"lr": 0.1}}}
    with pytest.raises(ConfigError, match=r"5 problems") as err:
        load_patched(tmp_path, patch)
    lines = str(err.value).splitlines()[1:]
    assert len(lines) == 5
    assert all(line.strip().startswith(f"{tmp_path / 'bad.json'}: ") for line in lines)
    for key in ("trainer.seedd", "trainer.total_steps", "actors.num_envs", "actors.devices[1]", "algorithm.cfg.lr"):
        assert any(f": {key}: " in line for line in lines), key


def test_every_cross_field_problem_is_reported_in_one_error(tmp_path):
    # gamma and gae_lambda are out of their ranges; the cross-field rules still run and report too
    patch = {"algorithm": {"cfg": {"gamma": 1.5, "gae_lambda": -0.1}}, "actors": {"devices": []},
             "learner": {"device": "gpu"}}
    with pytest.raises(ConfigError, match=r"4 problems") as err:
        load_patched(tmp_path, patch)
    message = str(err.value)
    for key in ("algorithm.cfg.gamma", "algorithm.cfg.gae_lambda", "actors.devices", "learner.device"):
        assert f"bad.json: {key}: " in message, key


def test_single_problem_is_singular(tmp_path):
    with pytest.raises(ConfigError, match=r"\(1 problem\):"):
        load_patched(tmp_path, {"trainer": {"seedd": 1}})


# ----------------------------------------------------------------------------- cross-field rules

@pytest.mark.parametrize("patch, match", [
    pytest.param({"actors": {"num_actors": 1, "num_envs": 2}, "trainer": {"buffer_size": 16, "buffer_capacity": 1},
                  "algorithm": {"cfg": {"batch_size": 33}}},
                 r"algorithm\.cfg\.batch_size: 33 is larger than one update's data .* = 32\)", id="batch_size"),
    pytest.param({"actors": {"num_actors": 4, "num_envs": 2}, "trainer": {"buffer_size": 16, "rollouts_per_update": 1},
                  "algorithm": {"cfg": {"batch_size": 33}}},
                 r"algorithm\.cfg\.batch_size: 33 is larger .* = 32\)", id="batch_size_rollouts_per_update"),
    pytest.param({"trainer": {"buffer_type": "fifo"}},
                 r"trainer\.buffer_type: expected one of 'standard' \| 'async' \| 'vla', got 'fifo'", id="buffer_type"),
    pytest.param({"actors": {"devices": ["gpu"]}}, r"actors\.devices\[0\]: unknown device 'gpu'", id="device_gpu"),
    pytest.param({"learner": {"devices": ["cpu", "cpu", "cpu"]}}, r"actors\.num_actors: 2 is not a multiple of the 3 "
                 r"learner ranks", id="ranks_actors"),
    pytest.param({"learner": {"devices": ["cuda", "cuda"]}}, r"learner\.devices: name each GPU", id="ranks_cuda"),
    pytest.param({"learner": {"devices": ["cpu", "cpu"], "rollout_port": 5555, "weights_port": 5556}},
                 r"learner\.weights_port: 5556 collides", id="ranks_ports"),
    pytest.param({"learner": {"devices": ["cpu", "cpu"]}, "trainer": {"record": True}},
                 r"trainer\.record: recording is for one learner rank", id="ranks_record"),
    pytest.param({"learner": {"weights_transport": "shm"}, "actors": {"weights_delay_s": 1.0}},
                 r"actors\.weights_delay_s: a delay cannot be combined", id="shm_delay"),
    pytest.param({"trainer": {"buffer_type": "standard"}, "actors": {"weights_lag_versions": 2}},
                 r"actors\.weights_lag_versions: 2 needs trainer\.buffer_type \"async\"", id="lag_versions_standard"),
    pytest.param({"trainer": {"buffer_type": "vla"}, "actors": {"weights_lag_versions": 2, "weights_delay_s": 0.5}},
                 r"actors\.weights_lag_versions / actors\.weights_delay_s: choose one", id="lag_versions_delay"),
    pytest.param({"trainer": {"buffer_type": "vla"}, "actors": {"weights_lag_versions": 2},
                  "learner": {"weights_transport": "shm"}},
                 r"actors\.weights_lag_versions: cannot be combined with learner\.weights_transport", id="lag_versions_shm"),
    pytest.param({"learner": {"curve_secret_key": "k"}}, r"learner\.curve_secret_key / learner\.curve_authorized_keys: "
                 r"set both", id="curve_half"),
    pytest.param({"actors": {"devices": ["cpu", "cuda:x"]}}, r"actors\.devices\[1\]: unknown device 'cuda:x'",
                 id="device_cuda_x"),
    pytest.param({"actors": {"devices": ["cuda:"]}}, r"actors\.devices\[0\]: unknown device 'cuda:'",
                 id="device_cuda_colon"),
    pytest.param({"learner": {"device": "CUDA"}}, r"learner\.device: unknown device 'CUDA'", id="learner_device"),
    pytest.param({"trainer": {"eval_device": "gpu0"}}, r"trainer\.eval_device: unknown device 'gpu0'",
                 id="eval_device"),
    pytest.param({"actors": {"devices": []}}, r"actors\.devices: must name at least one device", id="no_devices"),
    pytest.param({"trainer": {"buffer_type": "vla", "buffer_capacity": 1}, "actors": {"num_actors": 2}},
                 r"trainer\.buffer_capacity: 1 cannot hold one update's 2 rollouts", id="capacity_vs_actors"),
    pytest.param({"trainer": {"buffer_capacity": 3, "rollouts_per_update": 4}},
                 r"trainer\.buffer_capacity: 3 cannot hold one update's 4 rollouts", id="capacity_vs_rpu"),
    pytest.param({"policy": {"critic": None}}, r"policy\.name: PPO needs a critic.*critic null", id="ppo_no_critic"),
    pytest.param({"policy": {"name": "actor_only"}}, r"policy\.name: PPO needs a critic.*'actor_only'",
                 id="ppo_actor_only"),
    pytest.param({"actors": {"num_actors": 2, "slow_actor_ids": [1, 2]}},
                 r"actors\.slow_actor_ids: ids \[2\] are not in 0\.\.1", id="slow_actor_ids"),
])
def test_cross_field_rule(tmp_path, patch, match):
    with pytest.raises(ConfigError, match=rf"bad\.json: {match}"):
        load_patched(tmp_path, patch)


def test_batch_size_equal_to_one_update_is_allowed():
    cfg = config_from_dict({"actors": {"num_actors": 1, "num_envs": 2},
                            "trainer": {"buffer_size": 16, "buffer_capacity": 1},
                            "algorithm": {"cfg": {"batch_size": 32}}})
    assert cfg.algorithm.cfg.batch_size == 32


def test_small_buffer_capacity_is_allowed_in_standard_mode():
    cfg = config_from_dict({"trainer": {"buffer_type": "standard", "buffer_capacity": 1},
                            "actors": {"num_actors": 4}})
    assert cfg.trainer.buffer_capacity == 1


@pytest.mark.parametrize("device", ["cpu", "cuda", "cuda:0", "cuda:11", "mps"])
def test_known_device_names_are_accepted_without_the_device(device):
    # the config checks spelling only: a config for a GPU node must validate on a laptop
    cfg = config_from_dict({"actors": {"devices": [device, "cpu"]}, "learner": {"device": device}})
    assert cfg.actors.devices == [device, "cpu"]
    assert cfg.learner.device == device


# ----------------------------------------------------------------------------- overrides

def test_overrides_are_applied(tmp_path):
    path = write_config(tmp_path, minimal_config(), name="base.json")
    cfg = load_config(path, overrides=["trainer.total_steps=5000", "env.id=Pendulum-v1"])
    assert cfg.trainer.total_steps == 5000
    assert cfg.env.id == "Pendulum-v1"
    assert cfg.trainer.exp_name == "unit"  # untouched keys keep the file's values
    assert json.loads(path.read_text()) == minimal_config()


def test_overrides_parse_json_values_and_create_blocks(tmp_path):
    path = write_config(tmp_path, minimal_config(), name="base.json")
    cfg = load_config(path, overrides=['actors.devices=["cpu", "cuda:1"]', "trainer.use_wandb=false",
                                       "algorithm.cfg.target_kl=null", "algorithm.cfg.gamma=0.9",
                                       'env.cfg={"render_mode": null}', "learner.host=0.0.0.0",
                                       "trainer.exp_name=a=b"])
    assert cfg.actors.devices == ["cpu", "cuda:1"]
    assert cfg.trainer.use_wandb is False
    assert cfg.algorithm.cfg.target_kl is None
    assert cfg.algorithm.cfg.gamma == 0.9
    assert cfg.env.cfg == {"render_mode": None}
    assert cfg.learner.host == "0.0.0.0"
    assert cfg.trainer.exp_name == "a=b"  # only the first "=" separates key from value


def test_later_override_wins():
    cfg = config_from_dict({}, overrides=["trainer.seed=1", "trainer.seed=2"])
    assert cfg.trainer.seed == 2


@pytest.mark.parametrize("override, match", [
    ("trainer.total_steps", r"--set 'trainer\.total_steps': expected KEY=VALUE"),
    ("=5000", r"--set '=5000': expected KEY=VALUE"),
    ("", r"expected KEY=VALUE"),
    ("trainer.total_steps.x=1", r"--set 'trainer\.total_steps\.x=1': 'total_steps' is not a block"),
    ("trainer.seedd=1", r"bad\.json: trainer\.seedd: unknown key"),
    ("trainer.total_steps=abc", r"bad\.json: trainer\.total_steps: expected an integer, got 'abc'"),
    ("trainer=5", r"bad\.json: trainer: expected an object"),
])
def test_malformed_override_raises_config_error(tmp_path, override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(write_config(tmp_path, minimal_config()), overrides=[override])


# ----------------------------------------------------------------------------- files

def test_missing_file_names_the_file(tmp_path):
    with pytest.raises(ConfigError, match=r"nope\.json: config file not found"):
        load_config(tmp_path / "nope.json")


@pytest.mark.parametrize("text", ['{"trainer": {', "", "{'trainer': {}}", '{"trainer": {}} trailing'],
                         ids=["truncated", "empty", "single_quotes", "trailing_text"])
def test_invalid_json_names_the_file(tmp_path, text):
    path = tmp_path / "broken.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match=r"broken\.json: not valid JSON \(line \d+, column \d+"):
        load_config(path)


def test_non_utf8_file_names_the_file(tmp_path):
    path = tmp_path / "binary.json"
    path.write_bytes(b"\xff\xfe{\x00}")
    with pytest.raises(ConfigError, match=r"binary\.json"):
        load_config(path)


def test_directory_instead_of_file_names_it(tmp_path):
    folder = tmp_path / "folder.json"
    folder.mkdir()
    with pytest.raises(ConfigError, match=r"folder\.json"):
        load_config(folder)


@pytest.mark.parametrize("raw", [[1, 2], "cfg", 3, None], ids=["list", "string", "number", "null"])
def test_top_level_must_be_an_object(tmp_path, raw):
    with pytest.raises(ConfigError, match=r"top\.json: the top level must be a JSON object"):
        load_config(write_config(tmp_path, raw, name="top.json"))


@pytest.mark.parametrize("value", [object(), {1, 2}], ids=["object", "set"])
def test_config_from_dict_rejects_non_json_values(value):
    with pytest.raises(ConfigError, match=r"mine: "):
        config_from_dict({"trainer": {"seed": value}}, source="mine")


def test_the_asynchronous_mode_is_async_and_its_older_spelling_vla_is_still_accepted(tmp_path):
    assert config_from_dict({}).trainer.buffer_type == "async"
    for spelling in ("async", "vla"):
        cfg = config_from_dict({"trainer": {"buffer_type": spelling}})
        assert cfg.trainer.buffer_type == "async"
        save_config(cfg, tmp_path / "c.json")                 # a run's config.json says async
        assert json.loads((tmp_path / "c.json").read_text())["trainer"]["buffer_type"] == "async"
    assert config_from_dict({"trainer": {"buffer_type": "standard"}}).trainer.buffer_type == "standard"


def test_the_default_correction_is_the_recommended_one_for_the_mode():
    """trust in async mode (docs/corrections.md recommends it), none in standard mode (on-policy
    data needs none); a correction set in the config is kept in either mode. The rule is
    learner/corrections.py's (shared/ does not import learner/): every process that trains loads it."""
    assert config_from_dict({}).algorithm.cfg.correction == "trust"
    assert config_from_dict({"trainer": {"buffer_type": "standard"}}).algorithm.cfg.correction == "none"
    for mode in ("standard", "async"):
        cfg = config_from_dict({"trainer": {"buffer_type": mode}, "algorithm": {"cfg": {"correction": "is"}}})
        assert cfg.algorithm.cfg.correction == "is"


def test_an_unknown_correction_is_refused_naming_the_registered_ones():
    with pytest.raises(ConfigError, match=r"algorithm\.cfg\.correction: 'vtrace2' is not a correction; "
                                          r"choose from 'none', 'is', 'vtrace', 'appo', 'ewma', 'mask', 'trust'"):
        config_from_dict({"algorithm": {"cfg": {"correction": "vtrace2"}}}, source="x.json")
