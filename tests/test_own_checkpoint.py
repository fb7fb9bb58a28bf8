"""Bring your own VLA checkpoint: a directory written by transformers' save_pretrained, with no Tandem
file, becomes an action-token policy. Loading is strict (every wrong tensor is named with its file),
the value head starts fresh where none is saved, instructions are text tokenized with the
checkpoint's own tokenizer, and both binning conventions round-trip against by-hand implementations."""

from __future__ import annotations

import json
import logging
import re
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from foreign_vla import IMAGE_TOKEN, SPECIAL, VOCAB, WORDS, make_tokenizer, save_foreign_checkpoint
from shared.config import load_config
from shared.envs import env_spec, make_env
from shared.instructions import InstructionError, InstructionTokenizer, instruction_tokenizer
from shared.policies import make_policy, weights_digest
from shared.policies.action_tokens import ActionBins, ActionTokenPolicy
from shared.policies.vla import VLALoadError, load_vla_model

ATP = "shared.policies.action_tokens.ActionTokenPolicy"
ACTION = {"action_dim": 2, "n_bins": 256, "reserve_tail": 64}
OFFSET = VOCAB - 256 - 64                       # the bin block [704, 960), just before <image>
N_IMG, BOS, SEP, PAD = 16, 2, 108, 0


@pytest.fixture(scope="module")
def foreign(tmp_path_factory):
    path = tmp_path_factory.mktemp("foreign") / "paligemma"
    model = save_foreign_checkpoint(path)
    return path, model


