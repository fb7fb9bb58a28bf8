"""MLP actor-critic for Box (Gaussian, learnable state-independent log-std) and Discrete spaces.

``actor_only`` (for GRPO) is the same policy without the critic: it writes no ``value``.

TensorDict in, TensorDict out. Observation normalisation lives inside the policy (its buffers), so
the statistics the actor used travel with the weights and reach checkpoints.
"""

from __future__ import annotations

import math

import torch
from tensordict import TensorDictBase
from torch import nn
from torch.distributions import Categorical, Normal

from shared import keys
from shared.chunks import executed_sum
from shared.config import NetConfig, PolicyConfig
from shared.envs.base import EnvSpec
from shared.policies.normalization import ObsNormalizer

_LOG_SQRT_2PI = math.log(math.sqrt(2 * math.pi))

_ACTIVATIONS = {"tanh": nn.Tanh, "relu": nn.ReLU, "elu": nn.ELU, "gelu": nn.GELU}


def mlp(in_dim: int, net: NetConfig, out_dim: int, out_gain: float, ortho: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    last = in_dim
    for h in net.network_cfg.hidden_sizes:
        layers += [nn.Linear(last, h), _ACTIVATIONS[net.network_cfg.activation]()]
        last = h
    layers.append(nn.Linear(last, out_dim))
    if ortho:  # CleanRL/SB3 initialisation: sqrt(2) hidden, small policy head, unit value head
        linears = [m for m in layers if isinstance(m, nn.Linear)]
        for i, m in enumerate(linears):
            nn.init.orthogonal_(m.weight, out_gain if i == len(linears) - 1 else math.sqrt(2))
            nn.init.zeros_(m.bias)
    return nn.Sequential(*layers)


class ActorCritic(nn.Module):
    """Policy interface: ``forward(td, deterministic)``, ``get_value(td)``, ``evaluate_actions(td)``.

    Reads ``td["observation"]`` (``[*B, *obs_shape]``); writes ``action``, ``sample_log_prob``
    (``[*B]``) and ``value`` (``[*B]``). With ``policy.chunk_size`` H > 1 it is an action-chunk policy
    (shared/chunks.py): one head emits H actions, ``action`` is ``[*B, H, *action]`` and
    ``sample_log_prob`` ``[*B, H]`` per position; the learner's log-probs and entropies sum the
    executed positions (``executed_actions``).
    """
    capturable = True   # fixed shapes, no host sync in evaluate_actions: learner.compile may capture its update

    def __init__(self, spec: EnvSpec, cfg: PolicyConfig, with_critic: bool = True):
        super().__init__()
        if len(spec.obs_shape) != 1:
            raise ValueError(f"actor_critic needs a flat observation vector, got shape {spec.obs_shape}")
        self.spec = spec
        obs_dim = spec.obs_shape[0]
        self.obs_norm = ObsNormalizer(spec.obs_shape, clip=cfg.clip_obs) if cfg.normalize_obs else None
        self.discrete = spec.action.kind == "discrete"
        self.chunk_size = cfg.chunk_size
        self.actor = mlp(obs_dim, cfg.actor, spec.action.dim * self.chunk_size, 0.01, cfg.ortho_init)
        self.critic = mlp(obs_dim, cfg.critic or NetConfig(), 1, 1.0, cfg.ortho_init) if with_critic else None
        if not self.discrete:
            self.log_std = nn.Parameter(torch.full((spec.action.dim * self.chunk_size,), float(cfg.log_std_init)))
        self._action_shape = spec.action.shape

    def _features(self, obs: torch.Tensor) -> torch.Tensor:
        obs = obs.to(torch.float32)
        return self.obs_norm(obs) if self.obs_norm is not None else obs

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        """The actor's output, ``[*B, H, dim]`` for a chunk policy."""
        out = self.actor(x)
        return out if self.chunk_size == 1 else out.unflatten(-1, (self.chunk_size, -1))

    def _std(self, mean: torch.Tensor) -> torch.Tensor:
        log_std = self.log_std if self.chunk_size == 1 else self.log_std.unflatten(-1, (self.chunk_size, -1))
        return log_std.exp().expand_as(mean)

    def _summed(self, per_position: torch.Tensor, td: TensorDictBase) -> torch.Tensor:
        """A chunk policy's per-position terms summed over the executed positions (as is otherwise)."""
        return per_position if self.chunk_size == 1 else executed_sum(per_position, td[keys.EXECUTED])

    def _dist(self, x: torch.Tensor):
        out = self._head(x)
        if self.discrete:
            return Categorical(logits=out)
        return Normal(out, self._std(out))

    def _log_prob(self, dist, action: torch.Tensor) -> torch.Tensor:
        if self.discrete:
            return dist.log_prob(action.long())
        return dist.log_prob(action.reshape(*action.shape[:-len(self._action_shape)], -1)).sum(-1)

    def _act_gaussian(self, x: torch.Tensor, deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Acting with the Gaussian head, without building a ``Normal``: the same sample stream
        (``torch.normal``) and the same log-prob formula, term for term, as ``Normal.log_prob`` in
        :meth:`evaluate_actions`, so the first epoch's ratio is exactly 1. Half the cost per call."""
        mean = self._head(x)
        std = self._std(mean)
        action = mean if deterministic else torch.normal(mean, std)
        log_prob = (-((action - mean) ** 2) / (2 * std ** 2) - std.log() - _LOG_SQRT_2PI).sum(-1)
        return action, log_prob

    def forward(self, td: TensorDictBase, deterministic: bool = False) -> TensorDictBase:
        x = self._features(td[keys.OBS])
        if not self.discrete and not torch.is_grad_enabled():
            action, log_prob = self._act_gaussian(x, deterministic)
            td.set(keys.ACTION, action.reshape(*action.shape[:-1], *self._action_shape))
            td.set(keys.LOG_PROB, log_prob)
            if self.critic is not None:
                td.set(keys.VALUE, self.critic(x).squeeze(-1))
            return td
        dist = self._dist(x)
        if deterministic:
            action = dist.probs.argmax(-1) if self.discrete else dist.mean
        else:
            action = dist.sample()
        if not self.discrete:
            action = action.reshape(*action.shape[:-1], *self._action_shape)
        td.set(keys.ACTION, action)
        td.set(keys.LOG_PROB, self._log_prob(dist, action))
        if self.critic is not None:
            td.set(keys.VALUE, self.critic(x).squeeze(-1))
        return td

    def action_log_prob(self, td: TensorDictBase) -> torch.Tensor:
        """Only the log-prob of ``td["action"]`` ``[*B]``: no entropy, no critic (the ``ewma``
        correction's proximal policy needs nothing else, once per minibatch). The formula is
        :meth:`_act_gaussian`'s, term for term ``Normal.log_prob``'s."""
        x = self._features(td[keys.OBS])
        if self.discrete:
            return self._summed(self._log_prob(self._dist(x), td[keys.ACTION]), td)
        mean = self._head(x)
        std = self._std(mean)
        action = td[keys.ACTION]
        action = action.reshape(*action.shape[:-len(self._action_shape)], -1) if self._action_shape else action
        return self._summed((-((action - mean) ** 2) / (2 * std ** 2) - std.log() - _LOG_SQRT_2PI).sum(-1), td)

    def evaluate_actor(self, td: TensorDictBase) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`evaluate_actions` without the critic: the log-prob and entropy of ``td["action"]``.
        With :meth:`get_value` it splits one update step into two graphs over disjoint parameters
        (``learner.critic_thread``)."""
        dist = self._dist(self._features(td[keys.OBS]))
        entropy = dist.entropy() if self.discrete else dist.entropy().sum(-1)
        return self._summed(self._log_prob(dist, td[keys.ACTION]), td), self._summed(entropy, td)

    def get_value(self, td: TensorDictBase) -> torch.Tensor:
        if self.critic is None:
            raise RuntimeError("get_value: this policy has no critic (policy.name \"actor_only\")")
        return self.critic(self._features(td[keys.OBS])).squeeze(-1)

    def evaluate_actions(self, td: TensorDictBase) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Log-prob and entropy of ``td["action"]`` under this policy, and the value (None without a
        critic): each ``[*B]``."""
        x = self._features(td[keys.OBS])
        dist = self._dist(x)
        entropy = dist.entropy() if self.discrete else dist.entropy().sum(-1)
        value = self.critic(x).squeeze(-1) if self.critic is not None else None
        return self._summed(self._log_prob(dist, td[keys.ACTION]), td), self._summed(entropy, td), value

    @torch.no_grad()
    def update_normalizer(self, obs: torch.Tensor, all_reduce=None) -> None:
        if self.obs_norm is not None:
            self.obs_norm.update(obs, all_reduce=all_reduce)
