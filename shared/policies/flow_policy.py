"""π0 fine-tuned with RL: a flow-matching VLA as a Tandem action-chunk policy (``policy.name: "flow_vla"``).

:class:`FlowVLAPolicy` puts transformers' ``PI0ForConditionalGeneration`` (loaded strictly by
:func:`shared.policies.flow_vla.load_pi0`) behind the action-chunk contract of ``shared/chunks.py``: a call
returns H = ``config.chunk_size`` actions, and the actor executes the first ``actors.actions_per_call``.

Conventions (transformers'): x_1 is noise and x_0 the action chunk; the model predicts v ≈ ε − a; K
denoising steps of size Δ = 1/K at t_k = 1 − kΔ. A chain is ``[K+1, H, A]`` (A = ``max_action_dim``),
``chain[0]`` = x_1, ``chain[K]`` = x_0; the env's actions are x_0's first ``action_dim`` dims (the real
dims; the others are padding).

The plain ODE (x_{k+1} = x_k − Δ·v) has no likelihood. Two ways to make the chain stochastic:

* **Flow-Noise** (``method="noise"``, the default for PPO; πRL): every step is Gaussian,
  x_{k+1} ~ N(x_k − Δ·v_k, σ_k²), σ_k from :class:`NoiseHead` on the expert's output per action token,
  bounded by a tanh into [``noise_std_min``, ``noise_std_max``].
* **Flow-SDE** (``method="sde"``, the default for GRPO; Flow-GRPO's conversion of the ODE into an SDE with
  the same marginals): σ_t = a·√(t / (1 − t)) with a = ``noise_level``; with â = x_t − t·v and
  ε̂ = x_t + (1 − t)·v, the step is N(μ, (σ_t·√Δ)²) with μ = (1 − t + Δ)·â + (t − Δ − σ_t²Δ/(2t))·ε̂.
  At t = 1, where 1 − t = 0, the t in the denominator is replaced by the next time t_1 = 1 − Δ, as in
  Flow-GRPO's code (``torch.where(sigma == 1, sigma_max, sigma)`` with ``sigma_max = sigmas[1]``) and
  RLinf's (``torch.where(timesteps == 1, timesteps[1], timesteps)``): σ at t = 1 is a·√(1/Δ) = a·√K, so
  the first step's std is exactly a. One step k*, drawn uniformly per row and call, is stochastic; the
  others are ODE steps, and the learner re-runs the expert at k* only.

In both, the padding dims always take the ODE step: no noise is drawn where no action is read, so the
real dims' Gaussians are the chain's only randomness after x_1.

**The log-likelihood** is the SUM of log N(x_1; 0, I) and of every stochastic transition's
log N(x_{k+1}; μ_k, σ_k²), over the real action dims (Flow-SDE's ODE steps are deterministic and add
nothing). It is the chain's exact log-density, so exp(new − old) is the true likelihood ratio that PPO
and GRPO assume. (RLinf reports the mean over the K + 1 terms instead, which makes its ratio a geometric
mean of per-step ratios.) The x_1 term does not depend on the weights and cancels in every ratio.
``sample_log_prob`` ``[B, H]`` is each chunk position's share (its real dims, all terms); the learner
sums the executed positions (:func:`shared.chunks.executed_sum`).

**The entropy** is the sum, over the stochastic transitions, the executed positions and the real dims,
of each Gaussian transition's entropy ½·log(2πe·σ²) (the noise prior's is left out; under Flow-SDE it is
a constant of a and k*).

**What a rollout row stores** (:meth:`FlowVLAPolicy.rollout_extras`): ``flow_chain`` ``[K+1, H, A]``
float32 and, for Flow-SDE, ``flow_sde_step`` (k*). The learner runs the VLM once over the prefix and the
expert at the stored chain states (every step, or k* only), with gradients; x_0's real dims are read from
``action``.

**The value head** (PPO only) is a ReLU MLP on the expert's output mean-pooled over the action tokens, from
one expert pass at x = 0 (the noise's mean) and t = 1, so that V depends on the observation alone (π0
style), or on the VLM's output mean-pooled over the prompt (``value_from="prefix"``, π0.5 style).

Evaluation (``deterministic=True``) runs the plain ODE from x_1 ~ N(0, I), as ``sample_actions`` does; its
``sample_log_prob`` is 0 (an ODE chain has no density).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from typing import Any

import torch
from tensordict import TensorDictBase
from torch import nn

from shared import keys
from shared.chunks import actions_per_call, executed_sum
from shared.config import FlowConfig
from shared.policies.flow_vla import (Prefix, encode_prefix, expert_pass, load_heads, load_pi0, pi0_inputs,
                                      step_times)
from shared.policies.vla import VLALoadError, apply_lora

log = logging.getLogger("tandem.vla")

METHODS = ("noise", "sde")
_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)
# Where LoRA's target_modules are looked for (flow_config.lora_scope): module-path prefixes.
LORA_SCOPES = {"expert": ("model.dit.",), "expert_and_vlm": ("model.dit.", "model.vlm.")}


# ----------------------------------------------------------------------------- the transitions

def gaussian_log_prob(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """log N(x; mean, std²) per element (``Normal.log_prob``'s formula, term for term)."""
    return -((x - mean) ** 2) / (2 * std ** 2) - std.log() - _LOG_SQRT_2PI


def gaussian_entropy(std: torch.Tensor) -> torch.Tensor:
    """½·log(2πe·std²) per element."""
    return 0.5 + _LOG_SQRT_2PI + std.log()


def sde_sigma(k: torch.Tensor, num_steps: int, noise_level: float) -> torch.Tensor:
    """Flow-SDE's σ_t = a·√(t / (1 − t)) at the steps `k` (t = t_k); at k = 0 (t = 1) the denominator
    uses the next time, 1 − t_1 = Δ (Flow-GRPO's convention)."""
    t = step_time(k, num_steps)
    denominator = torch.where(k == 0, torch.full_like(t, 1.0 / num_steps), 1.0 - t)
    return noise_level * torch.sqrt(t / denominator)


def step_time(k: torch.Tensor, num_steps: int) -> torch.Tensor:
    """t_k as float32, the same floats as :func:`~shared.policies.flow_vla.step_times`."""
    return torch.tensor(step_times(num_steps), dtype=torch.float32, device=k.device)[k]


def sde_mean(x: torch.Tensor, v: torch.Tensor, t: torch.Tensor, dt: float, sigma: torch.Tensor) -> torch.Tensor:
    """Flow-SDE's step mean μ = (1 − t + Δ)·â + (t − Δ − σ²Δ/(2t))·ε̂ for `x`, `v` ``[B, H, A]``, `t` and
    `sigma` ``[B]``, `dt` = Δ."""
    t, sigma = t[:, None, None], sigma[:, None, None]
    a_hat, eps_hat = x - t * v, x + (1 - t) * v
    return (1 - t + dt) * a_hat + (t - dt - sigma ** 2 * dt / (2 * t)) * eps_hat


class NoiseHead(nn.Module):
    """Flow-Noise's std per action token and dim from the expert's output ``[..., hidden]``:
    σ = σ_min + (σ_max − σ_min)·(1 + tanh(W·h + b))/2. Zero-initialised: a fresh head gives the range's middle."""

    def __init__(self, hidden: int, action_dim: int, std_min: float, std_max: float):
        super().__init__()
        self.proj = nn.Linear(hidden, action_dim)
        nn.init.zeros_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)
        self.std_min, self.std_max = float(std_min), float(std_max)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        z = torch.tanh(self.proj(hidden.float())).float()
        return self.std_min + (self.std_max - self.std_min) * 0.5 * (1.0 + z)


