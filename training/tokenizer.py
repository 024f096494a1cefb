"""Byte-level BPE tokenizers trained with Hugging Face `tokenizers`.

Byte-level means every string round-trips exactly (no <unk>), which the server relies on when it
streams text token by token.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from models.tokenizer import EOS_TOKEN


def train_bpe(
    texts: Iterable[str],
    vocab_size: int = 8192,
    special_tokens: tuple[str, ...] = (EOS_TOKEN,),
    min_frequency: int = 2,
) -> Tokenizer:
    """Train a GPT-2-style byte-level BPE on an iterator of texts; special tokens get the first ids."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok
