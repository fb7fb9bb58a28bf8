"""A model written to the seed framework's policy interface, for ``tandem/Reach-v0``.

It shows interface (b) of ``shared/policies/vla.py`` end to end: ``forward(td)`` adds ``action``,
``sample_log_prob`` and ``value``; ``get_value(td)`` and ``evaluate_actions(td)`` score what it did.
An MLP over the flattened image, the proprioception and the one-hot instruction tokens; no
``action_dist``. Used by ``configs/vla_seed_interface_reach_ppo.json``
(``vla_config.model_class: "shared.policies.seed_example.ReachMLP"``).
"""

from __future__ import annotations

import torch
from tensordict import TensorDictBase
from torch import nn
from torch.distributions import Normal

from shared import keys


class ReachMLP(nn.Module):
    def __init__(self, image_size: int = 16, vocab_size: int = 8, instruction_len: int = 4, proprio_dim: int = 4,
                 action_dim: int = 2, hidden: int = 64, log_std_init: float = -0.5):
        super().__init__()
        self.vocab_size = vocab_size
        in_dim = image_size * image_size * 3 + vocab_size * instruction_len + proprio_dim

        def mlp(out_dim: int) -> nn.Sequential:
            return nn.Sequential(nn.Linear(in_dim, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
                                 nn.Linear(hidden, out_dim))
        self.actor = mlp(action_dim)
        self.critic = mlp(1)
        self.log_std = nn.Parameter(torch.full((action_dim,), float(log_std_init)))

    def _features(self, obs: TensorDictBase) -> torch.Tensor:
        dtype = self.log_std.dtype
        rgb = obs["rgb"].flatten(-3).to(dtype) / 255.0                        # [B, S*S*3] from uint8
        words = nn.functional.one_hot(obs["instruction"], self.vocab_size).flatten(-2).to(dtype)   # [B, L*V]
        return torch.cat([rgb, words, obs["proprio"].to(dtype)], -1)

    def _dist(self, x: torch.Tensor) -> Normal:
        mean = self.actor(x)
        return Normal(mean, self.log_std.exp().expand_as(mean))

    def forward(self, td: TensorDictBase, deterministic: bool = False) -> TensorDictBase:
        x = self._features(td[keys.OBS])
        dist = self._dist(x)
        action = dist.mean if deterministic else dist.sample()
        td.set(keys.ACTION, action)
        td.set(keys.LOG_PROB, dist.log_prob(action).sum(-1))
        td.set(keys.VALUE, self.critic(x).squeeze(-1))
        return td

    def get_value(self, td: TensorDictBase) -> torch.Tensor:
        return self.critic(self._features(td[keys.OBS])).squeeze(-1)

    def evaluate_actions(self, td: TensorDictBase) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = self._features(td[keys.OBS])
        dist = self._dist(x)
        return dist.log_prob(td[keys.ACTION]).sum(-1), dist.entropy().sum(-1), self.critic(x).squeeze(-1)
