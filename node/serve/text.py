"""Text in and out of a model: ``TextCodec`` turns strings into token ids and ids into strings.

A model folder's ``tokenizer.json`` is read with the ``tokenizers`` package when it is there;
otherwise a model whose vocabulary covers the 256 byte values (our byte presets) reads and
writes UTF-8 bytes, one id a byte. Decoding for a stream goes through ``StreamDecoder``, which
never emits half a UTF-8 character or half of what a merged token spells. Everything in the
folder is untrusted: sizes are bounded and malformed files are refused with ``TextCodecError``.
"""

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from fusionllm.common.errors import ConfigError
from fusionllm.common.logs import get_logger
from fusionllm.dag.models.hf_errors import CheckpointFolderError
from fusionllm.dag.models.hf_tensors import CONFIG, MAX_CONFIG_BYTES, read_json
from fusionllm.node.serve.chat import ROLE_TAGS, ChatStyle, chat_style_of

logger = get_logger(__name__)

TOKENIZER = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
GENERATION_CONFIG = "generation_config.json"
# Llama 3's tokenizer.json is ~9 MB and Qwen's ~7 MB; a bigger one is not a tokenizer we know.
MAX_TOKENIZER_BYTES = 64 << 20
BYTE_VOCAB = 256
# A stream holds back at most this many ids waiting for a character to complete (UTF-8 needs
# at most 4 bytes); past it the replacement character goes out, so a model that emits invalid
# bytes cannot make the decoder buffer without end.
MAX_HELD_IDS = 8
_REPLACEMENT = "\ufffd"


class TextCodecError(CheckpointFolderError, ConfigError):
    """A model folder's tokenizer files cannot be used; the message names the file and why."""


