"""Env adapters, rollout collection and policies: true final observations, bootstrapping values,
log-probs, normalisation statistics travelling with the weights."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch
from tensordict import TensorDict

from actors.rollout import Collector
from shared import keys, wire
from shared.config import config_from_dict
from shared.envs import make_env
from shared.envs.torch_envs import TorchPendulum
from shared.policies import load_weights_, make_policy, weights_td
from shared.policies.normalization import RewardScaler, RunningMeanStd


def cfg_for(env_id: str, **env_cfg):
    return config_from_dict({"env": {"id": env_id, "cfg": env_cfg},
                             "policy": {"actor": {"network_cfg": {"hidden_sizes": [8]}},
                                        "critic": {"network_cfg": {"hidden_sizes": [8]}}}})


def test_gym_adapter_returns_true_final_observation_on_truncation():
    env = make_env("Pendulum-v1", 3, {"max_episode_steps": 4})
    ref = gym.make("Pendulum-v1", max_episode_steps=4)            # one env, same seed as env 1
    obs = env.reset(seed=10)
    ref_obs, _ = ref.reset(seed=11)
    np.testing.assert_allclose(obs[1].numpy(), ref_obs, rtol=1e-6)
    actions = [torch.full((3, 1), a) for a in (0.5, -1.0, 2.0, 1.5)]
    for i, a in enumerate(actions):
        step = env.step(a)
        ref_obs, ref_r, _, ref_trunc, _ = ref.step(np.array([float(a[1, 0])], dtype=np.float32))
        assert bool(step.truncated[1]) == ref_trunc
        np.testing.assert_allclose(step.final_obs[1].numpy(), ref_obs, rtol=1e-5)
        assert step.reward[1].item() == pytest.approx(ref_r, rel=1e-5)
    assert step.truncated.all() and not step.terminated.any()
    assert not torch.allclose(step.obs, step.final_obs)              # obs is already the reset one
    assert step.episode_lengths == [4, 4, 4] and len(step.episode_returns) == 3
    env.close()


@pytest.mark.parametrize("env_id,kwargs,steps", [("CartPole-v1", {}, 60),
                                                   ("HalfCheetah-v5", {"max_episode_steps": 7}, 20)])
def test_gym_adapter_steps_exactly_as_gymnasiums_sync_vector_env(env_id, kwargs, steps):
    """The adapter steps its envs itself (no per-step info merging); every observation, reward,
    flag, final observation and episode return must equal SyncVectorEnv's in SAME_STEP mode."""
    n = 3
    env = make_env(env_id, n, kwargs)
    ref = gym.make_vec(env_id, num_envs=n, vectorization_mode="sync",
                       vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP}, **kwargs)
    try:
        obs = env.reset(seed=5)
        ref_obs, _ = ref.reset(seed=5)
        np.testing.assert_array_equal(obs.numpy(), ref_obs.astype(np.float32))
        g = torch.Generator().manual_seed(0)
        ref_ret = np.zeros(n)
        ends = 0
        kept: list[tuple[torch.Tensor, np.ndarray]] = []   # no step's tensors may alias the next step's
        for _ in range(steps):
            if env.spec.action.kind == "discrete":
                action = torch.randint(0, 2, (n,), generator=g)
            else:
                action = torch.rand(n, 6, generator=g) * 2 - 1
            step = env.step(action)
            o, r, te, tr, info = ref.step(action.numpy())
            np.testing.assert_array_equal(step.obs.numpy(), o.astype(np.float32))
            kept.append((step.obs, o.astype(np.float32).copy()))
            np.testing.assert_array_equal(step.reward.numpy(), r.astype(np.float32))
            np.testing.assert_array_equal(step.terminated.numpy(), te)
            np.testing.assert_array_equal(step.truncated.numpy(), tr)
            ref_ret += r
            done = te | tr
            if done.any():
                idx = np.flatnonzero(done)
                final = np.stack([info["final_obs"][i] for i in idx]).astype(np.float32)
                np.testing.assert_array_equal(step.final_obs.numpy()[idx], final)
                assert step.episode_returns == pytest.approx(ref_ret[idx].tolist())
                assert len(step.episode_metrics) == len(idx)
                ref_ret[idx] = 0.0
                ends += len(idx)
            else:
                assert step.episode_returns == [] and torch.equal(step.final_obs, step.obs)
        assert ends >= n
        for got, want in kept:
            np.testing.assert_array_equal(got.numpy(), want)
    finally:
        env.close()
        ref.close()


