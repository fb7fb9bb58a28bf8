"""CUDA paths of the learner, the actor, the shared-memory weights and the action-token VLA.

Skipped without CUDA. ``TANDEM_TEST_CUDA_DEVICE=cpu`` runs them on the CPU instead, to check the
tests themselves on a machine without a GPU (they then compare the CPU with itself)."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict
from torch import nn

from actors.actor import Actor
from actors.rollout import Collector
from learner.learner import Learner, ListPublisher
from shared import keys
from shared.config import load_config
from shared.envs import make_env
from shared.policies import make_policy, weights_td
from shared.policies.action_tokens import PaliGemmaActionTokenPolicy
from shared.shm_weights import ShmWeightsReader, load_published_
from tests.test_envs_policies import cfg_for
from tests.test_learner_component import CaptureSink, PublisherSource, serial_run, small_config, wired

DEV = os.environ.get("TANDEM_TEST_CUDA_DEVICE", "cuda:0")
ROOT = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(DEV.startswith("cuda") and not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(autouse=True)
def exact_float32():
    """TF32 matrix products and convolutions would make CUDA differ from the CPU by ~1e-3."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def on(cfg, device: str = DEV):
    cfg.learner.device = device
    cfg.actors.devices = [device]
    return cfg


def cpu_weights(policy) -> TensorDict:
    return weights_td(policy).to("cpu")


def assert_weights_close(a, b, atol: float) -> None:
    wa, wb = cpu_weights(a), cpu_weights(b)
    assert set(wa.keys(include_nested=True, leaves_only=True)) == set(wb.keys(include_nested=True, leaves_only=True))
    for k, t in wa.items(include_nested=True, leaves_only=True):
        torch.testing.assert_close(t, wb[k], atol=atol, rtol=1e-4, msg=lambda m: f"{k}: {m}")


def test_learner_and_actor_on_the_device_train_and_agree_on_weights():
    cfg = on(small_config(buffer_type="vla", buffer_capacity=4, max_policy_lag=10))
    learner, trained, published, actor = serial_run(cfg, 3)
    assert next(learner.policy.parameters()).device == torch.device(DEV)
    assert next(actor.policy.parameters()).device == torch.device(DEV)
    assert [int(t[keys.POLICY_VERSION].min()) for t in trained] == [0, 1, 2]
    assert learner.version == 3 and published[-1][1]["version"] == 3
    assert actor.step_once() and actor.version == 3
    assert_weights_close(actor.policy, learner.policy, atol=0)


def test_one_update_on_the_device_matches_the_cpu_on_the_same_rollout():
    cfg_cpu = small_config()
    learner_cpu, _, sink, actor = wired(cfg_cpu)
    assert actor.step_once()
    td, meta = sink.messages[-1]
    learner_dev = Learner(on(small_config()), run_dir=None, publisher=ListPublisher())
    assert_weights_close(learner_dev.policy, learner_cpu.policy, atol=0)     # same seed, same initial weights
    for learner in (learner_cpu, learner_dev):
        learner.ingest(td.clone(), {**meta, "incarnation": learner.incarnation})   # as if each had published v0
        learner.update_once(*learner.take_batch(timeout_s=0))
    assert learner_cpu.version == learner_dev.version == 1
    assert_weights_close(learner_dev.policy, learner_cpu.policy, atol=1e-4)


class Greedy(nn.Module):
    """A policy acting with its mean action: a CPU simulator then sees the same actions whichever
    device the policy runs on (sampling would draw from each device's own generator)."""

    def __init__(self, policy: nn.Module):
        super().__init__()
        self.inner, self.critic = policy, policy.critic

    def forward(self, td):
        return self.inner(td, deterministic=True)

    def get_value(self, td):
        return self.inner.get_value(td)


def test_a_device_actor_sends_the_rollout_it_collected_and_the_cpu_collects_the_same():
    """Rollouts are assembled on the device and copied into pinned host memory without blocking,
    two storages in turn. Each host rollout equals its device storage as it was when collected
    (not as the next rollout leaves it), and the same greedy policy on the CPU, on the same CPU
    simulator and seed, collects the same steps (truncation and its bootstrap value included)."""
    cfg = cfg_for("Pendulum-v1")
    torch.manual_seed(0)
    base = make_policy(cfg, make_env("Pendulum-v1", 1).spec)
    runs = {}
    for device in ("cpu", DEV):
        env = make_env("Pendulum-v1", 4, {"max_episode_steps": 12})
        collector = Collector(env, Greedy(copy.deepcopy(base).to(device)), num_steps=8, seed=3)
        rollouts, at_collection = [], []
        for version in (1, 2):
            td, _, idx = collector.collect(version=version)
            assert td[keys.OBS].device.type == "cpu" and idx == version - 1
            assert td[keys.OBS].is_pinned() == (torch.device(device).type == "cuda")
            rollouts.append(td)
            at_collection.append((collector._dev if collector._dev is not None else td).to("cpu").clone())
        for td, then in zip(rollouts, at_collection):     # the first is intact after the second
            assert (td == then).all(), f"{device}: a host rollout differs from what was collected"
        runs[device] = torch.cat([t.clone() for t in rollouts], dim=1)
        env.close()
    cpu, dev = runs["cpu"], runs[DEV]
    assert bool(cpu[keys.TRUNCATED].any())                 # step 12 truncates: bootstrap values taken
    for k in (keys.DONE, keys.TERMINATED, keys.TRUNCATED, keys.POLICY_VERSION):
        assert torch.equal(cpu[k], dev[k]), k
    for k in (keys.OBS, keys.ACTION, keys.LOG_PROB, keys.REWARD, keys.VALUE, keys.NEXT_VALUE):
        torch.testing.assert_close(dev[k], cpu[k], atol=1e-5, rtol=1e-5, msg=lambda m: f"{k}: {m}")


def test_shared_memory_weights_from_a_device_learner_reach_a_device_actor():
    cfg = on(small_config(buffer_type="vla"))
    cfg.learner.weights_transport = "shm"
    pub = ListPublisher()
    learner = Learner(cfg, run_dir=None, publisher=pub)
    try:
        learner.publish()
        sink = CaptureSink()
        actor = Actor(cfg, 0, PublisherSource(pub), sink)
        assert actor.step_once()
        learner.ingest(*sink.messages[-1])
        learner.update_once(*learner.take_batch(timeout_s=0))
        assert actor.step_once() and actor.version == 1
        assert_weights_close(actor.policy, learner.policy, atol=0)
        actor.close()
        fresh = Actor(cfg, 0, PublisherSource(pub), CaptureSink())
        reader = ShmWeightsReader()
        assert load_published_(fresh.policy, *pub.published[-1], reader, DEV)
        reader.close()
        assert_weights_close(fresh.policy, learner.policy, atol=0)
        fresh.close()
    finally:
        learner.shm_writer.close()


def reach_obs(n: int, device: str) -> TensorDict:
    g = torch.Generator().manual_seed(0)
    return TensorDict({"rgb": torch.randint(0, 256, (n, 16, 16, 3), generator=g, dtype=torch.uint8),
                       "proprio": torch.randn(n, 4, generator=g),
                       "instruction": torch.randint(0, 100, (n, 8), generator=g)}, batch_size=[n]).to(device)


