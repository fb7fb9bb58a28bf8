"""Action-token adapter: bins, and log-probs/entropy against an independent computation from the raw
logits of the Hugging Face model, in every decoding mode, on a tiny random PaliGemma."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tensordict import TensorDict
from transformers import GemmaConfig, GemmaForCausalLM, PaliGemmaForConditionalGeneration   # ~2 s, once

from shared import keys
from shared.config import VLAConfig
from shared.envs import make_env
from shared.policies.action_tokens import (
    ActionBins, ActionTokenPolicy, AutoregressiveActionTokenDistribution, make_tiny_paligemma, paligemma_config)
from shared.policies.vla import VLAPolicy, load_vla_model

MODES = ("parallel", "autoregressive")
N_IMG, BOS, SEP, PAD = 16, 2, 108, 0      # the tiny PaliGemma's image tokens, Gemma's bos, "\n", pad


@pytest.fixture
def model():
    torch.manual_seed(0)
    return make_tiny_paligemma()


def reach_obs(n=3, seed=0):
    env = make_env("tandem/Reach-v0", n, {}, "cpu")
    return env.reset(seed=seed)           # instructions "reach <colour> <pad> <pad>": padding is masked


def actions_from_bins(bins, low=-1.0, high=1.0, n_bins=256):
    return low + (high - low) * bins.float() / (n_bins - 1)


# ---------------------------------------------------------------------------- reference
def reference_rows(model, obs, suffix, offset, n_bins, read_from, temperature=1.0):
    """The prompt built by hand, the full HF model's logits, sliced to the bin block, divided by the
    temperature and log-softmaxed.

    Returns ``[N, len(suffix)..., n_bins]`` rows starting at position ``P + read_from``."""
    n = obs.batch_size[0]
    instr = obs["instruction"]
    proprio = ((obs["proprio"].clamp(-1, 1) + 1) / 2 * (n_bins - 1)).round().long() + offset
    ids = torch.cat([torch.full((n, N_IMG), model.config.image_token_index), torch.full((n, 1), BOS), instr,
                     proprio, torch.full((n, 1), SEP), suffix], 1)
    p = ids.shape[1] - suffix.shape[1]
    mask = torch.ones_like(ids)
    mask[:, N_IMG + 1:N_IMG + 1 + instr.shape[1]] = (instr != PAD).long()
    types = torch.zeros_like(ids)
    types[:, p:] = 1
    pixels = (obs["rgb"].permute(0, 3, 1, 2).float() / 255 - 0.5) / 0.5
    logits = model(input_ids=ids, attention_mask=mask, pixel_values=pixels, token_type_ids=types).logits
    block = (logits[..., offset:offset + n_bins].float() / temperature).log_softmax(-1)
    return block[:, p + read_from:p + read_from + 2]


def reference(model, obs, bins, mode, offset=256, n_bins=256, temperature=1.0):
    """(log_prob [N], entropy [N]) of ``bins`` [N, 2] computed from raw logits."""
    if mode == "parallel":     # placeholders after [sep]; the logits at the placeholders
        rows = reference_rows(model, obs, torch.full_like(bins, PAD), offset, n_bins, 0, temperature)
    else:                      # the chosen bins teacher-forced; position t predicts bin t + 1
        rows = reference_rows(model, obs, bins[:, :-1] + offset, offset, n_bins, -1, temperature)
    logp = rows.gather(-1, bins.unsqueeze(-1)).squeeze(-1).sum(-1)
    ent = -(rows.exp() * rows).sum(-1).sum(-1)
    return logp, ent, rows


# ---------------------------------------------------------------------------- bins
@pytest.mark.parametrize("n_bins", [256, 7, 2])
def test_bins_round_trip_within_half_a_bin(n_bins):
    low, high = torch.tensor([-1.0, -2.0, 0.0]), torch.tensor([1.0, 3.0, 0.5])
    bins = ActionBins(low, high, n_bins)
    a = low + (high - low) * torch.rand(10_000, 3, generator=torch.Generator().manual_seed(0))
    b = bins.to_bins(a)
    assert b.dtype == torch.int64 and int(b.min()) >= 0 and int(b.max()) <= n_bins - 1
    err = (bins.to_actions(b) - a).abs()
    assert (err <= bins.width / 2 + 1e-6).all()
    for bound in (low, high):          # the bounds are bin centres: exact
        assert torch.equal(bins.to_actions(bins.to_bins(bound[None])), bound[None])
    assert torch.equal(bins.to_bins(low[None]), torch.zeros(1, 3, dtype=torch.int64))
    assert torch.equal(bins.to_bins(high[None]), torch.full((1, 3), n_bins - 1))


def test_bins_clamp_out_of_bounds():
    bins = ActionBins(-1.0, 1.0, 256)
    a = torch.tensor([[-5.0, 5.0], [float("-inf"), float("inf")], [-1.0001, 1.0001]])
    assert torch.equal(bins.to_bins(a), torch.tensor([[0, 255]] * 3))
    assert torch.equal(bins.to_actions(bins.to_bins(a)), torch.tensor([[-1.0, 1.0]] * 3))


@pytest.mark.parametrize("args, match", [((-1.0, 1.0, 1), "n_bins=1"), ((1.0, 1.0, 8), "high > low"),
                                         ((0.0, float("nan"), 8), "finite")])
def test_bins_reject_bad_settings(args, match):
    with pytest.raises(ValueError, match=match):
        ActionBins(*args)


# ---------------------------------------------------------------------------- against raw logits
@pytest.mark.parametrize("mode", MODES)
def test_log_prob_and_entropy_match_raw_logits(model, mode):
    policy = ActionTokenPolicy(model, 2, decoding=mode)
    obs = reach_obs()
    bins = torch.randint(0, 256, (3, 2), generator=torch.Generator().manual_seed(1))
    jitter = (torch.rand(3, 2) - 0.5) * 0.9 * (2 / 255)          # inside the bin: same bin
    dist = policy.action_dist(obs)
    logp, ent = dist.log_prob(actions_from_bins(bins) + jitter), dist.entropy()
    ref_logp, ref_ent, _ = reference(model, obs, bins, mode)
    assert logp.shape == ent.shape == (3,) and logp.dtype == ent.dtype == torch.float32
    torch.testing.assert_close(logp, ref_logp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=0)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_tempers_log_prob_entropy_and_samples_but_not_the_argmax(model, mode, temperature):
    cold, plain = ActionTokenPolicy(model, 2, decoding=mode, temperature=temperature), ActionTokenPolicy(model, 2,
                                                                                                      decoding=mode)
    obs = reach_obs()
    bins = torch.randint(0, 256, (3, 2), generator=torch.Generator().manual_seed(1))
    dist = cold.action_dist(obs)
    logp, ent = dist.log_prob(actions_from_bins(bins)), dist.entropy()
    ref_logp, ref_ent, _ = reference(model, obs, bins, mode, temperature=temperature)
    torch.testing.assert_close(logp, ref_logp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=0)
    assert not torch.allclose(logp, plain.action_dist(obs).log_prob(actions_from_bins(bins)), atol=1e-3)
    assert torch.equal(cold.deterministic_action(cold.action_dist(obs)),
                       plain.deterministic_action(plain.action_dist(obs)))
    # a sampled action's log-prob, from the decoding pass itself, is the tempered one
    dist = cold.action_dist(obs)
    action = dist.sample()
    torch.testing.assert_close(dist.log_prob(action), reference(model, obs, cold.bins.to_bins(action), mode,
                                                                temperature=temperature)[0], atol=1e-5, rtol=0)


def test_autoregressive_kv_cache_sampling_matches_teacher_forcing(model):
    """Sampling decodes with the KV cache; its log-prob and entropy must equal a full pass over the sampled bins."""
    policy = ActionTokenPolicy(model, 2, decoding="autoregressive")
    obs = reach_obs()
    dist = policy.action_dist(obs)
    action = dist.sample()
    logp, ent = dist.log_prob(action), dist.entropy()           # reuse the decoded step logits
    ref_logp, ref_ent, _ = reference(model, obs, policy.bins.to_bins(action), "autoregressive")
    torch.testing.assert_close(logp, ref_logp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=0)
    # the cache was rewound: a second evaluation of other bins still matches
    other = actions_from_bins(torch.tensor([[0, 255], [255, 0], [128, 3]]))
    torch.testing.assert_close(dist.log_prob(other), reference(model, obs, policy.bins.to_bins(other),
                                                               "autoregressive")[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("mode", MODES)
def test_other_block_placement(model, mode):
    """n_bins=64, reserve_tail=16: bins are tokens [432, 496), proprio tokenised with the same 64 bins."""
    policy = ActionTokenPolicy(model, 2, n_bins=64, reserve_tail=16, decoding=mode)
    assert policy.token_offset == 512 - 64 - 16
    obs = reach_obs()
    bins = torch.randint(0, 64, (3, 2), generator=torch.Generator().manual_seed(2))
    dist = policy.action_dist(obs)
    logp = dist.log_prob(actions_from_bins(bins, n_bins=64))
    ref_logp, ref_ent, _ = reference(model, obs, bins, mode, offset=432, n_bins=64)
    torch.testing.assert_close(logp, ref_logp, atol=1e-5, rtol=0)
    torch.testing.assert_close(dist.entropy(), ref_ent, atol=1e-5, rtol=0)


def test_text_only_lm_matches_raw_logits():
    """Any LM with an LM head: a tiny Gemma without vision; rgb is ignored, the prefix is causal."""
    torch.manual_seed(0)
    lm = GemmaForCausalLM(GemmaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=16))
    policy = ActionTokenPolicy(lm, 2, n_bins=32, proprio_bounds=None)
    obs = reach_obs()
    bins = torch.randint(0, 32, (3, 2), generator=torch.Generator().manual_seed(3))
    dist = policy.action_dist(obs)
    ids = torch.cat([torch.full((3, 1), BOS), obs["instruction"], torch.full((3, 1), SEP), torch.zeros(3, 2).long()], 1)
    mask = torch.ones_like(ids)
    mask[:, 1:5] = (obs["instruction"] != PAD).long()
    rows = lm(input_ids=ids, attention_mask=mask).logits[:, -2:, 268:300].log_softmax(-1)
    torch.testing.assert_close(dist.log_prob(actions_from_bins(bins, n_bins=32)),
                               rows.gather(-1, bins[..., None]).squeeze(-1).sum(-1), atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------- sampling
@pytest.mark.parametrize("mode", MODES)
def test_samples_and_deterministic_action(model, mode):
    policy = ActionTokenPolicy(model, 2, decoding=mode)
    obs = reach_obs(4)
    dist = policy.action_dist(obs)
    a = dist.sample()
    assert a.shape == (4, 2) and a.dtype == torch.float32
    assert torch.equal(policy.bins.to_actions(policy.bins.to_bins(a)), a)     # on the bin grid, in bounds
    lp = dist.log_prob(a)
    assert torch.isfinite(lp).all() and (lp <= 0).all()
    det = policy.deterministic_action(dist)
    _, _, rows = reference(model, obs, policy.bins.to_bins(det), mode)
    # parallel: each dim's argmax; autoregressive: each step's argmax given the greedy bins before it
    assert torch.equal(policy.bins.to_bins(det), rows.argmax(-1))


@pytest.mark.parametrize("mode", MODES)
def test_sample_frequencies_follow_the_bin_probabilities(model, mode):
    """8 bins, 3000 draws for one observation: the first dim's histogram matches its probabilities."""
    torch.manual_seed(0)
    model.lm_head.weight.data[504:] *= 20      # spread the bin probabilities away from uniform
    policy = ActionTokenPolicy(model, 2, n_bins=8, decoding=mode)
    obs = reach_obs(1).expand(3000).clone()
    with torch.no_grad():
        dist = policy.action_dist(obs)
        first = policy.bins.to_bins(dist.sample())[:, 0]
        probs = reference(model, obs[:1], torch.zeros(1, 2, dtype=torch.int64), mode, 504, 8)[2][0, 0].exp()
    assert probs.max() > 0.3
    freq = torch.bincount(first, minlength=8).float() / first.numel()
    assert (freq - probs).abs().max() < 0.04, (freq, probs)