def test_gym_adapter_clips_box_actions_to_bounds():
    env = make_env("Pendulum-v1", 2)
    env.reset(seed=0)
    twin = make_env("Pendulum-v1", 2)
    twin.reset(seed=0)
    a = env.step(torch.tensor([[50.0], [-50.0]]))
    b = twin.step(torch.tensor([[2.0], [-2.0]]))
    torch.testing.assert_close(a.obs, b.obs)


def test_torch_pendulum_matches_gymnasium_dynamics():
    env = TorchPendulum(num_envs=1)
    env.reset(seed=0)
    ref = gym.make("Pendulum-v1").unwrapped
    ref.reset(seed=0)
    ref.state = np.array([float(env._theta[0]), float(env._theta_dot[0])])
    for u in (1.0, -2.0, 0.3, 5.0):
        step = env.step(torch.tensor([[u]]))
        ref_obs, ref_r, *_ = ref.step(np.array([u], dtype=np.float32))
        np.testing.assert_allclose(step.obs[0].numpy(), ref_obs, rtol=1e-4, atol=1e-5)
        assert step.reward[0].item() == pytest.approx(ref_r, rel=1e-4, abs=1e-5)


def record_final_obs(env) -> list:
    """Wrap ``env.step`` so that every step's ``final_obs`` is appended to the returned list."""
    finals = []
    step_fn = env.step

    def recording_step(action):
        out = step_fn(action)
        finals.append(out.final_obs.clone())
        return out

    env.step = recording_step
    return finals


@pytest.mark.parametrize("env_id", ["Pendulum-v1", "tandem/Pendulum-v0"])
def test_collector_bootstraps_truncation_from_final_observation(env_id):
    cfg = cfg_for(env_id, max_episode_steps=5)
    env = make_env(env_id, 2, cfg.env.cfg)
    policy = make_policy(cfg, env.spec)
    col = Collector(env, policy, num_steps=12, seed=0)
    finals = record_final_obs(env)
    td, stats, _ = col.collect(version=3)
    assert td.batch_size == torch.Size([2, 12])
    assert (td[keys.POLICY_VERSION] == 3).all()
    trunc = td[keys.TRUNCATED]
    assert trunc[:, 4].all() and trunc[:, 9].all() and trunc.sum() == 4
    assert torch.equal(td[keys.DONE], td[keys.TRUNCATED] | td[keys.TERMINATED])
    with torch.no_grad():
        for t in range(12):
            expected = policy.get_value(TensorDict({keys.OBS: finals[t]}, [2]))
            if t < 11:
                # not done: V of the next step's observation, which is also the final observation
                nd = ~td[keys.DONE][:, t]
                torch.testing.assert_close(td[keys.NEXT_VALUE][nd, t], td[keys.VALUE][nd, t + 1])
            torch.testing.assert_close(td[keys.NEXT_VALUE][:, t], expected)
        # a truncated step never bootstraps from the reset observation
        reset_value = td[keys.VALUE][:, 5]
        assert not torch.allclose(td[keys.NEXT_VALUE][:, 4], reset_value)
    assert stats.episode_lengths == [5, 5, 5, 5]


