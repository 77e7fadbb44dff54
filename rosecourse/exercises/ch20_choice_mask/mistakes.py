"""Chapter 20's known answers (data: rosecourse/exercises/answers.py says what each kind
is; tests/course/test_mutants.py runs them against this chapter's check)."""

from __future__ import annotations

import torch

from rosecourse.exercises.answers import alternative, blind, known, mutant

# -- the known mistakes: the check names each one it meets (answers.known) ----------


def _mask(vocab, choices, prefix, eot_id, fits, eot_allowed) -> torch.Tensor:
    wanted = [c.encode() for c in choices]
    allowed = [any(fits(c, prefix + token) for c in wanted) for token in vocab]
    allowed[eot_id] = eot_allowed(wanted, prefix, allowed)
    return torch.tensor(allowed)


def _complete(wanted, prefix, allowed) -> bool:
    return prefix in wanted


def _begins(choice: bytes, text: bytes) -> bool:
    return choice.startswith(text)


@known(
    "20",
    "end-of-text is never allowed: once the output is a whole choice it may end, "
    "and end-of-text is how it ends (where no choice goes on, nothing else is left)",
)
def _forgets_end_of_text(vocab, choices, prefix, eot_id):
    return _mask(vocab, choices, prefix, eot_id, _begins, lambda *_: False)


@known(
    "20",
    "end-of-text comes only when no token fits: where one choice begins another "
    "('yes' and 'yes please'), 'yes' is whole and may end there, though it could "
    "go on",
)
def _end_of_text_only_when_stuck(vocab, choices, prefix, eot_id):
    return _mask(vocab, choices, prefix, eot_id, _begins, lambda w, p, allowed: not any(allowed))


@known(
    "20",
    "you allow only tokens that finish a choice: a token may write part of one, "
    "and the next tokens the rest (most choices take several tokens)",
)
def _whole_choices_only(vocab, choices, prefix, eot_id):
    return _mask(vocab, choices, prefix, eot_id, lambda c, text: c == text, _complete)


@known(
    "20",
    "you allow a token that runs past the end of a choice ('yess' after 'ye'): the "
    "whole output must stay inside one choice",
)
def _overshoots(vocab, choices, prefix, eot_id):
    def fits(choice, text):
        return choice.startswith(text) or text.startswith(choice)

    return _mask(vocab, choices, prefix, eot_id, fits, _complete)


@known(
    "20",
    "you match the token against the rest of every choice, even of choices the "
    "output so far has already left: only choices that begin with the prefix count",
)
def _rest_of_every_choice(vocab, choices, prefix, eot_id):
    wanted = [c.encode() for c in choices]
    rests = [c[len(prefix) :] for c in wanted]
    allowed = [any(rest.startswith(token) for rest in rests) for token in vocab]
    allowed[eot_id] = prefix in wanted
    return torch.tensor(allowed)


@known(
    "20",
    "you compare text, not bytes: a token may hold part of a character (é is two "
    "bytes, and GPT-2 has a token for each), and decoding it gives a replacement "
    "character that no choice has",
)
def _compares_text(vocab, choices, prefix, eot_id):
    text = prefix.decode("utf-8", errors="replace")
    allowed = [
        any(c.startswith(text + token.decode("utf-8", errors="replace")) for c in choices)
        for token in vocab
    ]
    allowed[eot_id] = text in choices
    return torch.tensor(allowed)


# -- 20: choice_mask(vocab, choices, prefix, eot_id) ----------------------------------------


def _choice_mask(vocab, choices, prefix, eot_id, fits=None, wanted=None, eot=None):
    """The contract's mask, with one of its parts swapped: whether the output with a
    token's bytes added `fits` a choice, the choices `wanted` as bytes, end-of-text."""
    wanted = wanted or [c.encode() for c in choices]
    fits = fits or (lambda choice, text: choice.startswith(text))
    allowed = [any(fits(c, prefix + token) for c in wanted) for token in vocab]
    allowed[eot_id] = eot(wanted, prefix) if eot else prefix in wanted
    return torch.tensor(allowed)


@mutant("20")
def end_of_text_id_of_gpt2(vocab, choices, prefix, eot_id):
    return _choice_mask(vocab, choices, prefix, 50256)


@mutant("20")
def first_choice_only(vocab, choices, prefix, eot_id):
    return _choice_mask(vocab, choices[:1], prefix, eot_id)


@mutant("20")
def completing_token_forbidden(vocab, choices, prefix, eot_id):
    return _choice_mask(
        vocab, choices, prefix, eot_id, fits=lambda c, t: c.startswith(t) and c != t
    )


@mutant("20")
def choice_inside_the_output(vocab, choices, prefix, eot_id):
    return _choice_mask(vocab, choices, prefix, eot_id, fits=lambda c, t: t.startswith(c))


@mutant("20")
def end_of_text_whenever_on_a_choice(vocab, choices, prefix, eot_id):
    return _choice_mask(
        vocab, choices, prefix, eot_id, eot=lambda wanted, p: any(c.startswith(p) for c in wanted)
    )


@mutant("20")
def bytes_that_do_not_decode_dropped(vocab, choices, prefix, eot_id):
    def text(data: bytes) -> bytes:
        return data.decode("utf-8", errors="ignore").encode()

    return _choice_mask([text(token) for token in vocab], choices, text(prefix), eot_id)


@mutant("20")
def ids_one_off(vocab, choices, prefix, eot_id):
    return _choice_mask(vocab, choices, prefix, eot_id).roll(1)