# ---------------------------------------------------------------------------- training
@pytest.mark.parametrize("mode", MODES)
def test_ppo_loss_reaches_lm_vision_and_value_head(model, mode):
    policy = ActionTokenPolicy(model, 2, decoding=mode)
    obs = reach_obs(4)
    with torch.no_grad():
        action = policy.action_dist(obs).sample()
    dist = policy.action_dist(obs)
    logp, value = dist.log_prob(action), policy.value(obs)
    ratio = (logp - logp.detach()).exp()
    adv, ret = torch.randn(4), torch.randn(4)
    loss = -(ratio * adv).mean() + 0.5 * ((value - ret) ** 2).mean() - 0.01 * dist.entropy().mean()
    loss.backward()
    grads = {n: p.grad for n, p in policy.named_parameters()}
    for name in ("value_head.weight", "model.model.language_model.embed_tokens.weight",   # = lm_head (tied)
                 "model.model.multi_modal_projector.linear.weight",
                 "model.model.language_model.layers.0.self_attn.q_proj.weight",
                 "model.model.vision_tower.encoder.layers.0.mlp.fc1.weight"):
        assert grads[name] is not None and grads[name].abs().sum() > 0, name
    assert all(p.requires_grad for p in policy.parameters())


@pytest.mark.parametrize("mode", MODES)
def test_value_reuses_the_action_pass(model, mode):
    """action_dist(obs) then value(obs) is one forward pass, and equals a value from a prefix-only pass."""
    policy = ActionTokenPolicy(model, 2, decoding=mode)
    obs = reach_obs()
    calls = []
    hook = model.model.register_forward_hook(lambda *a: calls.append(1))
    dist = policy.action_dist(obs)
    v = policy.value(obs)
    assert len(calls) == 1
    v_alone = policy.value(obs.clone())      # another object: a fresh prefix-only pass
    assert len(calls) == 2
    hook.remove()
    torch.testing.assert_close(v, v_alone, atol=1e-5, rtol=0)
    assert v.shape == (3,) and torch.isfinite(dist.log_prob(dist.sample())).all()