def copy_of(foreign, tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(foreign[0], path)
    return path


def edit_shards(path, change):
    """Apply `change(name, tensor) -> {name: tensor}` to every tensor of every shard and rewrite the index."""
    index_file = path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    weight_map = {}
    for shard in sorted(set(index["weight_map"].values())):
        tensors = {}
        for name, t in load_file(str(path / shard)).items():
            for new_name, new_t in change(name, t).items():
                tensors[new_name] = new_t
                weight_map[new_name] = shard
        save_file(tensors, str(path / shard), metadata={"format": "pt"})
    index["weight_map"] = weight_map
    index_file.write_text(json.dumps(index))


# ---------------------------------------------------------------------------- a plain directory loads
def test_a_save_pretrained_directory_is_an_action_token_policy(foreign, caplog):
    path, model = foreign
    assert not any(p.name.startswith("tandem_adapter") for p in path.iterdir())
    assert len(list(path.glob("model-*.safetensors"))) > 1          # sharded, as large checkpoints are
    with caplog.at_level(logging.WARNING, logger="tandem.vla"):
        policy = load_vla_model(str(path), ATP, dict(ACTION))
    assert type(policy) is ActionTokenPolicy and policy.token_offset == OFFSET
    for name, t in model.state_dict().items():                      # every backbone tensor, exactly
        assert torch.equal(policy.model.state_dict()[name], t), name
    assert torch.count_nonzero(policy.value_head.weight) == 0 and torch.count_nonzero(policy.value_head.bias) == 0
    assert "value head" in caplog.text and "starts fresh at zero" in caplog.text
    assert policy.instruction_pad_id == SPECIAL["<pad>"]             # the checkpoint's own padding id


def test_save_pretrained_then_from_pretrained_is_exact(foreign, tmp_path):
    policy = load_vla_model(str(foreign[0]), ATP, {**ACTION, "binning": "openvla", "decoding": "autoregressive"})
    with torch.no_grad():
        policy.value_head.weight.normal_()
    policy.save_pretrained(tmp_path / "again")
    saved = json.loads((tmp_path / "again" / "tandem_adapter.json").read_text())
    assert saved["binning"] == "openvla" and saved["decoding"] == "autoregressive"
    back = load_vla_model(str(tmp_path / "again"), ATP, {})          # settings from tandem_adapter.json
    assert weights_digest(back) == weights_digest(policy)
    assert back.bins.binning == "openvla" and back.decoding == "autoregressive"
    assert load_vla_model(str(tmp_path / "again"), ATP, {"decoding": "parallel"}).decoding == "parallel"


def test_action_settings_are_required_and_checked(foreign):
    with pytest.raises(VLALoadError, match=r"model_config\.action_dim: required .* no tandem_adapter\.json"):
        load_vla_model(str(foreign[0]), ATP, {})
    with pytest.raises(VLALoadError, match=r"unknown key\(s\) \['n_bin'\].*allowed"):
        load_vla_model(str(foreign[0]), ATP, {"action_dim": 2, "n_bin": 256})
    with pytest.raises(VLALoadError, match=r"image_token_id=960 lies in the bin-token block.*reserve_tail"):
        load_vla_model(str(foreign[0]), ATP, {"action_dim": 2})      # reserve_tail 0 puts <image> in the block
    with pytest.raises(VLALoadError, match=r"vla_config\.model_path: .*ActionTokenPolicy is built from a checkpoint"):
        load_vla_model("", ATP, dict(ACTION))


def test_a_transformers_class_as_model_class_names_the_adapter(foreign):
    with pytest.raises(VLALoadError, match=r"needs an adapter.*shared\.policies\.action_tokens\.ActionTokenPolicy"):
        load_vla_model(str(foreign[0]), "transformers.PaliGemmaForConditionalGeneration", {})


# ---------------------------------------------------------------------------- strict loading
def _rename(target):
    return lambda n, t: {n.replace("layers.1.", "paligemma_with_expert.layers.1.") if n == target else n: t}


def _drop(target):
    return lambda n, t: {} if n == target else {n: t}


def _extra(target):
    return lambda n, t: {n: t, **({"model.action_expert.proj.weight": torch.zeros(4, 4)} if n == target else {})}


def _reshape(target):
    return lambda n, t: {n: torch.zeros(t.shape[0] + 1, *t.shape[1:]) if n == target else t}


@pytest.mark.parametrize("case, change, match", [
    ("renamed", _rename, r"missing \[.*layers\.1\.mlp\.down_proj\.weight.*\] \(in no weights file\), unexpected "
                         r"\[.*paligemma_with_expert\.layers\.1\.mlp\.down_proj\.weight.* in model-0000\d-of-"),
    ("missing", _drop, r"missing \[.*layers\.1\.mlp\.down_proj\.weight'\] \(in no weights file\)"),
    ("extra", _extra, r"unexpected \[.*action_expert\.proj\.weight.* in model-0000\d-of-0000\d\.safetensors\]"),
    ("wrong shape", _reshape, r"shape mismatch \['model\.language_model\.layers\.1\.mlp\.down_proj\.weight': file \(33, 64\), "
                             r"model \(32, 64\) \(saved as .*\) in model-0000\d-of-0000\d\.safetensors\]"),
])
def test_a_checkpoint_that_does_not_match_fails_naming_the_tensor(foreign, tmp_path, case, change, match):
    path = copy_of(foreign, tmp_path)
    target = next(n for n in json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
                  if n.endswith("layers.1.mlp.down_proj.weight"))
    edit_shards(path, change(target))
    with pytest.raises(VLALoadError, match=r"vla_config\.model_path .*does not match transformers\."
                                           r"PaliGemmaForConditionalGeneration: ") as e:
        load_vla_model(str(path), ATP, dict(ACTION))
    assert re.search(match, str(e.value)), str(e.value)
    assert "model.safetensors.index.json (3 shards" in str(e.value)


@pytest.mark.parametrize("tensors, match", [
    ({"value_head.weight": torch.zeros(1, 32), "value_head.bias": torch.zeros(1), "head.extra": torch.zeros(2)},
     r"tandem_adapter\.safetensors does not match ActionTokenPolicy's own tensors: unexpected \['head\.extra'\]"),
    ({"value_head.weight": torch.zeros(1, 31), "value_head.bias": torch.zeros(1)},
     r"shape mismatch: value_head\.weight: file \(1, 31\), model \(1, 32\)"),
])
def test_adapter_tensors_are_loaded_strictly(foreign, tmp_path, tensors, match):
    path = copy_of(foreign, tmp_path)
    save_file(tensors, str(path / "tandem_adapter.safetensors"))
    with pytest.raises(VLALoadError, match=match):
        load_vla_model(str(path), ATP, dict(ACTION))


def test_an_adapter_config_with_unknown_keys_names_the_file(foreign, tmp_path):
    path = copy_of(foreign, tmp_path)
    (path / "tandem_adapter.json").write_text(json.dumps({"action_dim": 2, "bins": 256}))
    with pytest.raises(VLALoadError, match=r"tandem_adapter\.json: unknown adapter keyword\(s\) \['bins'\]"):
        load_vla_model(str(path), ATP, dict(ACTION))


def test_the_preset_adapter_loads_strictly_too(foreign, tmp_path):
    """PaliGemmaActionTokenPolicy (the Reach configs' class) goes through the same strict loader."""
    path = copy_of(foreign, tmp_path)
    edit_shards(path, _drop(next(n for n in json.loads((path / "model.safetensors.index.json").read_text())
                                 ["weight_map"] if n.endswith("layers.1.mlp.down_proj.weight"))))
    with pytest.raises(VLALoadError, match=r"missing \[.*down_proj"):
        load_vla_model(str(path), "shared.policies.action_tokens.PaliGemmaActionTokenPolicy",
                       {"size": "tiny", **ACTION})


# ---------------------------------------------------------------------------- log-probs against raw logits
def openvla_bins_by_hand(a: np.ndarray, n: int = 256) -> np.ndarray:
    """OpenVLA's ActionTokenizer on [-1, 1], written from its description: token = V - digitize."""
    edges = np.linspace(-1.0, 1.0, n)
    return VOCAB - 64 - np.digitize(np.clip(a, -1.0, 1.0), edges)          # V = the tokenizer's end


def reference(model, obs, bins, mode, binning):
    """(log_prob [N], entropy [N]) of the block indices `bins` [N, 2], from the model's raw logits."""
    n = obs.batch_size[0]
    instr = obs["instruction"]
    p_np = obs["proprio"].double().numpy()
    proprio = torch.from_numpy(openvla_bins_by_hand(p_np) if binning == "openvla" else
                               np.round((np.clip(p_np, -1, 1) + 1) / 2 * 255).astype(np.int64) + OFFSET)
    suffix = torch.full_like(bins, PAD) if mode == "parallel" else bins[:, :-1] + OFFSET
    prefix = [torch.full((n, N_IMG), IMAGE_TOKEN), torch.full((n, 1), BOS), instr, proprio, torch.full((n, 1), SEP)]
    ids = torch.cat(prefix + [suffix], 1)
    p = ids.shape[1] - suffix.shape[1]
    # padding inside the instruction is masked; the prefix attends both ways (type 0), the suffix causally (1)
    mask = torch.cat([torch.ones(n, N_IMG + 1, dtype=torch.long), (instr != PAD).long(),
                      torch.ones(n, ids.shape[1] - N_IMG - 1 - instr.shape[1], dtype=torch.long)], 1)
    types = (torch.arange(ids.shape[1]) >= p).long().expand(n, -1)
    pixels = obs["rgb"].permute(0, 3, 1, 2).float().div(127.5).sub(1.0)              # (x / 255 - 0.5) / 0.5
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, pixel_values=pixels, token_type_ids=types).logits
    first = p if mode == "parallel" else p - 1
    rows = logits[:, first:first + 2, OFFSET:OFFSET + 256].float().log_softmax(-1)        # [N, 2, 256]
    if binning == "openvla":   # tokens 704 and 705 both decode to the top centre: one action, one probability
        rows = rows.clone()
        rows[..., 1] = torch.logaddexp(rows[..., 0], rows[..., 1])
        rows[..., 0] = float("-inf")
    logp = rows.gather(-1, bins.unsqueeze(-1)).squeeze(-1).sum(-1)
    probs = rows.exp()
    ent = -(probs * rows.nan_to_num(neginf=0.0)).sum(-1).sum(-1)
    return logp, ent


