"""ManiSkill3 tasks as a :class:`~shared.envs.base.BatchedEnv`: ``env.id: "maniskill/<EnvId>"``.

Any installed ManiSkill3 task (``PushCube-v1``, ``PickCube-v1``, ...) with these ``env.cfg`` keys:

* ``obs_mode``: ``"state"`` (a flat float vector, the default) or ``"rgb"``: a TensorDict with ``rgb``
  uint8 ``[H, W, 3]`` from ``camera`` (the task's first camera by default) and ``state`` float32 (the
  agent's joints and the task's extra state, flattened in ManiSkill's own order).
* ``control_mode`` (the task's default when absent), ``reward_mode`` (``"normalized_dense"``),
  ``max_episode_steps`` (the task's registered limit when absent).
* ``sim_backend``: ``"physx_cpu"`` (one SAPIEN scene per env, stepped in turn in the actor's process)
  or ``"physx_cuda"`` (ManiSkill's GPU-batched simulation: one scene set for all envs, tensors stay on
  the actor's device until the rollout is sent). The default follows the actor's device.
* ``image_size``: the camera's width and height (``"rgb"`` only; the task's own when absent).
* ``instruction``: for a vision-language-action model, added as an int64 ``instruction`` leaf: text
  (``"pick up the cube"``), tokenized in the actor with the model's own tokenizer
  (``shared/instructions.py``) and padded to ``instruction_length`` (required with text), or a list of
  token ids of that tokenizer. ``state_key`` renames ``state`` (``"proprio"`` for ``ActionTokenPolicy``).
* ``sim_kwargs``: anything else ``gym.make`` accepts for that task.

* ``terminate_on_success`` (false): by default an episode runs to the time limit, as in ManiSkill's
  evaluations (``ignore_terminations``), and its success is ManiSkill's ``success_once`` (solved at any
  step). ManiSkill's tasks otherwise terminate on success while their dense reward stays positive, so
  with a true terminal (no bootstrap) succeeding *loses* return and PPO learns to hover short of it
  (ManiSkill's own PPO bootstraps through those terminations instead). With ``true``, success ends
  the episode and is its last step's ``info["success"]``. A task's ``fail`` always terminates.

``truncated`` is the time limit; the env then resets that env only, and ``final_obs`` keeps the true
last observation. ``reset(seed=[...])`` with
equal seeds gives equal initial states (GRPO groups).

SAPIEN needs a Vulkan device even for state observations. On a machine without a GPU, run
``launch/setup_maniskill.sh`` once: it installs the ``maniskill`` extra and a newer lavapipe (Mesa's
CPU Vulkan driver) into ``.vulkan/`` in the repository, which :func:`use_local_vulkan` selects for
this process before SAPIEN loads. Nothing is done by hand and the system's Mesa is not touched.
"""

from __future__ import annotations

import ctypes
import os
import tempfile
from pathlib import Path

import torch

from shared.envs.base import ActionSpec, EnvSpec, StepResult
from shared.metrics import clean_metrics

PREFIX = "maniskill/"
SETUP = "launch/setup_maniskill.sh"


def vulkan_dir() -> Path:
    """Where ``launch/setup_maniskill.sh`` puts lavapipe: ``$TANDEM_VULKAN_DIR`` or ``<repo>/.vulkan``."""
    env = os.environ.get("TANDEM_VULKAN_DIR")
    return Path(env) if env else Path(__file__).resolve().parents[2] / ".vulkan"