def test_no_value_head_means_no_critic(model):
    policy = ActionTokenPolicy(model, 2, value_head=False)
    assert policy.value is None and VLAPolicy(policy, VLAConfig()).critic is None


# ---------------------------------------------------------------------------- shapes, dtypes, wiring
@pytest.mark.parametrize("mode", MODES)
def test_batch_shapes_and_vla_policy(model, mode):
    policy = VLAPolicy(ActionTokenPolicy(model, 2, decoding=mode), VLAConfig())
    obs = reach_obs(6).reshape(2, 3)                                    # [*B] = [2, 3]
    td = policy(TensorDict({keys.OBS: obs}, batch_size=[2, 3]))
    assert td[keys.ACTION].shape == (2, 3, 2) and td[keys.LOG_PROB].shape == td[keys.VALUE].shape == (2, 3)
    logp, ent, value = policy.evaluate_actions(td)
    assert logp.shape == ent.shape == value.shape == (2, 3)
    torch.testing.assert_close(logp, td[keys.LOG_PROB], atol=1e-5, rtol=0)
    torch.testing.assert_close(value, td[keys.VALUE], atol=1e-5, rtol=0)
    det = policy(TensorDict({keys.OBS: obs[:1, :1]}, batch_size=[1, 1]), deterministic=True)[keys.ACTION]
    assert det.shape == (1, 1, 2)


