"""Action tokens: a Hugging Face VLM (or any LM with an LM head) as a Tandem policy, OpenVLA-style.

Each action dimension is discretised into ``n_bins`` uniform bins; bin ``k`` is vocabulary token
``token_offset + k``, a block at the end of the vocabulary (``reserve_tail`` ids after it are left
alone, as SimpleVLA-RL skips the 64 padding ids of OpenVLA's vocabulary). An action is
``action_dim`` such tokens. The policy's distribution is ``action_dim`` categoricals over the bin
block only: logits are sliced to the block before the log-softmax (in float32), so the rest of the
vocabulary never takes probability mass.

The prompt (one row per observation, every row the same length, so no padding sides to track)::

    [image] * n_img  [bos]  instruction[L]  proprio[P]  [sep]  |  action positions[D]
    '----------------- prefix: bidirectional (PaliGemma) ----'  '- suffix: causal -'

* ``rgb`` goes through the model's own vision tower; the adapter converts uint8 HWC to float,
  resizes with ``F.interpolate`` only when the size differs, and normalises with ``image_mean`` and
  ``image_std`` (SigLIP's 0.5/0.5 by default). Text-only models ignore ``rgb``.
* ``instruction`` ids are used as the model's token ids (the env and the model must share a
  tokenizer); ids equal to ``instruction_pad_id`` are masked out of attention.
* ``proprio`` is tokenised with the same uniform bins (bounds ``proprio_bounds``) into the same
  token block, as pi0-FAST does with state: Reach-v0 gives the agent's position only in
  ``proprio`` (it is not drawn), so dropping it would make the task unsolvable. ``proprio_bounds=None`` ignores it (OpenVLA's choice).
* The value head is a linear layer on the last hidden state at ``[sep]``, the last prefix
  position: it has seen the whole prompt and, with a causal suffix, nothing of the action, so the
  value is the same whatever the decoding mode and needs no extra forward pass.

Decoding (``decoding=``):

* ``"parallel"`` (default): ``D`` placeholder tokens follow ``[sep]``; the logits at those ``D``
  positions give all action dims in one forward pass. Acting and training cost one forward each,
  the same pass, as in OpenVLA-OFT; for RL, where every minibatch re-evaluates log-probs, that is
  what we want. The price: action dims are independent given the prompt.
* ``"autoregressive"``: OpenVLA's pretraining factorisation. Acting runs the prefix once with a KV
  cache, then ``D - 1`` one-token steps (bin ``d`` is fed back to predict ``d + 1``); training is
  one teacher-forced pass of the chosen bins on top of the cached prefix. Its entropy is the sum of
  the per-step entropies along the last sampled or evaluated action (the exact joint entropy needs
  every path): an unbiased estimate on on-policy actions, which is what PPO's bonus uses.

``make_tiny_paligemma`` builds a random PaliGemma (SigLIP + Gemma) small enough for CPU tests;
``paligemma_config("0.5b")`` is a benchmark-sized config. No torchvision is imported anywhere.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tensordict import TensorDictBase
from torch import nn
from torch.distributions import Distribution

from shared.policies import ids_out_of_bounds

DECODING_MODES = ("parallel", "autoregressive")
BINNINGS = ("centres", "openvla")   # ActionBins conventions
GEMMA_NEWLINE_ID = 108   # "\n" in the Gemma tokenizer: PaliGemma's prefix terminator


class ActionBins:
    """Uniform bins over ``[low, high]`` per dimension: action values <-> bin indices ``[0, n_bins)``.

    Bin ``k`` is the action token ``token_offset + k``. Two conventions (``binning=``):

    * ``"centres"`` (Tandem's): centre ``k`` is ``low + k * (high - low) / (n_bins - 1)``, so bin 0 is
      centred on ``low`` and bin ``n_bins - 1`` on ``high``; both bounds round-trip exactly and any
      action in bounds comes back within half a bin width (``round(u * (n_bins - 1))``, ``u`` the
      action scaled to ``[0, 1]``).
    * ``"openvla"`` (OpenVLA's ``ActionTokenizer``): ``n_bins`` edges ``linspace(low, high, n_bins)``
      and the ``n_bins - 1`` midpoints between them as centres. An action is clipped to the bounds and
      digitised, ``d = #{edges <= a}`` in ``[1, n_bins]``, and its token is ``vocab_end - d``: the
      token order runs *down* as the action goes up, so bin ``k = n_bins - d``. Decoding takes centre
      ``clip(n_bins - 1 - k, 0, n_bins - 2)``, which folds bin 0 (only ``a == high`` encodes to it)
      onto bin 1's centre. Both tokens mean one action, so the policy's distribution merges their
      probability into bin 1 (:meth:`merge`): sampling, ``log_prob`` and the entropy are those of the
      action the env receives, and bin 0 is never sampled. With ``token_offset = vocab_end - n_bins``
      (OpenVLA's Llama tokenizer: ``vocab_end`` = 32,000, the model's 64 padding ids after it, so
      ``reserve_tail=64``) the token ids equal OpenVLA's.

    The bounds are float32 config, not module state: ``model.to(torch.bfloat16)`` must not round
    them, and weights files need not carry them. They follow the device of what they are applied to.

    Args:
        low, high: scalars, or one value per dimension (broadcast together); ``high > low``.
        n_bins: number of bins (tokens), at least 2 (3 for ``"openvla"``: one centre needs two edges
            and a folded bin).
        binning: ``"centres"`` or ``"openvla"``.
    Raises:
        ValueError: too few bins, an unknown convention, or bounds that are not finite with ``high > low``.
    """

    def __init__(self, low: float | Sequence[float] | torch.Tensor, high: float | Sequence[float] | torch.Tensor,
                 n_bins: int = 256, binning: str = "centres"):
        if binning not in BINNINGS:
            raise ValueError(f"ActionBins: binning={binning!r} is not one of {BINNINGS}")
        if n_bins < (2 if binning == "centres" else 3):
            raise ValueError(f"ActionBins: n_bins={n_bins} must be >= {2 if binning == 'centres' else 3} "
                             f"for binning {binning!r}")
        low_t, high_t = torch.broadcast_tensors(torch.as_tensor(low, dtype=torch.float32),
                                                torch.as_tensor(high, dtype=torch.float32))
        if not (torch.isfinite(low_t).all() and torch.isfinite(high_t).all() and (high_t > low_t).all()):
            raise ValueError(f"ActionBins: need finite bounds with high > low, got low={low}, high={high}")
        self.low, self.high, self.n_bins, self.binning = low_t.clone(), high_t.clone(), n_bins, binning
        if binning == "openvla":
            # float64 edges [*D, n_bins], as numpy's linspace gives them; centres [*D, n_bins - 1]
            lo, hi = self.low.double().unsqueeze(-1), self.high.double().unsqueeze(-1)
            self._edges = torch.arange(n_bins, dtype=torch.float64) * ((hi - lo) / (n_bins - 1)) + lo   # numpy's
            self._edges[..., -1] = hi[..., 0]                                                     # linspace
            self._centres = ((self._edges[..., :-1] + self._edges[..., 1:]) / 2).float()
        # Bins that decode to another bin's action, and that bin: merged into it by merge().
        probe = torch.arange(n_bins)[:, None].expand(n_bins, self.low.numel())                # [n_bins, D]
        canonical = self.to_bins(self.to_actions(probe))
        folded = (canonical != torch.arange(n_bins)[:, None]).any(-1).nonzero().squeeze(-1)
        self._folds = [(int(k), int(canonical[k, 0])) for k in folded]

    @property
    def width(self) -> torch.Tensor:
        """Distance between neighbouring centres, per dimension: the round-trip error is at most half of it."""
        return (self.high - self.low) / (self.n_bins - 1)

    def _on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self.low.device != device:   # moved once, then kept there
            self.low, self.high = self.low.to(device), self.high.to(device)
            if self.binning == "openvla":
                self._edges, self._centres = self._edges.to(device), self._centres.to(device)
        return self.low, self.high

    def to_bins(self, value: torch.Tensor) -> torch.Tensor:
        """``[*B, D]`` float -> ``[*B, D]`` int64 bin indices in ``[0, n_bins)``."""
        low, high = self._on(value.device)
        if self.binning == "openvla":
            v = torch.maximum(torch.minimum(value.double(), high.double()), low.double())   # NaN-free clip
            digit = (v.unsqueeze(-1) >= self._edges).sum(-1)                          # np.digitize: [1, n_bins]
            return (self.n_bins - digit).clamp(0, self.n_bins - 1).long()
        frac = (value.float() - low) / (high - low)                     # 0 at low, 1 at high
        return (frac * (self.n_bins - 1)).round().clamp(0, self.n_bins - 1).long()

    def to_actions(self, bins: torch.Tensor) -> torch.Tensor:
        """``[*B, D]`` int64 bin indices -> ``[*B, D]`` float32 actions (the bins' centres)."""
        low, high = self._on(bins.device)
        if self.binning == "openvla":
            idx = (self.n_bins - 1 - bins).clamp(0, self.n_bins - 2)                 # OpenVLA's decode
            return self._centres.expand(*bins.shape, self.n_bins - 1).gather(-1, idx.unsqueeze(-1)).squeeze(-1)
        # lerp returns exactly ``high`` at weight 1, where low + k * width could round past it.
        return torch.lerp(low.expand(bins.shape), high.expand(bins.shape), bins.float() / (self.n_bins - 1))

    def to_action_bins(self, value: torch.Tensor) -> torch.Tensor:
        """Like :meth:`to_bins`, but a folded bin maps to the bin that carries its probability (the
        bin a policy samples for this action): what log-probabilities are read at."""
        bins = self.to_bins(value)
        for src, dst in self._folds:
            bins = bins.masked_fill(bins == src, dst)
        return bins

    def merge(self, logp: torch.Tensor) -> torch.Tensor:
        """``[..., n_bins]`` log-probabilities over bins -> the same over actions: a bin that decodes to
        another bin's action gives it its probability and keeps none (-inf). Identity for ``"centres"``."""
        for src, dst in self._folds:
            dst_t = torch.tensor([dst], device=logp.device)
            logp = logp.index_copy(-1, dst_t, torch.logaddexp(logp[..., dst:dst + 1], logp[..., src:src + 1]))
            logp = logp.index_fill(-1, torch.tensor([src], device=logp.device), float("-inf"))
        return logp


class ActionTokenDistribution(Distribution):
    """``D`` independent categoricals over bins, one per action dim; actions are bin centres.

    Args:
        bin_logp: ``[*B, D, n_bins]`` float32 log-probabilities (log-softmax over the bin block).
        bins: maps actions to bins and back.
    """

    arg_constraints: dict = {}
    has_rsample = False

    def __init__(self, bin_logp: torch.Tensor, bins: ActionBins):
        self.bin_logp, self.bins = bin_logp, bins
        super().__init__(batch_shape=bin_logp.shape[:-2], event_shape=bin_logp.shape[-2:-1], validate_args=False)

    def sample(self, sample_shape: torch.Size = torch.Size()) -> torch.Tensor:
        """``[*S, *B, D]`` continuous actions (bin centres)."""
        with torch.no_grad():
            idx = torch.distributions.Categorical(logits=self.bin_logp).sample(torch.Size(sample_shape))
        return self.bins.to_actions(idx)

    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        """``[*S, *B, D]`` actions -> ``[*S, *B]``: sum over dims of the log-prob of each action's bin."""
        idx = self.bins.to_action_bins(value)
        logp = self.bin_logp.expand(*idx.shape, self.bin_logp.shape[-1])
        return logp.gather(-1, idx.unsqueeze(-1)).squeeze(-1).sum(-1)

    def entropy(self) -> torch.Tensor:
        """``[*B]``: the sum over dims of each categorical's entropy over the bins."""
        return _entropy(self.bin_logp)

    @property
    def mode(self) -> torch.Tensor:
        """``[*B, D]``: the centres of the most likely bins."""
        return self.bins.to_actions(self.bin_logp.argmax(-1))


def _entropy(logp: torch.Tensor) -> torch.Tensor:
    """``[*B, D, n_bins]`` log-probabilities -> ``[*B]``: the summed entropies; a bin of probability 0
    (-inf, a folded bin) adds 0, in the value and in the gradient."""
    safe = logp.masked_fill(logp == float("-inf"), 0.0)
    return -(logp.exp() * safe).sum(-1).sum(-1)


def _cache_arg(trunk: nn.Module) -> str:
    """The KV-cache argument of `trunk`'s forward: ``cache`` in transformers 5.x (which deprecates
    ``past_key_values``, warning on every process), ``past_key_values`` before."""
    cls = type(trunk)
    name = _CACHE_ARG.get(cls)
    if name is None:
        try:
            params = inspect.signature(trunk.forward).parameters
        except (TypeError, ValueError):
            params = {}
        name = _CACHE_ARG[cls] = "cache" if "cache" in params else "past_key_values"
    return name


_CACHE_ARG: dict[type, str] = {}


@dataclass
class _Prompt:
    input_ids: torch.Tensor            # [N, P] int64, the prefix
    attention_mask: torch.Tensor       # [N, P] int64, 0 on instruction padding
    pixel_values: torch.Tensor | None  # [N, 3, S, S] in the vision tower's dtype, or None (text-only)
    batch_shape: torch.Size            # the observation's [*B]; N = prod(*B)


class AutoregressiveActionTokenDistribution(Distribution):
    """Action dims decoded one at a time, each conditioned on the bins chosen before it.

    Built by ``ActionTokenPolicy.action_dist`` after the prefix pass; holds its KV cache. ``sample``
    and ``mode`` decode; ``log_prob`` reuses the decoded step logits when asked about the action it
    just produced, and otherwise runs one teacher-forced pass over the cached prefix.
    ``entropy`` is taken along the last action decoded or evaluated (see the module docstring).
    """

    arg_constraints: dict = {}
    has_rsample = False

    def __init__(self, policy: ActionTokenPolicy, prompt: _Prompt, cache, first_logp: torch.Tensor):
        self._policy, self._prompt, self._cache = policy, prompt, cache
        self._first_logp = first_logp                                  # [N, 1, n_bins]
        self._path: tuple[torch.Tensor, torch.Tensor] | None = None    # (bins [N, D], step logp [N, D, n_bins])
        super().__init__(batch_shape=prompt.batch_shape, event_shape=torch.Size([policy.action_dim]),
                         validate_args=False)

    def _decode(self, greedy: bool) -> torch.Tensor:
        self._path = self._policy._decode(self._prompt, self._cache, self._first_logp, greedy)
        return self._policy.bins.to_actions(self._path[0]).reshape(*self.batch_shape, -1)

    def sample(self, sample_shape: torch.Size = torch.Size()) -> torch.Tensor:
        """``[*B, D]`` actions, sampled token by token with the KV cache."""
        if len(sample_shape):
            raise ValueError("AutoregressiveActionTokenDistribution.sample: sample_shape is not supported; "
                             "batch the observation instead")
        return self._decode(greedy=False)

    @property
    def mode(self) -> torch.Tensor:
        """``[*B, D]``: greedy decoding (the argmax bin at each step, fed back)."""
        return self._decode(greedy=True)

    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        """``[*B, D]`` actions -> ``[*B]``: sum over dims of log p(bin_d | prompt, bins before d)."""
        bins = self._policy.bins.to_action_bins(value.reshape(-1, self._policy.action_dim))
        if self._path is None or not torch.equal(bins, self._path[0]):
            self._path = (bins, self._policy._teacher_force(self._prompt, self._cache, self._first_logp, bins))
        logp = self._path[1].gather(-1, bins.unsqueeze(-1)).squeeze(-1).sum(-1)
        return logp.reshape(self.batch_shape)

    def entropy(self) -> torch.Tensor:
        """``[*B]``: sum of the per-step bin entropies along the last sampled or evaluated action.

        Raises:
            RuntimeError: before any ``sample``, ``mode`` or ``log_prob``.
        """
        if self._path is None:
            raise RuntimeError("autoregressive entropy is taken along an action: call sample() or "
                               "log_prob(action) first")
        return _entropy(self._path[1]).reshape(self.batch_shape)


class ActionTokenPolicy(nn.Module):
    """A Hugging Face causal VLM / LM with an LM head as a VLA model (``action_dist``, ``value``,
    ``deterministic_action``); see the module docstring for the prompt, decoding and value choices.

    Args:
        model: e.g. ``PaliGemmaForConditionalGeneration``; needs ``get_output_embeddings()`` and a
            ``base_model`` that returns ``last_hidden_state``. May be bfloat16.
        action_dim: D, tokens per action.
        low, high: action bounds (scalars or ``[D]``); the bins span them.
        n_bins: bins per dim, and the size of the token block.
        token_offset: token id of bin 0; default ``vocab_size - n_bins - reserve_tail``.
        reserve_tail: ids left after the block when ``token_offset`` is derived (e.g. 64 for
            PaliGemma's ``<image>`` and padding ids).
        decoding: ``"parallel"`` (default) or ``"autoregressive"``.
        value_head: add the value head (PPO). Without it ``value`` is None, so ``VLAPolicy`` runs
            without a critic (GRPO).
        image_mean, image_std: per-channel normalisation of pixels in ``[0, 1]``.
        image_size: side the vision tower expects; default ``vision_config.image_size``.
        bos_token_id: default the text config's ``bos_token_id`` (none if it has none).
        sep_token_id: ends the prefix; its hidden state feeds the value head.
        placeholder_token_id: fills the action positions in parallel mode; default the pad id.
        instruction_pad_id: instruction ids masked out of attention (None: mask nothing).
        proprio_bounds: ``(low, high)`` for tokenising ``proprio``; None ignores it.
        temperature: the bin logits are divided by it before the log-softmax, so sampling, log-probs,
            entropy (and the learner's ratios and KL) all use the same tempered distribution; the
            argmax, and so deterministic evaluation, is unchanged. Below 1 the acting policy is closer
            to the greedy one that is evaluated; above 1 it explores more (SimpleVLA-RL samples
            rollouts hot).
        binning: how bins map to action values, ``"centres"`` (default) or ``"openvla"``
            (:class:`ActionBins`): use the convention the checkpoint was pretrained with. ``proprio``
            is tokenised with the same one.
        chunk_size: H, actions per call (an action chunk, shared/chunks.py): ``H x D`` placeholder
            tokens decoded in one parallel pass, as OpenVLA-OFT does; the distribution is then
            ``[*B, H]`` categoricals-per-dim. Needs ``decoding="parallel"``.
    Raises:
        ValueError: every inconsistent setting at once (unknown decoding, a block outside the
            vocabulary, a special token inside the block, ...), each with the fix.
    """

    # vla_config.lora wraps only the pretrained backbone (shared/policies/vla.py: apply_lora): the value
    # head beside it stays fully trainable.
    lora_base = "model"

    def __init__(self, model: nn.Module, action_dim: int, low: float | Sequence[float] = -1.0,
                 high: float | Sequence[float] = 1.0, n_bins: int = 256, token_offset: int | None = None,
                 reserve_tail: int = 0, decoding: str = "parallel", value_head: bool = True,
                 image_mean: Sequence[float] = (0.5, 0.5, 0.5), image_std: Sequence[float] = (0.5, 0.5, 0.5),
                 image_size: int | None = None, bos_token_id: int | None = None,
                 sep_token_id: int = GEMMA_NEWLINE_ID, placeholder_token_id: int | None = None,
                 instruction_pad_id: int | None = 0, proprio_bounds: Sequence[float] | None = (-1.0, 1.0),
                 temperature: float = 1.0, binning: str = "centres", chunk_size: int = 1):
        super().__init__()
        # Every keyword but the model, as given: what save_pretrained writes to tandem_adapter.json.
        self._adapter_kwargs = {k: v for k, v in locals().items() if k not in ("self", "model", "__class__")}
        self.model = model
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if not isinstance(head, nn.Linear):
            raise ValueError(f"ActionTokenPolicy: {type(model).__name__} has no LM head "
                             "(get_output_embeddings() must return an nn.Linear)")
        cfg = model.config
        text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        vocab, hidden = head.weight.shape
        self.action_dim, self.decoding, self.n_bins = action_dim, decoding, n_bins
        if not (isinstance(chunk_size, int) and chunk_size >= 1):
            raise ValueError(f"ActionTokenPolicy: chunk_size must be a positive int, got {chunk_size!r}")
        if chunk_size > 1 and decoding != "parallel":
            raise ValueError(f"ActionTokenPolicy: chunk_size {chunk_size} needs decoding=\"parallel\" (the H x "
                             f"action_dim tokens of a chunk are decoded in one pass), got {decoding!r}")
        self.chunk_size = chunk_size
        self.token_offset = vocab - n_bins - reserve_tail if token_offset is None else token_offset
        self.bos_token_id = getattr(text_cfg, "bos_token_id", None) if bos_token_id is None else bos_token_id
        self.sep_token_id = sep_token_id
        pad = getattr(text_cfg, "pad_token_id", None)
        self.placeholder_token_id = (pad if pad is not None else 0) if placeholder_token_id is None \
            else placeholder_token_id
        self.instruction_pad_id = instruction_pad_id
        self.softcap = getattr(text_cfg, "final_logit_softcapping", None)
        self.temperature = temperature

        self._read_vision(cfg, text_cfg, image_size)
        base_params = inspect.signature(self._trunk().forward).parameters
        # PaliGemma's prefix is bidirectional and its suffix causal: token_type_ids 0 and 1.
        self._token_types = "token_type_ids" in base_params
        self._validate(vocab, binning, proprio_bounds)

        self.bins = ActionBins(low, high, n_bins, binning)
        if self.bins.low.numel() not in (1, action_dim):
            raise ValueError(f"ActionTokenPolicy: low/high have {self.bins.low.numel()} values for "
                             f"action_dim={action_dim}: give one bound, or one per action dim")
        self.proprio_bins = ActionBins(*proprio_bounds, n_bins, binning) if proprio_bounds is not None else None
        self.register_buffer("image_mean", torch.tensor(image_mean, dtype=torch.float32).view(3, 1, 1),
                             persistent=False)
        self.register_buffer("image_std", torch.tensor(image_std, dtype=torch.float32).view(3, 1, 1),
                             persistent=False)
        if value_head:
            self.value_head = nn.Linear(hidden, 1)
            nn.init.zeros_(self.value_head.bias)
        else:
            self.value_head = None
            # VLAPolicy decides "has a critic" from callable(model.value); hide the method.
            self.value = None
        # The [sep] hidden state of the last prompt pass, kept for value(obs) on the same obs object,
        # so VLAPolicy's action_dist(obs) + value(obs) is one forward pass, not two.
        self._stash: tuple[TensorDictBase, torch.Tensor] | None = None

    def _read_vision(self, cfg, text_cfg, image_size: int | None) -> None:
        """A vision-language model: the image enters as n_img copies of the image token, which the
        model replaces with the vision tower's projected patches (PaliGemma's get_placeholder_mask).
        A text-only model has no image token, and image size and token count 0."""
        vision_cfg = getattr(cfg, "vision_config", None)
        self.image_token_id = getattr(cfg, "image_token_id", None) if vision_cfg is not None else None
        self.image_size, self.n_image_tokens = 0, 0
        if self.image_token_id is not None:
            self.image_size = image_size or vision_cfg.image_size
            self.n_image_tokens = getattr(text_cfg, "num_image_tokens", None) or \
                (vision_cfg.image_size // vision_cfg.patch_size) ** 2

    def _validate(self, vocab: int, binning: str, proprio_bounds) -> None:
        """Raise ValueError naming every inconsistent setting at once, each with the fix."""
        decoding, action_dim, n_bins, temperature = self.decoding, self.action_dim, self.n_bins, self.temperature
        errors = []
        if decoding not in DECODING_MODES:
            errors.append(f"decoding={decoding!r} is not one of {DECODING_MODES}")
        if action_dim < 1:
            errors.append(f"action_dim={action_dim} must be >= 1")
        if not 0 <= self.token_offset or self.token_offset + n_bins > vocab:
            errors.append(f"bin tokens [{self.token_offset}, {self.token_offset + n_bins}) do not fit the "
                          f"vocabulary of {vocab}: lower n_bins, reserve_tail or token_offset")
        for name in ("image_token_id", "bos_token_id", "sep_token_id", "placeholder_token_id"):
            tok = getattr(self, name)
            if tok is not None and self.token_offset <= tok < self.token_offset + n_bins:
                errors.append(f"{name}={tok} lies in the bin-token block [{self.token_offset}, "
                              f"{self.token_offset + n_bins}): set reserve_tail or token_offset to move the block")
            elif tok is not None and not 0 <= tok < vocab and name != "image_token_id":
                errors.append(f"{name}={tok} is outside the vocabulary of {vocab}")
        if not (isinstance(temperature, (int, float)) and not isinstance(temperature, bool) and 0 < temperature < float("inf")):
            errors.append(f"temperature={temperature!r} must be a finite number > 0 (1: the model's own logits)")
        if binning not in BINNINGS:
            errors.append(f"binning={binning!r} is not one of {BINNINGS}")
        elif binning == "openvla" and n_bins < 3:
            errors.append(f"n_bins={n_bins}: binning 'openvla' needs at least 3 (OpenVLA uses 256)")
        if proprio_bounds is not None and len(proprio_bounds) != 2:
            errors.append(f"proprio_bounds={proprio_bounds!r} must be (low, high) or None")
        if errors:
            raise ValueError("ActionTokenPolicy:\n  - " + "\n  - ".join(errors))

    # ------------------------------------------------------------------ prompt
    def _trunk(self) -> nn.Module:
        """The model without its LM head (PaliGemmaModel, LlamaModel, ...), under a PEFT wrapper too."""
        model = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        return model.base_model

    def _device(self) -> torch.device:
        return self.model.get_output_embeddings().weight.device

    def _pixels(self, rgb: torch.Tensor) -> torch.Tensor:
        """[N, H, W, 3] uint8 -> [N, 3, S, S] normalised, in the vision tower's dtype."""
        x = rgb.to(self._device()).permute(0, 3, 1, 2).float() / 255.0
        if x.shape[-2:] != (self.image_size, self.image_size):
            x = F.interpolate(x, size=(self.image_size, self.image_size), mode="bilinear", align_corners=False,
                              antialias=True)
        x = (x - self.image_mean) / self.image_std
        return x.to(self.model.get_input_embeddings().weight.dtype)

    def _prompt(self, obs: TensorDictBase) -> _Prompt:
        if "instruction" not in obs.keys():
            raise KeyError(f"ActionTokenPolicy: the observation has no 'instruction'; keys: {sorted(obs.keys())}")
        instr = obs["instruction"]
        batch = instr.shape[:-1]
        dev = self._device()
        instr = instr.reshape(-1, instr.shape[-1])
        if instr.device.type == "cpu":
            # out of range, a lookup on CUDA is a device-side assert that leaves the device unusable: refuse
            # such ids here, where checking costs nothing (an inference server's requests, a CPU actor's envs)
            bounds = self.observation_bounds()
            bad = ids_out_of_bounds({"instruction": instr}, bounds)
            if bad:
                vocab = bounds["instruction"][1]
                raise ValueError(f"ActionTokenPolicy: instruction ids must be in [0, {vocab}): {bad}")
        instr = instr.to(dev, torch.int64)                                          # [N, L]
        n = instr.shape[0]
        parts = []
        if self.image_token_id is not None:
            parts.append(torch.full((n, self.n_image_tokens), self.image_token_id, dtype=torch.int64, device=dev))
        if self.bos_token_id is not None:
            parts.append(torch.full((n, 1), self.bos_token_id, dtype=torch.int64, device=dev))
        n_before = sum(p.shape[1] for p in parts)
        parts.append(instr)
        proprio = obs.get("proprio", None) if self.proprio_bins is not None else None
        if proprio is not None:
            parts.append(self.proprio_bins.to_bins(proprio.reshape(n, -1).to(dev)) + self.token_offset)
        parts.append(torch.full((n, 1), self.sep_token_id, dtype=torch.int64, device=dev))
        ids = torch.cat(parts, 1)                                                  # [N, P]
        mask = torch.ones_like(ids)
        if self.instruction_pad_id is not None:
            mask[:, n_before:n_before + instr.shape[1]] = (instr != self.instruction_pad_id).long()
        pixels = None
        if self.image_token_id is not None:
            if "rgb" not in obs.keys():
                raise KeyError(f"ActionTokenPolicy: a vision-language model needs 'rgb'; keys: {sorted(obs.keys())}")
            rgb = obs["rgb"]
            pixels = self._pixels(rgb.reshape(-1, *rgb.shape[-3:]))
        return _Prompt(ids, mask, pixels, torch.Size(batch))

    # ------------------------------------------------------------------ passes
    def _run(self, ids: torch.Tensor, mask: torch.Tensor, pixels: torch.Tensor | None = None,
             n_prefix: int | None = None, cache=None, use_cache: bool = False):
        """One pass of the base model -> (last hidden states [N, T, H], KV cache or None).

        ``n_prefix`` (first pass only) marks the bidirectional prefix for PaliGemma-style models.
        """
        kwargs = {}
        if pixels is not None:
            kwargs["pixel_values"] = pixels
        if n_prefix is not None and self._token_types:
            types = torch.ones_like(ids)
            types[:, :n_prefix] = 0
            kwargs["token_type_ids"] = types
        trunk = self._trunk()
        kwargs[_cache_arg(trunk)] = cache
        out = trunk(input_ids=ids, attention_mask=mask, use_cache=use_cache, **kwargs)
        if not use_cache:
            return out.last_hidden_state, None
        new_cache = getattr(out, "cache", None)
        return out.last_hidden_state, (new_cache if new_cache is not None else out.past_key_values)

    def _bin_logp(self, h: torch.Tensor) -> torch.Tensor:
        """[N, T, H] hidden states -> [N, T, n_bins] float32 log-softmax over the bin block only."""
        head = self.model.get_output_embeddings()
        block = slice(self.token_offset, self.token_offset + self.n_bins)
        with torch.autocast(h.device.type, enabled=False):
            logits = F.linear(h.float(), head.weight[block].float(),
                              None if head.bias is None else head.bias[block].float())
        if self.softcap is not None:   # Gemma 2's final-logit soft-capping, as the LM head applies it
            logits = torch.tanh(logits / self.softcap) * self.softcap
        if self.temperature != 1.0:
            logits = logits / self.temperature
        return self.bins.merge(logits.log_softmax(-1))

    def _value_from(self, h_sep: torch.Tensor, batch: torch.Size) -> torch.Tensor:
        return self.value_head(h_sep.to(self.value_head.weight.dtype)).squeeze(-1).float().reshape(batch)

    def _decode(self, prompt: _Prompt, cache, first_logp: torch.Tensor, greedy: bool):
        """KV-cached decoding -> (bins [N, D], per-step logp [N, D, n_bins]); the cache is left as the prefix."""
        steps, chosen, mask = [first_logp], [], prompt.attention_mask
        for d in range(self.action_dim):
            logp = steps[-1][:, 0]                                                 # [N, n_bins]
            bins = logp.argmax(-1) if greedy else torch.multinomial(logp.detach().exp(), 1).squeeze(-1)
            chosen.append(bins)
            if d == self.action_dim - 1:
                break
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], 1)
            h, cache = self._run((bins + self.token_offset).unsqueeze(1), mask, cache=cache, use_cache=True)
            steps.append(self._bin_logp(h))
        self._rewind(cache, prompt)
        return torch.stack(chosen, 1), torch.cat(steps, 1)

    def _teacher_force(self, prompt: _Prompt, cache, first_logp: torch.Tensor, bins: torch.Tensor) -> torch.Tensor:
        """Bins [N, D] -> per-step logp [N, D, n_bins] from one pass of bins[:, :-1] over the cached prefix."""
        if self.action_dim == 1:
            return first_logp
        n = bins.shape[0]
        mask = torch.cat([prompt.attention_mask, prompt.attention_mask.new_ones(n, self.action_dim - 1)], 1)
        h, cache = self._run(bins[:, :-1] + self.token_offset, mask, cache=cache, use_cache=True)
        self._rewind(cache, prompt)
        return torch.cat([first_logp, self._bin_logp(h)], 1)

    @staticmethod
    def _rewind(cache, prompt: _Prompt) -> None:
        extra = cache.get_seq_length() - prompt.input_ids.shape[1]
        if extra:
            cache.crop(-extra)
        if cache.get_seq_length() != prompt.input_ids.shape[1]:
            raise RuntimeError(f"ActionTokenPolicy: the KV cache ({type(cache).__name__}) did not rewind to the "
                               "prompt; autoregressive decoding needs a croppable cache (DynamicCache)")

    # ------------------------------------------------------------------ VLA model interface
    def action_dist(self, obs: TensorDictBase) -> ActionTokenDistribution | AutoregressiveActionTokenDistribution:
        """The action distribution for ``obs`` ``[*B]`` (``rgb`` uint8, ``instruction`` int64, ``proprio``).

        Returns:
            a distribution whose ``sample``/``mode`` are ``[*B, D]`` bin centres and whose
            ``log_prob(action)``/``entropy()`` are ``[*B]``.
        """
        prompt = self._prompt(obs)
        n, p = prompt.input_ids.shape
        if self.decoding == "parallel":
            tokens = self.chunk_size * self.action_dim
            ids = torch.cat([prompt.input_ids, prompt.input_ids.new_full((n, tokens), self.placeholder_token_id)], 1)
            mask = torch.cat([prompt.attention_mask, prompt.attention_mask.new_ones(n, tokens)], 1)
            h, _ = self._run(ids, mask, prompt.pixel_values, n_prefix=p)            # [N, P + H*D, hidden]
            self._keep(obs, h[:, p - 1])
            logp = self._bin_logp(h[:, p:])                                        # [N, H*D, n_bins]
            chunk = (self.chunk_size,) if self.chunk_size > 1 else ()
            return ActionTokenDistribution(logp.reshape(*prompt.batch_shape, *chunk, self.action_dim, self.n_bins),
                                           self.bins)
        h, cache = self._run(prompt.input_ids, prompt.attention_mask, prompt.pixel_values, n_prefix=p,
                             use_cache=True)
        self._keep(obs, h[:, -1])
        return AutoregressiveActionTokenDistribution(self, prompt, cache, self._bin_logp(h[:, -1:]))

    def observation_bounds(self) -> dict[str, tuple[int, int]]:
        """Instruction ids index the model's embedding (``shared.policies.observation_bounds``)."""
        return {"instruction": (0, self.model.get_input_embeddings().weight.shape[0])}

    def _keep(self, obs: TensorDictBase, h_sep: torch.Tensor) -> None:
        self._stash = (obs, h_sep) if self.value_head is not None else None

    def __getstate__(self) -> dict:
        # deepcopy/pickle: a stashed hidden state may be a non-leaf tensor, which cannot be copied.
        return {**super().__getstate__(), "_stash": None}

    def value(self, obs: TensorDictBase) -> torch.Tensor:
        """``[*B]`` float32: the value head on the ``[sep]`` hidden state (reused from ``action_dist`` on this obs)."""
        if self._stash is not None and self._stash[0] is obs:
            h_sep, self._stash = self._stash[1], None
            return self._value_from(h_sep, obs["instruction"].shape[:-1])
        prompt = self._prompt(obs)
        h, _ = self._run(prompt.input_ids, prompt.attention_mask, prompt.pixel_values,
                         n_prefix=prompt.input_ids.shape[1])
        return self._value_from(h[:, -1], prompt.batch_shape)

    def deterministic_action(self, dist: ActionTokenDistribution | AutoregressiveActionTokenDistribution
                             ) -> torch.Tensor:
        """``[*B, D]``: the argmax bins' centres (greedy decoding in autoregressive mode)."""
        return dist.mode

    # ------------------------------------------------------------------ checkpoints
    # Built from a checkpoint directory (vla_config.model_path), never from model_config alone.
    needs_checkpoint = True

    @classmethod
    def from_pretrained(cls, path, local_files_only: bool = True, **model_config) -> ActionTokenPolicy:
        """The policy from a checkpoint directory: transformers' ``save_pretrained`` output is enough
        (see ``shared/policies/token_checkpoints.py``: strict loading, optional Tandem files, a fresh
        value head where none is saved). `model_config` holds this class's keywords (``action_dim``,
        ``low``, ``high``, ``n_bins``, ``binning``, ...) and ``backbone_class`` / ``backbone_kwargs``.

        Raises:
            ValueError: ``local_files_only`` false (checkpoints are never fetched from a hub).
            VLALoadError: see ``load_token_policy``.
        """
        from shared.policies.token_checkpoints import load_token_policy
        if local_files_only is not True:
            raise ValueError(f"{cls.__name__}.from_pretrained: local_files_only must be True")
        return load_token_policy(cls, path, model_config)

    def save_pretrained(self, path) -> None:
        """A checkpoint directory ``from_pretrained`` reads back exactly: the backbone's own
        ``save_pretrained`` plus ``tandem_adapter.json`` (keywords) and ``tandem_adapter.safetensors``
        (the value head)."""
        from shared.policies.token_checkpoints import save_token_policy
        save_token_policy(self, path)

    def adaptations(self, spec=None) -> list[str]:
        """What this adapter does to the env's inputs and the model's outputs, one line each, for the
        start-up log: the action-token block, image resizing, proprio and instruction handling."""
        vocab = self.model.get_output_embeddings().weight.shape[0]
        lo, hi = self.bins.low.tolist(), self.bins.high.tolist()
        lines = [f"action tokens: {self.action_dim} per action, {self.n_bins} bins each over [{lo}, {hi}] "
                 f"({self.bins.binning} binning) = token ids [{self.token_offset}, {self.token_offset + self.n_bins}) "
                 f"of a vocabulary of {vocab}; decoding {self.decoding}"]
        obs_keys = getattr(spec, "obs_keys", {}) or {}
        if self.image_token_id is not None:
            shape = obs_keys.get("rgb", ((), None))[0]
            size = f"{shape[0]}x{shape[1]}" if len(shape) == 3 else "?"
            resized = len(shape) == 3 and tuple(shape[:2]) != (self.image_size, self.image_size)
            lines.append(f"rgb {size} uint8 -> " + (f"resized to {self.image_size}x{self.image_size} (bilinear, "
                         "antialiased) -> " if resized else "") + "normalised with mean "
                         f"{self.image_mean.flatten().tolist()} std {self.image_std.flatten().tolist()} -> "
                         f"{self.n_image_tokens} image tokens")
        if "proprio" in obs_keys:
            lines.append("proprio is ignored (proprio_bounds None)" if self.proprio_bins is None else
                         f"proprio {list(obs_keys['proprio'][0])} is tokenised into the action-token block over "
                         f"[{self.proprio_bins.low.tolist()}, {self.proprio_bins.high.tolist()}]")
        if "instruction" in obs_keys:
            lines.append(f"instruction ids {list(obs_keys['instruction'][0])} are model token ids"
                         + (f"; id {self.instruction_pad_id} is padding, masked out of attention"
                            if self.instruction_pad_id is not None else ""))
        return lines


# ---------------------------------------------------------------------- PaliGemma backbones
_PRESETS = {
    # A few milliseconds per CPU forward: for tests. 16x16 images (Reach-v0's) in 4x4 patches = 16 image tokens.
    "tiny": dict(vocab_size=512, image_token_index=255, hidden=32, layers=2, heads=2, kv_heads=1, head_dim=16,
                 intermediate=64, image_size=16, patch_size=4, vision_hidden=32, vision_layers=2, vision_heads=2,
                 vision_intermediate=64),
    # ~0.5B parameters for benchmarks: SigLIP-B/16 at 224 (196 image tokens) + a 12-layer, 1024-wide Gemma
    # with PaliGemma's vocabulary (257,216 ids; <image> = 257,152, so use reserve_tail=64 with it).
    "0.5b": dict(vocab_size=257216, image_token_index=257152, hidden=1024, layers=12, heads=8, kv_heads=1,
                 head_dim=128, intermediate=4096, image_size=224, patch_size=16, vision_hidden=768,
                 vision_layers=12, vision_heads=12, vision_intermediate=3072),
}


def paligemma_config(size: str = "0.5b", **overrides):
    """A ``PaliGemmaConfig`` (SigLIP vision + Gemma text) from a preset (``"tiny"``, ``"0.5b"``).

    Args:
        size: the preset.
        **overrides: any preset key (``vocab_size``, ``hidden``, ``layers``, ``image_size``, ...).
    Raises:
        ValueError: an unknown preset or override key.
    """
    from transformers import GemmaConfig, PaliGemmaConfig, SiglipVisionConfig

    if size not in _PRESETS:
        raise ValueError(f"paligemma_config: unknown size {size!r}; choose from {sorted(_PRESETS)}")
    unknown = sorted(set(overrides) - set(_PRESETS[size]))
    if unknown:
        raise ValueError(f"paligemma_config: unknown override(s) {unknown}; allowed: {sorted(_PRESETS[size])}")
    p = {**_PRESETS[size], **overrides}
    vision = SiglipVisionConfig(hidden_size=p["vision_hidden"], intermediate_size=p["vision_intermediate"],
                                num_hidden_layers=p["vision_layers"], num_attention_heads=p["vision_heads"],
                                image_size=p["image_size"], patch_size=p["patch_size"], vision_use_head=False)
    text = GemmaConfig(vocab_size=p["vocab_size"], hidden_size=p["hidden"], intermediate_size=p["intermediate"],
                       num_hidden_layers=p["layers"], num_attention_heads=p["heads"],
                       num_key_value_heads=p["kv_heads"], head_dim=p["head_dim"])
    return PaliGemmaConfig(vision_config=vision, text_config=text, image_token_index=p["image_token_index"],
                           vocab_size=p["vocab_size"], projection_dim=p["hidden"], hidden_size=p["hidden"])


def make_tiny_paligemma(**overrides) -> nn.Module:
    """A randomly initialised tiny ``PaliGemmaForConditionalGeneration`` (see ``paligemma_config``)."""
    from transformers import PaliGemmaForConditionalGeneration

    return PaliGemmaForConditionalGeneration(paligemma_config("tiny", **overrides))


class PaliGemmaActionTokenPolicy(ActionTokenPolicy):
    """``ActionTokenPolicy`` around a PaliGemma built from ``paligemma_config(size, **backbone)``.

    JSON-constructible, so ``load_vla_model`` can build it (``vla_config.model_class:
    "shared.policies.action_tokens.PaliGemmaActionTokenPolicy"``) and then load ``model_path`` into it.
    Every other keyword goes to ``ActionTokenPolicy``.
    """

    def __init__(self, size: str = "tiny", backbone: dict | None = None, action_dim: int = 2, **kwargs):
        from transformers import PaliGemmaForConditionalGeneration

        super().__init__(PaliGemmaForConditionalGeneration(paligemma_config(size, **(backbone or {}))), action_dim,
                         **kwargs)
        self._adapter_kwargs = {"action_dim": action_dim, **kwargs}   # what was given, as the preset's files say

    # model_config keys that only say how to build a fresh backbone: a checkpoint's config.json decides.
    IGNORED_ON_LOAD = ("size", "backbone")
    needs_checkpoint = False
