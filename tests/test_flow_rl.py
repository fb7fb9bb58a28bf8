"""shared/policies/flow_policy.py on a tiny random π0 (tests/flow_vla_tiny.py): the Flow-Noise and Flow-SDE
chains' log-likelihoods, each against an independent computation, the ODE against transformers'
sample_actions, the executed positions and real dims, gradients into LoRA and Tandem's heads, and the
``flow_vla`` config and make_policy wiring."""

from __future__ import annotations

import math

import pytest
import torch
from tensordict import TensorDict
from torch.distributions import Normal

from shared import keys
from shared.chunks import executed_sum
from shared.config import ConfigError, FlowConfig, LoRAConfig, config_from_dict
from shared.policies import flow_policy, make_policy, published_state
from shared.policies.flow_policy import FlowVLAPolicy, gaussian_log_prob
from shared.policies.flow_vla import HEADS_FILE, Prefix, pi0_inputs, save_pi0, step_times
from shared.policies.vla import VLALoadError
from tests.flow_vla_tiny import make_tiny_pi0, save_tiny_pi0, tiny_observation

pytest.importorskip("transformers.models.pi0")

ACTION_DIM = 3          # of the tiny model's max_action_dim 8: dims 3..7 are padding
H, A, K = 8, 8, 4       # the tiny model's chunk_size, max_action_dim, num_inference_steps


def _policy(method="noise", **cfg) -> FlowVLAPolicy:
    return FlowVLAPolicy(make_tiny_pi0(), FlowConfig(**cfg), ACTION_DIM, method=method)


def _td(batch=4, seed=1) -> TensorDict:
    rgb, proprio, instruction = tiny_observation(batch, seed=seed)
    obs = TensorDict({"rgb": rgb, "proprio": proprio, "instruction": instruction}, batch_size=[batch])
    return TensorDict({keys.OBS: obs}, batch_size=[batch])


def _act(policy, td, seed=0, deterministic=False) -> TensorDict:
    torch.manual_seed(seed)
    with torch.inference_mode():
        return policy(td, deterministic=deterministic).clone()   # out of inference mode, for autograd later


def _inputs(policy, td):
    obs = td[keys.OBS]
    return pi0_inputs(policy.model.config, obs["rgb"], obs["proprio"], obs["instruction"], instruction_pad_id=0)


def _uncached(model, inputs, x, t) -> tuple[torch.Tensor, torch.Tensor]:
    """v and the expert's output per action token from a full forward (the VLM run again, no cache),
    the output read by a hook on action_out_proj."""
    seen = []
    hook = model.action_out_proj.register_forward_hook(lambda m, args, out: seen.append(args[0]))
    try:
        v = model(**inputs.prefix_kwargs(), noise=x, timestep=torch.full((x.shape[0],), float(t))).logits
    finally:
        hook.remove()
    return v, seen[0]


# ----------------------------------------------------------------------------- actor vs learner


@pytest.mark.parametrize("method", ["noise", "sde"])
def test_learner_log_prob_equals_the_actors(method):
    policy = _policy(method)
    td = _act(policy, _td(batch=6), seed=3)
    assert td[keys.ACTION].shape == (6, H, ACTION_DIM) and td[keys.LOG_PROB].shape == (6, H)
    assert td[keys.FLOW_CHAIN].shape == (6, K + 1, H, A) and td[keys.VALUE].shape == (6,)
    torch.testing.assert_close(td[keys.ACTION], td[keys.FLOW_CHAIN][:, -1, :, :ACTION_DIM], rtol=0, atol=0)
    if method == "sde":
        assert td[keys.FLOW_STEP].dtype == torch.int64 and len(set(td[keys.FLOW_STEP].tolist())) > 1
    for executed in ([H] * 6, [H, 3, 1, H, 5, 2]):
        td[keys.EXECUTED] = torch.tensor(executed)
        log_prob, entropy, value = policy.evaluate_actions(td)
        actor = executed_sum(td[keys.LOG_PROB], td[keys.EXECUTED])
        torch.testing.assert_close(log_prob, actor, rtol=0, atol=1e-5)
        torch.testing.assert_close(policy.action_log_prob(td), actor, rtol=0, atol=1e-5)
        torch.testing.assert_close(value, td[keys.VALUE], rtol=0, atol=1e-5)
        torch.testing.assert_close(policy.get_value(td), td[keys.VALUE], rtol=0, atol=1e-5)
        assert entropy.shape == (6,) and torch.isfinite(entropy).all()