@pytest.mark.parametrize("env_id", ["Pendulum-v1", "CartPole-v1"])
def test_collector_sends_the_observation_each_bootstrap_needs(env_id):
    """With bootstrap_obs (vla-mode PPO): the final observation at truncated steps, the observation
    after the last step where it did not end an episode, zeros everywhere else (terminations too);
    and the actor's next_value is its critic on exactly that observation."""
    cfg = cfg_for(env_id, max_episode_steps=5)
    env = make_env(env_id, 3, cfg.env.cfg)
    policy = make_policy(cfg, env.spec)
    col = Collector(env, policy, num_steps=12, seed=0, bootstrap_obs=True)
    finals = record_final_obs(env)
    for _ in range(2):                               # the second rollout reuses a storage: re-zeroed
        finals.clear()
        td, _, _ = col.collect(version=0)
        boot, term, done = td[keys.BOOTSTRAP_OBS], td[keys.TERMINATED], td[keys.DONE]
        assert boot.shape == td[keys.OBS].shape
        need = ~term & (done | torch.arange(12).eq(11).expand(3, 12))
        assert need[:, 11].any() and (done & ~term).any()
        for t in range(12):
            for e in range(3):
                if need[e, t]:
                    torch.testing.assert_close(boot[e, t], finals[t][e])
                else:
                    assert not boot[e, t].any()
        with torch.no_grad():
            v = policy.get_value(TensorDict({keys.OBS: boot[need]}, [int(need.sum())]))
        torch.testing.assert_close(td[keys.NEXT_VALUE][need], v)
    assert keys.BOOTSTRAP_OBS not in Collector(env, policy, num_steps=4, seed=0).collect(0)[0].keys()


def test_collector_zero_bootstrap_on_termination():
    cfg = cfg_for("CartPole-v1")
    env = make_env("CartPole-v1", 4)
    col = Collector(env, make_policy(cfg, env.spec), num_steps=64, seed=1)
    td, stats, _ = col.collect(version=0)
    term = td[keys.TERMINATED]
    assert term.any(), "random CartPole policy should fall within 64 steps"
    assert (td[keys.NEXT_VALUE][term] == 0).all()
    assert len(stats.episode_returns) == int(td[keys.DONE].sum())


def test_collector_alternates_storage():
    cfg = cfg_for("CartPole-v1")
    env = make_env("CartPole-v1", 2)
    col = Collector(env, make_policy(cfg, env.spec), num_steps=4, seed=0)
    a, _, ia = col.collect(0)
    b, _, ib = col.collect(0)
    assert ia != ib and a[keys.OBS].data_ptr() != b[keys.OBS].data_ptr()


@pytest.mark.parametrize("env_id", ["CartPole-v1", "Pendulum-v1"])
def test_policy_log_prob_matches_evaluate_actions(env_id):
    cfg = cfg_for(env_id)
    env = make_env(env_id, 5)
    policy = make_policy(cfg, env.spec)
    td = policy(TensorDict({keys.OBS: env.reset(seed=0)}, [5]))
    logp, entropy, value = policy.evaluate_actions(td)
    torch.testing.assert_close(logp, td[keys.LOG_PROB])
    torch.testing.assert_close(value, td[keys.VALUE])
    assert entropy.shape == (5,)
    with torch.no_grad():      # the log-prob alone (the ewma proximal policy's pass): the same numbers
        policy.log_std.data.normal_() if hasattr(policy, "log_std") else None
        torch.testing.assert_close(policy.action_log_prob(td), policy.evaluate_actions(td)[0], rtol=1e-6, atol=1e-6)
    det1 = policy(TensorDict({keys.OBS: td[keys.OBS]}, [5]), deterministic=True)[keys.ACTION]
    det2 = policy(TensorDict({keys.OBS: td[keys.OBS]}, [5]), deterministic=True)[keys.ACTION]
    assert torch.equal(det1, det2)


def test_normaliser_statistics_travel_with_the_weights():
    cfg = cfg_for("Pendulum-v1")
    env = make_env("Pendulum-v1", 2)
    learner_side = make_policy(cfg, env.spec)
    learner_side.update_normalizer(torch.randn(100, 3) * 5 + 2)
    frames = wire.encode(weights_td(learner_side), kind="weights", version=1)
    td, meta = wire.decode([bytes(f) for f in frames])
    actor_side = make_policy(cfg, env.spec)
    load_weights_(actor_side, td)
    for k, v in learner_side.state_dict().items():
        assert torch.equal(actor_side.state_dict()[k], v), k
    assert meta == {"kind": "weights", "version": 1}


