"""Each built-in env's options (env.cfg) are declared once, in shared/envs/options.py: the declarations
check env.cfg (an unknown key, a wrong type, a value not accepted: one message naming env.cfg.<key>, the
file and the accepted values, printed by the entry points without a traceback), agree with the envs'
constructors, and generate docs/reference/envs.md, which must not go stale."""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from children import child_pythonpath
from shared.config import ConfigError, load_config
from shared.envs import EnvConfigError, check_env_config, env_spec, make_env
from shared.envs.options import TORCH_NATIVE, ManiSkillOptions, default_of
from shared.envs.reference import PAGE, render
from shared.instructions import InstructionError

ROOT = Path(__file__).resolve().parents[1]
PPO = ROOT / "configs" / "vla_own_reach_ppo.json"


def test_the_env_reference_is_up_to_date():
    assert PAGE.read_text() == render(), "docs/reference/envs.md is stale: run python -m shared.envs.reference"


def test_every_declared_option_is_documented():
    from shared.config_reference import field_docs
    for cls in [*TORCH_NATIVE.values(), ManiSkillOptions]:
        docs = field_docs(cls)
        assert cls.__doc__ and all(docs.get(f.name) for f in dataclasses.fields(cls)), cls.__name__


@pytest.mark.parametrize("env_id", sorted(TORCH_NATIVE))
def test_the_declared_defaults_are_the_constructors(env_id):
    from shared.envs.mjwarp import MJWarpHalfCheetah
    from shared.envs.reach import Reach
    from shared.envs.torch_envs import TorchPendulum
    ctor = {"tandem/Reach-v0": Reach, "tandem/Pendulum-v0": TorchPendulum,
            "tandem/MJWarpHalfCheetah-v0": MJWarpHalfCheetah}[env_id]
    params = {k: p.default for k, p in inspect.signature(ctor.__init__).parameters.items()
              if k not in ("self", "num_envs", "device", "tokenizer")}
    declared = {f.name: default_of(f) for f in dataclasses.fields(TORCH_NATIVE[env_id])}
    assert declared == params


@pytest.mark.parametrize("cfg, match", [
    ({"instructions": "foo"}, r"env\.cfg\.instructions: expected one of 'ids' \| 'text', got 'foo'"),
    ({"instruction_length": 8}, r"env\.cfg\.instruction_length: 8 with env\.cfg\.instructions \"ids\": .* must be 4 "
                                r"or left out"),
    ({"instruction_length": None}, r"env\.cfg\.instruction_length: expected an integer, got None \(accepted: "
                                   r"integer in \[1, 512\]; default 4\)"),
    ({"instructions": "text", "instruction_length": 0}, r"env\.cfg\.instruction_length: must be in \[1, 512\], got 0"),
    ({"reward": "sparse"}, r"env\.cfg\.reward: expected one of 'dense' \| 'success'"),
    ({"colour": "red"}, r"env\.cfg\.colour: unknown key \(known keys here: group_goals, image_size, .*\)"),
])
def test_reach_refuses_what_it_does_not_accept_naming_the_key_and_the_accepted_values(cfg, match):
    with pytest.raises(EnvConfigError, match=match) as e:
        env_spec("tandem/Reach-v0", cfg)
    assert isinstance(e.value, ConfigError) and "docs/reference/envs.md" in str(e.value)
    with pytest.raises(EnvConfigError, match=match):
        make_env("tandem/Reach-v0", 2, cfg)


def test_reach_ids_of_length_4_are_accepted_and_the_file_is_named_when_loaded_from_one(tmp_path):
    spec = env_spec("tandem/Reach-v0", {"instructions": "ids", "instruction_length": 4})
    assert spec.obs_keys["instruction"][0] == (4,)
    cfg = load_config(PPO, [f"policy.vla_config.model_path={tmp_path}", "env.cfg.instructions=ids",
                            "env.cfg.instruction_length=4"])
    check_env_config(cfg)        # no tokenizer needed: Reach's own ids
    bad = load_config(PPO, [f"policy.vla_config.model_path={tmp_path}", "env.cfg.instructions=ids"])
    with pytest.raises(EnvConfigError, match=rf"{PPO}: env\.cfg\.instruction_length: 8 with"):
        check_env_config(bad)


