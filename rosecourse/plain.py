"""Plain data: what the learner's code made, as the grader takes it from another process.

A message is pickled with its tensors as their bytes (with dtype and shape), and any object
that is no number, string, container, dtype or Raised as its type's name only (`Foreign`).
The grader reads it with `PlainData`, an unpickler that builds no object of any class, so
no message can run code in the grader or hand it an object of the learner's.
"""

from __future__ import annotations

import dataclasses
import io
import numbers
import pickle
from typing import NoReturn

import torch

from rosecourse.exercises.common import Raised

TENSOR, DTYPE, RAISED, FOREIGN = "rose:tensor", "rose:dtype", "rose:raised", "rose:foreign"


@dataclasses.dataclass(frozen=True)
class Foreign:
    """An object that is no plain data (of a class of the learner's, say): the grader knows
    only its type's name, and it equals nothing else."""

    type_name: str

    def __str__(self) -> str:
        return f"a {self.type_name} object"


def encode(value: object) -> object:
    """`value` as what pickle makes without any class: tensors, dtypes, Raised and Foreign
    as tagged tuples."""
    if value is None or type(value) in (bool, int, float, str, bytes):
        return value
    if isinstance(value, torch.Tensor):
        if value.layout != torch.strided or value.device.type == "meta":  # no values to send
            return (FOREIGN, f"{value.layout} tensor on {value.device}")
        flat = value.detach().cpu().contiguous().reshape(-1)
        return (TENSOR, str(value.dtype), tuple(value.shape), bytes(flat.view(torch.uint8).numpy()))
    if isinstance(value, torch.dtype):
        return (DTYPE, str(value))
    if isinstance(value, Raised):
        return (RAISED, str(value.error))
    if isinstance(value, numbers.Real):  # a numpy scalar, say
        return int(value) if isinstance(value, numbers.Integral) else float(value)
    if isinstance(value, dict):
        return {encode(k): encode(v) for k, v in value.items()}
    for kind in (list, tuple, frozenset, set):
        if isinstance(value, kind):
            return kind(encode(item) for item in value)
    return (FOREIGN, type(value).__qualname__)


def decode(value: object) -> object:
    """What `encode` made, back: tensors, dtypes, Raised and Foreign."""
    tag = value[0] if isinstance(value, tuple) and value else None
    if tag == TENSOR:
        _, dtype, shape, raw = value  # (a byte more: frombuffer takes no empty buffer)
        data = torch.frombuffer(bytearray(raw) + bytearray(1), dtype=torch.uint8)[:-1]
        return data.view(dtype_named(dtype)).reshape(tuple(shape))
    if tag == DTYPE:
        return dtype_named(value[1])
    if tag in (RAISED, FOREIGN):
        return (Raised if tag == RAISED else Foreign)(str(value[1]))
    if isinstance(value, dict):
        return {decode(k): decode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return type(value)(decode(item) for item in value)
    return value


def dtype_named(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"no dtype called {name!r}")
    return dtype


def plain(value: object) -> object:
    """A copy of `value` as the grader receives it: plain data."""
    return decode(encode(value))


def dumps(message: object) -> bytes:
    return pickle.dumps(encode(message), protocol=pickle.HIGHEST_PROTOCOL)


def loads(data: bytes) -> object:
    """A message `dumps` made, read as plain data only (PlainData). One cut short is a
    ValueError (an EOFError is a pipe's end)."""
    try:
        return decode(PlainData(io.BytesIO(data)).load())
    except EOFError:
        raise ValueError("a message cut short") from None


class PlainData(pickle.Unpickler):
    """An unpickler that builds no object of any class: only what pickle makes of its own
    (None, bools, numbers, strings, bytes, lists, tuples, dicts, sets)."""

    def find_class(self, module: str, name: str) -> NoReturn:
        raise pickle.UnpicklingError(f"{module}.{name}: the grader takes plain data only")
