"""A small vision-language-action model that implements the VLA model interface.

Convolutional image encoder + instruction-token embedding + proprioception MLP, fused into a
Gaussian action head and a value head. It stands in for a large pretrained VLA in the examples and
tests (``policy.name: "vla"``, ``vla_config.model_class: "shared.policies.tiny_vla.TinyVLA"``).
"""

from __future__ import annotations

import torch
from tensordict import TensorDictBase
from torch import nn
from torch.distributions import Independent, Normal


class TinyVLA(nn.Module):
    def __init__(self, image_size: int = 16, vocab_size: int = 32, proprio_dim: int = 4, action_dim: int = 2,
                 hidden: int = 64, log_std_init: float = -0.5):
        super().__init__()
        # Two stride-2 convolutions, then flatten: keeping the spatial map (no global pooling)
        # is what lets the model tell where the named target is.
        side = (image_size + 3) // 4
        self.vision = nn.Sequential(
            nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.ReLU(),
            nn.Conv2d(16, 16, 3, stride=2, padding=1), nn.ReLU(),
            nn.Flatten(), nn.Linear(16 * side * side, 32), nn.ReLU())
        self.language = nn.Embedding(vocab_size, 32)
        self.proprio = nn.Sequential(nn.Linear(proprio_dim, 32), nn.ReLU())
        self.trunk = nn.Sequential(nn.Linear(32 * 3, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU())
        self.action_head = nn.Linear(hidden, action_dim)
        self.value_head = nn.Linear(hidden, 1)
        self.log_std = nn.Parameter(torch.full((action_dim,), float(log_std_init)))

    def _features(self, obs: TensorDictBase) -> torch.Tensor:
        rgb = obs["rgb"]                                           # [*B, H, W, 3] uint8
        batch = rgb.shape[:-3]
        dtype = self.action_head.weight.dtype
        img = rgb.reshape(-1, *rgb.shape[-3:]).permute(0, 3, 1, 2).to(dtype) / 255.0
        v = self.vision(img).reshape(*batch, -1)
        lang = self.language(obs["instruction"]).mean(-2)          # [*B, L] int64 -> [*B, 32]
        prop = self.proprio(obs["proprio"].to(dtype))
        return self.trunk(torch.cat([v, lang, prop], -1))

    def action_dist(self, obs: TensorDictBase) -> Independent:
        h = self._features(obs)
        mean = self.action_head(h)
        return Independent(Normal(mean, self.log_std.exp().to(mean.dtype).expand_as(mean)), 1)

    def value(self, obs: TensorDictBase) -> torch.Tensor:
        return self.value_head(self._features(obs)).squeeze(-1)

    def deterministic_action(self, dist: Independent) -> torch.Tensor:
        return dist.base_dist.mean

    def observation_bounds(self) -> dict[str, tuple[int, int]]:
        """The instruction ids its embedding can look up (shared.policies.observation_bounds): checked
        on the CPU as rollouts and requests arrive, since an id outside is a sticky CUDA assert."""
        return {"instruction": (0, self.language.num_embeddings)}