def use_local_vulkan() -> bool:
    """Select the project-local lavapipe for this process (and the processes it starts), unless the
    user chose a Vulkan driver already (``VK_ICD_FILENAMES``/``VK_DRIVER_FILES``). Call before SAPIEN
    loads. Returns whether the local driver is in use."""
    root = vulkan_dir()
    icd = root / "lvp_icd.json"
    if not icd.is_file() or os.environ.get("VK_ICD_FILENAMES") or os.environ.get("VK_DRIVER_FILES"):
        return False
    os.environ["VK_ICD_FILENAMES"] = str(icd)
    lib = root / "lib"
    os.environ["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(lib), os.environ.get("LD_LIBRARY_PATH")]))
    # The dynamic loader read LD_LIBRARY_PATH when this process started: load the driver's own
    # dependencies now, by path (LLVM first), so that the driver's dlopen finds them resolved.
    deps = sorted((p for p in lib.glob("*.so*") if not p.name.startswith("libvulkan_")),
                  key=lambda p: (not p.name.startswith("libLLVM"), p.name))
    for dep in deps:
        try:
            ctypes.CDLL(str(dep), mode=ctypes.RTLD_GLOBAL)
        except OSError:
            pass
    if not os.environ.get("XDG_RUNTIME_DIR") or not os.path.isdir(os.environ["XDG_RUNTIME_DIR"]):
        os.environ["XDG_RUNTIME_DIR"] = _runtime_dir()
    return True


def _runtime_dir() -> str:
    """One private runtime directory per user, reused by every process and run (a fresh temporary
    directory per process would be left behind by each one): 0700 and ours, as Vulkan wants."""
    path = os.path.join(tempfile.gettempdir(), f"tandem-xdg-{os.getuid()}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        st = os.lstat(path)
        if not (os.path.isdir(path) and not os.path.islink(path) and st.st_uid == os.getuid()
                and (st.st_mode & 0o077) == 0):
            return tempfile.mkdtemp(prefix="tandem-xdg-")   # someone else's or unsafe: a private one
    return path


def import_maniskill():
    """``(gymnasium, mani_skill)`` after selecting a Vulkan driver; an ImportError naming the set-up
    command when the extra is not installed."""
    use_local_vulkan()
    try:
        import gymnasium as gym
        import mani_skill
        import mani_skill.envs  # noqa: F401  (registers the tasks)
    except ImportError as e:
        raise ImportError(f"maniskill envs need the 'maniskill' extra and a Vulkan driver: run `{SETUP}` "
                          f"({e})") from e
    return gym, mani_skill


def _flat(tree, batch: int) -> list[torch.Tensor]:
    """Every tensor leaf of a nested dict, in its order, as ``[batch, -1]`` float32."""
    out = []
    for v in tree.values():
        if isinstance(v, dict):
            out += _flat(v, batch)
        elif isinstance(v, torch.Tensor):
            out.append(v.reshape(batch, -1).float())
    return out


class _CpuScenes:
    """``n`` single-scene ManiSkill envs (``physx_cpu`` holds one scene per env) behind the batched
    interface of one GPU env: batched tensors in and out, ``reset(options={"env_idx": ...})``."""

    def __init__(self, gym, task: str, n: int, kwargs: dict):
        self.envs = [gym.make(task, num_envs=1, **kwargs) for _ in range(n)]
        self.unwrapped = self.envs[0].unwrapped
        self._last: list = [None] * n

    def _cat(self, parts: list):
        if isinstance(parts[0], dict):
            return {k: self._cat([p[k] for p in parts]) for k in parts[0]}
        if isinstance(parts[0], torch.Tensor):
            return torch.cat([p.reshape(1, *p.shape[1:]) if p.dim() else p.reshape(1) for p in parts])
        return parts

    def reset(self, seed=None, options=None):
        idx = (options or {}).get("env_idx")
        idx = range(len(self.envs)) if idx is None else [int(i) for i in idx]
        for j, i in enumerate(idx):
            s = seed[j] if isinstance(seed, list) else (None if seed is None else seed + i)
            obs, _ = self.envs[i].reset(seed=s)
            self._last[i] = obs
        return self._cat(self._last), {}

    def step(self, action: torch.Tensor):
        outs = [env.step(action[i:i + 1]) for i, env in enumerate(self.envs)]
        self._last = [o[0] for o in outs]
        obs = self._cat(self._last)
        infos = [o[4] for o in outs]
        info = {k: torch.cat([i[k].reshape(1) for i in infos]) for k in ("success", "fail") if k in infos[0]}
        return (obs, torch.cat([o[1].reshape(1) for o in outs]), torch.cat([o[2].reshape(1) for o in outs]),
                torch.cat([torch.as_tensor(o[3]).reshape(1) for o in outs]), info)

    def close(self):
        for env in self.envs:
            env.close()


class ManiSkillEnv:
    """``num_envs`` envs of one ManiSkill3 task (see the module docstring for ``cfg``)."""

    def __init__(self, task: str, num_envs: int, cfg: dict | None = None, device: str | torch.device = "cpu",
                 render: bool = False, tokenizer=None):
        from shared.envs.options import env_options
        cfg = dict(cfg or {})
        o = env_options(f"maniskill/{task}", cfg)   # every key, type and rule: shared/envs/options.py
        self.task, self.num_envs = task, num_envs
        self.obs_mode = o.obs_mode
        want = torch.device(device)
        backend = o.sim_backend or ("physx_cuda" if want.type == "cuda" else "physx_cpu")
        instr, length, size = o.instruction, o.instruction_length, o.image_size
        if isinstance(instr, str):
            if tokenizer is None:
                from shared.instructions import InstructionError
                raise InstructionError(f"maniskill/{task}: a text env.cfg.instruction needs the model's tokenizer "
                                       f"(actors load it from vla_config.model_path or vla_config.tokenizer)")
            instr = tokenizer.table([instr], length, f"maniskill/{task}: env.cfg.instruction_length")[0].tolist()
        gym, _ = import_maniskill()
        kwargs = dict(obs_mode=self.obs_mode, reward_mode=o.reward_mode, sim_backend=backend, **o.sim_kwargs)
        if o.control_mode is not None:
            kwargs["control_mode"] = o.control_mode
        if size is not None:
            kwargs["sensor_configs"] = dict(width=size, height=size)
        if render:      # evaluation videos: ManiSkill's human-view camera
            kwargs["render_mode"] = "rgb_array"
        try:
            registered = gym.spec(task).max_episode_steps
        except gym.error.Error as e:
            raise ValueError(f"maniskill/{task}: no such ManiSkill3 task ({e})") from e
        self.max_episode_steps = int(o.max_episode_steps or registered or 0) or None
        if self.max_episode_steps:
            kwargs["max_episode_steps"] = self.max_episode_steps
        if backend == "physx_cpu":
            self.sim = _CpuScenes(gym, task, num_envs, kwargs)
        else:
            self.sim = gym.make(task, num_envs=num_envs, **kwargs)
        self.terminate_on_success = o.terminate_on_success
        self.camera = o.camera
        self.state_key = o.state_key
        self.instruction = None if instr is None else torch.tensor(instr, dtype=torch.int64)
        obs = self.reset(seed=0)
        self.device = obs.device
        u = self.sim.unwrapped
        space = u.single_action_space
        self.control_mode = u.control_mode
        self.spec = EnvSpec(
            obs_shape=tuple(obs.shape[1:]) if self.obs_mode == "state" else (), obs_dtype=torch.float32,
            action=ActionSpec(kind="box", shape=tuple(space.shape), low=tuple(float(x) for x in space.low.reshape(-1)),
                              high=tuple(float(x) for x in space.high.reshape(-1))),
            max_episode_steps=self.max_episode_steps,
            obs_keys={} if self.obs_mode == "state" else {k: (tuple(v.shape[1:]), v.dtype) for k, v in obs.items()},
            extra={"maniskill_task": task, "control_mode": self.control_mode, "sim_backend": backend,
                   **({"instructions": "text"} if self.instruction is not None else {})})
        self._low = torch.tensor(self.spec.action.low, device=self.device)
        self._high = torch.tensor(self.spec.action.high, device=self.device)

    # ------------------------------------------------------------------ observations
    def _convert(self, raw):
        n = self.num_envs
        if self.obs_mode == "state":
            x = raw if isinstance(raw, torch.Tensor) else torch.cat(_flat(raw, n), -1)
            return x.reshape(n, -1).float()
        from tensordict import TensorDict
        cams = raw["sensor_data"]
        cam = self.camera or next(iter(cams))
        if cam not in cams:
            raise KeyError(f"maniskill/{self.task}: no camera {cam!r}; cameras: {sorted(cams)}")
        rgb = cams[cam]["rgb"].reshape(n, *cams[cam]["rgb"].shape[-3:]).to(torch.uint8)
        state = torch.cat(_flat({k: raw[k] for k in ("agent", "extra") if k in raw}, n), -1)
        leaves = {"rgb": rgb, self.state_key: state}
        if self.instruction is not None:
            leaves["instruction"] = self.instruction.to(rgb.device).expand(n, -1).clone()
        return TensorDict(leaves, batch_size=[n], device=rgb.device)

    # ------------------------------------------------------------------ protocol
    def reset(self, seed: int | list[int] | None = None):
        if isinstance(seed, list) and len(seed) != self.num_envs:
            raise ValueError(f"reset: {len(seed)} seeds for {self.num_envs} envs")
        if isinstance(self.sim, _CpuScenes):
            raw, _ = self.sim.reset(seed=seed)
        else:
            raw, _ = self.sim.reset(seed=seed if not isinstance(seed, int) else
                                    [seed + i for i in range(self.num_envs)])
        obs = self._convert(raw)
        self._ep_return = torch.zeros(self.num_envs, dtype=torch.float64, device=obs.device)
        self._ep_len = torch.zeros(self.num_envs, dtype=torch.int64, device=obs.device)
        self._solved = torch.zeros(self.num_envs, dtype=torch.bool, device=obs.device)
        return obs

    def step(self, action: torch.Tensor) -> StepResult:
        a = action.to(self.device).reshape(self.num_envs, -1).float().clamp(self._low, self._high)
        raw, reward, terminated, truncated, info = self.sim.step(a)
        reward = reward.reshape(self.num_envs).float()
        terminated = terminated.reshape(self.num_envs).bool()
        success = info["success"].reshape(self.num_envs).bool() if "success" in info else None
        if not self.terminate_on_success:   # run to the time limit; only a failure ends an episode early
            terminated = info["fail"].reshape(self.num_envs).bool() if "fail" in info else torch.zeros_like(terminated)
            if success is not None:
                self._solved |= success.to(self._solved.device)
                success = self._solved.clone()
        truncated = truncated.reshape(self.num_envs).bool() & ~terminated
        final_obs = self._convert(raw)
        self._ep_return += reward.double()
        self._ep_len += 1
        done = terminated | truncated
        returns, lengths, successes, metrics = [], [], [], []
        obs = final_obs
        if bool(done.any()):
            idx = done.nonzero().flatten()
            returns, lengths = self._ep_return[idx].tolist(), self._ep_len[idx].tolist()
            if success is not None:
                successes = success[idx.to(success.device)].tolist()
            # the task's own per-step flags and figures at the episode's last step (is_grasped, ...)
            per_env = {k: v.reshape(-1) for k, v in info.items()
                       if isinstance(v, torch.Tensor) and v.numel() == self.num_envs and k != "elapsed_steps"}
            metrics = [clean_metrics({k: v[i] for k, v in per_env.items()}) for i in idx.tolist()]
            self._ep_return[idx] = 0.0
            self._solved[idx] = False
            self._ep_len[idx] = 0
            raw_reset, _ = self.sim.reset(options={"env_idx": idx.to(self.device)})
            obs = final_obs.clone()
            fresh = self._convert(raw_reset)
            obs[idx] = fresh[idx]
        return StepResult(obs=obs, reward=reward, terminated=terminated, truncated=truncated, final_obs=final_obs,
                          episode_returns=returns, episode_lengths=lengths, episode_successes=successes,
                          episode_metrics=metrics)

    def render_frames(self, indices: list[int]) -> list:
        """``[H, W, 3]`` uint8 frames of ManiSkill's human-view camera for the envs at `indices`
        (the env must be built with ``render=True``)."""
        if isinstance(self.sim, _CpuScenes):
            return [self.sim.envs[i].render()[0].cpu().numpy() for i in indices]
        frames = self.sim.render()
        return [frames[i].cpu().numpy() for i in indices]

    def close(self) -> None:
        self.sim.close()


def make_maniskill_env(task: str, num_envs: int, cfg: dict | None, device: str | torch.device,
                       render: bool = False, tokenizer=None) -> ManiSkillEnv:
    return ManiSkillEnv(task, num_envs, cfg, device, render, tokenizer)