def test_rollout_extras_declare_what_forward_writes():
    for method, extra in (("noise", {}), ("sde", {keys.FLOW_STEP: ((), torch.int64)})):
        policy = _policy(method)
        assert policy.chunk_size == H
        assert policy.rollout_extras() == {keys.FLOW_CHAIN: ((K + 1, H, A), torch.float32), **extra}
        td = _act(policy, _td())
        for key, (shape, dtype) in policy.rollout_extras().items():
            assert td[key].shape == (4, *shape) and td[key].dtype == dtype


# ----------------------------------------------------------------------------- independent computations


def test_gaussian_log_prob_equals_float64_normal():
    g = torch.Generator().manual_seed(0)
    x, mean = torch.randn(3, 8, 8, generator=g), torch.randn(3, 8, 8, generator=g)
    std = 0.05 + torch.rand(3, 8, 8, generator=g)
    reference = Normal(mean.double(), std.double()).log_prob(x.double())
    torch.testing.assert_close(gaussian_log_prob(x, mean, std).double(), reference, rtol=1e-6, atol=1e-5)


def test_flow_noise_transitions_equal_float64_normal():
    """Each transition's mean from an uncached forward, its std from the noise head's formula, and its
    log-prob from a float64 Normal; the padding dims follow the ODE exactly."""
    policy = _policy("noise")
    with torch.no_grad():        # a noise head that is not constant: its std varies per token and dim
        policy.noise_head.proj.weight.normal_(0, 0.5)
        policy.noise_head.proj.bias.normal_(0, 0.5)
    td = _act(policy, _td(), seed=4)
    chain, inputs, d = td[keys.FLOW_CHAIN].double(), _inputs(policy, td), ACTION_DIM
    w, b = (p.double() for p in (policy.noise_head.proj.weight, policy.noise_head.proj.bias))
    total = Normal(0.0, 1.0).log_prob(chain[:, 0, :, :d]).sum(-1)
    with torch.no_grad():
        for k, t in enumerate(step_times(K)[:-1]):
            v, hidden = (a.double() for a in _uncached(policy.model, inputs, td[keys.FLOW_CHAIN][:, k], t))
            std = 0.08 + 0.08 * (1 + torch.tanh(hidden @ w.T + b)) / 2
            mean = chain[:, k] - v / K
            step = Normal(mean[..., :d], std[..., :d]).log_prob(chain[:, k + 1, :, :d])
            assert step.shape == (4, H, d) and std.min() < 0.1 < 0.14 < std.max()
            total = total + step.sum(-1)
            torch.testing.assert_close(chain[:, k + 1, :, d:], mean[..., d:], rtol=0, atol=1e-5)
    torch.testing.assert_close(td[keys.LOG_PROB].double(), total, rtol=1e-6, atol=1e-4)


