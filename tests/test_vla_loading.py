"""VLA loading (issue 13): both model interfaces, every checkpoint kind, transformers classes, LoRA.

Every checkpoint is written by the test (tiny models, nothing fetched): safetensors, torch state dicts,
Hugging Face directories with one file or with shards and an index, and ``save_pretrained`` output.
"""

from __future__ import annotations

import doctest
import json
import logging
import sys
import warnings

import pytest
import torch
from safetensors.torch import save_file
from tensordict import TensorDict
from torch import nn
from torch.distributions import Categorical

import shared.policies.vla as vla
from shared import keys
from shared.config import ConfigError, LoRAConfig, VLAConfig, config_from_dict, load_config
from shared.policies import has_critic, make_policy
from shared.policies.seed_example import ReachMLP
from shared.policies.vla import VLALoadError, VLAPolicy, apply_lora, load_pretrained, load_vla_model, read_checkpoint

try:  # imported here, not in a test: transformers takes seconds to import
    import peft
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM
except ImportError:  # the [vla] extra is not installed
    transformers = peft = None
needs_hf = pytest.mark.skipif(transformers is None or peft is None, reason="needs pip install -e '.[vla]'")

SEED_CLASS = "shared.policies.seed_example.ReachMLP"
SEED_CONF = {"hidden": 8}
HERE = __name__   # test classes below are imported by this module name


def reach_obs(n=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return TensorDict({"rgb": torch.randint(0, 256, (n, 16, 16, 3), generator=g, dtype=torch.uint8),
                       "proprio": torch.randn(n, 4, generator=g),
                       "instruction": torch.randint(0, 8, (n, 4), generator=g)}, batch_size=[n])


@pytest.fixture
def seed_model():
    torch.manual_seed(0)
    return ReachMLP(**SEED_CONF)


def contiguous_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}