@mutant("20")
def spaces_stripped(vocab, choices, prefix, eot_id):
    return _choice_mask([token.strip() for token in vocab], choices, prefix, eot_id)


@mutant("20")
def last_choice_decides(vocab, choices, prefix, eot_id):
    return _choice_mask(vocab, choices[-1:], prefix, eot_id)


@mutant("20")
def choices_encoded_in_latin_1(vocab, choices, prefix, eot_id):
    wanted = [c.encode("latin-1", errors="replace") for c in choices]
    return _choice_mask(vocab, choices, prefix, eot_id, wanted=wanted)


@mutant("20")
def end_of_text_found_by_its_gpt2_name(vocab, choices, prefix, eot_id):
    eot = vocab.index(b"<|endoftext|>") if b"<|endoftext|>" in vocab else eot_id
    wanted = [c.encode() for c in choices]
    allowed = [
        t != eot and any(c.startswith(prefix + tok) for c in wanted) for t, tok in enumerate(vocab)
    ]
    allowed[eot] = prefix in wanted
    return torch.tensor(allowed)


@mutant("20")
def decided_on_text_decoded_ignoring_errors(vocab, choices, prefix, eot_id):
    # Half a character dropped: "no" + b"\xc3" reads as "no".
    text = prefix.decode("utf-8", errors="ignore")
    allowed = [
        any(c.startswith((prefix + token).decode("utf-8", errors="ignore")) for c in choices)
        for token in vocab
    ]
    allowed[eot_id] = text in choices
    return torch.tensor(allowed)


@mutant("20")
def end_of_text_is_the_last_token(vocab, choices, prefix, eot_id):
    return _choice_mask(vocab, choices, prefix, len(vocab) - 1)


@mutant("20")
def end_of_text_decided_on_decoded_text(vocab, choices, prefix, eot_id):
    # The tokens right, end-of-text allowed when the text read so far is a whole choice.
    def whole(wanted, prefix):
        return prefix.decode("utf-8", errors="ignore") in choices

    return _choice_mask(vocab, choices, prefix, eot_id, eot=whole)


@alternative("20")
def choice_mask_by_lookup(vocab, choices, prefix, eot_id):
    # Each open choice's rest, cut after every byte, looked up among the tokens: no loop
    # over the vocabulary (the tokens are all different).
    ids = {token: t for t, token in enumerate(vocab) if t != eot_id}
    allowed = torch.zeros(len(vocab), dtype=torch.bool)
    for choice in (c.encode() for c in choices):
        if choice.startswith(prefix):
            rest = choice[len(prefix) :]
            for end in range(1, len(rest) + 1):
                if rest[:end] in ids:
                    allowed[ids[rest[:end]]] = True
            allowed[eot_id] |= not rest
    return allowed


@alternative("20")
def choice_mask_on_latin_1_text(vocab, choices, prefix, eot_id):
    # Latin-1 reads every byte as one character: strings compare as the bytes would.
    wanted = [c.encode().decode("latin-1") for c in choices]
    text = prefix.decode("latin-1")
    allowed = [any(c.startswith(text + t.decode("latin-1")) for c in wanted) for t in vocab]
    allowed[eot_id] = text in wanted
    return torch.tensor(allowed)


# -- Written blind (issue 45) --


def _blind_20(vocab, choices, prefix, eot_id, fits, ends) -> torch.Tensor:
    """`fits(out, encoded)`: the output so far may go on; `ends(prefix, encoded)`: it may
    end here."""
    encoded = [c.encode("utf-8") for c in choices]
    mask = torch.zeros(len(vocab), dtype=torch.bool)
    for t, tok in enumerate(vocab):
        if t == eot_id:
            continue
        if fits(prefix + tok, encoded):
            mask[t] = True
    mask[eot_id] = ends(prefix, encoded)
    return mask


def _begins_one(out: bytes, encoded: list[bytes]) -> bool:
    return any(c.startswith(out) for c in encoded)


def _is_one(prefix: bytes, encoded: list[bytes]) -> bool:
    return prefix in encoded


# WRONG: compares decoded text (errors='ignore'): a token ending mid-character is judged on
# its complete characters only
@blind("20")
def decoded_text(vocab, choices, prefix, eot_id):
    def fits(out, encoded):
        return any(c.startswith(out.decode("utf-8", errors="ignore")) for c in choices)

    return _blind_20(vocab, choices, prefix, eot_id, fits, _is_one)


# WRONG: end-of-text allowed whenever the prefix begins a choice (not only when it is a
# whole one)
@blind("20")
def eot_on_any_prefix(vocab, choices, prefix, eot_id):
    return _blind_20(vocab, choices, prefix, eot_id, _begins_one, _begins_one)


# WRONG: end-of-text allowed only when the prefix is a choice that no longer choice extends
@blind("20", known="end_of_text_only_when_stuck")
def eot_only_unique(vocab, choices, prefix, eot_id):
    def ends(prefix, encoded):
        longer = any(c != prefix and c.startswith(prefix) for c in encoded)
        return prefix in encoded and not longer

    return _blind_20(vocab, choices, prefix, eot_id, _begins_one, ends)


# WRONG: token allowed when the output so far begins with a choice (overshoot allowed), or a
# choice begins with it
@blind("20", known="overshoots")
def startswith_reversed(vocab, choices, prefix, eot_id):
    def fits(out, encoded):
        return any(c.startswith(out) or out.startswith(c) for c in encoded)

    return _blind_20(vocab, choices, prefix, eot_id, fits, _is_one)