def test_flow_sde_step_equals_float64_normal_in_flow_grpos_form():
    """The stochastic step's mean in Flow-GRPO's own form, x(1 + σ²/(2t)·dt) + v(1 + σ²(1 − t)/(2t))·dt with
    dt = −Δ, σ = a√(t / (1 − t)) and σ = a√(1/Δ) at t = 1; std σ√Δ; the other steps are ODE steps."""
    a = 0.7
    policy = _policy("sde", noise_level=a)
    td = _act(policy, _td(batch=8), seed=2)
    chain, inputs, d, dt = td[keys.FLOW_CHAIN].double(), _inputs(policy, td), ACTION_DIM, 1.0 / K
    k_star = td[keys.FLOW_STEP]
    assert 0 in k_star.tolist() and len(set(k_star.tolist())) >= 3   # t = 1 and other steps
    total = Normal(0.0, 1.0).log_prob(chain[:, 0, :, :d]).sum(-1)
    with torch.no_grad():
        for k, t in enumerate(step_times(K)[:-1]):
            v = _uncached(policy.model, inputs, td[keys.FLOW_CHAIN][:, k], t)[0].double()
            x = chain[:, k]
            sigma = a * math.sqrt(t / (1 - t)) if t < 1 else a * math.sqrt(1 / dt)
            mean = x * (1 + sigma ** 2 / (2 * t) * -dt) + v * (1 + sigma ** 2 * (1 - t) / (2 * t)) * -dt
            on = k_star == k
            lp = Normal(mean[..., :d], sigma * math.sqrt(dt)).log_prob(chain[:, k + 1, :, :d]).sum(-1)
            total = total + torch.where(on[:, None], lp, torch.zeros_like(lp))
            ode = x - dt * v
            torch.testing.assert_close(chain[~on, k + 1], ode[~on], rtol=0, atol=1e-5)
            torch.testing.assert_close(chain[on, k + 1, :, d:], ode[on][..., d:], rtol=0, atol=1e-5)
    torch.testing.assert_close(td[keys.LOG_PROB].double(), total, rtol=1e-6, atol=1e-4)


@pytest.mark.parametrize("method", ["noise", "sde"])
def test_linear_velocity_one_step_samples_match_the_known_gaussian(method, monkeypatch):
    """K = 1 and v = A·x + b (A diagonal): x_0 is Gaussian per dim with a known mean and variance.
    Flow-Noise: x_0 = (1 − A)x_1 − b + σε. Flow-SDE (t = 1, Δ = 1, σ_1 = a): μ = x − v − (a²/2)·x, std a."""
    stats = pytest.importorskip("scipy.stats")
    # large noise, so that a wrong variance is told apart from the right one in 4,000 samples
    slope, offset = torch.tensor([0.3, -1.0, -0.5]), torch.tensor([0.2, -1.0, 0.5])
    a, fixed_std = 1.0, 2.0

    def linear(model, prefix, x, t):
        v = x.clone()
        v[..., :3] = slope * x[..., :3] + offset
        return v, torch.zeros(*x.shape[:2], model.config.dit_config.hidden_size)

    monkeypatch.setattr(flow_policy, "expert_pass", linear)
    monkeypatch.setattr(flow_policy, "encode_prefix", lambda model, inputs: Prefix(None, 0, inputs, None))
    policy = _policy(method, num_steps=1, noise_level=a, noise_std_min=fixed_std, noise_std_max=fixed_std)
    x0 = _act(policy, _td(batch=500), seed=11)[keys.ACTION].reshape(-1, ACTION_DIM)   # 4,000 per dim
    if method == "noise":
        scale, wrong = ((1 - slope) ** 2 + fixed_std ** 2).sqrt(), (1 - slope).abs()         # wrong: the ODE
    else:
        scale = ((1 - slope - a ** 2 / 2) ** 2 + a ** 2).sqrt()
        wrong = ((1 - slope) ** 2 + a ** 2).sqrt()       # wrong: the ODE's mean plus noise, no drift correction
    for i in range(ACTION_DIM):
        sample = x0[:, i].double().numpy()
        assert stats.kstest(sample, "norm", args=(-offset[i].item(), scale[i].item())).pvalue > 1e-3
        assert stats.kstest(sample, "norm", args=(-offset[i].item(), wrong[i].item())).pvalue < 1e-4


@pytest.mark.parametrize("method, deterministic, level", [("noise", True, 0.5), ("sde", True, 0.5),
                                                          ("sde", False, 0.0)])
