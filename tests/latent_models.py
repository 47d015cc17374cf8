"""Tiny, randomly initialised text encoders built offline (no hub), for latents tests.

Each is saved with ``save_pretrained`` to a folder and loaded back by path, exactly as
lakeshard loads a real encoder: a BERT-style encoder, a T5 encoder-decoder (only its
encoder is used) and a GPT-2 decoder used as an encoder (no pad token, left padding).
"""

from __future__ import annotations

from pathlib import Path

CORPUS = [
    "a photo of a cat sitting on a red sofa",
    "an astronaut in a white suit floating above the earth",
    "a cup of coffee on a wooden table, morning light",
    "a rocket launching into a blue sky with white smoke",
    "the hubble deep field, thousands of distant galaxies",
    "a dog running on the beach at sunset",
    "black and white portrait of an old man smiling",
] * 3


def _tokenizer(out: Path, *, pad: bool = True, padding_side: str = "right"):
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]
    tok.train_from_iterator(CORPUS, trainers.WordPieceTrainer(vocab_size=300,
                                                              special_tokens=specials))
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        special_tokens=[("[CLS]", tok.token_to_id("[CLS]")), ("[SEP]", tok.token_to_id("[SEP]"))],
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]",
        eos_token="[SEP]", pad_token="[PAD]" if pad else None, padding_side=padding_side,
        model_max_length=512,
    )
    fast.save_pretrained(out)
    return fast


def build_encoder(out: Path, kind: str = "bert", *, positions: int = 64, seed: int = 0) -> str:
    """Build and save a tiny random encoder of `kind` (bert, t5, gpt2); returns its path."""
    import torch
    from transformers import (
        BertConfig,
        BertModel,
        GPT2Config,
        GPT2Model,
        T5Config,
        T5Model,
    )

    out.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer(out, pad=kind != "gpt2", padding_side="left" if kind == "gpt2" else "right")
    vocab = len(tok)
    torch.manual_seed(seed)
    if kind == "bert":
        model = BertModel(BertConfig(
            vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=64, max_position_embeddings=positions,
        ))
    elif kind == "t5":
        model = T5Model(T5Config(
            vocab_size=vocab, d_model=24, d_kv=8, num_heads=2, num_layers=1, d_ff=48,
            pad_token_id=tok.pad_token_id, decoder_start_token_id=tok.pad_token_id,
        ))
    elif kind == "gpt2":
        model = GPT2Model(GPT2Config(
            vocab_size=vocab, n_embd=16, n_layer=1, n_head=2, n_positions=positions,
        ))
    else:
        raise ValueError(kind)
    model.save_pretrained(out)
    return str(out)
