"""Chapter 14's known answers (data: rosecourse/exercises/answers.py says what each kind
is; tests/course/test_mutants.py runs them against this chapter's check)."""

from __future__ import annotations

from rosecourse.exercises.answers import alternative, blind, known, mutant
from roseinfer.request.detokenizer import held_back

# -- the known mistakes: the check names each one it meets (answers.known) ----------


@known(
    "14",
    "you hold nothing back: the stream shows the start of a stop string, and "
    "cannot take it back when the stop completes",
)
def _holds_nothing(text, stops):
    return 0


@known(
    "14",
    "you always hold back a stop string's length: hold only a tail that could "
    "still begin one, or the stream lags for nothing",
)
def _holds_whole_stop(text, stops):
    return min(len(text), max(map(len, stops), default=0))


@known("14", "you look at the first stop string only: any of them may be beginning")
def _first_stop_only(text, stops):
    return held_back(text, stops[:1])


@known(
    "14",
    "you count a whole stop string as 'could still begin one': a completed stop "
    "has finished the request already; hold at most len(stop) - 1 characters",
)
def _includes_the_whole_stop(text, stops):
    longest = 0
    for stop in stops:
        for length in range(min(len(stop), len(text)), 0, -1):
            if text.endswith(stop[:length]):
                longest = max(longest, length)
                break
    return longest


# -- 14: held_back(text, stops) ---------------------------------------------------------------


@mutant("14")
def first_letter_only(text, stops):
    return 1 if any(stop and text.endswith(stop[0]) for stop in stops) else 0


@mutant("14")
def shortest_tail(text, stops):
    lengths = [n for stop in stops for n in range(1, len(stop)) if text.endswith(stop[:n])]
    return min(lengths, default=0)


@mutant("14")
def beginning_of_the_text(text, stops):
    lengths = [n for stop in stops for n in range(1, len(stop)) if text.startswith(stop[:n])]
    return max(lengths, default=0)


@mutant("14")
def whole_stop_minus_one(text, stops):
    begins = any(text.endswith(stop[:n]) for stop in stops for n in range(1, len(stop)))
    return max((len(stop) - 1 for stop in stops), default=0) if begins else 0


@mutant("14")
def last_stop_wins(text, stops):
    held = 0
    for stop in stops:
        held = next(
            (n for n in range(min(len(stop) - 1, len(text)), 0, -1) if text.endswith(stop[:n])), 0
        )
    return held


@mutant("14")
def one_character_short(text, stops):
    lengths = [n for stop in stops for n in range(1, len(stop) - 1) if text.endswith(stop[:n])]
    return max(lengths, default=0)


@alternative("14")
def suffixes_of_the_text(text, stops):
    return max(
        (
            n
            for n in range(1, len(text) + 1)
            for stop in stops
            if len(stop) > n and stop.startswith(text[-n:])
        ),
        default=0,
    )


# -- Written blind (issue 45) --


def _blind_14(text, stops, longest_first=True, whole_stop=False) -> int:
    best = 0
    for stop in stops:
        longest = min(len(stop) - (0 if whole_stop else 1), len(text))
        for n in range(longest, 0, -1) if longest_first else range(1, longest + 1):
            if text.endswith(stop[:n]):
                best = max(best, n)
                break
    return best


# WRONG: looks at the first stop string only
@blind("14", known="first_stop_only")
def first_stop_only(text, stops):
    return _blind_14(text, stops[:1])


# WRONG: stops at the shortest matching tail (n counted up)
@blind("14")
def shortest_match(text, stops):
    return _blind_14(text, stops, longest_first=False)


# WRONG: also holds back a tail equal to a whole stop string
@blind("14", known="includes_the_whole_stop")
def whole_stop_held(text, stops):
    return _blind_14(text, stops, whole_stop=True)