def test_ode_and_noiseless_sde_equal_sample_actions(method, deterministic, level):
    policy = _policy(method, noise_level=level)
    td = _act(policy, _td(), seed=7, deterministic=deterministic)
    torch.manual_seed(7)
    noise = torch.randn(4, H, A)    # the first draw of a call is x_1
    inputs = _inputs(policy, td)
    with torch.no_grad():
        reference = policy.model.sample_actions(state=inputs.state, input_ids=inputs.input_ids,
                                                pixel_values=inputs.pixel_values, noise=noise,
                                                attention_mask=inputs.attention_mask,
                                                pixel_attention_mask=inputs.pixel_attention_mask, num_steps=K)
    torch.testing.assert_close(td[keys.FLOW_CHAIN][:, 0], noise, rtol=0, atol=0)
    torch.testing.assert_close(td[keys.FLOW_CHAIN][:, -1], reference, rtol=0, atol=1e-5)
    torch.testing.assert_close(td[keys.ACTION], reference[..., :ACTION_DIM], rtol=0, atol=1e-5)
    if deterministic:
        assert torch.equal(td[keys.LOG_PROB], torch.zeros(4, H))


# ----------------------------------------------------------------------------- what the log-probs cover


@pytest.mark.parametrize("method", ["noise", "sde"])
def test_log_probs_cover_only_executed_positions_and_real_dims(method):
    policy = _policy(method)
    td = _act(policy, _td(), seed=5)
    td[keys.EXECUTED] = torch.tensor([2, 5, 1, 8])
    with torch.no_grad():
        base = policy.evaluate_actions(td)[0]
        padded = td.clone()
        padded[keys.FLOW_CHAIN][:, -1, :, ACTION_DIM:] += 3.0          # x_0's padding dims
        unexecuted = td.clone()
        for row, n in enumerate(td[keys.EXECUTED].tolist()):
            unexecuted[keys.ACTION][row, n:] += 3.0                    # actions the envs never took
        executed = td.clone()
        executed[keys.ACTION][:, 0, 0] += 0.5                          # the first executed action
        torch.testing.assert_close(policy.evaluate_actions(padded)[0], base, rtol=0, atol=1e-5)
        torch.testing.assert_close(policy.evaluate_actions(unexecuted)[0], base, rtol=0, atol=1e-5)
        changed = policy.evaluate_actions(executed)[0]
    if method == "noise":    # under Flow-SDE x_0 moves the log-prob only where k* is the last step
        assert ((changed - base).abs() > 1.0).all()
    else:
        last = td[keys.FLOW_STEP] == K - 1
        assert ((changed - base).abs()[last] > 1.0).all() and torch.allclose(changed[~last], base[~last])


# ----------------------------------------------------------------------------- gradients, LoRA, heads


@pytest.mark.parametrize("scope", ["expert", "expert_and_vlm"])
def test_gradients_reach_lora_adapters_and_heads(scope):
    policy = _policy("noise", lora=LoRAConfig(r=4), lora_scope=scope)
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    assert set(published_state(policy)) == trainable
    assert all("lora_" in n or n.startswith(("noise_head.", "value_head.")) for n in trainable)
    assert any(".dit." in n for n in trainable)
    assert any(".vlm." in n for n in trainable) == (scope == "expert_and_vlm")
    td = _act(policy, _td(), seed=1)
    td[keys.EXECUTED] = torch.tensor([8, 3, 1, 8])
    log_prob, entropy, value = policy.evaluate_actions(td)
    (log_prob.sum() + entropy.sum() + value.sum()).backward()
    grads = {n: p.grad for n, p in policy.named_parameters() if p.requires_grad}
    # lora_B starts at zero, so lora_A's gradient is zero on the first step; lora_B's is not, except on
    # the VLM's last query projection: the expert reads the VLM's keys and values, not its last output
    unused = "vlm.language_model.layers.1.self_attn.q_proj"
    assert all(grads[n] is not None and grads[n].abs().sum() > 0 for n in grads if "lora_B" in n and unused not in n)
    for head in ("noise_head.proj.weight", "value_head.net.0.weight"):
        assert grads[head].abs().sum() > 0, head
    assert all(p.grad is None for p in policy.parameters() if not p.requires_grad)


def test_lora_target_outside_the_scope_is_an_error():
    with pytest.raises(VLALoadError, match=r"flow_config.lora.target_modules \['fc1'\].*model.dit.*lora_scope"):
        _policy("noise", lora=LoRAConfig(target_modules=["fc1"]))   # fc1 exists only in the vision tower
    policy = _policy("noise", lora=LoRAConfig(target_modules=["fc1"]), lora_scope="expert_and_vlm")
    assert any("vision_tower" in n and "lora_A" in n for n, _ in policy.named_parameters())


def test_value_from_prefix_and_bfloat16_autocast():
    policy = _policy("noise", value_from="prefix", dtype="bfloat16", autocast=True)
    assert policy.model.action_out_proj.weight.dtype == torch.bfloat16
    assert policy.value_head.net[0].in_features == policy.model.config.vlm_config.text_config.hidden_size
    td = _act(policy, _td(), seed=2)
    td[keys.EXECUTED] = torch.full((4,), H)
    log_prob, _, value = policy.evaluate_actions(td)
    torch.testing.assert_close(log_prob, executed_sum(td[keys.LOG_PROB], td[keys.EXECUTED]), rtol=1e-3, atol=0.05)
    torch.testing.assert_close(value, td[keys.VALUE], rtol=1e-2, atol=1e-2)


def test_heads_saved_and_loaded_strictly(tmp_path):
    policy = _policy("noise")
    with torch.no_grad():
        policy.noise_head.proj.bias.fill_(0.3)
    save_pi0(policy.model, tmp_path / "ckpt", heads=policy.heads())
    loaded = FlowVLAPolicy.from_pretrained(FlowConfig(model_path=str(tmp_path / "ckpt")), ACTION_DIM)
    for name, head in policy.heads().items():
        for k, v in head.state_dict().items():
            assert torch.equal(loaded.heads()[name].state_dict()[k], v), (name, k)
    with pytest.raises(VLALoadError, match=rf"{HEADS_FILE}.*value_head.net.0.weight: file \(128, 16\), model "
                                           rf"\(128, 32\)"):
        FlowVLAPolicy.from_pretrained(FlowConfig(model_path=str(tmp_path / "ckpt"), value_from="prefix"), ACTION_DIM)


# ----------------------------------------------------------------------------- config and make_policy


def _config(model_path, algorithm="ppo", blocks=None, **flow):
    raw = {"env": {"id": "tandem/Reach-v0"}, "actors": {"num_envs": 4},
           "policy": {"name": "flow_vla", "flow_config": {"model_path": str(model_path), **flow}},
           "algorithm": {"name": algorithm, "cfg": {"batch_size": 64}}}
    for block, values in (blocks or {}).items():
        raw[block] = {**raw.get(block, {}), **values}
    if algorithm == "grpo":
        raw["algorithm"]["cfg"]["group_size"] = 2
    return config_from_dict(raw, source="flow.json")


def test_config_and_make_policy(tmp_path):
    from shared.envs.reach import Reach
    save_tiny_pi0(tmp_path / "pi0")
    spec = Reach.spec_for()
    ppo = make_policy(_config(tmp_path / "pi0"), spec)
    assert ppo.method == "noise" and ppo.critic is not None and ppo.action_dim == 2 and ppo.chunk_size == H
    grpo = make_policy(_config(tmp_path / "pi0", "grpo"), spec)
    assert grpo.method == "sde" and grpo.critic is None and keys.FLOW_STEP in grpo.rollout_extras()
    assert make_policy(_config(tmp_path / "pi0", "grpo", method="noise"), spec).method == "noise"
    obs = TensorDict({k: torch.zeros(2, *shape, dtype=dt) for k, (shape, dt) in spec.obs_keys.items()}, batch_size=[2])
    with torch.inference_mode():
        td = grpo(TensorDict({keys.OBS: obs}, batch_size=[2]))
    assert td[keys.ACTION].shape == (2, H, 2) and keys.VALUE not in td.keys()


@pytest.mark.parametrize("algorithm", ["ppo", "grpo"])
def test_serial_run_carries_the_chains_from_the_actor_to_the_learner(tmp_path, algorithm):
    """The collector stores each call's chain in its rollout row, and the learner's policy recomputes the
    actor's log-probs of the executed actions from it; then an update trains on it."""
    from runners.serial import SerialRunner

    save_tiny_pi0(tmp_path / "pi0")
    blocks = {"trainer": {"total_steps": 64, "buffer_size": 4, "eval_freq": 0},
              "actors": {"num_actors": 1, "num_envs": 4, "actions_per_call": 4},
              "algorithm": {"cfg": {"batch_size": 8, "n_epochs": 1, **({"group_size": 2} if algorithm == "grpo" else {})}}}
    runner = SerialRunner(_config(tmp_path / "pi0", algorithm, blocks, lora={"r": 4}), None, evaluate_every=0)
    try:
        ((rollout, meta),) = runner.collect()
        rows = rollout.reshape(-1).clone()
        assert rows[keys.FLOW_CHAIN].shape == (16, K + 1, H, A) and rows[keys.ACTION].shape == (16, H, 2)
        assert ((rows[keys.EXECUTED] >= 1) & (rows[keys.EXECUTED] <= 4)).all()
        assert (keys.FLOW_STEP in rows.keys()) == (algorithm == "grpo")
        with torch.no_grad():
            recomputed = runner.learner.policy.evaluate_actions(rows)[0]
        torch.testing.assert_close(recomputed, rows[keys.LOG_PROB], rtol=0, atol=1e-4)
        runner.learner.ingest(rollout, meta)
        assert runner.train() and runner.learner.version == 1
    finally:
        runner.close()


@pytest.mark.parametrize("policy, match", [
    ({"name": "flow_vla"}, r"flow\.json: policy\.flow_config\.model_path: .*needs a local π0 checkpoint"),
    ({"name": "actor_critic", "flow_config": {"model_path": "x"}}, r"policy\.flow_config: only used with"),
    ({"name": "flow_vla", "flow_config": {"model_path": "x", "noise_std_min": 0.2}}, r"noise_std_min 0\.2 is above"),
    ({"name": "flow_vla", "chunk_size": 4, "flow_config": {"model_path": "x"}}, r"policy\.chunk_size: 4.*checkpoint"),
    ({"name": "flow_vla", "flow_config": {"model_path": "x", "method": "ode"}}, r"flow_config\.method: expected"),
])
def test_config_errors_name_the_key(policy, match):
    with pytest.raises(ConfigError, match=match):
        config_from_dict({"policy": policy}, source="flow.json")


# ----------------------------------------------------------------------------- text instructions


def _save_with_tokenizer(path, words=None):
    """A tiny π0 with a word-level tokenizer.json beside it (ids 20 and up, <pad> 0: tests/foreign_vla.py)."""
    from tests.foreign_vla import make_tokenizer
    save_tiny_pi0(path)
    tok = make_tokenizer()
    if words:
        tok.add_tokens(words)
    tok.save_pretrained(str(path))
    return path


def _text_config(model_path, **flow):
    return _config(model_path, blocks={"env": {"cfg": {"instructions": "text", "instruction_length": 2}},
                                       "trainer": {"buffer_size": 4}, "actors": {"actions_per_call": 4},
                                       "algorithm": {"cfg": {"batch_size": 16}}}, **flow)


