"""A request's text, made as its tokens arrive, and the stop strings in it: `Detokenizer`.

Each token costs the decoding of its own ids, and the stop-string check reads only the
text the new token can have completed: the characters before it that a stop string
could start in (at most the longest stop's length - 1) and its own text. So a
request's text work grows with its length, not with the square of it.

GPT-2 splits some characters (a Chinese glyph, an emoji) over several tokens whose
bytes alone are not UTF-8; `decode` gives U+FFFD for such an unfinished character at
the end. Those ids wait in `pending` until the character is complete, and are decoded
together then. A character has at most 4 bytes and a token at least one, so ids that
still end in U+FFFD after 4 of them are invalid bytes: they are taken as they decode
(U+FFFD, as in the decode of the whole output).
"""

from __future__ import annotations

from collections.abc import Callable

REPLACEMENT = "\ufffd"
MAX_CHARACTER_TOKENS = 4  # UTF-8 characters have at most 4 bytes; a token at least one


class Detokenizer:
    def __init__(self, decode: Callable[[list[int]], str], stops: tuple[str, ...]) -> None:
        self.decode = decode
        self.stops = stops
        self.text = ""  # complete characters only
        self.pending: list[int] = []  # ids of a character whose bytes have not all arrived
        self.stop_at: int | None = None  # where the first stop string in `text` begins

    def push(self, token_id: int) -> str | None:
        """Add one token's text; return the stop string it completed, if any."""
        self.pending.append(token_id)
        piece = self.decode(self.pending)
        if piece.endswith(REPLACEMENT) and len(self.pending) < MAX_CHARACTER_TOKENS:
            return None  # an unfinished character: wait for the rest of its bytes
        self.pending = []
        return self._add(piece)

    def flush(self) -> None:
        """The request finished: an unfinished character is final (U+FFFD)."""
        if self.pending:
            self.text += self.decode(self.pending)
            self.pending = []

    def visible_length(self, finished: bool, stopped: bool) -> int:
        """How much of `text` a client may see (its first characters): up to a stop
        string that ended the request (`stopped`), else all of it once finished; while
        running, all but a tail that could still grow into a stop string. A length, not
        the text: a caller that sends only the new characters copies only those."""
        if stopped and self.stop_at is not None:
            return self.stop_at
        if finished:
            return len(self.text)
        return len(self.text) - held_back(self.text, self.stops)

    def _add(self, piece: str) -> str | None:
        before = len(self.text)
        self.text += piece
        found = []
        for stop in self.stops:
            # Earlier text held no stop string: one found now ends inside the new piece.
            at = self.text.find(stop, max(0, before - len(stop) + 1))
            if at >= 0:
                found.append((at, stop))
        if not found:
            return None
        self.stop_at, stop = min(found)
        return stop


def held_back(text: str, stops: tuple[str, ...]) -> int:
    """How many characters at the end of `text` could still begin a stop string (a named
    piece: chapter 14's exercise swaps in the learner's)."""
    longest = 0
    for stop in stops:
        for length in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:length]):
                longest = length
                break
    return longest