@pytest.mark.parametrize("binning", ["centres", "openvla"])
@pytest.mark.parametrize("mode", ["parallel", "autoregressive"])
def test_log_probs_of_a_foreign_checkpoint_equal_the_raw_logits(foreign, mode, binning):
    path, model = foreign
    policy = load_vla_model(str(path), ATP, {**ACTION, "decoding": mode, "binning": binning}).eval()
    env = make_env("tandem/Reach-v0", 4, {"instructions": "text", "instruction_length": 8}, "cpu",
                   tokenizer=InstructionTokenizer(path))
    obs = env.reset(seed=3)
    g = torch.Generator().manual_seed(1)
    bins = torch.randint(1, 256, (4, 2), generator=g)
    bins[0] = torch.tensor([1, 255])                        # both ends of the block
    actions = policy.bins.to_actions(bins)
    with torch.no_grad():
        dist = policy.action_dist(obs)
        logp, ent = dist.log_prob(actions), dist.entropy()
    ref_logp, ref_ent = reference(model, obs, bins, mode, binning)
    torch.testing.assert_close(logp, ref_logp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=0)
    if binning == "openvla":                                # OpenVLA's decode of these tokens
        edges = np.linspace(-1, 1, 256)
        centres = (edges[:-1] + edges[1:]) / 2
        tokens = (bins + OFFSET).numpy()
        by_hand = centres[np.clip(VOCAB - 64 - tokens - 1, 0, 254)]
        np.testing.assert_allclose(actions.numpy(), by_hand, atol=1e-6)


