"""A tiny random π0 (transformers' ``PI0ForConditionalGeneration``) for the tests of
``shared/policies/flow_vla.py``: 2-layer VLM and expert, 32x32 images (16 image tokens), chunk 8,
8 state and action dims; about 57k parameters.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import torch

IMAGE_TOKEN, VOCAB = 127, 128


def tiny_pi0_config(**overrides):
    from transformers import PI0Config

    text = {"model_type": "gemma", "hidden_size": 32, "num_hidden_layers": 2, "intermediate_size": 64,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "vocab_size": VOCAB}
    vision = {"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64, "patch_size": 8,
              "image_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "vision_use_head": False}
    dit = {"model_type": "gemma", "hidden_size": 16, "num_hidden_layers": 2, "intermediate_size": 32,
           "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16}
    kwargs = {"vlm_config": {"model_type": "paligemma", "text_config": text, "vision_config": vision,
                             "projection_dim": 32, "image_token_id": IMAGE_TOKEN},
              "dit_config": dit, "chunk_size": 8, "max_state_dim": 8, "max_action_dim": 8,
              "num_inference_steps": 4, **overrides}
    return PI0Config(**kwargs)


def make_tiny_pi0(seed: int = 0, **overrides):
    from transformers import PI0ForConditionalGeneration

    torch.manual_seed(seed)
    return PI0ForConditionalGeneration(tiny_pi0_config(**overrides)).eval()


def save_tiny_pi0(path: str | Path, seed: int = 0):
    """Write a tiny π0 with ``save_pretrained`` to `path`; returns the model."""
    model = make_tiny_pi0(seed)
    model.save_pretrained(str(path))
    return model


def lerobot_name(name: str) -> str:
    """A ``PI0ForConditionalGeneration`` state-dict name as LeRobot's ``PI0Policy`` saves it: under
    ``model.``, the VLM as ``paligemma_with_expert.paligemma`` (a PaliGemmaForConditionalGeneration whose
    tied embedding is saved as its ``lm_head``, SigLIP under ``vision_model``), the expert as
    ``paligemma_with_expert.gemma_expert`` (embedding saved as ``lm_head``), the projections at the top."""
    if name == "model.vlm.language_model.embed_tokens.weight":
        return "model.paligemma_with_expert.paligemma.lm_head.weight"
    if name == "model.dit.embed_tokens.weight":
        return "model.paligemma_with_expert.gemma_expert.lm_head.weight"
    name = name.replace("model.vlm.vision_tower.", "model.vlm.vision_tower.vision_model.")
    name = re.sub(r"^model\.vlm\.", "paligemma_with_expert.paligemma.model.", name)
    name = re.sub(r"^model\.dit\.", "paligemma_with_expert.gemma_expert.model.", name)
    name = re.sub(r"^embed_action_time\.", "", name)
    return "model." + name


def save_lerobot_layout(model, path: str | Path) -> dict[str, str]:
    """`model`'s tensors in LeRobot's key layout, with its config.json; returns {model name: file name}."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(str(path))
    names = {k: lerobot_name(k) for k in model.state_dict()}
    save_file({names[k]: v.detach().contiguous().clone() for k, v in model.state_dict().items()},
              str(path / "model.safetensors"), metadata={"format": "pt"})
    return names


def edit_checkpoint(src: str | Path, dst: str | Path, edit) -> None:
    """Copy the checkpoint directory `src` to `dst`, with `edit(tensors)` applied to its safetensors dict."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(str(Path(src) / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(Path(dst) / "model.safetensors"), metadata={"format": "pt"})


def tiny_observation(batch: int = 2, seed: int = 1, size: int = 32, cameras: int | None = None):
    """rgb uint8 ``[B, (cams,) size, size, 3]``, proprio ``[B, 5]`` and instruction ids ``[B, 4]`` (0 pads)."""
    g = torch.Generator().manual_seed(seed)
    shape = (batch, size, size, 3) if cameras is None else (batch, cameras, size, size, 3)
    rgb = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    proprio = torch.randn(batch, 5, generator=g)
    instruction = torch.randint(1, IMAGE_TOKEN, (batch, 4), generator=g)
    instruction[0, -1] = 0       # one padded position
    return rgb, proprio, instruction