def test_text_instructions_without_a_tokenizer_say_what_to_set(tmp_path):
    cfg = load_config(PPO, [f"policy.vla_config.model_path={tmp_path}"])
    with pytest.raises(InstructionError, match=r"no tokenizer\.json .* set policy\.vla_config\.tokenizer .* "
                                               r"env\.cfg\.instructions \"ids\" with env\.cfg\.instruction_length 4"
                       ) as e:
        check_env_config(cfg)
    assert isinstance(e.value, ConfigError)


def test_an_instruction_longer_than_the_length_is_refused_before_anything_is_built(tmp_path):
    from foreign_vla import make_tokenizer
    make_tokenizer().save_pretrained(str(tmp_path))
    check_env_config(load_config(PPO, [f"policy.vla_config.model_path={tmp_path}"]))
    with pytest.raises(InstructionError, match=r"env\.cfg\.instruction_length: 'reach red' is 2 tokens .* more than "
                                               r"the instruction length 1"):
        check_env_config(load_config(PPO, [f"policy.vla_config.model_path={tmp_path}",
                                           "env.cfg.instruction_length=1"]))


def test_maniskill_options_are_checked_without_maniskill():
    with pytest.raises(EnvConfigError, match=r"env\.cfg\.instruction_length: required with a text "
                                             r"env\.cfg\.instruction"):
        env_spec("maniskill/PickCube-v1", {"instruction": "pick up the cube"})
    with pytest.raises(EnvConfigError, match=r"env\.cfg\.sim_backend: expected one of 'physx_cpu' \| 'physx_cuda'"):
        env_spec("maniskill/PickCube-v1", {"sim_backend": "warp"})


def run_entry(*args, cwd=ROOT) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": child_pythonpath()}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("entry", [["-m", "learner", "--run-dir", "RUN"],
                                   ["-m", "actors", "--actor-id", "0", "--run-dir", "RUN"],
                                   ["-m", "runners.serial"],
                                   ["launch/evaluate.py", "--checkpoint", "none"]])
def test_a_bad_env_cfg_value_is_refused_in_the_tidy_form_by_every_entry_point(entry, tmp_path):
    entry = [str(tmp_path / "run") if a == "RUN" else a for a in entry]
    p = run_entry(*entry, "--config", "configs/vla_own_reach_ppo.json", "--set", "env.cfg.instructions=foo")
    assert p.returncode == 2, p.stdout + p.stderr
    assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) <= 4, p.stderr
    assert "configs/vla_own_reach_ppo.json: env.cfg.instructions: expected one of 'ids' | 'text', got 'foo'" in p.stderr


def test_a_missing_tokenizer_is_refused_in_the_tidy_form(tmp_path):
    p = run_entry("-m", "learner", "--config", "configs/vla_own_reach_ppo.json", "--run-dir", str(tmp_path / "run"),
                  "--set", f"policy.vla_config.model_path={tmp_path}")
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert "no tokenizer.json" in p.stderr and "--set env.cfg.instructions=ids --set env.cfg.instruction_length=4" \
        in p.stderr


def test_the_fresh_value_head_is_said_by_the_process_that_trains_it_only(tmp_path, caplog):
    from foreign_vla import save_foreign_checkpoint
    from shared.policies import make_policy
    save_foreign_checkpoint(tmp_path / "ckpt", tokenizer=False)
    cfg = load_config(PPO, [f"policy.vla_config.model_path={tmp_path / 'ckpt'}", "env.cfg.instructions=ids",
                            "env.cfg.instruction_length=4"])
    spec = env_spec(cfg.env.id, cfg.env.cfg)
    with caplog.at_level(logging.DEBUG, logger="tandem.vla"):
        make_policy(cfg, spec)                       # an actor's or the evaluator's copy
    copies = [r for r in caplog.records if "starts fresh at zero" in r.getMessage()]
    assert copies and all(r.levelno == logging.DEBUG for r in copies)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tandem.vla"):
        make_policy(cfg, spec, describe=True)        # the learner's
    said = [r for r in caplog.records if "starts fresh at zero" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING
