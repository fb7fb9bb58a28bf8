"""MuJoCo Warp (``mujoco-warp``): MuJoCo's batched GPU simulator, as a :class:`BatchedEnv`.

``tandem/MJWarpHalfCheetah-v0`` is gymnasium's HalfCheetah-v5 (same MJCF model, frame skip 5,
observation ``qpos[1:] ++ qvel``, reward ``forward velocity - 0.1 |a|^2``, no termination, truncated
at 1000 steps, reset noise U(+-0.1) on qpos and 0.1 N(0, 1) on qvel) simulated for all envs at once
by MuJoCo Warp on the actor's device: ``cuda:N`` on a GPU, ``cpu`` through Warp's CPU backend
(about half the speed of single-threaded C MuJoCo here, but it runs the same kernels: tests and
development work without a GPU). The simulator state lives in Warp arrays; actions go in and
observations come out as torch tensors that share their memory (``wp.to_torch``, zero-copy), and
stay on the device until the actor's collector copies the finished rollout to pinned host memory.

The ``frame_skip`` physics steps of an env step and the masked reset are recorded once as Warp
graphs (CUDA graphs on a GPU; Warp >= 1.19 records CPU launches too) and replayed: a step costs one
launch instead of ~100 kernel launches from Python.

Needs ``pip install 'tandem-rl[warp]'`` (mujoco-warp, warp-lang). The first use on a machine compiles
the kernels (once; cached in ``~/.cache/warp``).
"""

from __future__ import annotations

import inspect
from pathlib import Path

import torch

from shared.envs.base import ActionSpec, EnvSpec, StepResult


def _half_cheetah_xml() -> str:
    import gymnasium
    path = Path(gymnasium.__file__).parent / "envs" / "mujoco" / "assets" / "half_cheetah.xml"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: gymnasium's HalfCheetah model is missing (gymnasium[mujoco] >= 1.0)")
    return str(path)