def test_load_weights_names_mismatch():
    a = make_policy(cfg_for("Pendulum-v1"), make_env("Pendulum-v1", 1).spec)
    b = make_policy(cfg_for("CartPole-v1"), make_env("CartPole-v1", 1).spec)
    with pytest.raises(ValueError, match="weights"):
        load_weights_(a, weights_td(b))


def test_running_mean_std_equals_batch_statistics():
    rms = RunningMeanStd((3,), epsilon=0.0)
    chunks = [torch.randn(n, 3, dtype=torch.float64) * 3 + 1 for n in (5, 17, 40)]
    for c in chunks:
        rms.update(c)
    full = torch.cat(chunks)
    torch.testing.assert_close(rms.mean, full.mean(0))
    torch.testing.assert_close(rms.var, full.var(0, unbiased=False))


def test_reward_scaler_tracks_discounted_returns_per_actor():
    scaler = RewardScaler(gamma=0.5)
    reward = torch.ones(1, 4)
    done = torch.tensor([[False, True, False, False]])
    scaler.observe(0, reward, done)
    # returns: 1, 1.5 (episode ends), 1, 1.5
    torch.testing.assert_close(scaler.stats.mean, torch.tensor(1.25, dtype=torch.float64), atol=1e-3, rtol=1e-3)
    scaler.observe(0, reward[:, :1], torch.tensor([[False]]))    # continues from 1.5: 1.75
    assert scaler._returns[0].item() == pytest.approx(1.75)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("env_id", ["tandem/Pendulum-v0", "Pendulum-v1"])
def test_collector_on_cuda_returns_pinned_host_rollout(env_id):
    cfg = cfg_for(env_id)
    env = make_env(env_id, 4, {}, "cuda:0")
    policy = make_policy(cfg, env.spec).to("cuda:0")
    td, _, _ = Collector(env, policy, num_steps=8, seed=0).collect(version=1)
    assert td[keys.OBS].device.type == "cpu" and td[keys.OBS].is_pinned()
    assert torch.isfinite(td[keys.NEXT_VALUE]).all() and (td[keys.POLICY_VERSION] == 1).all()


def test_steps_reach_a_cpu_collector_by_copies_that_wait():
    """A GPU simulator whose policy acts on the CPU (an inference server's actor): the step's tensors
    come to the host by copies that wait. ``non_blocking`` towards the host may return before the bytes
    arrive, and the collector reads them at once (rewards recorded, observations sent to the server)."""
    from types import SimpleNamespace

    from shared.envs.base import StepResult
    asked: list[bool] = []

    class Spy(torch.Tensor):   # records every .to(): where, and whether it waits
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if func is torch.Tensor.to:
                asked.append(bool((kwargs or {}).get("non_blocking", False)))
            return super().__torch_function__(func, types, args, kwargs or {})

    def spy(t):
        return t.as_subclass(Spy)

    step = StepResult(spy(torch.zeros(4, 3)), spy(torch.ones(4)), spy(torch.zeros(4, dtype=torch.bool)),
                      spy(torch.zeros(4, dtype=torch.bool)), spy(torch.zeros(4, 3)), [], [])
    Collector._to_device(SimpleNamespace(device=torch.device("cpu")), step)
    assert asked == [False] * 5
    asked.clear()
    Collector._to_device(SimpleNamespace(device=torch.device("meta")), step)   # any device but a GPU: waits too
    assert asked == [False] * 5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_gpu_simulator_with_a_cpu_policy_records_what_the_env_returned():
    """The rollout holds the rewards and observations the GPU env gave (read back by waiting copies)."""
    cfg = cfg_for("tandem/Pendulum-v0")
    env = make_env("tandem/Pendulum-v0", 256, {}, "cuda:0")
    seen = []
    step = env.step

    def recording_step(action):
        out = step(action)
        seen.append((out.reward.clone(), out.obs.clone()))   # on the device: what the env returned
        torch.cuda._sleep(20_000_000)   # the collector's copies queue behind this: a copy that does not wait reads early
        return out

    env.step = recording_step
    policy = make_policy(cfg, env.spec)                   # on the CPU
    td, _, _ = Collector(env, policy, num_steps=16, seed=0).collect(version=1)
    torch.cuda.synchronize()
    for t, (reward, obs) in enumerate(seen):
        assert torch.equal(td[keys.REWARD][:, t], reward.cpu())
        if t + 1 < len(seen):
            assert torch.equal(td[keys.OBS][:, t + 1], obs.cpu())