def test_text_instructions_use_the_flow_checkpoints_tokenizer(tmp_path):
    """flow_config.model_path's tokenizer.json (or flow_config.tokenizer) tokenizes Reach's instructions, the
    policy built on them passes the vocabulary checks, and an actor's observations carry its ids."""
    from runners.serial import SerialActor
    from shared.instructions import instruction_tokenizer
    model = _save_with_tokenizer(tmp_path / "pi0")
    cfg = _text_config(model, lora={"r": 4})
    assert instruction_tokenizer(cfg).source == str(model / "tokenizer.json")
    other = _save_with_tokenizer(tmp_path / "other")
    assert instruction_tokenizer(_text_config(model, tokenizer=str(other))).source == str(other / "tokenizer.json")
    actor = SerialActor(cfg, 0)
    try:
        rollout = actor.collector.collect(version=0)[0]
        ids = {tuple(row) for row in rollout[keys.OBS]["instruction"].reshape(-1, 2).tolist()}
        assert ids <= {(20, 21), (20, 22), (20, 23)} and len(ids) > 1, ids   # "reach red|green|blue", its ids
        assert rollout[keys.ACTION].shape[-2:] == (H, 2)
    finally:
        actor.env.close()


def test_text_instruction_errors_name_the_flow_config_keys(tmp_path):
    from shared.envs.reach import Reach
    from shared.instructions import InstructionError, instruction_tokenizer
    spec = Reach.spec_for(instructions="text", instruction_length=2)
    bare = tmp_path / "bare"
    save_tiny_pi0(bare)
    with pytest.raises(InstructionError, match=r"no tokenizer\.json in flow_config\.model_path .*bare.*"
                                               r"policy\.flow_config\.tokenizer"):
        instruction_tokenizer(_text_config(bare))
    model = _save_with_tokenizer(tmp_path / "pi0")
    with pytest.raises(InstructionError, match=r"pads with id 0, the model masks id 5: set "
                                               r"flow_config\.instruction_pad_id to 0"):
        make_policy(_text_config(model, instruction_pad_id=5), spec)
    big = _save_with_tokenizer(tmp_path / "big", words=[f"w{i}" for i in range(200)])
    with pytest.raises(InstructionError, match=r"has \d+ ids, the model \(π0 at .*big'\) embeds 128.*"
                                               r"flow_config\.tokenizer"):
        make_policy(_text_config(big), spec)
    assert make_policy(_text_config(model), spec).instruction_pad_id == 0


def test_an_env_whose_proprio_does_not_fit_max_state_dim_is_refused_at_start_up(tmp_path):
    """Caught when the policy is built (each process's start-up), not at every actor's first call."""
    from shared.envs.reach import Reach
    make_tiny_pi0(max_state_dim=2).save_pretrained(str(tmp_path / "pi0"))
    with pytest.raises(VLALoadError, match=r"flow\.json: env tandem/Reach-v0 and the π0 model at "
                                           r"flow_config\.model_path .*: the env's proprio has 4 dims, more than "
                                           r"the model's max_state_dim 2"):
        make_policy(_config(tmp_path / "pi0"), Reach.spec_for())


def test_more_actions_per_call_than_the_checkpoints_chunk_is_refused_when_the_policy_is_built(tmp_path):
    from shared.envs.reach import Reach
    save_tiny_pi0(tmp_path / "pi0")
    cfg = _config(tmp_path / "pi0", blocks={"actors": {"num_envs": 4, "actions_per_call": 16}})
    with pytest.raises(ValueError, match=r"flow\.json: actors\.actions_per_call is 16, but the policy returns "
                                         r"chunks of 8 actions"):
        make_policy(cfg, Reach.spec_for())
    assert make_policy(_config(tmp_path / "pi0", blocks={"actors": {"actions_per_call": 8}}),
                       Reach.spec_for()).actions_per_call == 8