class MJWarpHalfCheetah:
    """HalfCheetah-v5 for ``num_envs`` worlds on one MuJoCo Warp device."""

    def __init__(self, num_envs: int, device: str | torch.device = "cpu", frame_skip: int = 5,
                 forward_reward_weight: float = 1.0, ctrl_cost_weight: float = 0.1,
                 reset_noise_scale: float = 0.1, max_episode_steps: int = 1000, use_graph: bool = True):
        try:
            import mujoco
            import mujoco_warp as mjw
            import warp as wp
        except ImportError as e:
            raise ImportError(f"tandem/MJWarpHalfCheetah-v0 needs MuJoCo Warp: pip install 'tandem-rl[warp]' "
                              f"({e})") from e
        self._wp, self._mjw = wp, mjw
        if hasattr(wp, "LOG_WARNING"):   # no per-kernel "module load" lines in the actors' logs
            wp.config.log_level = wp.LOG_WARNING
        wp.init()
        self.device = torch.device(device)
        self.num_envs, self.frame_skip, self.max_episode_steps = num_envs, frame_skip, max_episode_steps
        self.w_fwd, self.w_ctrl, self.noise = forward_reward_weight, ctrl_cost_weight, reset_noise_scale
        self.mjm = mujoco.MjModel.from_xml_path(_half_cheetah_xml())
        self.dt = float(self.mjm.opt.timestep) * frame_skip
        lo, hi = self.mjm.actuator_ctrlrange.T
        self.spec = self._spec(self.mjm, max_episode_steps)
        self._wp_device = wp.get_device(str(self.device) if self.device.type == "cuda" else "cpu")
        with wp.ScopedDevice(self._wp_device):
            self.m = mjw.put_model(self.mjm)
            self.d = mjw.make_data(self.mjm, nworld=num_envs)
            self._mask_wp = wp.zeros(num_envs, dtype=wp.bool)
            self._step_graph = self._reset_graph = None
            if use_graph:
                mjw.step(self.m, self.d)                      # compiles every kernel before capture
                mjw.reset_data(self.m, self.d, reset=self._mask_wp)
                with wp.ScopedCapture() as cap:
                    for _ in range(frame_skip):
                        mjw.step(self.m, self.d)
                self._step_graph = cap.graph
                with wp.ScopedCapture() as cap:
                    mjw.reset_data(self.m, self.d, reset=self._mask_wp)
                self._reset_graph = cap.graph
            mjw.reset_data(self.m, self.d)
        # Zero-copy torch views of the simulator state (their storage never moves).
        self.qpos, self.qvel = wp.to_torch(self.d.qpos), wp.to_torch(self.d.qvel)
        self.ctrl, self._mask = wp.to_torch(self.d.ctrl), wp.to_torch(self._mask_wp)
        dev = self.qpos.device
        self._qpos0 = torch.as_tensor(self.mjm.qpos0, dtype=torch.float32, device=dev)
        self._low = torch.as_tensor(lo, dtype=torch.float32, device=dev)
        self._high = torch.as_tensor(hi, dtype=torch.float32, device=dev)
        self.t = torch.zeros(num_envs, dtype=torch.int64, device=dev)
        self.ep_return = torch.zeros(num_envs, dtype=torch.float64, device=dev)
        self._gen = torch.Generator().manual_seed(0)

    @staticmethod
    def _spec(mjm, max_episode_steps: int) -> EnvSpec:
        lo, hi = mjm.actuator_ctrlrange.T
        return EnvSpec(obs_shape=(mjm.nq - 1 + mjm.nv,), obs_dtype=torch.float32,
                       action=ActionSpec(kind="box", shape=(mjm.nu,), low=tuple(map(float, lo)),
                                         high=tuple(map(float, hi))),
                       max_episode_steps=max_episode_steps)

    @classmethod
    def spec_for(cls, **kwargs) -> EnvSpec:
        """The spec for these keyword arguments (``env.cfg``), from C MuJoCo's model alone: no Warp
        device, no kernels compiled (the learner needs only this, and a GPU machine's learner should
        not compile Warp's CPU kernels for it). An unknown argument raises as building the env would."""
        import mujoco
        args = _INIT_SIGNATURE.bind(None, 1, **kwargs)
        args.apply_defaults()
        return cls._spec(mujoco.MjModel.from_xml_path(_half_cheetah_xml()), args.arguments["max_episode_steps"])

    # ------------------------------------------------------------------ state
    def _obs(self) -> torch.Tensor:
        return torch.cat([self.qpos[:, 1:], self.qvel], dim=-1).clone()

    def _noise(self, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.noise
        q = torch.rand(k, self.mjm.nq, generator=gen) * 2 * s - s
        v = torch.randn(k, self.mjm.nv, generator=gen) * s
        return q.to(self.qpos.device), v.to(self.qpos.device)

    def _reset_worlds(self, mask: torch.Tensor, noise: tuple[torch.Tensor, torch.Tensor]) -> None:
        self._mask.copy_(mask)
        if self._reset_graph is not None:
            self._wp.capture_launch(self._reset_graph)
        else:
            with self._wp.ScopedDevice(self._wp_device):
                self._mjw.reset_data(self.m, self.d, reset=self._mask_wp)
        self.qpos[mask] = self._qpos0 + noise[0]
        self.qvel[mask] = noise[1]
        self.t[mask] = 0
        self.ep_return[mask] = 0.0

    # ------------------------------------------------------------------ protocol
    def reset(self, seed: int | list[int] | None = None) -> torch.Tensor:
        dev = self.qpos.device
        if isinstance(seed, list):   # envs given the same seed start from the same state
            for s in sorted(set(seed)):
                mask = torch.tensor([x == s for x in seed], device=dev)
                q, v = self._noise(1, torch.Generator().manual_seed(s))
                k = int(mask.sum())
                self._reset_worlds(mask, (q.expand(k, -1), v.expand(k, -1)))
        else:
            if seed is not None:
                self._gen.manual_seed(seed)
            self._reset_worlds(torch.ones(self.num_envs, dtype=torch.bool, device=dev),
                               self._noise(self.num_envs, self._gen))
        return self._obs()

    def step(self, action: torch.Tensor) -> StepResult:
        a = action.to(self.qpos.device, torch.float32).reshape(self.num_envs, -1)
        a = torch.maximum(torch.minimum(a, self._high), self._low)
        x_before = self.qpos[:, 0].clone()
        self.ctrl.copy_(a)
        if self._step_graph is not None:
            self._wp.capture_launch(self._step_graph)
        else:
            with self._wp.ScopedDevice(self._wp_device):
                for _ in range(self.frame_skip):
                    self._mjw.step(self.m, self.d)
        self._wp.synchronize_device(self._wp_device)
        reward = self.w_fwd * (self.qpos[:, 0] - x_before) / self.dt - self.w_ctrl * (a ** 2).sum(-1)
        self.t += 1
        self.ep_return += reward.double()
        terminated = torch.zeros(self.num_envs, dtype=torch.bool, device=self.qpos.device)
        truncated = self.t >= self.max_episode_steps
        final_obs = self._obs()
        returns, lengths = [], []
        obs = final_obs
        if bool(truncated.any()):
            returns, lengths = self.ep_return[truncated].tolist(), self.t[truncated].tolist()
            self._reset_worlds(truncated, self._noise(int(truncated.sum()), self._gen))
            obs = self._obs()
        return StepResult(obs=obs, reward=reward.to(torch.float32), terminated=terminated, truncated=truncated,
                          final_obs=final_obs, episode_returns=returns, episode_lengths=lengths)

    def close(self) -> None:
        pass


_INIT_SIGNATURE = inspect.signature(MJWarpHalfCheetah.__init__)