@pytest.mark.parametrize("mode", MODES)
def test_bfloat16_model_float32_log_softmax(model, mode):
    policy = ActionTokenPolicy(model.to(torch.bfloat16), 2, decoding=mode).to(torch.bfloat16)
    obs = reach_obs()
    dist = policy.action_dist(obs)
    a = dist.sample()
    lp, ent, v = dist.log_prob(a), dist.entropy(), policy.value(obs)
    assert lp.dtype == ent.dtype == v.dtype == torch.float32
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all() and torch.isfinite(v).all()
    if mode == "parallel":
        assert dist.bin_logp.dtype == torch.float32


def test_images_are_resized_to_the_vision_tower(model):
    torch.manual_seed(0)
    big = make_tiny_paligemma(image_size=32)                    # 64 image tokens; Reach renders 16x16
    policy = ActionTokenPolicy(big, 2)
    obs = reach_obs()
    dist = policy.action_dist(obs)
    assert dist.log_prob(dist.sample()).shape == (3,)
    x = obs["rgb"].permute(0, 3, 1, 2).float() / 255
    want = (F.interpolate(x, size=(32, 32), mode="bilinear", align_corners=False, antialias=True) - 0.5) / 0.5
    torch.testing.assert_close(policy._pixels(obs["rgb"]), want)