class TextCodec:
    """Encode prompts, decode outputs, know the end-of-text ids and the chat format of a model."""

    def __init__(
        self,
        *,
        encode: Callable[[str], list[int]],
        decode: Callable[[Sequence[int]], str],
        vocab_size: int,
        eos_ids: tuple[int, ...] = (),
        chat: ChatStyle | None = None,
        name: str = "bytes",
    ) -> None:
        if vocab_size < 1:
            raise ConfigError(f"vocab_size must be >= 1, got {vocab_size}")
        self._encode = encode
        self._decode = decode
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids
        self.chat = chat or ROLE_TAGS
        self.name = name

    @classmethod
    def byte_level(
        cls, *, vocab_size: int = BYTE_VOCAB, eos_ids: tuple[int, ...] = ()
    ) -> "TextCodec":
        """UTF-8 bytes as ids 0..255 (ids above 255 of a larger vocabulary decode to nothing)."""
        if vocab_size < BYTE_VOCAB:
            raise TextCodecError(
                f"a byte-level model needs a vocabulary of at least {BYTE_VOCAB}, not {vocab_size}"
            )
        return cls(
            encode=lambda text: list(text.encode("utf-8")),
            decode=_decode_bytes,
            vocab_size=vocab_size,
            eos_ids=eos_ids,
            name="bytes",
        )

    @classmethod
    def from_model_folder(cls, path: str | os.PathLike[str]) -> "TextCodec":
        """The folder's tokenizer.json if it has one, else bytes if its config.json allows."""
        folder = Path(path)
        if not folder.is_dir():
            raise TextCodecError(f"{folder} is not a directory")
        config = _optional_json(folder / CONFIG)
        if (folder / TOKENIZER).exists():
            return _from_tokenizer(folder, config)
        if config is None:
            raise TextCodecError(f"{folder} holds neither {TOKENIZER} nor {CONFIG}")
        vocab = _vocab_of(config, folder)
        if vocab < BYTE_VOCAB:
            raise TextCodecError(
                f"{folder} has no {TOKENIZER} and its vocabulary ({vocab}) does not cover the "
                f"{BYTE_VOCAB} byte values: add the model's tokenizer.json"
            )
        eos = _eos_ids(folder, config, vocab, token_id=lambda _: None)
        logger.info("%s: byte-level text (no %s), eos ids %s", folder, TOKENIZER, eos)
        return cls.byte_level(vocab_size=vocab, eos_ids=eos)

    def encode(self, text: str) -> list[int]:
        """The ids of ``text`` (with the special tokens the tokenizer's post-processor adds)."""
        return self._encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``; special tokens and ids outside the vocabulary are skipped."""
        return self._decode(ids)

    def stream_decoder(self) -> "StreamDecoder":
        return StreamDecoder(self._decode)


class StreamDecoder:
    """Text deltas of ids that arrive one by one; the deltas join to ``decode`` of all ids.

    Each new id is decoded in a window with the ids just before it (as text-generation-inference
    does): the delta is what the window's text gained, and it waits while that text ends in an
    unfinished character (a UTF-8 sequence or a byte-level token split mid-character), so no
    delta ever carries half a character. ``finish`` emits whatever is still held.
    """

    def __init__(self, decode: Callable[[Sequence[int]], str]) -> None:
        self._decode = decode
        self._ids: list[int] = []
        self._prefix = 0  # the window starts here: ids already emitted, kept as context
        self._read = 0  # ids before this are emitted

    def push(self, token_id: int) -> str:
        """The text that ``token_id`` completes (often "", while a character is unfinished)."""
        self._ids.append(token_id)
        before = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        held = len(self._ids) - self._read
        if len(text) > len(before) and (not text.endswith(_REPLACEMENT) or held >= MAX_HELD_IDS):
            self._prefix, self._read = self._read, len(self._ids)
            return text[len(before) :]
        return ""

    def finish(self) -> str:
        """What is still held at the end of the stream (a final unfinished character included)."""
        before = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return text[len(before) :]


def _decode_bytes(ids: Sequence[int]) -> str:
    return bytes(i for i in ids if 0 <= i < BYTE_VOCAB).decode("utf-8", errors="replace")


def _from_tokenizer(folder: Path, config: dict[str, Any] | None) -> TextCodec:
    path = folder / TOKENIZER
    size = path.stat().st_size
    if size > MAX_TOKENIZER_BYTES:
        raise TextCodecError(f"{path} is {size} bytes; more than {MAX_TOKENIZER_BYTES} is refused")
    try:
        tokenizer = Tokenizer.from_str(path.read_text(encoding="utf-8"))
    except Exception as exc:  # the Rust side raises plain Exception on any malformed file
        raise TextCodecError(
            f"{path} is not a tokenizer the tokenizers package reads: {exc}"
        ) from exc
    size_of_tokenizer = tokenizer.get_vocab_size(with_added_tokens=True)
    vocab = size_of_tokenizer if config is None else _vocab_of(config, folder)
    if size_of_tokenizer > vocab:
        # Ids the model has no embedding for would come out of encode: refuse the pair now.
        raise TextCodecError(
            f"{path} has {size_of_tokenizer} tokens but {CONFIG} a vocabulary of {vocab}"
        )
    token_id = tokenizer.token_to_id
    tokenizer_config = _optional_json(folder / TOKENIZER_CONFIG) or {}
    template = tokenizer_config.get("chat_template")
    chat = chat_style_of(template if isinstance(template, str) else None, token_id=token_id)
    eos = _eos_ids(
        folder, config or {}, vocab, token_id=token_id, tokenizer_config=tokenizer_config
    )
    eos = tuple(sorted(set(eos) | set(chat.stop_ids)))
    logger.info("%s: %s (%d tokens), chat %s, eos ids %s", folder, TOKENIZER, vocab, chat.name, eos)

    def decode(ids: Sequence[int]) -> str:
        known = [i for i in ids if 0 <= i < size_of_tokenizer]
        return tokenizer.decode(known, skip_special_tokens=True)

    return TextCodec(
        encode=lambda text: tokenizer.encode(text).ids,
        decode=decode,
        vocab_size=vocab,
        eos_ids=eos,
        chat=chat,
        name=TOKENIZER,
    )


def _optional_json(path: Path) -> dict[str, Any] | None:
    return read_json(path, limit=MAX_CONFIG_BYTES) if path.exists() else None


def _vocab_of(config: dict[str, Any], folder: Path) -> int:
    vocab = config.get("vocab_size")
    if not isinstance(vocab, int) or isinstance(vocab, bool) or not 1 <= vocab < 2**31:
        raise TextCodecError(f"{folder / CONFIG}: vocab_size must be a positive int, got {vocab!r}")
    return vocab


def _eos_ids(
    folder: Path,
    config: dict[str, Any],
    vocab: int,
    *,
    token_id: Callable[[str], int | None],
    tokenizer_config: dict[str, Any] | None = None,
) -> tuple[int, ...]:
    """End-of-text ids named by config.json, generation_config.json and the tokenizer's config."""
    found: set[int] = set()
    generation = _optional_json(folder / GENERATION_CONFIG) or {}
    for source, raw in ((CONFIG, config), (GENERATION_CONFIG, generation)):
        value = raw.get("eos_token_id")
        values = value if isinstance(value, list) else [] if value is None else [value]
        for item in values:
            if not isinstance(item, int) or isinstance(item, bool) or not 0 <= item < vocab:
                raise TextCodecError(
                    f"{folder / source}: eos_token_id {item!r} is not an id < {vocab}"
                )
            found.add(item)
    token = (tokenizer_config or {}).get("eos_token")
    content = token.get("content") if isinstance(token, dict) else token
    if isinstance(content, str):
        named = token_id(content)
        if named is not None and 0 <= named < vocab:
            found.add(named)
    return tuple(sorted(found))
