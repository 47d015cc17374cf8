"""A tiny, randomly initialised Qwen2.5-VL, built locally: the smoke-test captioning model.

No model hub is reachable from where lakeshard is built and tested, so the embedded
default config and the tests caption with a model of the *real* Qwen2.5-VL architecture
(vision tower, merger, M-RoPE decoder, chat template, left-padded batched generation)
but a few hundred thousand random parameters and a byte-level BPE tokenizer trained here
on a few sentences. Its captions are noise; they exercise the whole pipeline, nothing
more. Point ``caption.versions.<name>.model`` at a real checkpoint (a local folder or a
hub id such as ``Qwen/Qwen2.5-VL-7B-Instruct``) for real captions.

:func:`ensure_tiny_vlm` builds it once into a local folder
(``<storage.cache_dir>/models/tiny-qwen2_5_vl``: ``<root>/cache`` for a local root,
``~/.cache/lakeshard`` for an object-store root) with ``save_pretrained``; everything then
loads it back by path, like any checkpoint. Only processes that see that folder can load
it: local runs (``local[*]``), or a cache folder every node mounts.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

__all__ = ["TINY_MODEL", "ensure_tiny_vlm", "build_tiny_vlm", "build_random_vlm", "tiny_config"]

log = logging.getLogger(__name__)

# The name a config uses for this model: ``model: tiny-qwen2_5_vl``.
TINY_MODEL = "tiny-qwen2_5_vl"

_SPECIAL = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]

# A short Qwen-style chat template: system-less, one user turn with images and text.
_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for c in message['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_CORPUS = [
    "Describe this image in one dense, faithful paragraph.",
    "A photo of a cat lying on a wooden table next to a cup of coffee.",
    "An astronaut in an orange suit smiles in front of a flag.",
    "A rocket stands on a launch pad under a clear blue sky.",
    "The image shows a logo with white text on a dark background and a watermark.",
    "Soft light from the left, shallow depth of field, a close-up, centred composition.",
    "Galaxies, stars, a motorcycle, a retina, a camera on a tripod, black and white.",
]


def tiny_config(vocab_size: int, ids: dict[str, int]) -> dict:
    """The Qwen2.5-VL config of the tiny model (the real architecture, tiny widths)."""
    return {
        "model_type": "qwen2_5_vl",
        "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "text_config": {
            "vocab_size": vocab_size,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 4096,
            "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
            "tie_word_embeddings": True,
            # Wide random weights: varied, image-dependent noise instead of one token
            # repeated (the default 0.02 makes every logit nearly equal).
            "initializer_range": 0.5,
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"],
        },
        "vision_config": {
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 56,
            "out_hidden_size": 64,
            "fullatt_block_indexes": [1],
            "initializer_range": 0.5,
        },
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
        "tie_word_embeddings": True,
        "initializer_range": 0.5,
    }


def build_tiny_vlm(out_dir: str | Path, *, seed: int = 0, max_pixels: int = 56 * 56 * 4) -> Path:
    """Train the tokenizer, initialise the model with `seed`, save both to `out_dir`."""
    return build_random_vlm(out_dir, tiny_config, seed=seed, max_pixels=max_pixels)


def build_random_vlm(out_dir: str | Path, make_config, *, seed: int = 0,
                     max_pixels: int = 56 * 56 * 4, dtype: str = "float32",
                     device: str = "cpu") -> Path:
    """A randomly initialised Qwen2.5-VL checkpoint with this module's tokenizer.

    ``make_config(vocab_size, special_token_ids)`` returns the config dict; the vocabulary
    may be larger than the tokenizer's (a real model's size, for realistic compute)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    tokenizer = _train_tokenizer()
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in _SPECIAL}
    model = _random_model(make_config(len(tokenizer), ids), ids, seed=seed, dtype=dtype,
                          device=device)
    return _save(Path(out_dir), model, _processor(tokenizer, max_pixels), seed=seed)


def _train_tokenizer():
    """A byte-level BPE tokenizer trained on :data:`_CORPUS`, with Qwen's special
    tokens, left padding and the chat template."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import Qwen2TokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(_CORPUS * 4, vocab_size=400, min_frequency=1,
                            special_tokens=_SPECIAL, show_progress=False)
    return Qwen2TokenizerFast(
        tokenizer_object=bpe._tokenizer,
        unk_token=None,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=_SPECIAL[1:],
        padding_side="left",
        chat_template=_CHAT_TEMPLATE,
    )


def _random_model(config: dict, ids: dict[str, int], *, seed: int, dtype: str, device: str):
    """The model of `config`, initialised from `seed`, greedy generation ending at
    ``<|im_end|>`` or ``<|endoftext|>``."""
    import torch
    from transformers import (
        GenerationConfig,
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
    )

    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen2_5_VLForConditionalGeneration._from_config(
            Qwen2_5_VLConfig(**config), dtype=getattr(torch, dtype)
        ).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]],
        pad_token_id=ids["<|endoftext|>"],
        do_sample=False,
    )
    return model


def _processor(tokenizer, max_pixels: int):
    """The Qwen2.5-VL processor: images of up to `max_pixels`, `tokenizer`, the template."""
    from transformers import Qwen2_5_VLProcessor, Qwen2VLImageProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    return Qwen2_5_VLProcessor(
        image_processor=Qwen2VLImageProcessor(min_pixels=28 * 28, max_pixels=max_pixels),
        tokenizer=tokenizer,
        video_processor=Qwen2VLVideoProcessor(),
        chat_template=_CHAT_TEMPLATE,
    )


def _save(out: Path, model, processor, *, seed: int) -> Path:
    """Save the checkpoint and its smoke-test marker into a private folder renamed to
    `out` (another builder may have won the race: theirs is identical, ours is dropped)."""
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(tmp)
    processor.save_pretrained(tmp)
    params = sum(p.numel() for p in model.parameters())
    (tmp / "LAKESHARD_SMOKE_TEST_MODEL.json").write_text(
        json.dumps({"what": "randomly initialised Qwen2.5-VL; captions are noise",
                    "parameters": params, "seed": seed}),
        encoding="utf-8",
    )
    try:
        tmp.rename(out)  # another builder may have won the race: theirs is identical
    except OSError:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return out


def ensure_tiny_vlm(models_dir: str | Path) -> Path:
    """``<models_dir>/tiny-qwen2_5_vl``, built on first use."""
    out = Path(models_dir) / TINY_MODEL
    if not (out / "LAKESHARD_SMOKE_TEST_MODEL.json").is_file():
        log.info("building the tiny smoke-test VLM into %s", out)
        out.parent.mkdir(parents=True, exist_ok=True)
        build_tiny_vlm(out)
    return out
