"""Chapter 20: which tokens may come next when the output must be one of a few choices."""

from __future__ import annotations

import torch


def choice_mask(vocab: list[bytes], choices: list[str], prefix: bytes, eot_id: int) -> torch.Tensor:
    """The allowed-token mask of a choice constraint: (len(vocab),) bool, True where
    token id t may come next.

    vocab: every token's bytes, by id (no two alike); vocab[eot_id] is the end-of-text
    token, which writes no text: it ends the output. choices: the strings the whole
    output may be (non-empty), written in UTF-8. prefix: the bytes of the output so far,
    the beginning of at least one choice; tokens are bytes, so it may end inside a
    character.

    A token is allowed when the output with its bytes added is still the beginning of
    some choice (or all of one). End-of-text is allowed exactly when the output so far
    is a whole choice. The check compares this with llguidance's mask (its forcing off)
    on GPT-2's vocabulary and on a small one, then generates with it in place of the
    library's.
    """
    wanted = [choice.encode("utf-8") for choice in choices]
    allowed = [any(choice.startswith(prefix + token) for choice in wanted) for token in vocab]
    # End-of-text is no bytes to match: it may come only where the output is complete.
    allowed[eot_id] = prefix in wanted
    return torch.tensor(allowed, dtype=torch.bool)


# `rose-course hint 20` gives these one at a time, the idea first and the near-code
# last (`rose-course check 20` counts how many were used); the stub leaves them out.
HINTS = (
    "Work in bytes, not text: a token may hold half a character. Encode every choice in "
    "UTF-8; a token fits when the prefix and its bytes are still the beginning of some "
    "choice (or all of one).",
    "End-of-text writes no bytes: it is allowed exactly when the prefix is a whole choice. "
    "Decide it on its own, whatever its bytes in the vocabulary are.",
    "Near-code:\n"
    "    wanted = [choice.encode('utf-8') for choice in choices]\n"
    "    allowed = [any(w.startswith(prefix + token) for w in wanted) for token in vocab]\n"
    "    allowed[eot_id] = prefix in wanted",
)
