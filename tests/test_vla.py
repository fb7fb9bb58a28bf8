"""VLA policies: load_vla_model on checkpoints the test writes (safetensors and torch), each of its
errors, freezing, bf16 weights, and the policy interface on multi-modal observations."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from tensordict import TensorDict

from shared import keys, wire
from shared.config import ConfigError, VLAConfig, config_from_dict
from shared.policies import has_critic, load_weights_, weights_td
from shared.policies.tiny_vla import TinyVLA
from shared.policies.vla import VLALoadError, VLAPolicy, load_vla_model

CLASS = "shared.policies.tiny_vla.TinyVLA"
CONF = {"image_size": 16, "vocab_size": 32, "proprio_dim": 4, "action_dim": 2, "hidden": 32}


def obs(n=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return TensorDict({"rgb": torch.randint(0, 256, (n, 16, 16, 3), generator=g, dtype=torch.uint8),
                       "proprio": torch.randn(n, 4, generator=g),
                       "instruction": torch.randint(0, 32, (n, 6), generator=g)}, batch_size=[n])


@pytest.fixture
def pretrained():
    torch.manual_seed(0)
    return TinyVLA(**CONF)


@pytest.mark.parametrize("fmt", ["safetensors", "pt"])
def test_loads_written_checkpoint_exactly(tmp_path, pretrained, fmt):
    path = tmp_path / f"model.{fmt}"
    state = {k: v.contiguous() for k, v in pretrained.state_dict().items()}
    save_file(state, str(path)) if fmt == "safetensors" else torch.save(state, path)
    model = load_vla_model(str(path), CLASS, CONF)
    for k, v in pretrained.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k


def test_missing_file(tmp_path):
    with pytest.raises(VLALoadError, match=r"model_path '.*nope\.safetensors': no such file"):
        load_vla_model(str(tmp_path / "nope.safetensors"), CLASS, CONF)


@pytest.mark.parametrize("cls, match", [
    ("shared.policies.no_such_module.TinyVLA", r"cannot import module 'shared\.policies\.no_such_module'"),
    ("shared.policies.tiny_vla.Nope", r"has no nn\.Module class 'Nope'"),
    ("TinyVLA", r"expected 'package\.module\.Class'"),
    ("shared.policies.vla.VLALoadError", r"has no nn\.Module class"),
])
def test_unknown_class(cls, match):
    with pytest.raises(VLALoadError, match=match):
        load_vla_model("", cls, CONF)


def test_bad_model_config():
    with pytest.raises(VLALoadError, match=r"model_config does not fit .*TinyVLA.*hiden"):
        load_vla_model("", CLASS, {**CONF, "hiden": 3})


def test_wrong_shapes_name_the_parameter(tmp_path, pretrained):
    path = tmp_path / "small.pt"
    torch.save(TinyVLA(**{**CONF, "action_dim": 3}).state_dict(), path)
    with pytest.raises(VLALoadError, match=r"shape mismatch: action_head\.bias: file \(3,\), model \(2,\)"):
        load_vla_model(str(path), CLASS, CONF)


def test_missing_and_unexpected_keys(tmp_path, pretrained):
    state = dict(pretrained.state_dict())
    state.pop("value_head.bias")
    state["extra.weight"] = torch.zeros(1)
    path = tmp_path / "m.pt"
    torch.save(state, path)
    with pytest.raises(VLALoadError, match=r"missing \['value_head\.bias'\].*unexpected \['extra\.weight'\]"):
        load_vla_model(str(path), CLASS, CONF)


def test_not_a_state_dict(tmp_path):
    path = tmp_path / "junk.pt"
    torch.save([1, 2, 3], path)
    with pytest.raises(VLALoadError, match="expected a state dict of tensors"):
        load_vla_model(str(path), CLASS, CONF)


def test_policy_interface_and_freezing(pretrained):
    policy = VLAPolicy(pretrained, VLAConfig(model_class=CLASS, freeze=["vision.", "language."]))
    assert has_critic(policy)
    td = policy(TensorDict({keys.OBS: obs()}, [5]))
    assert td[keys.ACTION].shape == (5, 2) and td[keys.LOG_PROB].shape == (5,) and td[keys.VALUE].shape == (5,)
    logp, ent, value = policy.evaluate_actions(td)
    torch.testing.assert_close(logp, td[keys.LOG_PROB])
    assert ent.shape == (5,)
    frozen = {n for n, p in policy.model.named_parameters() if not p.requires_grad}
    assert frozen and all(n.startswith(("vision.", "language.")) for n in frozen)
    assert all(p.requires_grad for n, p in policy.model.named_parameters() if n.startswith("trunk."))
    det = policy(TensorDict({keys.OBS: obs()}, [5]), deterministic=True)[keys.ACTION]
    assert torch.equal(det, policy(TensorDict({keys.OBS: obs()}, [5]), deterministic=True)[keys.ACTION])
    with pytest.raises(VLALoadError, match=r"freeze \['decoder\.'\]"):
        VLAPolicy(TinyVLA(**CONF), VLAConfig(model_class=CLASS, freeze=["decoder."]))


def test_bf16_weights_travel_over_the_wire(pretrained):
    policy = VLAPolicy(pretrained, VLAConfig(model_class=CLASS, dtype="bfloat16"))
    assert all(p.dtype == torch.bfloat16 for p in policy.parameters())
    td = policy(TensorDict({keys.OBS: obs()}, [5]))
    assert td[keys.LOG_PROB].dtype == torch.float32
    frames = wire.encode(weights_td(policy), kind="weights", version=3)
    received, _ = wire.decode([bytes(f) for f in frames])
    other = VLAPolicy(TinyVLA(**CONF), VLAConfig(model_class=CLASS, dtype="bfloat16"))
    load_weights_(other, received)
    for k, v in policy.state_dict().items():
        assert torch.equal(other.state_dict()[k], v)


def test_config_needs_model_class():
    with pytest.raises(ConfigError, match=r"policy\.vla_config\.model_class: policy\.name \"vla\" needs"):
        config_from_dict({"policy": {"name": "vla"}}, "v.json")
    with pytest.raises(ConfigError, match=r"policy\.vla_config: only used with policy\.name \"vla\""):
        config_from_dict({"policy": {"vla_config": {"model_class": CLASS}}}, "v.json")