@pytest.mark.parametrize("kwargs, match", [
    (dict(decoding="beam"), r"decoding='beam'"),
    (dict(reserve_tail=257), r"bin tokens \[-1, 255\) do not fit"),
    (dict(sep_token_id=300), r"sep_token_id=300 lies in the bin-token block \[256, 512\).*reserve_tail"),
    (dict(reserve_tail=1), r"image_token_id=255 lies in the bin-token block \[255, 511\)"),
    (dict(n_bins=8, placeholder_token_id=600), r"placeholder_token_id=600 is outside the vocabulary of 512"),
    (dict(temperature=0.0), r"temperature=0.0 must be a finite number > 0"),
    (dict(temperature=float("inf")), r"temperature=inf must be a finite number > 0"),
])
def test_bad_settings_name_the_fix(model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        ActionTokenPolicy(model, 2, **kwargs)


@pytest.mark.parametrize("bad", [-1, 512, 10**9])      # the tiny model's vocabulary is 512
def test_instruction_ids_outside_the_vocabulary_are_refused_before_the_lookup(model, bad):
    """On CUDA such an id would be a device-side assert that leaves the device unusable (an
    inference server would die with it); on the CPU it is refused first, with what is wrong."""
    policy = ActionTokenPolicy(model, 2)
    obs = reach_obs(2)
    obs["instruction"][1, 0] = bad
    with pytest.raises(ValueError, match=r"instruction ids must be in \[0, 512\)"):
        policy.action_dist(obs)


def test_loader_builds_it_from_json_config():
    model = load_vla_model("", "shared.policies.action_tokens.PaliGemmaActionTokenPolicy",
                           {"size": "tiny", "action_dim": 2, "decoding": "autoregressive"})
    dist = model.action_dist(reach_obs(2))
    assert isinstance(dist, AutoregressiveActionTokenDistribution) and dist.sample().shape == (2, 2)


def test_half_billion_config_on_meta_device():
    with torch.device("meta"):
        big = PaliGemmaForConditionalGeneration(paligemma_config("0.5b"))
    assert 0.45e9 < sum(p.numel() for p in big.parameters()) < 0.6e9
    with pytest.raises(ValueError, match="image_token_id=257152 lies in the bin-token block"):
        ActionTokenPolicy(big, 7)
    assert ActionTokenPolicy(big, 7, reserve_tail=64).token_offset == 257216 - 256 - 64


def test_no_torchvision(model):
    """Nothing Tandem installs brings torchvision, and the adapter never needs it. Where a user's
    environment has it anyway (CUDA images do), transformers imports it on its own: not ours to check."""
    if importlib.util.find_spec("torchvision") is not None and not os.environ.get("CI"):
        pytest.skip("torchvision is installed in this environment, by something other than Tandem")
    dist = ActionTokenPolicy(model, 2).action_dist(reach_obs(1))
    dist.log_prob(dist.sample())
    assert "torchvision" not in sys.modules
    assert importlib.util.find_spec("torchvision") is None


def test_deepcopy_while_a_value_is_pending(model):
    import copy
    policy = ActionTokenPolicy(model, 2)
    policy.action_dist(reach_obs())              # stashes a non-leaf hidden state for value(obs)
    twin = copy.deepcopy(policy)
    obs = reach_obs()
    torch.testing.assert_close(twin.value(obs), policy.value(obs))


def _pretrain_script():
    path = Path(__file__).resolve().parents[1] / "launch" / "pretrain_vla_tokens_reach.py"
    spec = importlib.util.spec_from_file_location("pretrain_vla_tokens_reach", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class _ScriptedTokens(torch.nn.Module):
    """Puts all its probability on one bin per dim: the named target's position (``reads=True``) or
    target 0's whatever the instruction says (``reads=False``)."""

    def __init__(self, reads: bool):
        super().__init__()
        self.reads, self.bins = reads, ActionBins(-1.0, 1.0, 21)

    def action_dist(self, obs):
        from shared.envs.reach import COLORS, TOKENS
        from shared.policies.action_tokens import ActionTokenDistribution
        rgb, n = obs["rgb"], obs["rgb"].shape[0]
        k = obs["instruction"][:, 1] - TOKENS["red"] if self.reads else torch.zeros(n, dtype=torch.long)
        hit = (rgb == COLORS[k][:, None, None]).all(-1)                       # [n, S, S] the 2x2 blob
        ys, xs = hit.nonzero(as_tuple=True)[1:]
        top_left = torch.stack([xs.view(n, 4).min(-1).values, ys.view(n, 4).min(-1).values], -1).float()
        xy = top_left / (rgb.shape[1] - 2) * 2 - 1                             # Reach's pixel mapping, inverted
        logits = torch.full((n, 2, 21), -30.0)
        logits.scatter_(-1, self.bins.to_bins(xy).unsqueeze(-1), 0.0)
        return ActionTokenDistribution(logits.log_softmax(-1), self.bins)


def test_pretraining_measures_grounding_and_pointing():
    script = _pretrain_script()
    reads, blind = _ScriptedTokens(True), _ScriptedTokens(False)
    assert script.pointing_accuracy(reads) > 0.9
    assert script.pointing_accuracy(blind) < 0.5                    # right only when target 0 is named
    assert script.grounding(blind) == pytest.approx(0.0, abs=1e-6)
    assert script.grounding(reads) > 5.0                             # another colour: another bin, ~30 nats
    assert script.LOCATE not in script.TOKENS.values()


SHIPPED = Path(__file__).resolve().parents[1] / "benchmarks" / "pretrained" / "tokens_reach_intel"


def test_the_shipped_reach_checkpoint_is_the_one_reported_and_loads_through_the_configs():
    """benchmarks/pretrained/tokens_reach_intel: the pretrained model the README's Intel-VM Reach
    figures start from (pretraining depends on the CPU, so it is shipped rather than remade)."""
    import hashlib
    import json
    from learner.evaluator import evaluate
    from shared.config import load_config
    from shared.policies import make_policy
    digest = hashlib.sha256((SHIPPED / "model.safetensors").read_bytes()).hexdigest()
    assert digest == "9d3e09a18eeeaadef5d7f0492c1b57318e22d82fc6396433bfcb6618bda2ccaf"
    assert json.loads((SHIPPED / "pretrain.json").read_text())["parameters"] == 151_153
    root = SHIPPED.parents[2]
    for name, trainable in (("vla_tokens_reach_ppo", 42_049), ("vla_tokens_reach_grpo", 41_984)):
        cfg = load_config(root / "configs" / f"{name}.json", [f"policy.vla_config.model_path={SHIPPED}"])
        env = make_env(cfg.env.id, 200, cfg.env.cfg, "cpu")
        policy = make_policy(cfg, env.spec).eval()
        assert sum(p.numel() for p in policy.parameters() if p.requires_grad) == trainable   # LoRA (+ value head)
    successes = evaluate(policy, env, 200, seed=cfg.trainer.seed + 1_000_003).successes
    # 40.5% on these 200 episodes where it was made (README: 40.9% on seed 1's 2,000); another CPU
    # may flip an argmax here and there, not 20 points
    assert 0.3 <= sum(successes) / len(successes) <= 0.5
