"""shared/policies/flow_vla.py on a tiny random π0 (tests/flow_vla_tiny.py): strict loading of
save_pretrained and LeRobot layouts, the cached-prefix ODE chain against uncached forwards and
against transformers' sample_actions, and the observation-to-input mapping."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from shared.policies import flow_vla
from shared.policies.flow_vla import (HEADS_FILE, env_actions, load_pi0, ode_chain, pi0_inputs, save_pi0,
                                      step_times, velocities_at)
from shared.policies.vla import VLALoadError
from tests.flow_vla_tiny import edit_checkpoint, save_lerobot_layout, save_tiny_pi0, tiny_observation

pytest.importorskip("transformers.models.pi0")

EXPERT_UP = "paligemma_with_expert.gemma_expert.model.layers.1.mlp.up_proj.weight"   # as save_pretrained names it


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("pi0") / "tiny"
    return path, save_tiny_pi0(path)


@pytest.fixture(scope="module")
def model(saved):
    return load_pi0(saved[0])


def _equal_state(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def test_save_pretrained_loads_every_tensor(saved, model):
    _equal_state(model, saved[1])
    assert not model.training


def test_lerobot_layout_loads_through_transformers_mapping(saved, tmp_path):
    names = save_lerobot_layout(saved[1], tmp_path / "lerobot")
    assert names["model.vlm.language_model.layers.0.self_attn.q_proj.weight"] == \
        "model.paligemma_with_expert.paligemma.model.language_model.layers.0.self_attn.q_proj.weight"
    assert names["embed_action_time.state_proj.weight"] == "model.state_proj.weight"
    _equal_state(load_pi0(tmp_path / "lerobot"), saved[1])

    missing = "model.paligemma_with_expert.paligemma.model.vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight"
    edit_checkpoint(tmp_path / "lerobot", tmp_path / "lerobot_missing", lambda d: d.pop(missing))
    with pytest.raises(VLALoadError, match=r"missing \['model.vlm.vision_tower.encoder.layers.0.mlp.fc1.weight'\]"
                       r".*weights: model.safetensors"):
        load_pi0(tmp_path / "lerobot_missing")


@pytest.mark.parametrize("case, edit, named", [
    ("renamed", lambda d: d.__setitem__(EXPERT_UP.replace("up_proj", "upp_proj"), d.pop(EXPERT_UP)),
     ["missing", "model.dit.layers.1.mlp.up_proj.weight", "unexpected", "model.dit.layers.1.mlp.upp_proj.weight"]),
    ("missing", lambda d: d.pop(EXPERT_UP), ["missing", "model.dit.layers.1.mlp.up_proj.weight"]),
    ("extra", lambda d: d.__setitem__("value_head.weight", torch.zeros(1, 16)), ["unexpected", "value_head.weight"]),
    ("shape", lambda d: d.__setitem__("state_proj.weight", torch.zeros(16, 9)),
     ["shape mismatch", "embed_action_time.state_proj.weight", "file (16, 9), model (16, 8)"]),
])
def test_checkpoint_that_does_not_match_fails_naming_tensor_and_file(saved, tmp_path, case, edit, named):
    edit_checkpoint(saved[0], tmp_path / case, edit)
    with pytest.raises(VLALoadError) as e:
        load_pi0(tmp_path / case)
    for text in named + ["model.safetensors", str(tmp_path / case), "policy.flow_config.model_path"]:
        assert text in str(e.value), (text, str(e.value))
    assert "vla_config" not in str(e.value)


def test_no_checkpoint_directory(tmp_path):
    with pytest.raises(VLALoadError, match="policy.flow_config.model_path .*absent.*no such directory"):
        load_pi0(tmp_path / "absent")


def test_heads_fresh_logged_once_then_saved_and_loaded(saved, tmp_path, caplog):
    flow_vla._said.clear()
    with caplog.at_level(logging.WARNING, logger="tandem.vla"):
        load_pi0(saved[0], heads={"value_head": nn.Linear(16, 1)})
        load_pi0(saved[0], heads={"value_head": nn.Linear(16, 1)})
    fresh = [r for r in caplog.records if "start" in r.getMessage() and "fresh" in r.getMessage()]
    assert len(fresh) == 1 and "value_head" in fresh[0].getMessage()

    torch.manual_seed(3)
    head = nn.Linear(16, 1)
    save_pi0(saved[1], tmp_path / "with_head", heads={"value_head": head})
    loaded = nn.Linear(16, 1)
    load_pi0(tmp_path / "with_head", heads={"value_head": loaded})
    _equal_state(loaded, head)
    with pytest.raises(VLALoadError, match=r"value_head.weight: file \(1, 16\), model \(2, 16\)"):
        load_pi0(tmp_path / "with_head", heads={"value_head": nn.Linear(16, 2)})
    with pytest.raises(VLALoadError, match=f"{HEADS_FILE}.*unexpected.*value_head.bias"):
        load_pi0(tmp_path / "with_head", heads={"value_head": nn.Linear(16, 1, bias=False)})
    with pytest.raises(VLALoadError, match="Tandem's own heads"):
        load_pi0(saved[0], heads={"q_head": nn.Linear(16, 1)})


def _inputs(model, batch=2, **kw):
    rgb, proprio, instruction = tiny_observation(batch, **kw)
    return pi0_inputs(model.config, rgb, proprio, instruction, instruction_pad_id=0)


def _noise(model, batch=2, seed=5):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, model.config.chunk_size, model.config.max_action_dim, generator=g)


def test_cached_chain_equals_uncached_forwards(model):
    inputs, x1 = _inputs(model), _noise(model)
    with torch.no_grad():
        chain, vel = ode_chain(model, inputs, x1, num_steps=4)
        assert chain.shape == (2, 5, 8, 8) and vel.shape == (2, 4, 8, 8)
        assert torch.equal(chain[:, 0], x1)
        times = step_times(4)
        assert times == [1.0, 0.75, 0.5, 0.25, 0.0]
        for k in range(4):   # no cache: each forward runs the VLM over the prefix again
            t = torch.full((2,), times[k])
            full = model(**inputs.prefix_kwargs(), noise=chain[:, k], timestep=t).logits
            torch.testing.assert_close(vel[:, k], full, atol=1e-5, rtol=0)
            torch.testing.assert_close(chain[:, k + 1], chain[:, k] - 0.25 * vel[:, k], atol=1e-6, rtol=0)
        again = velocities_at(model, inputs, chain[:, :-1], torch.tensor(times[:-1]))
    torch.testing.assert_close(again, vel, atol=1e-5, rtol=0)


def test_chain_end_equals_sample_actions(model):
    inputs, x1 = _inputs(model, cameras=2), _noise(model, seed=7)
    with torch.no_grad():
        chain, _ = ode_chain(model, inputs, x1, num_steps=3)
        reference = model.sample_actions(state=inputs.state, input_ids=inputs.input_ids,
                                         pixel_values=inputs.pixel_values, noise=x1.clone(),
                                         attention_mask=inputs.attention_mask,
                                         pixel_attention_mask=inputs.pixel_attention_mask, num_steps=3)
    torch.testing.assert_close(chain[:, -1], reference, atol=1e-5, rtol=0)


def test_recomputed_velocities_carry_gradients_to_the_vlm(model):
    inputs, x1 = _inputs(model), _noise(model)
    with torch.no_grad():
        chain, vel = ode_chain(model, inputs, x1, num_steps=2)
    model.zero_grad()
    v = velocities_at(model, inputs, chain[:, :-1], torch.tensor(step_times(2)[:-1]).expand(2, 2))
    torch.testing.assert_close(v.detach(), vel, atol=1e-5, rtol=0)
    v.square().sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert grads["model.vlm.language_model.layers.0.self_attn.k_proj.weight"].abs().sum() > 0
    assert grads["model.dit.layers.0.mlp.up_proj.weight"].abs().sum() > 0
    model.zero_grad(set_to_none=True)


def test_inputs_resize_pad_and_actions(model, caplog):
    flow_vla._said.clear()
    with caplog.at_level(logging.INFO, logger="tandem.vla"):
        a = _inputs(model, size=48)
        _inputs(model, size=48)
    resized = [r for r in caplog.records if "resized" in r.getMessage()]
    assert len(resized) == 1 and "48x48" in resized[0].getMessage() and "32x32" in resized[0].getMessage()
    assert a.pixel_values.shape == (2, 1, 3, 32, 32)
    assert a.pixel_values.min() >= -1 and a.pixel_values.max() <= 1
    assert a.state.shape == (2, 8) and torch.all(a.state[:, 5:] == 0)
    n_img = model.config.vlm_config.text_config.num_image_tokens
    assert n_img == 16 and a.input_ids.shape == (2, 20)
    assert torch.all(a.input_ids[:, :16] == model.config.vlm_config.image_token_id)
    assert a.attention_mask[0].tolist() == [1] * 19 + [0] and a.attention_mask[1].sum() == 20
    assert env_actions(torch.zeros(2, 8, 8), 3).shape == (2, 8, 3)
    with pytest.raises(ValueError, match="max_action_dim"):
        env_actions(torch.zeros(2, 8, 8), 9)
    rgb, _, instruction = tiny_observation(2)
    with pytest.raises(ValueError, match="max_state_dim=8"):
        pi0_inputs(model.config, rgb, torch.zeros(2, 9), instruction)
