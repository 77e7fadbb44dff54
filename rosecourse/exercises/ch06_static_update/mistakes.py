"""Chapter 06's known answers (data: rosecourse/exercises/answers.py says what each kind
is; tests/course/test_mutants.py runs them against this chapter's check)."""

from __future__ import annotations

from rosecourse.exercises.answers import alternative, blind, known, mutant

# -- the known mistakes: the check names each one it meets (answers.known) ----------


@known(
    "06",
    "every call writes from slot 0 (input_pos "
    "ignored): each decode step overwrites the prompt's first keys and leaves "
    "its own slot unwritten, and the mask row shows the query that slot",
)
def _at_slot_zero(k_buffer, v_buffer, input_pos, k_new, v_new):
    k_buffer[:, :, : k_new.size(2)] = k_new
    v_buffer[:, :, : v_new.size(2)] = v_new
    return k_buffer, v_buffer


@known(
    "06",
    "you wrote into a copy of the buffers (an out-of-place operation): this "
    "call sees its keys, the next finds their slots "
    "unwritten (zeros) and attends to them",
)
def _into_a_copy(k_buffer, v_buffer, input_pos, k_new, v_new):
    return k_buffer.index_copy(2, input_pos, k_new), v_buffer.index_copy(2, input_pos, v_new)


@known(
    "06",
    "you write batch row 0 only: every other row of a batch keeps zeros (or a "
    "stale sequence) in its slots; write every row of the batch",
)
def _first_row_only(k_buffer, v_buffer, input_pos, k_new, v_new):
    k_buffer[0, :, input_pos] = k_new[0]
    v_buffer[0, :, input_pos] = v_new[0]
    return k_buffer, v_buffer


@known(
    "06", "nothing is written: every query attends to unwritten slots (zeros), even at the prefill"
)
def _never_written(k_buffer, v_buffer, input_pos, k_new, v_new):
    return k_buffer, v_buffer


# -- 06: static_update(k_buffer, v_buffer, input_pos, k_new, v_new) ----------------------


@mutant("06")
def first_new_token_only(k_buffer, v_buffer, input_pos, k_new, v_new):
    k_buffer[:, :, input_pos[0]] = k_new[:, :, 0]
    v_buffer[:, :, input_pos[0]] = v_new[:, :, 0]
    return k_buffer, v_buffer


@mutant("06")
def one_slot_late(k_buffer, v_buffer, input_pos, k_new, v_new):
    k_buffer[:, :, input_pos + 1] = k_new
    v_buffer[:, :, input_pos + 1] = v_new
    return k_buffer, v_buffer


@mutant("06")
def written_slots_only(k_buffer, v_buffer, input_pos, k_new, v_new):
    k_buffer[:, :, input_pos] = k_new
    v_buffer[:, :, input_pos] = v_new
    return k_buffer[:, :, input_pos], v_buffer[:, :, input_pos]


@mutant("06")
def keys_and_values_swapped(k_buffer, v_buffer, input_pos, k_new, v_new):
    k_buffer[:, :, input_pos] = v_new
    v_buffer[:, :, input_pos] = k_new
    return k_buffer, v_buffer


@mutant("06")
def values_written_as_keys(k_buffer, v_buffer, input_pos, k_new, v_new):
    k_buffer[:, :, input_pos] = k_new
    v_buffer[:, :, input_pos] = k_new
    return k_buffer, v_buffer


@mutant("06")
def up_to_the_last_written(k_buffer, v_buffer, input_pos, k_new, v_new):
    k_buffer[:, :, input_pos] = k_new
    v_buffer[:, :, input_pos] = v_new
    end = int(input_pos[-1]) + 1
    return k_buffer[:, :, :end], v_buffer[:, :, :end]


@alternative("06")
def index_copy_in_place(k_buffer, v_buffer, input_pos, k_new, v_new):
    return k_buffer.index_copy_(2, input_pos, k_new), v_buffer.index_copy_(2, input_pos, v_new)


@alternative("06")
def slice_from_the_first_slot(k_buffer, v_buffer, input_pos, k_new, v_new):
    start = int(input_pos[0])
    k_buffer[:, :, start : start + k_new.size(2)] = k_new
    v_buffer[:, :, start : start + v_new.size(2)] = v_new
    return k_buffer, v_buffer


# -- Written blind (issue 45) --


# WRONG: writes only the last new token into slot input_pos[0] (right for the decode
# example, q_len 1; wrong for a prefill)
@blind("06")
def decode_shape_only(k_buffer, v_buffer, input_pos, k_new, v_new):
    s = int(input_pos[0])
    k_buffer[:, :, s] = k_new[:, :, -1]
    v_buffer[:, :, s] = v_new[:, :, -1]
    return k_buffer, v_buffer


# WRONG: index_copy (out of place): returns new tensors, the buffers are never written
@blind("06", known="into_a_copy")
def out_of_place(k_buffer, v_buffer, input_pos, k_new, v_new):
    return k_buffer.index_copy(2, input_pos, k_new), v_buffer.index_copy(2, input_pos, v_new)


# WRONG: writes only row 0 of the batch
@blind("06", known="first_row_only")
def row0_only(k_buffer, v_buffer, input_pos, k_new, v_new):
    k_buffer[0].index_copy_(1, input_pos, k_new[0])
    v_buffer[0].index_copy_(1, input_pos, v_new[0])
    return k_buffer, v_buffer
