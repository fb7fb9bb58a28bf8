"""A VLA checkpoint Tandem did not write, as a user brings one: a tiny PaliGemma saved by transformers'
``save_pretrained`` in safetensors shards, with its tokenizer saved beside it, and no Tandem file.

Its layout follows the real PaliGemma's: ``<image>`` is the id 64 places before the end of the
vocabulary, so the shipped ``configs/vla_own_reach_*.json`` (256 bins, ``reserve_tail`` 64) fit it
unchanged. The tokenizer is a word-level one whose words sit at ids 20 and up, as a real tokenizer's
do, away from Reach's own ids 1-4.
"""

from __future__ import annotations

from pathlib import Path

VOCAB, IMAGE_TOKEN = 1024, 960
WORDS = ["reach", "red", "green", "blue", "pick", "up", "the", "cube"]
SPECIAL = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3}


def make_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {**SPECIAL, **{w: 20 + i for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
                                   unk_token="<unk>")


def make_model(seed: int = 0):
    import torch

    from shared.policies.action_tokens import make_tiny_paligemma
    torch.manual_seed(seed)
    return make_tiny_paligemma(vocab_size=VOCAB, image_token_index=IMAGE_TOKEN).eval()


def save_foreign_checkpoint(path: str | Path, seed: int = 0, tokenizer: bool = True):
    """Write the checkpoint to `path` (three safetensors shards and their index); returns the model."""
    path = Path(path)
    model = make_model(seed)
    model.save_pretrained(str(path), max_shard_size="100KB")
    if tokenizer:
        make_tokenizer().save_pretrained(str(path))
    return model


if __name__ == "__main__":   # python tests/foreign_vla.py DIR: the checkpoint the recipe page starts from
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    save_foreign_checkpoint(sys.argv[1])
    print(sorted(p.name for p in Path(sys.argv[1]).iterdir()))