@pytest.mark.parametrize("decoding", ["parallel", "autoregressive"])
def test_action_token_log_probs_and_entropy_on_the_device_match_the_cpu(decoding):
    torch.manual_seed(0)
    cpu = PaliGemmaActionTokenPolicy(size="tiny", action_dim=2, decoding=decoding).eval()
    dev = PaliGemmaActionTokenPolicy(size="tiny", action_dim=2, decoding=decoding).eval()
    dev.load_state_dict(cpu.state_dict())
    dev.to(DEV)
    with torch.no_grad():
        d_cpu, d_dev = cpu.action_dist(reach_obs(6, "cpu")), dev.action_dist(reach_obs(6, DEV))
        a = d_cpu.sample()
        torch.testing.assert_close(d_dev.log_prob(a.to(DEV)).cpu(), d_cpu.log_prob(a), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(d_dev.entropy().cpu(), d_cpu.entropy(), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(dev.value(reach_obs(6, DEV)).cpu(), cpu.value(reach_obs(6, "cpu")),
                                   atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bf16-autocast"])
def test_lora_action_token_vla_trains_on_the_device_and_publishes_only_what_trains(autocast):
    cfg = on(load_config(ROOT / "configs" / "vla_tokens_reach_smoke.json",
                         ["actors.num_actors=1", "actors.num_envs=4", "trainer.buffer_size=8",
                          "algorithm.cfg.batch_size=16", f"policy.vla_config.autocast={str(autocast).lower()}"]))
    learner, trained, published, actor = serial_run(cfg, 2)
    assert learner.version == 2
    weights, meta = published[-1]
    names = list(weights.keys(include_nested=True, leaves_only=True))
    dotted = [k if isinstance(k, str) else ".".join(k) for k in names]
    assert dotted and all("lora_" in k or "value_head" in k for k in dotted), dotted   # the base stays home
    assert sum(weights[k].numel() for k in names) == sum(p.numel() for p in learner.policy.parameters()
                                                        if p.requires_grad)
    for t in trained:
        assert torch.isfinite(t[keys.LOG_PROB]).all()
    assert actor.step_once() and actor.version == 2
    assert_weights_close(actor.policy, learner.policy, atol=0)


@pytest.mark.parametrize("env_id", ["tandem/Reach-v0", "tandem/Pendulum-v0"])
def test_a_seed_is_the_same_episode_on_the_device_as_on_the_cpu(env_id):
    """Torch-native envs draw their scenes and initial states on the CPU, so that an evaluation seed (or a
    GRPO group's seed) plays the same episode on every device: the same actions from the same seeds give
    the same observations and rewards, auto-resets included."""
    cfg = {"group_goals": "rotate"} if "Reach" in env_id else {}
    n, act_dim = 8, (2 if "Reach" in env_id else 1)
    tol = 1e-5 if "Reach" in env_id else 1e-3     # the pendulum's sin/cos on the device round differently
    for seed in (12345, [7, 7, 7, 7, 40, 40, 40, 40]):
        cpu, dev = make_env(env_id, n, cfg, "cpu"), make_env(env_id, n, cfg, DEV)
        o_cpu, o_dev = cpu.reset(seed=seed), dev.reset(seed=seed)
        g = torch.Generator().manual_seed(1)
        for _ in range(70):                       # past Reach's 30-step limit: auto-resets draw new scenes
            torch.testing.assert_close(o_dev.cpu() if isinstance(o_dev, torch.Tensor) else o_dev.to("cpu"),
                                       o_cpu, atol=tol, rtol=tol)
            a = torch.rand(n, act_dim, generator=g) * 2 - 1
            r_cpu, r_dev = cpu.step(a), dev.step(a.to(DEV))
            torch.testing.assert_close(r_dev.reward.cpu(), r_cpu.reward, atol=10 * tol, rtol=10 * tol)
            o_cpu, o_dev = r_cpu.obs, r_dev.obs
        cpu.close()
        dev.close()


@pytest.mark.parametrize("form", ["none", "is/vtrace/appo", "mask", "ewma"])
def test_graph_mode_equals_eager_on_the_device(form):
    """learner.compile "graph" on CUDA: the minibatch step captured once per minibatch size and
    replayed, against the eager loop on the same device: the same steps taken, and the weights equal
    to rounding (cuBLAS may pick other kernels inside a capture). A learning rate changed between
    updates reaches the captured step (a device tensor, filled in place), and so do the observation
    normaliser's statistics (updated in place after every update, never read from a stale copy)."""
    from learner.corrections import resolve
    from learner.fast_epochs import MinibatchStep
    from learner.learner import make_optimizer
    from learner.ppo import ppo_update
    from learner.proximal import EWMAProximal
    from shared.config import PPOConfig
    from tests.test_fast_epochs import LOSS_FORMS
    from tests.test_ppo import _actor_critic_batch
    renormalize, with_mask, with_prox = LOSS_FORMS[form]
    results = []
    for mode in ("off", "graph"):
        _, policy, td = _actor_critic_batch(300, seed=3, with_mask=with_mask)
        policy, td = policy.to(DEV), td.to(DEV)
        cfg = resolve(PPOConfig(n_epochs=3, batch_size=64, clip_vloss=True, max_grad_norm=0.5,
                                correction="ewma" if with_prox else "none"))
        opt = make_optimizer(policy, 1e-3, 1e-5)
        prox = EWMAProximal(policy, 0.9) if with_prox else None
        step = MinibatchStep(mode, policy, opt, 0.5) if mode == "graph" else None
        gen = torch.Generator().manual_seed(0)
        stats = []
        for update, lr in enumerate((1e-3, 5e-4, 2.5e-4)):   # updates 2 and 3 replay the captured graphs
            for g in opt.param_groups:
                if torch.is_tensor(g["lr"]):
                    g["lr"].fill_(lr)
                else:
                    g["lr"] = lr
            stats.append(ppo_update(policy, opt, td, cfg, gen, renormalize=renormalize, proximal=prox, step=step))
            policy.update_normalizer(td[keys.OBS] * (update + 2))   # as the learner does: in place, between replays
        results.append(({k: v.cpu() for k, v in policy.state_dict().items()}, stats, step))
    (w0, s0, _), (w1, s1, step) = results
    if DEV.startswith("cuda"):
        assert step.capture and len(step._graphs) == 2       # full and short minibatch
    assert [s["steps"] for s in s0] == [s["steps"] for s in s1] == [15, 15, 15]
    for k in w0:
        torch.testing.assert_close(w0[k], w1[k], atol=1e-5, rtol=1e-4, msg=k)


@pytest.mark.parametrize("correction", ["vtrace", "trust"])
def test_a_learner_in_graph_mode_on_the_device_trains_what_eager_trains(tmp_path, correction):
    """The whole learner on the device (vla mode, stale data, the correction refreshed before every
    epoch), learner.compile "graph" against "off": on CUDA the step is captured, and trust's clip,
    which changes with every update's lag, reaches the captured graph through its device tensor."""
    from learner.logs import RunLogger
    from tests.test_staleness import _weights_after_stale_updates
    weights = []
    for mode in ("off", "graph"):
        cfg = on(small_config(buffer_type="vla", max_policy_lag=3, buffer_capacity=8))
        cfg.algorithm.cfg.correction, cfg.algorithm.cfg.advantages_every, cfg.algorithm.cfg.n_epochs = correction, "epoch", 3
        cfg.learner.compile = mode
        run = tmp_path / mode
        run.mkdir()
        learner = Learner(cfg, run, ListPublisher(), logger=RunLogger(run, use_tensorboard=False))
        learner.publish()
        weights.append({k: v.cpu() for k, v in _weights_after_stale_updates(cfg, learner, 3).items()})
        if mode == "graph" and DEV.startswith("cuda"):
            assert learner.algorithm.step is not None and learner.algorithm.step.capture
    for k in weights[0]:
        torch.testing.assert_close(weights[0][k], weights[1][k], atol=1e-5, rtol=1e-4, msg=k)