def test_normaliser_and_reward_scale_combine_exactly_over_learner_ranks():
    """Several learner ranks: each folds in its own batch with the moments summed over ranks, and
    ends with the statistics of the union, identical on every rank (here two ranks, simulated)."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(50, 3, generator=g, dtype=torch.float64) * 5 + 1000
    b = torch.randn(70, 3, generator=g, dtype=torch.float64) * 5 + 1000
    one = RunningMeanStd((3,))
    one.update(torch.cat([a, b]))
    ranks = [RunningMeanStd((3,)), RunningMeanStd((3,))]
    m = ranks[0].mean.clone()
    total = sum(torch.stack([torch.full_like(m, float(x.shape[0])), (x - m).sum(0), (x - m).pow(2).sum(0)])
                for x in (a, b))
    for r, x in zip(ranks, (a, b)):
        r.update(x, all_reduce=lambda t: total)
    torch.testing.assert_close(ranks[0].mean, one.mean)
    torch.testing.assert_close(ranks[0].var, one.var, rtol=1e-9, atol=1e-9)
    assert torch.equal(ranks[0].mean, ranks[1].mean) and torch.equal(ranks[0].var, ranks[1].var)
    # reward scale: the std over both ranks' returns (returns near 0: each rank's running-std prior,
    # a 1e-4 count at mean 0, is then negligible)
    s0, s1 = RewardScaler(0.9), RewardScaler(0.9)
    a, b = a - 1000, b - 1000
    s0.stats.update(a[:, 0])
    s1.stats.update(b[:, 0])
    parts = [torch.stack([s.stats.count, s.stats.count * s.stats.mean, s.stats.count * (s.stats.var + s.stats.mean ** 2)])
             for s in (s0, s1)]
    both = RunningMeanStd(())
    both.update(a[:, 0])
    both.update(b[:, 0])
    assert s0.std(lambda t: parts[0] + parts[1]) == pytest.approx(float((both.var + s0.eps).sqrt()), rel=1e-5)


def test_a_gpu_simulator_spec_is_known_without_building_it(monkeypatch):
    """The learner needs only the spec: for MuJoCo Warp it comes from C MuJoCo's model, with no Warp
    device and no kernels compiled (a GPU machine's learner must not compile Warp's CPU kernels)."""
    pytest.importorskip("mujoco")
    from shared.envs import env_spec
    from shared.envs.mjwarp import MJWarpHalfCheetah
    from learner.learner import env_spec_of

    def refuse(*args, **kwargs):
        raise AssertionError("the simulator was built for its spec")

    monkeypatch.setattr(MJWarpHalfCheetah, "__init__", refuse)
    spec = env_spec("tandem/MJWarpHalfCheetah-v0", {"max_episode_steps": 7})
    ref = gym.make("HalfCheetah-v5")
    assert spec.obs_shape == ref.observation_space.shape and spec.action.shape == ref.action_space.shape
    assert spec.action.low == tuple(ref.action_space.low.tolist()) and spec.max_episode_steps == 7
    ref.close()
    assert env_spec("tandem/MJWarpHalfCheetah-v0").max_episode_steps == 1000
    with pytest.raises(ValueError, match=r"env\.cfg\.bogus: unknown key"):   # as building the env would
        env_spec("tandem/MJWarpHalfCheetah-v0", {"bogus": 1})
    cfg = config_from_dict({"env": {"id": "tandem/MJWarpHalfCheetah-v0", "cfg": {"frame_skip": 4}}})
    assert env_spec_of(cfg).obs_shape == (17,)
    # envs without a description are built once on the CPU, as before
    assert env_spec("tandem/Reach-v0", {}).action.shape == (2,)
