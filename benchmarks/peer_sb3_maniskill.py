"""The peer run for ManiSkill3 state PPO: Stable-Baselines3 PPO, one process, on the same task, control
mode, hyperparameters and step budget as a Tandem config (``configs/maniskill_pushcube_ppo.json`` by
default), with deterministic evaluations at the same env-step marks.

ManiSkill's own PPO baseline (``examples/baselines/ppo/ppo.py``) builds its envs with
``sim_backend="physx_cuda"`` and ``ManiSkillVectorEnv``; on the CPU backend a ManiSkill env holds one
scene, so that script cannot batch envs without a GPU. SB3 with a ``DummyVecEnv`` of single-scene
envs is the one-process loop a CPU user would write instead.

SB3 is not a Tandem dependency: install it beside the project (it needs ``cloudpickle`` and ``pandas``)::

    pip install stable-baselines3
    python benchmarks/peer_sb3_maniskill.py [--config configs/maniskill_pushcube_ppo.json] [--out DIR]

Prints, and writes to ``OUT/peer_sb3.json``: wall time (training only; evaluations are paused
out of it), and for every evaluation: env steps, wall time and deterministic success rate.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch


def _env_factory(gym, task: str, env_cfg: dict):
    """``factory(seed)``: a function that makes one seeded ManiSkill `task` env the way SB3 takes it."""
    from mani_skill.utils.wrappers.gymnasium import CPUGymWrapper
    kwargs = dict(obs_mode="state", control_mode=env_cfg["control_mode"],
                  reward_mode=env_cfg.get("reward_mode", "normalized_dense"), sim_backend="physx_cpu")

    class Renamed(gym.Wrapper):
        """ManiSkill's metrics under info["metrics"]: SB3 reads info["episode"] as its own."""
        def step(self, action):
            obs, reward, terminated, truncated, info = self.env.step(action)
            info["metrics"] = info.pop("episode")
            return obs, reward, terminated, truncated, info

    def factory(seed: int):
        def make():
            # Tandem's episodes run to the time limit unless terminate_on_success: the same here
            env = CPUGymWrapper(gym.make(task, num_envs=1, **kwargs), record_metrics=True,
                                ignore_terminations=not env_cfg.get("terminate_on_success", False))
            env = Renamed(env)
            env.reset(seed=seed)
            return env
        return make
    return factory


def _ppo(cfg: dict, venv):
    """SB3's PPO with the config's hyperparameters and network."""
    from stable_baselines3 import PPO
    t, a = cfg["trainer"], cfg["algorithm"]["cfg"]
    hidden = cfg["policy"]["actor"]["network_cfg"]["hidden_sizes"]
    act = {"tanh": torch.nn.Tanh, "relu": torch.nn.ReLU}[cfg["policy"]["actor"]["network_cfg"]["activation"]]
    return PPO("MlpPolicy", venv, learning_rate=a["learning_rate"], n_steps=t["buffer_size"],
               batch_size=a["batch_size"], n_epochs=a["n_epochs"], gamma=a["gamma"], gae_lambda=a["gae_lambda"],
               clip_range=a["clip_coef"], ent_coef=a["ent_coef"], vf_coef=a["vf_coef"],
               max_grad_norm=a["max_grad_norm"], seed=t["seed"], device="cpu", verbose=0,
               policy_kwargs=dict(net_arch=dict(pi=hidden, vf=hidden), activation_fn=act,
                                  log_std_init=cfg["policy"].get("log_std_init", 0.0)))


def _success_rate(model, venv, eval_env, eval_n: int, episodes: int) -> float:
    """The deterministic policy's success rate over `episodes` episodes of `eval_env` (`venv`'s
    observation statistics)."""
    eval_env.obs_rms = venv.obs_rms
    successes: list[bool] = []
    obs = eval_env.reset()
    done_once = np.zeros(eval_n, dtype=bool)
    while len(successes) < episodes:
        action, _ = model.predict(obs, deterministic=True)
        obs, _, dones, infos = eval_env.step(action)
        for i in np.flatnonzero(dones):
            successes.append(bool(infos[i]["metrics"]["success_once"]))   # as Tandem counts it
        done_once |= dones
    return float(np.mean(successes[:episodes]))


def _marks(eval_freq: int, evaluate):
    """An SB3 callback that evaluates every `eval_freq` env steps, its time kept out of the wall time."""
    from stable_baselines3.common.callbacks import BaseCallback

    class Marks(BaseCallback):
        def __init__(self):
            super().__init__()
            self.next, self.rows, self.paused, self.t0 = eval_freq, [], 0.0, time.perf_counter()

        def _on_step(self) -> bool:
            if self.num_timesteps >= self.next:
                self.next += eval_freq
                wall = time.perf_counter() - self.t0 - self.paused
                e0 = time.perf_counter()
                rate = evaluate()
                self.paused += time.perf_counter() - e0
                self.rows.append({"env_steps": self.num_timesteps, "wall_s": round(wall, 1), "success_rate": rate})
                print(f"[sb3] {self.num_timesteps:>8} steps  {wall:7.1f} s  success {rate:.2f}", flush=True)
            return True
    return Marks()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=Path("configs/maniskill_pushcube_ppo.json"))
    p.add_argument("--out", type=Path, default=Path("outputs/peer_sb3"))
    p.add_argument("--steps", type=int, default=None, help="env steps (default: the config's total_steps)")
    args = p.parse_args()

    from stable_baselines3.common.vec_env import DummyVecEnv, VecMonitor, VecNormalize

    from shared.envs.maniskill import import_maniskill
    gym, _ = import_maniskill()

    cfg = json.loads(args.config.read_text())
    t, a, env_cfg = cfg["trainer"], cfg["algorithm"]["cfg"], cfg["env"]["cfg"]
    task = cfg["env"]["id"].split("/", 1)[1]
    n_envs = cfg["actors"]["num_actors"] * cfg["actors"]["num_envs"]
    total = args.steps or t["total_steps"]
    factory = _env_factory(gym, task, env_cfg)
    venv = VecNormalize(VecMonitor(DummyVecEnv([factory(t["seed"] * 1000 + i) for i in range(n_envs)])),
                        norm_obs=bool(cfg["policy"].get("normalize_obs")), norm_reward=bool(a.get("normalize_reward")),
                        gamma=a["gamma"])
    eval_n = 10
    eval_env = VecNormalize(DummyVecEnv([factory(10_000 + i) for i in range(eval_n)]), training=False,
                            norm_obs=venv.norm_obs, norm_reward=False)
    model = _ppo(cfg, venv)
    episodes = t["num_eval_episodes"]

    def evaluate() -> float:
        return _success_rate(model, venv, eval_env, eval_n, episodes)

    marks = _marks(t["eval_freq"], evaluate)
    torch.set_num_threads(2)
    model.learn(total_timesteps=total, callback=marks)
    wall = time.perf_counter() - marks.t0 - marks.paused
    final = evaluate()
    print(f"[sb3] {task} {env_cfg['control_mode']}: {total} env steps in {wall:.1f} s (training only), "
          f"final deterministic success {final:.2f} over {episodes} episodes")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "peer_sb3.json").write_text(json.dumps(
        {"task": task, "config": str(args.config), "env_steps": total, "wall_s": round(wall, 1), "final_success": final,
         "evals": marks.rows, "n_envs": n_envs}, indent=2) + "\n")


if __name__ == "__main__":
    main()