# ---------------------------------------------------------------------------- binning conventions
@pytest.mark.parametrize("n_bins", [256, 7])
def test_centres_binning_round_trips_as_written_by_hand(n_bins):
    low, high = np.array([-1.0, -2.0]), np.array([1.0, 3.0])
    a = np.concatenate([np.random.default_rng(0).uniform(low - 0.2, high + 0.2, (5000, 2)), [low, high]])
    k = np.clip(np.round((np.clip(a, low, high) - low) / (high - low) * (n_bins - 1)), 0, n_bins - 1).astype(int)
    centre = low + k * (high - low) / (n_bins - 1)
    bins = ActionBins(torch.tensor(low), torch.tensor(high), n_bins, "centres")
    got = bins.to_bins(torch.tensor(a, dtype=torch.float32))
    # float32 against float64 may round a value sitting on a half-bin boundary the other way
    assert (got.numpy() != k).mean() < 1e-3
    np.testing.assert_allclose(bins.to_actions(torch.tensor(k)).numpy(), centre, atol=1e-6)
    assert torch.equal(bins.to_bins(bins.to_actions(torch.tensor(k))), torch.tensor(k))   # exact round trip


@pytest.mark.parametrize("n_bins", [256, 11])
def test_openvla_binning_round_trips_as_written_by_hand(n_bins):
    """OpenVLA: edges linspace(low, high, n), token = V - digitize(clip(a)), decode centres[clip(V - token - 1)]."""
    v = 32_000                                                   # Llama's tokenizer end; the block is [V - n, V)
    low, high = np.array([-1.0, -0.5, 0.0]), np.array([1.0, 0.5, 2.0])
    rng = np.random.default_rng(0)
    a = np.concatenate([rng.uniform(low - 0.3, high + 0.3, (5000, 3)).astype(np.float32), [low, high]]).astype(np.float32)
    edges = np.stack([np.linspace(lo, hi, n_bins) for lo, hi in zip(low, high)], -1)         # [n, D]
    centres = (edges[:-1] + edges[1:]) / 2
    digit = np.stack([np.digitize(np.clip(a[:, d].astype(np.float64), low[d], high[d]), edges[:, d])
                      for d in range(3)], -1)
    tokens = v - digit
    decoded = np.take_along_axis(centres, np.clip(v - tokens - 1, 0, n_bins - 2), 0)
    bins = ActionBins(torch.tensor(low), torch.tensor(high), n_bins, "openvla")
    k = bins.to_bins(torch.from_numpy(a))
    np.testing.assert_array_equal(k.numpy() + (v - n_bins), tokens)           # the same token ids
    np.testing.assert_allclose(bins.to_actions(k).numpy(), decoded, atol=1e-6)  # the same actions
    # decode then encode lands on the bin that carries the action's probability: the top centre's is bin 1
    all_bins = torch.arange(n_bins)[:, None].expand(n_bins, 3)
    assert torch.equal(bins.to_action_bins(bins.to_actions(all_bins))[1:], all_bins[1:])
    assert torch.equal(bins.to_action_bins(bins.to_actions(all_bins))[0], torch.ones(3, dtype=torch.long))


def test_openvla_binning_never_samples_the_folded_token_and_learns_through_it():
    bins = ActionBins(-1.0, 1.0, 8, "openvla")
    logits = torch.zeros(1, 8, requires_grad=True)
    logp = bins.merge(logits.log_softmax(-1))
    assert logp[0, 0] == float("-inf") and torch.isclose(logp[0, 1].exp(), torch.tensor(2 / 8))
    from shared.policies.action_tokens import ActionTokenDistribution
    dist = ActionTokenDistribution(logp.unsqueeze(0).expand(500, 1, 8), bins)
    sampled = bins.to_bins(dist.sample())
    assert int(sampled.min()) >= 1
    (dist.log_prob(dist.sample()).sum() + dist.entropy().sum()).backward()
    assert torch.isfinite(logits.grad).all() and logits.grad[0, 0] != 0   # the folded token's logit still trains


def test_bad_binning_is_refused():
    with pytest.raises(ValueError, match=r"binning='floor' is not one of \('centres', 'openvla'\)"):
        ActionBins(-1.0, 1.0, 8, "floor")


# ---------------------------------------------------------------------------- text instructions
def test_text_instructions_are_the_checkpoint_tokenizers_ids(foreign):
    from transformers import AutoTokenizer
    path = foreign[0]
    hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    env = make_env("tandem/Reach-v0", 6, {"instructions": "text", "instruction_length": 5}, "cpu",
                   tokenizer=InstructionTokenizer(path))
    obs = env.reset(seed=0)
    colours = ("red", "green", "blue")
    for row, goal in zip(obs["instruction"].tolist(), env.goal.tolist()):
        ids = hf(f"reach {colours[goal]}", add_special_tokens=False).input_ids
        assert row == ids + [hf.pad_token_id] * (5 - len(ids)) and min(ids) >= 20
    spec = env_spec("tandem/Reach-v0", {"instructions": "text", "instruction_length": 5})
    assert spec.obs_keys["instruction"] == ((5,), torch.int64) and spec.extra["instructions"] == "text"


def test_a_tokenizer_encodes_each_text_once():
    tok = InstructionTokenizer.__new__(InstructionTokenizer)
    calls = []

    class Counting:
        def encode(self, text, add_special_tokens):
            calls.append(text)
            return type("E", (), {"ids": [20 + len(text)]})()
    tok._tok, tok._cache, tok.pad_id, tok.source = Counting(), {}, 0, "counting"
    for _ in range(3):
        tok.table(["reach red", "reach blue", "reach red"], 2, "here")
    assert calls == ["reach red", "reach blue"]


def test_an_instruction_longer_than_the_env_allows_is_refused(foreign):
    with pytest.raises(ValueError, match=r"env\.cfg\.instruction_length: 'reach red' is 2 tokens .* more than the "
                                         r"instruction length 1"):
        make_env("tandem/Reach-v0", 2, {"instructions": "text", "instruction_length": 1}, "cpu",
                 tokenizer=InstructionTokenizer(foreign[0]))


def own_config(path, *extra, name="vla_own_reach_ppo"):
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    return load_config(root / "configs" / f"{name}.json", [f"policy.vla_config.model_path={path}", *extra])


