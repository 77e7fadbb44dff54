"""The tokenizers: a tiktoken encoding by name (GPT-2's, what rose trains with), or a
Hugging Face folder's tokenizer.json (a Llama's, a Qwen2's); each with its end-of-text
token and streaming decode, one interface for both."""

from __future__ import annotations

import codecs
import functools
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
    chat_template: str | None = field(default=None, init=False)  # GPT-2 has no chat format

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

    def token_bytes(self, token_id: int) -> bytes:
        """One token's own bytes (part of a UTF-8 character, perhaps)."""
        return self.encoding.decode_single_token_bytes(token_id)

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The most bytes of text one token stands for (GPT-2's: 128)."""
        return max(map(len, self.encoding.token_byte_values()))

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


class HFTokenizer:
    """A Hugging Face folder's tokenizer (tokenizer.json, through the `tokenizers` library)
    with what rose needs of a tokenizer, as Tokenizer has it; and the folder's chat template
    (tokenizer_config.json), which `rose-serve` renders chats with.

    Text is encoded without adding special tokens (a chat template writes its own), and
    special tokens written in the text (a template's <|im_start|>) are read as themselves.
    The end-of-text token is the folder's eos_token.
    """

    def __init__(self, folder: str | Path) -> None:
        from tokenizers import Tokenizer as HFTokenizerFile  # only Hugging Face folders need it

        folder = Path(folder)
        self.name = f"hf:{folder}"
        try:
            self.tokenizer = HFTokenizerFile.from_file(str(folder / "tokenizer.json"))
        except Exception as err:  # the library raises its own Exception for every problem
            raise RoseError(f"cannot read {folder / 'tokenizer.json'}: {err}") from None
        settings = read_json_object(folder / "tokenizer_config.json")
        eos = settings.get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        eos_id = None if eos is None else self.tokenizer.token_to_id(eos)
        if eos_id is None:
            raise RoseError(
                f"{folder / 'tokenizer_config.json'} names no eos_token of the tokenizer "
                f"(got {eos!r}): rose needs the token that ends a text"
            )
        self.eot_id: int = eos_id
        template = settings.get("chat_template")
        self.chat_template: str | None = template if isinstance(template, str) else None

    @property
    def n_vocab(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        return self.decode([token_id]).encode("utf-8")

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """At least the most bytes of text one token stands for: each vocabulary entry's
        spelling in UTF-8 (a byte-level or "▁" spelling takes as many bytes as its text or
        more; special tokens are written as themselves)."""
        vocab = self.tokenizer.get_vocab(with_added_tokens=True)
        return max(len(token.encode("utf-8")) for token in vocab)

    def stream_decoder(self) -> HFStreamDecoder:
        return HFStreamDecoder(self.tokenizer)


class HFStreamDecoder:
    """StreamDecoder's promise for a Hugging Face tokenizer: text as it is complete, the
    pieces adding up to the whole decode (the library's DecodeStream holds back a partial
    character)."""

    def __init__(self, tokenizer: Any) -> None:
        from tokenizers.decoders import DecodeStream

        self.tokenizer, self.stream = tokenizer, DecodeStream(skip_special_tokens=False)

    def push(self, token_id: int) -> str:
        return self.stream.step(self.tokenizer, token_id) or ""

    def flush(self) -> str:
        return ""


def read_json_object(path: Path) -> dict[str, Any]:
    """A JSON file's object (a Hugging Face folder's config files), {} when it is not there."""
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as err:
        raise RoseError(f"{path} is not valid JSON: {err}") from None
    if not isinstance(value, dict):
        raise RoseError(f"{path} must hold a JSON object")
    return value