class ValueHead(nn.Module):
    """V from pooled features ``[B, in_dim]``: a ReLU MLP, ``[B]``."""

    def __init__(self, in_dim: int, hidden_sizes: list[int]):
        super().__init__()
        layers: list[nn.Module] = []
        for width in hidden_sizes:
            layers += [nn.Linear(in_dim, width), nn.ReLU()]
            in_dim = width
        self.net = nn.Sequential(*layers, nn.Linear(in_dim, 1))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.net(features.float()).squeeze(-1).float()


# ----------------------------------------------------------------------------- the model's set-up

def prepare_model(model: nn.Module, cfg: FlowConfig) -> Any:
    """Apply ``flow_config``'s dtype, freeze and LoRA (in that order) to the π0 `model` in place.

    Returns:
        The ``peft.PeftModel`` around `model`, or None without LoRA.

    Raises:
        VLALoadError: a freeze prefix or a LoRA target that matches nothing (the layers that exist are named).
    """
    have = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters() if p.is_floating_point()})
    if have and have != [cfg.dtype]:
        log.info("flow_config.dtype %s: the π0 weights (%s) are cast to %s", cfg.dtype, ", ".join(have), cfg.dtype)
        model.to(torch.bfloat16 if cfg.dtype == "bfloat16" else torch.float32)
    frozen = 0
    for name, p in model.named_parameters():
        if any(name.startswith(prefix) for prefix in cfg.freeze):
            p.requires_grad_(False)
            frozen += 1
    if cfg.freeze and not frozen:
        raise VLALoadError(f"flow_config.freeze {cfg.freeze}: no parameter name of the π0 model starts with these "
                           f"prefixes (e.g. model.vlm., model.dit.)")
    if cfg.lora is None:
        return None
    scope = LORA_SCOPES[cfg.lora_scope]
    linear = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.startswith(scope)]
    targets = [n for n in linear if any(n == t or n.endswith("." + t) for t in cfg.lora.target_modules)]
    if not targets:
        names = sorted({n.rsplit(".", 1)[-1] for n in linear})
        raise VLALoadError(f"flow_config.lora.target_modules {cfg.lora.target_modules}: no linear layer under "
                           f"{' or '.join(s.rstrip('.') for s in scope)} (flow_config.lora_scope "
                           f"{cfg.lora_scope!r}) has this name; there: {', '.join(names[:12])}")
    # q_proj and the like exist in the VLM and the expert alike: the adapters go where the scope says.
    return apply_lora(model, dataclasses.replace(cfg.lora, target_modules=targets), "PI0ForConditionalGeneration")


