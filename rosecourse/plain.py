"""Plain data: what the learner's code made, as the grader takes it across processes.

Tensors travel as their bytes (with dtype and shape), numbers, strings and containers as
themselves, and anything else as its type's name only: no class of the learner's is ever
built in the grader (`PlainData` unpickles nothing but pickle's own kinds).
"""

from __future__ import annotations

import dataclasses
import numbers
import pickle
from typing import NoReturn

import torch

from rosecourse.exercises.common import Raised

# Tensors of these dtypes travel as their bytes; any other is an object the grader
# does not read.
DTYPES = {
    str(dtype): dtype
    for dtype in (
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.complex64,
        torch.complex128,
    )
}
TENSOR, DTYPE, RAISED, FOREIGN = "rose:tensor", "rose:dtype", "rose:raised", "rose:foreign"


@dataclasses.dataclass(frozen=True)
class Foreign:
    """What the learner's code answered that is no plain data (an object of a class of its
    own, say): the grader knows only its type's name, and it equals nothing else."""

    type_name: str

    def __str__(self) -> str:
        return f"a {self.type_name} object"


def encode(value: object) -> object:
    """`value` as plain data (in the check's process): numbers, strings, bytes, containers
    of them, and tagged tuples for tensors, dtypes, Raised and anything else."""
    if value is None or type(value) in (bool, int, float, str, bytes):
        return value
    if isinstance(value, torch.Tensor):
        if value.dtype not in DTYPES.values() or value.layout != torch.strided:
            return (FOREIGN, f"tensor of {value.dtype}, {value.layout}")
        if value.device.type == "meta":  # no values: only what it is
            return (FOREIGN, f"tensor of {value.dtype} on the meta device")
        plain = value.detach().cpu().contiguous()
        raw = bytes(plain.reshape(-1).view(torch.uint8).numpy())
        return (TENSOR, str(plain.dtype), tuple(plain.shape), raw)
    if isinstance(value, torch.dtype):
        return (DTYPE, str(value))
    if isinstance(value, Raised):
        return (RAISED, str(value.error))
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, str):
        return str(value)
    if isinstance(value, dict):
        return {encode(k): encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        kind = next(t for t in (list, tuple, frozenset, set) if isinstance(value, t))
        return kind(encode(item) for item in value)
    return (FOREIGN, type(value).__qualname__)


def decode(value: object) -> object:
    """What `encode` made, back (in the grader): tensors, dtypes, Raised, Foreign."""
    if isinstance(value, tuple) and value and isinstance(value[0], str):
        if value[0] == TENSOR:
            _, dtype_name, shape, raw = value
            dtype, shape = DTYPES[dtype_name], tuple(int(size) for size in shape)
            if not raw:
                return torch.zeros(shape, dtype=dtype)
            return torch.frombuffer(bytearray(raw), dtype=dtype).reshape(shape)
        if value[0] == DTYPE:
            return DTYPES[value[1]]
        if value[0] == RAISED:
            return Raised(str(value[1]))
        if value[0] == FOREIGN:
            return Foreign(str(value[1]))
    if isinstance(value, dict):
        return {decode(k): decode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return type(value)(decode(item) for item in value)
    return value


class PlainData(pickle.Unpickler):
    """An unpickler that builds no object of any class: only what pickle makes of its own
    (None, bools, numbers, strings, bytes, lists, tuples, dicts, sets)."""

    def find_class(self, module: str, name: str) -> NoReturn:
        raise pickle.UnpicklingError(f"{module}.{name}: the grader takes plain data only")
