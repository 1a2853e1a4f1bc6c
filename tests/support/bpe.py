"""A tiny byte-level BPE tokenizer trained here (the `tokenizers` package; nothing downloaded)."""

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """GPT-2's kind of tokenizer at ``vocab_size`` (with one special token, <|endoftext|>)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()  # as GPT-2's tokenizer.json: ids back to UTF-8 text
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def train_sentencepiece_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Llama 2's kind: "▁" for spaces (Metaspace), a decoder that strips the first space."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"])
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer
