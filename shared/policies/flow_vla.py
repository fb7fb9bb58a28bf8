"""π0 (transformers' ``PI0ForConditionalGeneration``) as the base of a flow-matching RL policy: loading and
model plumbing.

Tandem does not write its own π0: the model is transformers' (a PaliGemma VLM and a Gemma action expert
with joint attention). This module adds only what RL needs on top of it.

Conventions (transformers'): x_1 is noise, x_0 the action chunk; the model predicts v ≈ ε − a; K Euler
steps of size Δ = 1/K at t_k = 1 − kΔ, x_{k+1} = x_k − Δ·v(x_k, t_k). A chain is ``[B, K+1, H, A]`` with
``chain[:, 0]`` = x_1 and ``chain[:, K]`` = x_0, where H = ``config.chunk_size`` and A =
``config.max_action_dim`` (the model's action space; the env's actions are its first ``action_dim``).

What it covers:

* :func:`load_pi0`: strict loading of a local ``model_path`` directory that
  ``PI0ForConditionalGeneration.from_pretrained`` reads: its own ``save_pretrained`` output and LeRobot's
  key layout (``model.paligemma_with_expert.*``, ``model.state_proj`` ...), which transformers' own key
  mapping for ``pi0`` renames. A missing, unexpected or wrongly shaped tensor is a
  :class:`~shared.policies.vla.VLALoadError` naming the tensor and the file (through
  :func:`shared.policies.vla.load_pretrained`). Tandem's own small heads (``value_head``, ``noise_head``)
  live in ``tandem_heads.safetensors`` beside the checkpoint and are loaded as strictly; a head that no
  file holds is the one allowed exception: it starts as built, and that is logged once.
* :func:`encode_prefix`, :func:`expert_pass`, :func:`velocity`, :func:`ode_chain` and
  :func:`velocities_at`: the prefix (images and instruction through the VLM) is computed once per call
  into a KV cache, and each of the K expert passes attends to it, the cache cropped back to the prefix
  after each pass (as ``sample_actions`` does). ``expert_pass`` also returns the expert's output per
  action token (what Tandem's noise and value heads read). ``ode_chain`` returns the deterministic chain
  and its velocities; ``velocities_at`` recomputes the velocities at given chain states and times from one
  prefix cache, with gradients (the learner's side).
* :func:`pi0_inputs`: Tandem observations to the model's inputs (see there), :func:`env_actions`.

The RL policy built on these (Flow-Noise and Flow-SDE chains, their log-likelihoods, the value head,
LoRA) is :class:`shared.policies.flow_policy.FlowVLAPolicy`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shared.policies.token_checkpoints import mismatch_text, weight_files
from shared.policies.vla import VLALoadError, load_pretrained

log = logging.getLogger("tandem.vla")

PI0_CLASS = "transformers.PI0ForConditionalGeneration"
HEADS_FILE = "tandem_heads.safetensors"
# Tandem's own heads, not in a π0 checkpoint: the only tensors that may start fresh (logged once).
HEAD_NAMES = ("value_head", "noise_head")

_said: set[str] = set()


def _once(key: str, level: int, message: str, *args: Any) -> None:
    """Log `message` the first time `key` is seen in this process."""
    if key not in _said:
        _said.add(key)
        log.log(level, message, *args)


# ----------------------------------------------------------------------------- loading

KEY = "policy.flow_config.model_path"   # the config key that names a π0 checkpoint, for error messages


def load_pi0(model_path: str | Path, heads: dict[str, nn.Module] | None = None,
             backbone_kwargs: dict[str, Any] | None = None) -> nn.Module:
    """``PI0ForConditionalGeneration`` from the local directory `model_path`, strictly, in eval mode.

    Args:
        model_path: a directory with ``config.json`` and ``model.safetensors`` (or shards and their
            index), in transformers' ``save_pretrained`` layout or LeRobot's; never fetched from a hub.
        heads: Tandem's own heads by name (``value_head``, ``noise_head``), built by the caller; their
            tensors are loaded in place from ``tandem_heads.safetensors`` (see :func:`load_heads`). None:
            that file is not read (a caller that builds its heads after the model loads them itself).
        backbone_kwargs: more keywords for ``from_pretrained`` (e.g. ``{"torch_dtype": torch.float32}``).

    Raises:
        VLALoadError: no such directory, a tensor missing from the files, one the model does not have,
            or one of another shape (each named, with the file), or heads that do not match their file.
    """
    path = Path(model_path)
    if not (path / "config.json").is_file():
        raise VLALoadError(f"{KEY} {str(path)!r}: a π0 checkpoint is a directory with config.json and "
                           f"model.safetensors (written by save_pretrained, or LeRobot's); "
                           + ("it has no config.json" if path.is_dir() else "no such directory"))
    try:
        model = load_pretrained(str(path), PI0_CLASS, dict(backbone_kwargs or {}), key=KEY)
    except VLALoadError as e:   # transformers names tensors as the model has them: say which file was read
        raise VLALoadError(f"{e} (weights: {weight_files(path)}; LeRobot's names are mapped by transformers' "
                           f"key mapping for pi0)") from None
    if heads is not None:
        load_heads(heads, path)
    return model.eval()


def load_heads(heads: dict[str, nn.Module], path: str | Path, announce: bool = True) -> None:
    """Load Tandem's heads in place from ``<path>/tandem_heads.safetensors`` (keys ``<head>.<tensor>``).

    Every tensor in the file must belong to a given head, with the same shape, and a head in the file
    must be there whole. A head that the file does not hold at all (or no file) keeps the values it was
    built with: a fresh head, logged once (a warning where `announce`, else at debug level: a policy copy
    that takes the learner's weights before it acts need not say it).

    Raises:
        VLALoadError: a head name outside ``HEAD_NAMES``, an unreadable file, or tensors that do not
            match (named, with the file).
    """
    from safetensors.torch import load_file

    unknown = sorted(set(heads) - set(HEAD_NAMES))
    if unknown:
        raise VLALoadError(f"π0 heads {unknown}: Tandem's own heads are {list(HEAD_NAMES)}")
    file = Path(path) / HEADS_FILE
    try:
        saved = load_file(str(file)) if file.is_file() else {}
    except Exception as e:
        raise VLALoadError(f"{file}: cannot read: {type(e).__name__}: {e}") from None
    own = {f"{name}.{k}": v for name, head in heads.items() for k, v in head.state_dict().items()}
    held = {k.split(".", 1)[0] for k in saved}
    fresh = sorted(name for name in heads if name not in held)
    expected = {k for k in own if k.split(".", 1)[0] not in fresh}
    if differences := mismatch_text(saved, own, expected):
        raise VLALoadError(f"{file} does not match the heads {sorted(heads)}: {differences}")
    with torch.no_grad():
        for k, v in saved.items():
            own[k].copy_(v)
    if fresh:
        _once(f"fresh:{Path(path).resolve()}:{fresh}", logging.WARNING if announce else logging.DEBUG,
              "%s: no %s in %s: %s start%s fresh, as built", path, " or ".join(fresh), HEADS_FILE,
              " and ".join(fresh), "s" if len(fresh) == 1 else "")


def save_pi0(model: nn.Module, path: str | Path, heads: dict[str, nn.Module] | None = None) -> None:
    """``model.save_pretrained(path)`` plus Tandem's heads in ``tandem_heads.safetensors`` (if any)."""
    from safetensors.torch import save_file

    path = Path(path)
    model.save_pretrained(str(path))
    own = {f"{name}.{k}": v.detach().contiguous() for name, head in (heads or {}).items()
           for k, v in head.state_dict().items()}
    if own:
        save_file(own, str(path / HEADS_FILE))


# ----------------------------------------------------------------------------- inputs

@dataclass
class PI0Inputs:
    """What ``PI0ForConditionalGeneration`` reads for one batch of B observations."""

    state: torch.Tensor                 # [B, max_state_dim] float
    input_ids: torch.Tensor             # [B, L] int64: image tokens, then the instruction's ids
    pixel_values: torch.Tensor          # [B, cameras, 3, S, S] float in [-1, 1]
    pixel_attention_mask: torch.Tensor  # [B, cameras] bool
    attention_mask: torch.Tensor        # [B, L] int64 (0 on instruction padding)

    def prefix_kwargs(self) -> dict[str, torch.Tensor]:
        """The keywords of a full ``model(...)`` call besides the noise and the time."""
        return {"state": self.state, "input_ids": self.input_ids, "pixel_values": self.pixel_values,
                "pixel_attention_mask": self.pixel_attention_mask, "attention_mask": self.attention_mask}


def _pixels(rgb: torch.Tensor, size: int, dtype: torch.dtype) -> torch.Tensor:
    """uint8 ``[B, (cams,) h, w, 3]`` to ``[B, cams, 3, size, size]`` in [-1, 1] (resized if needed)."""
    if rgb.dim() == 4:
        rgb = rgb[:, None]
    if rgb.dim() != 5 or rgb.shape[-1] != 3:
        raise ValueError(f"rgb: expected [B, h, w, 3] or [B, cameras, h, w, 3], got {tuple(rgb.shape)}")
    b, cams, h, w, _ = rgb.shape
    x = rgb.reshape(b * cams, h, w, 3).permute(0, 3, 1, 2).to(torch.float32)
    x = x / 255.0 if rgb.dtype == torch.uint8 else x
    if (h, w) != (size, size):
        _once(f"resize:{h}x{w}->{size}", logging.INFO, "π0 inputs: rgb %dx%d resized to the model's %dx%d "
              "(bilinear, antialiased; the aspect ratio is not kept)", h, w, size, size)
        x = F.interpolate(x, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
    x = (x - 0.5) / 0.5    # PI0ImageProcessor's normalisation (mean 0.5, std 0.5 per channel)
    return x.reshape(b, cams, 3, size, size).to(dtype)


def pi0_inputs(config: Any, rgb: torch.Tensor, proprio: torch.Tensor, instruction: torch.Tensor,
               instruction_pad_id: int | None = None, dtype: torch.dtype = torch.float32) -> PI0Inputs:
    """Tandem's observation (``rgb``, ``proprio``, ``instruction``) as π0's inputs.

    * ``rgb``: ``[B, h, w, 3]`` or ``[B, cameras, h, w, 3]``, uint8 (or float in [0, 1]); resized to the
      vision tower's ``image_size`` where it differs (each size logged once) and scaled to [-1, 1].
    * ``proprio``: ``[B, D]``, zero-padded to ``max_state_dim`` (already normalised: π0's processor
      normalises with dataset statistics; Tandem's own normalisation is the caller's).
    * ``instruction``: token ids ``[B, L]`` as given (no tokenizer here); the prompt is the image tokens
      (``num_image_tokens`` per camera) followed by them. Where ``instruction_pad_id`` is given, those
      positions are masked out of attention.

    Raises:
        ValueError: shapes that do not fit, or more proprio dims than ``max_state_dim``.
    """
    vision, text = config.vlm_config.vision_config, config.vlm_config.text_config
    pixels = _pixels(rgb, vision.image_size, dtype)
    b, cams = pixels.shape[:2]
    if proprio.dim() != 2 or proprio.shape[0] != b or proprio.shape[1] > config.max_state_dim:
        raise ValueError(f"proprio: expected [B={b}, D <= max_state_dim={config.max_state_dim}], "
                         f"got {tuple(proprio.shape)}")
    state = F.pad(proprio.to(dtype), (0, config.max_state_dim - proprio.shape[1]))
    if instruction.dim() != 2 or instruction.shape[0] != b:
        raise ValueError(f"instruction: expected token ids [B={b}, L], got {tuple(instruction.shape)}")
    n_image = text.num_image_tokens * cams
    image_ids = torch.full((b, n_image), config.vlm_config.image_token_id, dtype=torch.long,
                           device=instruction.device)
    ids = torch.cat([image_ids, instruction.long()], dim=1)
    text_mask = (instruction != instruction_pad_id) if instruction_pad_id is not None \
        else torch.ones_like(instruction, dtype=torch.bool)
    mask = torch.cat([torch.ones_like(image_ids, dtype=torch.bool), text_mask], dim=1).long()
    return PI0Inputs(state=state, input_ids=ids, pixel_values=pixels,
                     pixel_attention_mask=torch.ones(b, cams, dtype=torch.bool, device=pixels.device),
                     attention_mask=mask)


def env_actions(x0: torch.Tensor, action_dim: int) -> torch.Tensor:
    """The env's actions from the model's ``[..., max_action_dim]``: the first `action_dim`."""
    if action_dim > x0.shape[-1]:
        raise ValueError(f"action_dim {action_dim} exceeds the model's max_action_dim {x0.shape[-1]}")
    return x0[..., :action_dim]


# ----------------------------------------------------------------------------- the ODE chain

@dataclass
class Prefix:
    """The VLM's KV cache over the prefix (images and instruction), reused by every expert pass."""

    cache: Any                  # transformers' Cache, cropped back to `length` after each expert pass
    length: int
    inputs: PI0Inputs
    hidden: torch.Tensor        # [B, L, vlm hidden] the VLM's last hidden state over the prefix


def encode_prefix(model: nn.Module, inputs: PI0Inputs) -> Prefix:
    """Run the VLM once over the prefix (as ``sample_actions`` does) and keep its cache."""
    position_ids = inputs.attention_mask.cumsum(-1) - 1
    embeds = model.model.embed_prefix(inputs.input_ids, inputs.pixel_values, inputs.pixel_attention_mask)
    out = model.model.vlm(inputs_embeds=embeds, attention_mask=inputs.attention_mask, position_ids=position_ids,
                          token_type_ids=torch.zeros_like(embeds)[:, :, 0], use_cache=True)
    return Prefix(cache=out.cache, length=out.cache.get_seq_length(), inputs=inputs, hidden=out.last_hidden_state)


def expert_pass(model: nn.Module, prefix: Prefix, x_t: torch.Tensor,
                t: torch.Tensor | float) -> tuple[torch.Tensor, torch.Tensor]:
    """One expert pass over the state and x_t, attending to the prefix cache: ``(v, hidden)``.

    The steps of ``PI0ForConditionalGeneration.forward`` with a cache (embed state, x_t and t; the expert;
    ``action_out_proj``), keeping the expert's output per action token for Tandem's heads. `t` is a float
    or ``[B]``; `x_t` is cast to the model's dtype. The cache is cropped back to the prefix afterwards, so
    passes do not see each other.

    Returns:
        ``v`` ``[B, H, A]`` (the model's velocity) and ``hidden`` ``[B, H, expert hidden]``.
    """
    inputs = prefix.inputs
    if not torch.is_tensor(t) or t.dim() == 0:
        t = torch.full((x_t.shape[0],), float(t), dtype=torch.float32, device=x_t.device)
    dtype = model.action_out_proj.weight.dtype
    embeds = model.embed_action_time(inputs.state, x_t.to(dtype), t.to(torch.float32))
    out = model.model(action_embeds=embeds, attention_mask=inputs.attention_mask,
                      pixel_attention_mask=inputs.pixel_attention_mask, cache=prefix.cache)
    # this version's crop takes the (negative) number of tokens to drop: the pass's 1 + H
    prefix.cache.crop(prefix.length - prefix.cache.get_seq_length())
    hidden = out.last_hidden_state[:, -model.config.chunk_size:]
    return model.action_out_proj(hidden), hidden


def velocity(model: nn.Module, prefix: Prefix, x_t: torch.Tensor, t: torch.Tensor | float) -> torch.Tensor:
    """v(x_t, t) ``[B, H, A]``: :func:`expert_pass`'s velocity alone."""
    return expert_pass(model, prefix, x_t, t)[0]


def step_times(num_steps: int) -> list[float]:
    """t_k = 1 − kΔ for k = 0..K (Δ = 1/K), computed as ``sample_actions`` does."""
    dt = -1.0 / num_steps
    return [1.0 + k * dt for k in range(num_steps + 1)]


def ode_chain(model: nn.Module, inputs: PI0Inputs, x1: torch.Tensor,
              num_steps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The deterministic Euler chain from the noise `x1` ``[B, H, A]``, the prefix computed once.

    Returns:
        ``(chain [B, K+1, H, A], velocities [B, K, H, A])``: ``chain[:, 0]`` is x1, ``chain[:, k+1] =
        chain[:, k] − Δ·velocities[:, k]``, ``chain[:, K]`` the action chunk x_0 (equal to
        ``sample_actions(..., noise=x1, num_steps=K)``). Gradients flow where autograd is on.
    """
    k_steps = num_steps or model.config.num_inference_steps
    expected = (inputs.state.shape[0], model.config.chunk_size, model.config.max_action_dim)
    if tuple(x1.shape) != expected:
        raise ValueError(f"x1: expected [B, chunk_size, max_action_dim] = {list(expected)}, got {list(x1.shape)}")
    prefix = encode_prefix(model, inputs)
    dt = -1.0 / k_steps
    times = step_times(k_steps)
    states, velocities = [x1], []
    for k in range(k_steps):
        v = velocity(model, prefix, states[-1], times[k])
        velocities.append(v)
        states.append(states[-1] + dt * v)
    return torch.stack(states, dim=1), torch.stack(velocities, dim=1)


def velocities_at(model: nn.Module, inputs: PI0Inputs, x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Recompute v at given chain states: `x_t` ``[B, N, H, A]`` at times `t` (``[N]`` or ``[B, N]``).

    One prefix cache for all N expert passes (the learner's side: with autograd on, gradients reach
    the VLM through the cache). For a chain from :func:`ode_chain`, ``velocities_at(model, inputs,
    chain[:, :-1], torch.tensor(step_times(K)[:-1]))`` gives its velocities back.

    Returns:
        ``[B, N, H, A]``.
    """
    if x_t.dim() != 4:
        raise ValueError(f"x_t: expected [B, N, H, A], got {list(x_t.shape)}")
    b, n = x_t.shape[:2]
    t = torch.as_tensor(t, dtype=torch.float32, device=x_t.device)
    t = t.expand(b, n) if t.dim() == 1 else t
    if tuple(t.shape) != (b, n):
        raise ValueError(f"t: expected [N={n}] or [B={b}, N={n}], got {list(t.shape)}")
    prefix = encode_prefix(model, inputs)
    return torch.stack([velocity(model, prefix, x_t[:, i], t[:, i]) for i in range(n)], dim=1)
