"""The per-row step every loop shares: one sampled token per row into its request.

The teaching loop, the onnxruntime loop, the split model's driver and the engine all
end a step the same way: each row still going takes its token (its `Sequence` keeps it
and applies the stopping rules), and a streaming caller sees each kept token.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from roseinfer.request.sequence import Sequence

TokenCallback = Callable[[int, int], None]  # on_token(row, token), for streaming
ErrorCallback = Callable[[int, Exception], None]  # on_error(row, error)


def take_tokens(
    seqs: list[Sequence],
    tokens: list[int] | list[int | None],
    *,
    on_token: TokenCallback | None = None,
    max_len: int | None = None,
    on_error: ErrorCallback | None = None,
) -> list[int]:
    """Give each unfinished row its token; return the rows that took one.

    A row that has stopped, or whose token is None (its sampling failed), is skipped:
    the batch runs on for the others. on_token(row, token) sees each token kept in a
    row's output; max_len: the most tokens a row may hold (see Sequence.append_token).
    on_error(row, error): a row whose step raises is handed over and the other rows go
    on (the engine fails that one request); without it the error propagates.
    """
    now = time.perf_counter()
    took = []
    for row, (seq, token) in enumerate(zip(seqs, tokens, strict=True)):
        if seq.is_finished or token is None:
            continue
        try:
            if seq.append_token(token, now, max_len) and on_token is not None:
                on_token(row, token)
        except Exception as error:
            if on_error is None:
                raise
            on_error(row, error)
            continue
        took.append(row)
    return took
