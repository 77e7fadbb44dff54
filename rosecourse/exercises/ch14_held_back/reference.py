"""Chapter 14: what a stream holds back while a stop string may be beginning."""

from __future__ import annotations

# The reference is rose's own piece (roseinfer/request/detokenizer.py); the stub leaves this import out,
# with the body below.
from roseinfer.request.detokenizer import held_back as rose_held_back


def held_back(text: str, stops: tuple[str, ...]) -> int:
    """How many characters at the end of `text` to hold back from the stream.

    A streamed request shows its text as it grows, but never any part of a stop string
    (the response ends just before one). Hold back the longest tail of `text` that is
    a proper beginning of some stop string (a whole stop string has already finished
    the request), so nothing shown must ever be taken back. 0 when no tail could be.
    """
    return rose_held_back(text, stops)


# `rose-course hint 14` gives these one at a time, the idea first and the near-code
# last (`rose-course check 14` counts how many were used); the stub leaves them out.
HINTS = (
    "Only the end of the text matters: its longest tail that is the beginning (not the "
    "whole) of some stop string must wait; everything before that tail can be shown.",
    "For each stop, try its proper beginnings stop[:length] from the longest (len(stop) - "
    "1, and no longer than the text) down, and keep the longest length for which "
    "text.endswith(stop[:length]).",
)
