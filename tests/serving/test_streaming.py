"""Streaming decode with the real GPT-2 BPE: never half a character, nothing lost or added."""

from __future__ import annotations

import pytest

from rosetrainer.tokenizer import Tokenizer

TEXTS = [
    "你好，世界！今天的天气很好。",
    "Emoji 🌹🚀👩‍👩‍👧 and naïve café",
    "日本語のテキスト🍣と English mixed ✓",
]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer("gpt2")


def stream(tokenizer: Tokenizer, ids: list[int]) -> list[str]:
    """The pieces a streaming caller prints: one per token, then the flush."""
    decoder = tokenizer.stream_decoder()
    return [decoder.push(token) for token in ids] + [decoder.flush()]


@pytest.mark.parametrize("text", TEXTS)
def test_pieces_concatenate_to_the_full_decode(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    pieces = stream(tokenizer, ids)
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert not any("\ufffd" in piece for piece in pieces)


@pytest.mark.parametrize("text", TEXTS)
def test_a_character_split_across_tokens_is_held_back(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    token_bytes = [tokenizer.encoding.decode_single_token_bytes(t) for t in ids]
    # The premise: some tokens are not whole UTF-8 on their own (a character is split).
    split = [i for i, raw in enumerate(token_bytes) if not is_utf8(raw)]
    assert split, "no token splits a character: this text does not test streaming"
    pieces = stream(tokenizer, ids)
    assert "" in pieces[:-1]
    # Every piece is the text of all bytes so far, up to the last complete character.
    seen = b""
    printed = ""
    for raw, piece in zip(token_bytes, pieces, strict=False):
        seen += raw
        printed += piece
        assert seen.startswith(printed.encode())
        assert len(seen) - len(printed.encode()) <= 3  # at most an unfinished character waits


def test_invalid_bytes_become_the_replacement_character_in_both(tokenizer: Tokenizer) -> None:
    # A lone UTF-8 continuation byte, then a lead byte that never gets its continuation.
    ids = [tokenizer.encoding.encode_single_token(bytes([b])) for b in (0x80, 0x41, 0xE4)]
    pieces = stream(tokenizer, ids)
    assert "".join(pieces) == tokenizer.decode(ids) == "\ufffdA\ufffd"
    assert pieces[-1] == "\ufffd"  # the unfinished lead byte is only given up at the flush


def is_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def test_a_4000_token_generations_text_work_is_linear(tokenizer: Tokenizer) -> None:
    """Each token decodes only its own ids (a split character's few, together), so the
    decode work per token is bounded, however long the output; the text, what a client
    sees along the way, and a stop string that straddles tokens at the very end are
    exactly what decoding everything at once gives."""
    from roseinfer.request.sampling_params import SamplingParams
    from roseinfer.request.sequence import Sequence

    stop = "终了😀"  # several characters GPT-2 splits over tokens, only at the end
    body = tokenizer.encode(" ".join(TEXTS * 200))[:4000]
    ids = body + tokenizer.encode(f" {stop} and more")
    decoded: list[int] = []  # ids passed to decode, call by call

    def decode(part: list[int]) -> str:
        decoded.append(len(part))
        return tokenizer.decode(part)

    params = SamplingParams(max_tokens=len(ids), stop=("never written", stop))
    seq = Sequence([tokenizer.eot_id], params, decode=decode)
    seen = ""
    for token in ids:
        seq.append_token(token)
        visible = seq.text[: seq.num_visible_chars]
        assert visible.startswith(seen)  # what a client was shown is never taken back
        seen = visible
        if seq.is_finished:
            break
    assert len(seq.output_ids) > 4000
    assert (seq.finish_reason, seq.stop_reason) == ("stop", stop)
    text = tokenizer.decode(seq.output_ids)
    assert text.endswith(stop) and seq.text == text
    assert seen == text[: -len(stop)]
    # Linear: one decode call per token at most, each of at most one character's ids.
    assert len(decoded) <= len(seq.output_ids) and max(decoded) <= 4
    assert sum(decoded) <= 2 * len(seq.output_ids)
