"""The tokenizer: a tiktoken encoding by name, its end-of-text token, streaming decode."""

from __future__ import annotations

import codecs
import os
from dataclasses import dataclass, field

import tiktoken

from rosetrainer.errors import RoseError


def get_encoding(name: str = "gpt2") -> tiktoken.Encoding:
    """Load a tiktoken encoding, with errors that say what to do."""
    if name not in tiktoken.list_encoding_names():
        raise RoseError(
            f"unknown tokenizer {name!r}; tiktoken knows: {', '.join(tiktoken.list_encoding_names())}"
        )
    try:
        return tiktoken.get_encoding(name)
    except Exception as err:  # tiktoken raises requests/urllib errors when it cannot download
        cache = os.environ.get("TIKTOKEN_CACHE_DIR")
        where = (
            f"TIKTOKEN_CACHE_DIR={cache} did not have them"
            if cache
            else "TIKTOKEN_CACHE_DIR is unset"
        )
        raise RoseError(
            f"could not load the {name!r} BPE files ({type(err).__name__}; {where}). "
            f"Offline? Copy tiktoken's cache folder from a machine where it ran "
            f"($TMPDIR/data-gym-cache, /tmp/data-gym-cache on Linux) and point "
            f"TIKTOKEN_CACHE_DIR at the copy, e.g. export TIKTOKEN_CACHE_DIR=$HOME/tiktoken_cache"
        ) from None


@dataclass
class Tokenizer:
    """What rose needs of a tokenizer: encode, decode, and the end-of-text id."""

    name: str = "gpt2"
    encoding: tiktoken.Encoding = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.encoding = get_encoding(self.name)

    @property
    def eot_id(self) -> int:
        return self.encoding.eot_token

    @property
    def n_vocab(self) -> int:
        return self.encoding.n_vocab

    def encode(self, text: str) -> list[int]:
        # Text that merely contains "<|endoftext|>" is encoded as ordinary characters.
        return self.encoding.encode_ordinary(text)

    def decode(self, ids: list[int]) -> str:
        return self.encoding.decode(ids)

    def stream_decoder(self) -> StreamDecoder:
        return StreamDecoder(self.encoding)


class StreamDecoder:
    """Turn token ids into text as they arrive, never emitting half a UTF-8 character.

    A GPT-2 token is a run of bytes, and one character (a Chinese glyph, an emoji) may
    be split across tokens. Python's incremental UTF-8 decoder holds back a trailing,
    still-incomplete character until its last byte arrives, so the pieces returned by
    `push` and `flush` concatenate to exactly `decode(all ids)` (invalid bytes become
    U+FFFD in both).
    """

    def __init__(self, encoding: tiktoken.Encoding) -> None:
        self.encoding = encoding
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        return self.utf8.decode(self.encoding.decode_single_token_bytes(token_id))

    def flush(self) -> str:
        """Whatever is still held back at the end of the stream."""
        return self.utf8.decode(b"", final=True)
