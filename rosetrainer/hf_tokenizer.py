"""GPT-2's Hugging Face tokenizer files, built from the BPE tiktoken uses.

tiktoken and Hugging Face's `tokenizers` run the same byte-level BPE; they store it
differently. tiktoken keeps one table, token bytes -> rank, where a token's rank is
also its id and the order in which it is merged. Hugging Face keeps a vocabulary
(token string -> id) and the list of merges, a token's two halves, in merge order;
its strings spell each byte as one printable character (GPT-2's byte-to-unicode
table), because the original files were JSON and text.

So each multi-byte token, in rank order, becomes a merge: its two halves are what
BPE makes of its bytes when only the merges ranked before it are allowed. The files
written here are the ones OpenAI's GPT-2 ships (vocab.json, merges.txt) plus
Hugging Face's fast-tokenizer file and configs, all derived from tiktoken's table.

One difference from the usual GPT-2 tokenizer is deliberate: rose encodes text that
merely contains "<|endoftext|>" as ordinary characters (rosetrainer.tokenizer), so
tokenizer_config.json sets `split_special_tokens`, and Hugging Face encodes it the
same way. The end-of-text token is still the eos token for generation.
"""

from __future__ import annotations

import json
from typing import Any

import tiktoken

from rosetrainer.errors import RoseError
from rosetrainer.tokenizer import get_encoding

EOT = "<|endoftext|>"


def byte_to_char() -> dict[int, str]:
    """GPT-2's spelling of bytes as characters: printable Latin-1 bytes stand for
    themselves, the others (control bytes, space, ...) take the characters from U+0100
    on, in byte order, so no token string holds whitespace or an invisible character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {b: chr(b) for b in printable}
    others = [b for b in range(256) if b not in table]
    table.update({b: chr(256 + i) for i, b in enumerate(others)})
    return table


def check_gpt2_like(encoding: tiktoken.Encoding) -> None:
    """GPT-2's files can hold this encoding only if it splits text like GPT-2 and has
    GPT-2's one special token."""
    gpt2 = get_encoding("gpt2")
    if encoding._pat_str != gpt2._pat_str or set(encoding._special_tokens) != {EOT}:
        raise RoseError(
            f"the model's tokenizer {encoding.name!r} is not GPT-2's byte-level BPE (another "
            f"pre-tokenizer or special tokens); Hugging Face's GPT-2 tokenizer files cannot "
            f"express it"
        )


def hf_tokenizer_files(encoding: tiktoken.Encoding, model_max_length: int) -> dict[str, str]:
    """File name -> text of GPT-2's tokenizer files for a GPT-2-like tiktoken encoding."""
    check_gpt2_like(encoding)
    ranks: dict[bytes, int] = encoding._mergeable_ranks  # tiktoken's own table, id = rank
    spell = byte_to_char()

    def text(token: bytes) -> str:
        return "".join(spell[b] for b in token)

    vocab = {text(token): rank for token, rank in ranks.items()}
    eot_id = encoding._special_tokens[EOT]
    vocab[EOT] = eot_id
    merges = [
        f"{text(left)} {text(right)}"
        for left, right in (
            _halves(ranks, token, rank)
            for token, rank in sorted(ranks.items(), key=lambda item: item[1])
            if len(token) > 1
        )
    ]
    eot_added = {
        "id": eot_id,
        "content": EOT,
        "single_word": False,
        "lstrip": False,
        "rstrip": False,
        "normalized": True,
        "special": True,
    }
    byte_level = {"add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [eot_added],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", **byte_level},
        "post_processor": {"type": "ByteLevel", **byte_level},
        "decoder": {"type": "ByteLevel", **byte_level},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": False,
            "byte_fallback": False,
            "vocab": vocab,
            "merges": merges,
        },
    }
    special = {"bos_token": EOT, "eos_token": EOT, "unk_token": EOT}
    tokenizer_config = {
        **special,
        "add_prefix_space": False,
        "added_tokens_decoder": {str(eot_id): {k: v for k, v in eot_added.items() if k != "id"}},
        # rose decodes bytes as they are: no tidying of spaces before punctuation
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "split_special_tokens": True,  # "<|endoftext|>" in a text is text (module docstring)
        "tokenizer_class": "GPT2Tokenizer",
    }
    return {
        "vocab.json": _json(vocab),
        "merges.txt": "#version: 0.2\n" + "\n".join(merges) + "\n",
        "tokenizer.json": _json(tokenizer),
        "tokenizer_config.json": _json(tokenizer_config),
        "special_tokens_map.json": _json(special),
    }


def _halves(ranks: dict[bytes, int], token: bytes, rank: int) -> tuple[bytes, bytes]:
    """The two tokens whose merge makes `token`: BPE on its bytes, using only the merges
    ranked below it, stops one merge short."""
    parts = [bytes([b]) for b in token]
    while True:
        pairs = [
            (ranks.get(parts[i] + parts[i + 1], rank), i)
            for i in range(len(parts) - 1)
            if ranks.get(parts[i] + parts[i + 1], rank) < rank
        ]
        if not pairs:
            break
        _, i = min(pairs)
        parts[i : i + 2] = [parts[i] + parts[i + 1]]
    if len(parts) != 2:
        raise RoseError(f"token {token!r} of rank {rank} is not one merge of two earlier tokens")
    return parts[0], parts[1]


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, indent=2) + "\n"