# ----------------------------------------------------------------------------- the policy

class FlowVLAPolicy(nn.Module):
    """π0 as an action-chunk policy trained with Flow-Noise or Flow-SDE (see the module docstring).

    Args:
        model: a ``PI0ForConditionalGeneration`` (e.g. from :func:`~shared.policies.flow_vla.load_pi0`).
        cfg: ``policy.flow_config``; its dtype, freeze and LoRA are applied to `model` in place.
        action_dim: the env's action size (the first ``action_dim`` of ``max_action_dim`` are real).
        method: "noise" (Flow-Noise) or "sde" (Flow-SDE); :func:`resolve_method` picks it from a config.
        with_value: build the value head (PPO needs it; ``critic`` is None without it).

    Reads ``td["observation"]``'s ``rgb`` (uint8 ``[B, h, w, 3]`` or ``[B, cams, h, w, 3]``), ``proprio``
    and ``instruction`` (token ids; both optional). Writes ``action`` ``[B, H, action_dim]``,
    ``sample_log_prob`` ``[B, H]``, ``flow_chain``, ``flow_sde_step`` (Flow-SDE) and ``value`` ``[B]``.
    """

    def __init__(self, model: nn.Module, cfg: FlowConfig, action_dim: int, method: str = "noise",
                 with_value: bool = True):
        super().__init__()
        c = model.config
        if method not in METHODS:
            raise ValueError(f"flow_config.method: expected one of {METHODS}, got {method!r}")
        if not 1 <= action_dim <= c.max_action_dim:
            raise VLALoadError(f"flow_vla: the env's {action_dim}-dimensional actions do not fit the π0 model's "
                               f"max_action_dim {c.max_action_dim} (flow_config.model_path {cfg.model_path!r})")
        self.model, self.method, self.action_dim = model, method, int(action_dim)
        self.chunk_size = int(c.chunk_size)
        self.num_steps = int(cfg.num_steps or c.num_inference_steps)
        self.noise_level, self.value_from = float(cfg.noise_level), cfg.value_from
        self.instruction_pad_id, self.autocast = cfg.instruction_pad_id, cfg.autocast
        expert, vlm = c.dit_config.hidden_size, c.vlm_config.text_config.hidden_size
        self.noise_head = (NoiseHead(expert, c.max_action_dim, cfg.noise_std_min, cfg.noise_std_max)
                           if method == "noise" else None)
        self.value_head = (ValueHead(expert if cfg.value_from == "expert" else vlm, cfg.value_hidden_sizes)
                           if with_value else None)
        # Not a submodule: its parameters are the model's, registered once under "model.".
        self.__dict__["_peft_model"] = prepare_model(model, cfg)

    @classmethod
    def from_pretrained(cls, cfg: FlowConfig, action_dim: int, method: str = "noise", with_value: bool = True,
                        announce: bool = True) -> "FlowVLAPolicy":
        """Load π0 from ``cfg.model_path`` strictly, then Tandem's heads from its ``tandem_heads.safetensors``
        (a head it does not hold starts fresh, logged once; `announce`: as a warning)."""
        policy = cls(load_pi0(cfg.model_path), cfg, action_dim, method, with_value)
        load_heads(policy.heads(), cfg.model_path, announce=announce)
        return policy

    @property
    def critic(self) -> nn.Module | None:
        """The value head, or None (the learner's test for a critic)."""
        return self.value_head

    @property
    def peft_model(self):
        """``peft.PeftModel`` around the π0 model, or None without ``flow_config.lora``."""
        return self._peft_model

    def heads(self) -> dict[str, nn.Module]:
        """Tandem's heads by the names ``tandem_heads.safetensors`` uses."""
        return {name: head for name, head in (("value_head", self.value_head), ("noise_head", self.noise_head))
                if head is not None}

    def rollout_extras(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The per-row tensors the learner needs besides the observation and the action."""
        c = self.model.config
        extras = {keys.FLOW_CHAIN: ((self.num_steps + 1, self.chunk_size, c.max_action_dim), torch.float32)}
        if self.method == "sde":
            extras[keys.FLOW_STEP] = ((), torch.int64)
        return extras

    def observation_bounds(self) -> dict[str, tuple[int, int]]:
        """Instruction ids index the VLM's embedding table."""
        return {"instruction": (0, self.model.model.get_input_embeddings().weight.shape[0])}

    def update_normalizer(self, obs, all_reduce=None) -> None:
        """π0 normalises its own inputs: nothing to update."""

    # ------------------------------------------------------------------ the policy interface

    def forward(self, td: TensorDictBase, deterministic: bool = False) -> TensorDictBase:
        """Sample a chunk (the plain ODE where `deterministic`) and write it with its log-prob and extras."""
        obs, unflat = self._flat_obs(td)
        with self._ctx():
            prefix = encode_prefix(self.model, self._inputs(obs))
            chain, log_prob, k_star = self._sample_chain(prefix, deterministic)
            value = self._value(prefix) if self.value_head is not None else None
        td.set(keys.ACTION, unflat(chain[:, -1, :, :self.action_dim]))
        td.set(keys.LOG_PROB, unflat(log_prob))
        td.set(keys.FLOW_CHAIN, unflat(chain))
        if k_star is not None:
            td.set(keys.FLOW_STEP, unflat(k_star))
        if value is not None:
            td.set(keys.VALUE, unflat(value))
        return td

    def evaluate_actions(self, td: TensorDictBase) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Log-prob and entropy of the stored chains over the executed positions and real dims, and V: ``[B]`` each."""
        return self._evaluate(td, with_value=self.value_head is not None)

    def action_log_prob(self, td: TensorDictBase) -> torch.Tensor:
        """The log-prob of :meth:`evaluate_actions` alone ``[B]`` (no value pass)."""
        return self._evaluate(td, with_value=False)[0]

    def get_value(self, td: TensorDictBase) -> torch.Tensor:
        """V(observation) ``[B]``."""
        if self.value_head is None:
            raise RuntimeError("get_value: this flow_vla policy has no value head (it is built for PPO only)")
        obs, unflat = self._flat_obs(td)
        with self._ctx():
            return unflat(self._value(encode_prefix(self.model, self._inputs(obs))))

    # ------------------------------------------------------------------ internals

    def _evaluate(self, td: TensorDictBase, with_value: bool):
        obs, unflat = self._flat_obs(td)
        flat = td.reshape(-1)
        chain = flat[keys.FLOW_CHAIN].to(self._device(), torch.float32)
        k_star = flat[keys.FLOW_STEP].to(self._device()) if self.method == "sde" else None
        with self._ctx():
            prefix = encode_prefix(self.model, self._inputs(obs))
            log_prob, entropy = self._chain_terms(prefix, chain, flat[keys.ACTION].to(chain), k_star)
            value = self._value(prefix) if with_value else None
        executed = flat.get(keys.EXECUTED, None)
        executed = (executed.to(self._device()) if executed is not None
                    else torch.full((chain.shape[0],), self.chunk_size, device=chain.device))
        return (unflat(executed_sum(log_prob, executed)), unflat(executed_sum(entropy, executed)),
                unflat(value) if value is not None else None)

    def _transition(self, x: torch.Tensor, v: torch.Tensor, hidden: torch.Tensor,
                    k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The stochastic step's mean and std ``[B, H, A]`` from x_k, v and the expert's output at steps `k` ``[B]``."""
        dt = 1.0 / self.num_steps
        if self.method == "noise":
            return x - dt * v, self.noise_head(hidden)
        sigma = sde_sigma(k, self.num_steps, self.noise_level)
        mean = sde_mean(x, v, step_time(k, self.num_steps), dt, sigma)
        return mean, (sigma * math.sqrt(dt))[:, None, None].expand_as(mean)

    def _real(self, per_dim: torch.Tensor) -> torch.Tensor:
        """``[B, H, A]`` terms summed over the real action dims: ``[B, H]``."""
        return per_dim[..., :self.action_dim].sum(-1)

    def _sample_chain(self, prefix: Prefix, deterministic: bool):
        """The chain ``[B, K+1, H, A]``, its per-position log-prob ``[B, H]`` and k* ``[B]`` (Flow-SDE)."""
        b, dev = prefix.inputs.state.shape[0], prefix.inputs.state.device
        c, k_steps = self.model.config, self.num_steps
        x = torch.randn(b, self.chunk_size, c.max_action_dim, device=dev)
        log_prob = torch.zeros(b, self.chunk_size, device=dev) if deterministic else \
            self._real(gaussian_log_prob(x, torch.zeros_like(x), torch.ones_like(x)))
        k_star = torch.randint(0, k_steps, (b,), device=dev) if self.method == "sde" else None
        if k_star is not None and deterministic:
            k_star.zero_()
        real = torch.arange(c.max_action_dim, device=dev) < self.action_dim
        dt, times, states = -1.0 / k_steps, step_times(k_steps), [x]
        for k in range(k_steps):
            v, hidden = expert_pass(self.model, prefix, x, times[k])
            v = v.float()
            ode = x + dt * v        # sample_actions' update, to the bit
            if not deterministic:
                mean, std = self._transition(x, v, hidden, torch.full((b,), k, device=dev))
                drawn = torch.where(real, mean + std * torch.randn_like(mean), ode)
                step_log_prob = self._real(gaussian_log_prob(drawn, mean, std))
                on = torch.ones(b, dtype=torch.bool, device=dev) if k_star is None else k_star == k
                ode = torch.where(on[:, None, None], drawn, ode)
                log_prob = log_prob + torch.where(on[:, None], step_log_prob, torch.zeros_like(step_log_prob))
            x = ode
            states.append(x)
        return torch.stack(states, dim=1), log_prob, k_star

    def _chain_terms(self, prefix: Prefix, chain: torch.Tensor, action: torch.Tensor,
                     k_star: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-position log-prob and entropy ``[B, H]`` of stored chains, recomputed (with gradients)."""
        b, k_steps, d = chain.shape[0], self.num_steps, self.action_dim
        if chain.shape[1] != k_steps + 1:
            raise ValueError(f"flow_chain: {chain.shape[1]} states per chain, this policy takes K + 1 = "
                             f"{k_steps + 1} (flow_config.num_steps)")
        last = torch.cat([action, chain[:, -1, :, d:]], dim=-1)     # x_0: the action the actor sent
        after = torch.cat([chain[:, 1:-1], last[:, None]], dim=1)    # x_{k+1} for k = 0..K-1
        x1 = chain[:, 0]
        log_prob = self._real(gaussian_log_prob(x1, torch.zeros_like(x1), torch.ones_like(x1)))
        entropy = torch.zeros_like(log_prob)
        if self.method == "sde":
            rows = torch.arange(b, device=chain.device)
            steps, targets = [(chain[rows, k_star], k_star)], [after[rows, k_star]]
        else:
            steps = [(chain[:, k], torch.full((b,), k, device=chain.device)) for k in range(k_steps)]
            targets = [after[:, k] for k in range(k_steps)]
        for (x, k), target in zip(steps, targets):
            v, hidden = expert_pass(self.model, prefix, x, step_time(k, k_steps))
            mean, std = self._transition(x, v.float(), hidden, k)
            log_prob = log_prob + self._real(gaussian_log_prob(target, mean, std))
            entropy = entropy + self._real(gaussian_entropy(std))
        return log_prob, entropy

    def _value(self, prefix: Prefix) -> torch.Tensor:
        """V ``[B]`` from the expert's output at x = 0, t = 1 (mean over action tokens) or the prompt's mean."""
        if self.value_from == "expert":
            state = prefix.inputs.state
            zeros = torch.zeros(state.shape[0], self.chunk_size, self.model.config.max_action_dim,
                                device=state.device)
            features = expert_pass(self.model, prefix, zeros, 1.0)[1].float().mean(dim=1)
        else:
            mask = prefix.inputs.attention_mask[..., None].float()
            features = (prefix.hidden.float() * mask).sum(1) / mask.sum(1).clamp_min(1.0)
        return self.value_head(features)

    def _inputs(self, obs: TensorDictBase):
        dev, b = self._device(), obs.batch_size[0]
        if "rgb" not in obs.keys():
            raise KeyError(f"flow_vla: π0 needs the observation's 'rgb'; keys: {sorted(obs.keys())}")
        proprio = obs.get("proprio", None)
        instruction = obs.get("instruction", None)
        proprio = torch.zeros(b, 0) if proprio is None else proprio.reshape(b, -1)
        instruction = torch.zeros(b, 0, dtype=torch.long) if instruction is None else instruction.reshape(b, -1)
        return pi0_inputs(self.model.config, obs["rgb"].to(dev), proprio.to(dev), instruction.to(dev),
                          self.instruction_pad_id, self.model.action_out_proj.weight.dtype)

    def _flat_obs(self, td: TensorDictBase):
        """The observation with one batch dim, and a function giving outputs ``[N, ...]`` the td's batch shape."""
        batch = td.batch_size
        obs = td[keys.OBS]
        if len(batch) == 1:
            return obs, lambda t: t
        return obs.reshape(-1), lambda t: t.reshape(*batch, *t.shape[1:])

    def _device(self) -> torch.device:
        return self.model.action_out_proj.weight.device

    def _ctx(self):
        dev = self._device()
        if self.autocast and dev.type in ("cuda", "cpu"):
            return torch.autocast(dev.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()


def resolve_method(cfg) -> str:
    """``flow_config.method``, or its default for the algorithm: Flow-Noise for PPO, Flow-SDE for GRPO."""
    method = cfg.policy.flow_config.method
    return method or ("noise" if cfg.algorithm.name == "ppo" else "sde")


def check_observation(cfg, spec, config) -> None:
    """Refuse, at start-up, an env whose observation π0 cannot read: no ``rgb`` image, or a ``proprio``
    longer than the checkpoint's ``max_state_dim`` (else every actor would fail at its first call).

    Raises:
        VLALoadError: naming the env, the observation key and ``flow_config.model_path``.
    """
    where = (f"{cfg.source}: env {cfg.env.id} and the π0 model at flow_config.model_path "
             f"{cfg.policy.flow_config.model_path!r}")
    if "rgb" not in spec.obs_keys:
        raise VLALoadError(f"{where}: π0 reads a camera image, observation key 'rgb'; the env gives "
                           f"{sorted(spec.obs_keys) or 'a flat vector'}")
    proprio = spec.obs_keys.get("proprio", ((0,), None))[0]
    state = math.prod(proprio)
    if state > config.max_state_dim:
        raise VLALoadError(f"{where}: the env's proprio has {state} dims, more than the model's max_state_dim "
                           f"{config.max_state_dim} (config.json): use a checkpoint with a larger state, or an env "
                           f"whose proprio fits")


def build_flow_policy(cfg, spec, describe: bool = False) -> FlowVLAPolicy:
    """``policy.name: "flow_vla"``: the policy from ``policy.flow_config``, checked against the env.

    The value head is built for PPO only. `describe`: this process says what it adapts (a fresh head as a
    warning; the others log it at debug level).

    Raises:
        VLALoadError: a checkpoint that does not load, or an env whose actions or observation π0 cannot take.
        ValueError: ``actors.actions_per_call`` above the checkpoint's ``chunk_size``.
    """
    from shared.instructions import check_instruction_vocabulary

    f = cfg.policy.flow_config
    if spec.action.kind != "box":
        raise VLALoadError(f"{cfg.source}: policy.name \"flow_vla\" gives continuous actions; env {cfg.env.id} "
                           f"has {spec.action.kind} actions")
    policy = FlowVLAPolicy.from_pretrained(f, spec.action.dim, resolve_method(cfg),
                                           with_value=cfg.algorithm.name == "ppo", announce=describe)
    check_observation(cfg, spec, policy.model.config)
    actions_per_call(cfg, policy)    # at most the checkpoint's chunk: refused here, not by every actor in turn
    check_instruction_vocabulary(cfg, spec, policy)
    if describe:
        log.info("flow_vla: π0 from %s, %s, K = %d steps, chunks of %d actions (%d of %d dims real)%s",
                 f.model_path, "Flow-Noise" if policy.method == "noise" else "Flow-SDE", policy.num_steps,
                 policy.chunk_size, policy.action_dim, policy.model.config.max_action_dim,
                 ", LoRA" if policy.peft_model is not None else "")
    return policy