def write_sharded(directory, state: dict[str, torch.Tensor], n_shards: int = 3) -> list[str]:
    """Shards ``model-0000k-of-0000n.safetensors`` and their index, as transformers writes them."""
    directory.mkdir(exist_ok=True)
    names = sorted(state)
    shards = [f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors" for i in range(n_shards)]
    weight_map = {}
    for i, shard in enumerate(shards):
        part = {k: state[k] for k in names[i::n_shards]}
        save_file(part, str(directory / shard))
        weight_map.update({k: shard for k in part})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return shards


# ----------------------------------------------------------------------------- the docstring's examples

def test_module_docstring_examples_run():
    result = doctest.testmod(vla, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 5 and result.failed == 0


# ----------------------------------------------------------------------------- interface (b) from every checkpoint kind

@pytest.mark.parametrize("kind", ["safetensors", "torch", "hf_single", "hf_sharded"])
def test_seed_interface_model_loads_and_acts(tmp_path, seed_model, kind):
    state = contiguous_state(seed_model)
    if kind == "safetensors":
        path = tmp_path / "reach.safetensors"
        save_file(state, str(path))
    elif kind == "torch":
        path = tmp_path / "reach.pt"
        torch.save(state, path)
    elif kind == "hf_single":
        path = tmp_path / "hf"
        path.mkdir()
        save_file(state, str(path / "model.safetensors"))
    else:
        path = tmp_path / "hf"
        assert len(write_sharded(path, state, 3)) == 3
    model = load_vla_model(str(path), SEED_CLASS, SEED_CONF)
    assert not hasattr(model, "action_dist")
    for k, v in state.items():
        assert torch.equal(model.state_dict()[k], v), k
    policy = VLAPolicy(model, VLAConfig(model_class=SEED_CLASS))
    assert policy.interface == "seed" and has_critic(policy)
    td = policy(TensorDict({keys.OBS: reach_obs()}, [5]))
    assert td[keys.ACTION].shape == (5, 2) and td[keys.LOG_PROB].shape == (5,) and td[keys.VALUE].shape == (5,)
    logp, entropy, value = policy.evaluate_actions(td)
    torch.testing.assert_close(logp, td[keys.LOG_PROB])
    torch.testing.assert_close(value, td[keys.VALUE])
    torch.testing.assert_close(policy.get_value(td), td[keys.VALUE])
    assert entropy.shape == (5,)
    det = policy(TensorDict({keys.OBS: reach_obs()}, [5]), deterministic=True)[keys.ACTION]
    assert torch.equal(det, policy(TensorDict({keys.OBS: reach_obs()}, [5]), deterministic=True)[keys.ACTION])


def test_seed_example_config_builds_through_make_policy():
    cfg = load_config("configs/vla_seed_interface_reach_ppo.json")
    policy = make_policy(cfg, spec=None)   # a VLA builds from vla_config alone
    assert isinstance(policy, VLAPolicy) and policy.interface == "seed" and has_critic(policy)
    td = policy(TensorDict({keys.OBS: reach_obs(3)}, [3]))
    assert td[keys.LOG_PROB].shape == (3,)


class SampleOnly(nn.Module):
    """The seed interface with a forward that takes no ``deterministic``, and no critic."""
    critic = None

    def __init__(self):
        super().__init__()
        self.pi = nn.Linear(3, 4)

    def forward(self, td):
        dist = Categorical(logits=self.pi(td[keys.OBS]))
        action = dist.sample()
        td.set(keys.ACTION, action)
        td.set(keys.LOG_PROB, dist.log_prob(action))
        return td

    def get_value(self, td):
        raise RuntimeError("no critic")

    def evaluate_actions(self, td):
        dist = Categorical(logits=self.pi(td[keys.OBS]))
        return dist.log_prob(td[keys.ACTION]), dist.entropy(), None


def test_deterministic_falls_back_to_sampling_with_one_warning(caplog):
    policy = VLAPolicy(SampleOnly(), VLAConfig(model_class="SampleOnly"))
    assert not has_critic(policy)
    with caplog.at_level(logging.WARNING, logger="tandem.vla"):
        for _ in range(3):
            td = policy(TensorDict({keys.OBS: torch.randn(6, 3)}, [6]), deterministic=True)
    assert td[keys.ACTION].shape == (6,) and keys.VALUE not in td.keys()
    assert [r.getMessage() for r in caplog.records] == [
        "SampleOnly.forward takes no 'deterministic' keyword: deterministic calls (evaluation) use the sampled action"]
    assert policy.evaluate_actions(td)[2] is None
    with pytest.raises(RuntimeError, match="no value head"):
        policy.get_value(td)


# ----------------------------------------------------------------------------- load errors

class ForwardOnly(nn.Module):
    def forward(self, td):
        return td

    def get_value(self, td):
        return td


class EvaluateOnly(nn.Module):
    def evaluate_actions(self, td):
        return td


class Nothing(nn.Module):
    def __init__(self, width: int = 2):
        super().__init__()
        self.layer = nn.Linear(width, width)


@pytest.mark.parametrize("cls, match", [
    ("ForwardOnly", r"'.*ForwardOnly': ForwardOnly implements neither interface: has forward, get_value but no "
                    r"evaluate_actions \(seed interface.*; no action_dist\(obs\) \(distribution interface\)"),
    ("EvaluateOnly", r"EvaluateOnly implements neither interface: has evaluate_actions but no forward, get_value"),
    ("Nothing", r"Nothing implements neither interface: has none of forward, get_value, evaluate_actions.*"
                r"no action_dist\(obs\)"),
])
def test_missing_method_is_named_for_each_interface(cls, match):
    with pytest.raises(VLALoadError, match=match):
        load_vla_model("", f"{HERE}.{cls}", {})
    with pytest.raises(VLALoadError, match=match):   # a model built in code is checked the same way
        VLAPolicy(getattr(sys.modules[HERE], cls)(), VLAConfig(model_class=f"{HERE}.{cls}"))


def test_missing_method_is_reported_before_the_checkpoint_is_read(tmp_path):
    with pytest.raises(VLALoadError, match="Nothing implements neither interface"):
        load_vla_model(str(tmp_path / "absent.safetensors"), f"{HERE}.Nothing", {})


def test_missing_file_names_path_and_class(tmp_path):
    with pytest.raises(VLALoadError, match=r"model_path '.*nope\.safetensors': no such file or directory "
                                           r"\(model_class shared\.policies\.seed_example\.ReachMLP\)"):
        load_vla_model(str(tmp_path / "nope.safetensors"), SEED_CLASS, SEED_CONF)


@pytest.mark.parametrize("cls, match", [
    ("shared.policies.no_such.ReachMLP", r"model_class 'shared\.policies\.no_such\.ReachMLP': cannot import "
                                         r"module 'shared\.policies\.no_such'"),
    ("shared.policies.seed_example.Nope", r"model_class 'shared\.policies\.seed_example\.Nope': "
                                          r"shared\.policies\.seed_example has no nn\.Module class 'Nope'"),
])
def test_unknown_module_or_class(cls, match):
    with pytest.raises(VLALoadError, match=match):
        load_vla_model("", cls, SEED_CONF)


def test_constructor_args_that_do_not_fit():
    with pytest.raises(VLALoadError, match=r"model_config does not fit shared\.policies\.seed_example\.ReachMLP: "
                                           r".*unexpected keyword argument 'hiden'"):
        load_vla_model("", SEED_CLASS, {"hiden": 8})


def test_wrong_shape_names_parameter_and_both_shapes(tmp_path):
    path = tmp_path / "wide.safetensors"
    save_file(contiguous_state(ReachMLP(hidden=16)), str(path))
    with pytest.raises(VLALoadError, match=r"'.*wide\.safetensors' does not match .*ReachMLP: shape mismatch: "
                                           r"actor\.0\.bias: file \(16,\), model \(8,\)"):
        load_vla_model(str(path), SEED_CLASS, SEED_CONF)


def test_missing_and_unexpected_params(tmp_path, seed_model):
    state = contiguous_state(seed_model)
    state.pop("critic.4.bias")
    state["value_head.weight"] = torch.zeros(1)
    path = tmp_path / "m.pt"
    torch.save(state, path)
    with pytest.raises(VLALoadError, match=r"'.*m\.pt' does not match .*ReachMLP: missing \['critic\.4\.bias'\], "
                                           r"unexpected \['value_head\.weight'\]"):
        load_vla_model(str(path), SEED_CLASS, SEED_CONF)


def test_index_naming_a_missing_shard(tmp_path, seed_model):
    shards = write_sharded(tmp_path / "hf", contiguous_state(seed_model))
    (tmp_path / "hf" / shards[1]).unlink()
    with pytest.raises(VLALoadError, match=r"model_path '.*hf' \(model_class .*ReachMLP\): "
                                           r"model\.safetensors\.index\.json names shard "
                                           r"'model-00002-of-00003\.safetensors', which does not exist"):
        load_vla_model(str(tmp_path / "hf"), SEED_CLASS, SEED_CONF)


def test_shard_holding_unassigned_tensors_and_names_missing_from_shards(tmp_path, seed_model):
    state = contiguous_state(seed_model)
    shards = write_sharded(tmp_path / "hf", state)
    index = tmp_path / "hf" / "model.safetensors.index.json"
    raw = json.loads(index.read_text())
    moved = sorted(k for k, s in raw["weight_map"].items() if s == shards[0])[0]
    raw["weight_map"][moved] = shards[2]        # the index now says shard 3 holds it; shard 1 does
    index.write_text(json.dumps(raw))
    with pytest.raises(VLALoadError, match=rf"shard '{shards[0]}' holds tensors model\.safetensors\.index\.json "
                                           rf"does not assign to it: \['{moved}'\]"):
        read_checkpoint(tmp_path / "hf", SEED_CLASS)
    save_file({k: v for k, v in state.items() if raw["weight_map"][k] == shards[0]}, str(tmp_path / "hf" / shards[0]))
    with pytest.raises(VLALoadError, match=rf"index\.json assigns \['{moved}'\] to shard '{shards[2]}', which does "
                                           rf"not hold them"):
        read_checkpoint(tmp_path / "hf", SEED_CLASS)


@pytest.mark.parametrize("shard, match", [("../outside.safetensors", "which is not a file name"),
                                          ("elsewhere.safetensors", "which does not exist")])
def test_index_cannot_name_files_outside_the_directory(tmp_path, shard, match):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a.weight": shard}}))
    with pytest.raises(VLALoadError, match=rf"names shard '{shard.replace('.', '[.]')}', {match}"):
        read_checkpoint(tmp_path / "hf")


def test_directory_without_weights(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(VLALoadError, match=r"a directory without model\.safetensors.*holds \['config\.json'\]"):
        read_checkpoint(tmp_path)


# ----------------------------------------------------------------------------- transformers classes

LLAMA = "transformers.LlamaForCausalLM"


def tiny_llama(seed: int = 0):
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16))


@pytest.fixture(scope="module")
def llama_dirs(tmp_path_factory):
    model = tiny_llama()
    single, sharded = tmp_path_factory.mktemp("llama"), tmp_path_factory.mktemp("llama_sharded")
    model.save_pretrained(single)
    model.save_pretrained(sharded, max_shard_size="4KB")
    return model, single, sharded


@needs_hf
@pytest.mark.parametrize("which", ["single", "sharded"])
def test_transformers_class_loads_locally_and_equals_the_saved_weights(llama_dirs, which):
    saved, single, sharded = llama_dirs
    path = single if which == "single" else sharded
    assert (which == "sharded") == (path / "model.safetensors.index.json").is_file()
    model = load_pretrained(str(path), LLAMA, {})
    assert type(model) is LlamaForCausalLM
    assert model.state_dict().keys() == saved.state_dict().keys()
    for k, v in saved.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k


@needs_hf
def test_loading_draws_no_progress_bar_and_leaves_the_users_setting(llama_dirs, capfd):
    from transformers.utils import logging as hf_logging
    _, _, sharded = llama_dirs
    hf_logging.enable_progress_bar()
    load_pretrained(str(sharded), LLAMA, {})
    assert "Loading" not in capfd.readouterr().err            # nothing in each process's log
    assert hf_logging.is_progress_bar_enabled()                 # as the caller had it
    hf_logging.disable_progress_bar()
    load_pretrained(str(sharded), LLAMA, {})
    assert not hf_logging.is_progress_bar_enabled()
    hf_logging.enable_progress_bar()


@needs_hf
def test_transformers_model_config_goes_to_from_pretrained(llama_dirs):
    _, single, _ = llama_dirs
    model = load_pretrained(str(single), LLAMA, {"dtype": "bfloat16"})
    assert next(model.parameters()).dtype == torch.bfloat16
    with pytest.raises(VLALoadError, match=r"'.*' does not match transformers\.LlamaForCausalLM: missing "
                                           r"\['model\.layers\.2\."):
        load_pretrained(str(single), LLAMA, {"num_hidden_layers": 3})


@needs_hf
def test_transformers_path_must_exist_here_and_local_files_only_stays_on(tmp_path, llama_dirs, monkeypatch):
    calls = []
    monkeypatch.setattr(LlamaForCausalLM, "from_pretrained", classmethod(lambda cls, *a, **kw: calls.append(kw)))
    with pytest.raises(VLALoadError, match=r"model_path 'meta-llama/Llama-2-7b': no such file or directory "
                                           r"\(model_class transformers\.LlamaForCausalLM; .*never fetched"):
        load_pretrained("meta-llama/Llama-2-7b", LLAMA, {})
    with pytest.raises(VLALoadError, match=r"model_config\.local_files_only: must stay true for transformers"):
        load_pretrained(str(llama_dirs[1]), LLAMA, {"local_files_only": False})
    with pytest.raises(VLALoadError, match=r"model_path: transformers\.LlamaForCausalLM\.from_pretrained needs"):
        load_pretrained("", LLAMA, {})
    assert calls == []                      # refused before from_pretrained was called
    with pytest.raises(VLALoadError, match="from_pretrained returned NoneType"):
        load_pretrained(str(llama_dirs[1]), LLAMA, {"dtype": "float32"})
    assert calls == [{"dtype": "float32", "local_files_only": True, "output_loading_info": True,
                      "ignore_mismatched_sizes": True}]   # mismatches reported by name, then refused by us


@needs_hf
def test_from_pretrained_failure_names_path_and_class(tmp_path):
    with pytest.raises(VLALoadError, match=rf"model_path '{tmp_path}': transformers\.LlamaForCausalLM\.from_pretrained "
                                           rf"failed: "):
        load_pretrained(str(tmp_path), LLAMA, {})


@needs_hf
def test_a_raw_transformers_model_is_told_which_adapter_to_use(llama_dirs):
    with pytest.raises(VLALoadError, match=r"'transformers\.LlamaForCausalLM': a LlamaForCausalLM needs an adapter .*"
                                           r"'shared\.policies\.action_tokens\.ActionTokenPolicy', keep model_path.*"
                                           r"action_dim, low, high, n_bins, binning"):
        load_vla_model(str(llama_dirs[1]), LLAMA, {})


# ----------------------------------------------------------------------------- LoRA

def peft_counts(peft_model) -> tuple[int, int]:
    trainable, total = peft_model.get_nb_trainable_parameters()
    return trainable, total - trainable


@needs_hf
def test_lora_on_a_transformers_model_trains_only_adapters_and_modules_to_save():
    model = tiny_llama()
    pm = apply_lora(model, LoRAConfig(r=2, alpha=4, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"]))
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n or ".modules_to_save." in n for n in trainable)
    assert any("lm_head.modules_to_save." in n for n in trainable)
    assert sum(".lora_A." in n for n in trainable) == 4            # q and v in each of the 2 layers
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    assert (sum(p.numel() for p in trainable.values()), frozen) == peft_counts(pm)


@needs_hf
def test_lora_on_a_transformers_model_leaves_no_deprecation_warning_from_peft():
    """peft reads transformers' deprecated ``is_gradient_checkpointing``; apply_lora silences exactly
    that warning (it would be in every VLA process's log), and nothing else."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        apply_lora(tiny_llama(), LoRAConfig(r=2, target_modules=["q_proj"]))
        warnings.warn("a later warning still shows", FutureWarning)
    messages = [str(w.message) for w in seen]
    assert not [m for m in messages if "is_gradient_checkpointing" in m], messages
    assert "a later warning still shows" in messages


class LlamaActions(nn.Module):
    """A minimal adapter around a transformers model: next-token logits over 4 action tokens, a value head
    of its own, and ``lora_base`` naming the pretrained part."""
    lora_base = "backbone"

    def __init__(self):
        super().__init__()
        self.backbone = tiny_llama()
        self.value_head = nn.Linear(16, 1)

    def _out(self, obs):
        out = self.backbone(input_ids=obs, output_hidden_states=True)
        return out.logits[:, -1, :4], out.hidden_states[-1][:, -1]

    def action_dist(self, obs):
        return Categorical(logits=self._out(obs)[0])

    def value(self, obs):
        return self.value_head(self._out(obs)[1]).squeeze(-1)


@needs_hf
def test_lora_through_vla_policy_keeps_the_adapters_value_head_trainable():
    lora = LoRAConfig(r=2, target_modules=["q_proj", "v_proj"])
    policy = VLAPolicy(LlamaActions(), VLAConfig(model_class="LlamaActions", lora=lora))
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    assert {"model.value_head.weight", "model.value_head.bias"} <= trainable
    assert all(n.startswith("model.value_head.") or ".lora_" in n for n in trainable)
    head = sum(p.numel() for p in policy.model.value_head.parameters())
    peft_trainable, peft_frozen = peft_counts(policy.peft_model)
    assert sum(p.numel() for p in policy.parameters() if p.requires_grad) == peft_trainable + head
    assert sum(p.numel() for p in policy.parameters() if not p.requires_grad) == peft_frozen
    td = policy(TensorDict({keys.OBS: torch.randint(0, 32, (3, 5))}, [3]))
    logp, entropy, value = policy.evaluate_actions(td)
    torch.testing.assert_close(logp, td[keys.LOG_PROB])
    (-(logp.mean()) + value.pow(2).mean() - entropy.mean()).backward()
    grads = {n for n, p in policy.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert any(".lora_B." in n for n in grads) and "model.value_head.weight" in grads
    assert not any(n for n, p in policy.named_parameters() if not p.requires_grad and p.grad is not None)


@needs_hf
def test_lora_on_a_seed_interface_model(seed_model):
    lora = LoRAConfig(r=2, target_modules=["actor.0", "actor.2"], modules_to_save=["critic"])
    policy = VLAPolicy(seed_model, VLAConfig(model_class=SEED_CLASS, lora=lora))
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n or ".modules_to_save." in n for n in trainable)
    assert (sum(p.numel() for p in policy.parameters() if p.requires_grad),
            sum(p.numel() for p in policy.parameters() if not p.requires_grad)) == peft_counts(policy.peft_model)
    td = policy(TensorDict({keys.OBS: reach_obs()}, [5]))
    torch.testing.assert_close(policy.evaluate_actions(td)[0], td[keys.LOG_PROB])


@needs_hf
@pytest.mark.parametrize("lora, match", [
    (LoRAConfig(target_modules=["qkv"]), r"lora\.target_modules \['qkv'\]: .*not found.*layers of LlamaForCausalLM "
                                         r"that can take adapters: embed_tokens, q_proj, k_proj, v_proj, o_proj"),
    (LoRAConfig(modules_to_save=["score"]), r"lora\.modules_to_save \['score'\]: no module of LlamaForCausalLM "
                                            r"has this name"),
    (LoRAConfig(dropout=1.0), r"lora\.dropout: must be below 1 \(got 1\.0\)"),
])
def test_lora_errors_name_the_setting(lora, match):
    with pytest.raises(VLALoadError, match=match):
        apply_lora(tiny_llama(), lora)


def test_lora_without_peft_says_how_to_install(monkeypatch, seed_model):
    monkeypatch.setitem(sys.modules, "peft", None)          # import peft raises ImportError
    with pytest.raises(VLALoadError, match=r"vla_config\.lora needs peft: pip install -e '\.\[vla\]'"):
        VLAPolicy(seed_model, VLAConfig(model_class=SEED_CLASS, lora=LoRAConfig()))


def test_lora_config_block():
    raw = {"policy": {"name": "vla", "vla_config": {"model_class": SEED_CLASS, "lora": {"r": 4, "alpha": 8,
                                                                                        "target_modules": ["fc"]}}}}
    lora = config_from_dict(raw).policy.vla_config.lora
    assert lora == LoRAConfig(r=4, alpha=8.0, dropout=0.0, target_modules=["fc"], modules_to_save=[])
    assert config_from_dict({"policy": {"name": "vla", "vla_config": {"model_class": SEED_CLASS}}}
                            ).policy.vla_config.lora is None
    raw["policy"]["vla_config"]["lora"] = {"r": 0, "alpha": 0, "dropout": -0.1, "rank": 2}
    with pytest.raises(ConfigError, match=r"4 problems") as err:
        config_from_dict(raw, "l.json")
    for line in ("policy.vla_config.lora.r: must be >= 1, got 0", "policy.vla_config.lora.alpha: must be > 0, got 0.0",
                 "policy.vla_config.lora.dropout: must be in [0, 1], got -0.1",
                 "policy.vla_config.lora.rank: unknown key"):
        assert f"l.json: {line}" in str(err.value)