def test_the_actor_finds_the_tokenizer_in_the_checkpoint_and_says_when_there_is_none(foreign, tmp_path):
    cfg = own_config(foreign[0])
    assert instruction_tokenizer(cfg).source == str(foreign[0] / "tokenizer.json")
    bare = tmp_path / "bare"
    save_foreign_checkpoint(bare, tokenizer=False)
    with pytest.raises(InstructionError, match=r"text instructions.*no tokenizer\.json in vla_config\.model_path "
                                               r".*bare.*vla_config\.tokenizer is not set"):
        instruction_tokenizer(own_config(bare))
    with pytest.raises(InstructionError, match=r"no tokenizer\.json"):     # the learner refuses it at start-up too
        make_policy(own_config(bare), env_spec("tandem/Reach-v0", {"instructions": "text", "instruction_length": 8}))
    cfg = own_config(bare, f"policy.vla_config.tokenizer={foreign[0]}")
    assert instruction_tokenizer(cfg).vocab_size == len(SPECIAL) + len(WORDS)


def test_reach_ids_with_a_model_that_has_a_tokenizer_are_refused(foreign):
    cfg = own_config(foreign[0], 'env.cfg={}')                     # Reach's own ids, not text
    with pytest.raises(InstructionError, match=r"env tandem/Reach-v0 gives instruction ids of its own vocabulary "
                                               r"\(tandem/Reach-v0's own 8 ids: .*reach, red.*\), but the model reads "
                                               r"ids of its tokenizer \(.*paligemma\).*env\.cfg\.instructions"):
        make_policy(cfg, env_spec(cfg.env.id, cfg.env.cfg))


def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused(foreign, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    big = {**SPECIAL, **{f"w{i}": 4 + i for i in range(2000)}, "reach": 2004, "red": 2005, "green": 2006, "blue": 2007}
    tok = Tokenizer(models.WordLevel(big, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>").save_pretrained(str(tmp_path / "tok"))
    cfg = own_config(foreign[0], f"policy.vla_config.tokenizer={tmp_path / 'tok'}")
    with pytest.raises(InstructionError, match=r"the tokenizer .*tok/tokenizer\.json has 2008 ids, the model "
                                               r"\(.*ActionTokenPolicy at .*paligemma'\) embeds 1024"):
        make_policy(cfg, env_spec(cfg.env.id, cfg.env.cfg))


def test_a_wrong_action_size_is_refused(foreign):
    cfg = own_config(foreign[0], "policy.vla_config.model_config.action_dim=3")
    with pytest.raises(VLALoadError, match=r"action_dim is 3 .*takes 2-dimensional actions"):
        make_policy(cfg, env_spec(cfg.env.id, cfg.env.cfg))


def test_make_policy_logs_what_it_adapts(foreign, caplog):
    cfg = own_config(foreign[0], "env.cfg.image_size=8")
    with caplog.at_level(logging.INFO, logger="tandem.vla"):
        make_policy(cfg, env_spec(cfg.env.id, cfg.env.cfg), describe=True)
    text = caplog.text
    assert "PaliGemmaForConditionalGeneration from" in text and "Tandem adapter files: none" in text
    assert "token ids [704, 960) of a vocabulary of 1024" in text and "centres binning" in text
    assert "rgb 8x8 uint8 -> resized to 16x16 (bilinear, antialiased)" in text
    assert "instruction ids [8] are model token ids; id 0 is padding" in text


def test_a_bfloat16_checkpoint_is_cast_to_the_configured_dtype_and_says_so(foreign, tmp_path, caplog):
    model = save_foreign_checkpoint(tmp_path / "bf16")
    model.to(torch.bfloat16).save_pretrained(str(tmp_path / "bf16"))
    cfg = own_config(tmp_path / "bf16")
    with caplog.at_level(logging.INFO, logger="tandem.vla"):
        policy = make_policy(cfg, env_spec(cfg.env.id, cfg.env.cfg))
    assert {p.dtype for p in policy.parameters()} == {torch.float32}
    assert re.search(r"vla_config\.dtype float32: the weights of .*ActionTokenPolicy \(bfloat16, float32\) are cast "
                     r"to float32", caplog.text)
