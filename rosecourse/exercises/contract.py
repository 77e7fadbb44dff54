"""What every exercise's contract says beyond its values, checked on every call the probe
makes: the same for every chapter, not written per answer.

While an exercise's probe runs the learner's function, each call is watched (`Watcher`):

- its arguments are compared before and after: a tensor, list or dict the caller passed
  comes back as it was, unless the contract says the function writes into it (`writes`:
  chapter 06's buffers);
- it runs again on the same inputs moved to another device (`Elsewhere`: CPU tensors
  that say they stand on meta, values and all, and raise as a GPU does when an op meets
  one of them and a CPU tensor; a model's weights are moved with it): what it returns
  must stand where the reference's does, so a tensor made without the inputs' device
  (right on the CPU, an error on a GPU) fails, even in code that reads values (a greedy
  loop's argmax);
- it runs again with its floating-point inputs in bfloat16: what it returns must have
  the reference's dtype, so a float32 intermediate that leaks into the result fails;
- the dtype and device of what it returns are compared with the reference's, not only
  its values (a float64 or an int32 result fails).

Each finding names the clause it breaks (`breach`). The reference's calls are watched
the same way, so a property the reference itself does not have asks nothing of the
learner.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
from collections.abc import Callable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from rosetrainer.errors import one_line

# The key under which a probe's outcomes carry what the watcher found, call by call.
PROPERTIES = "properties of each call"
# The other device a call runs again on: its tensors are CPU tensors underneath (they hold
# values), but they say they stand on ELSEWHERE, as a GPU's would say cuda.
ELSEWHERE, CPU = torch.device("meta"), torch.device("cpu")
# An index may stay on the CPU (a GPU tensor takes CPU indices), but not what is written.
INDEXING = (torch.Tensor.__getitem__, torch.Tensor.__setitem__)


class Elsewhere(torch.Tensor):
    """A CPU tensor that stands on ELSEWHERE for the code it meets: an op that meets it
    and a CPU tensor of one element or more raises, as on a GPU (a 0-d tensor is a number
    on any device); what an op makes of it stands there too, until `.cpu()`."""

    @property
    def device(self) -> torch.device:
        return ELSEWHERE

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.numpy:
            raise TypeError(f"can't convert {ELSEWHERE} device type tensor to numpy")
        met = (args[0], *args[2:]) if func in INDEXING else args
        for t in pytree.tree_leaves((met, kwargs)):
            if isinstance(t, torch.Tensor) and not isinstance(t, cls) and t.dim() > 0:
                raise RuntimeError(
                    "Expected all tensors to be on the same device, but found at least two "
                    f"devices, {ELSEWHERE} and cpu!"
                )
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **kwargs)
        back = func is torch.Tensor.cpu or (func is torch.Tensor.to and to_cpu(args, kwargs))
        return pytree.tree_map_only(
            torch.Tensor, lambda t: t.as_subclass(torch.Tensor if back else cls), result
        )


def to_cpu(args: tuple, kwargs: dict) -> bool:
    """Whether `tensor.to(*args[1:], **kwargs)` moves it to the CPU."""
    device = torch._C._nn._parse_to(*args[1:], **kwargs)[0]
    return device is not None and device.type == "cpu"


class ToElsewhere(TorchFunctionMode):
    """While it holds, a tensor asked for on ELSEWHERE (`device=`, `.to(device)`) is made
    on the CPU and stands there (Elsewhere)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        there = ELSEWHERE in pytree.tree_leaves((args, kwargs or {}))
        if there:
            args, kwargs = pytree.tree_map_only(
                torch.device, lambda d: CPU if d == ELSEWHERE else d, (args, kwargs or {})
            )
        result = func(*args, **(kwargs or {}))
        if not there:
            return result
        return pytree.tree_map_only(torch.Tensor, lambda t: t.as_subclass(Elsewhere), result)


def signature(value: object) -> object:
    """What the contract fixes of a result besides its values: for each tensor its shape,
    dtype and device type, nested as the result is; other values as their type's name."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), str(value.dtype), value.device.type)
    if isinstance(value, (tuple, list)):
        return tuple(signature(item) for item in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return tuple(signature(getattr(value, f.name)) for f in dataclasses.fields(value))
    return type(value).__name__


def input_key(args: tuple, kwargs: dict) -> str:
    """A call's inputs in a few words (what a repeated call with the same inputs shares)."""

    def word(value: object) -> str:
        if isinstance(value, torch.Tensor):
            return f"tensor{tuple(value.shape)}"
        if isinstance(value, (int, float, bool, str, type(None), torch.device, torch.dtype)):
            return repr(value)
        if isinstance(value, (list, tuple)):
            return f"{type(value).__name__} of {len(value)}"
        return type(value).__name__

    return ", ".join([*map(word, args), *(f"{k}={word(v)}" for k, v in kwargs.items())])


def moved(value: object, to: Callable[[torch.Tensor], torch.Tensor]) -> object:
    """`value` with every tensor in it converted by `to` (for `elsewhere`, every device and
    a copy of every model moved there too)."""
    if isinstance(value, torch.Tensor):
        return to(value)
    if isinstance(value, torch.device):
        return ELSEWHERE if to is elsewhere else value
    if isinstance(value, torch.nn.Module) and to is elsewhere:
        model, made = copy.deepcopy(value), {}
        for module in model.modules():
            for table in (module._parameters, module._buffers):
                for name, t in table.items():  # (a tied weight stays one tensor)
                    if t is not None:
                        table[name] = made.setdefault(id(t), elsewhere(t))
        return model
    if isinstance(value, (tuple, list)):
        return type(value)(moved(item, to) for item in value)
    return value


def elsewhere(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().as_subclass(Elsewhere)


def in_bfloat16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16) if t.is_floating_point() else t


def plain(value: object) -> bool:
    """Tensors, models, numbers, strings, devices and dtypes, and lists and tuples of them."""
    if isinstance(value, (tuple, list)):
        return all(map(plain, value))
    return isinstance(value, (torch.Tensor, torch.nn.Module, *MARKS))


MARKS = (int, float, bool, str, bytes, type(None), torch.device, torch.dtype)


def holds(value: object, kind: type | tuple[type, ...]) -> bool:
    if isinstance(value, kind):
        return True
    return isinstance(value, (tuple, list)) and any(holds(item, kind) for item in value)


def snapshot(value: object) -> object:
    """A copy of what the caller passed that a call could change in place (tensors, lists,
    dicts); None for anything else (the function's own objects are not compared)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (list, dict)):
        try:
            return copy_plain(value)
        except TypeError:
            return None
    return None


def copy_plain(value: object) -> object:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, list):
        return [copy_plain(item) for item in value]
    if isinstance(value, dict):
        return {key: copy_plain(item) for key, item in value.items()}
    if isinstance(value, (tuple, int, float, bool, str, bytes, type(None))):
        return value
    raise TypeError(type(value).__name__)


def unchanged(before: object, after: object) -> bool:
    if isinstance(before, torch.Tensor):
        if not isinstance(after, torch.Tensor) or (before.shape, before.dtype) != (
            after.shape,
            after.dtype,
        ):
            return False
        after = after.detach().cpu()
        if before.is_floating_point():
            return torch.allclose(before, after, rtol=0, atol=0, equal_nan=True)
        return torch.equal(before, after)
    if isinstance(before, list):
        return (
            isinstance(after, list)
            and len(before) == len(after)
            and all(map(unchanged, before, after))
        )
    if isinstance(before, dict):
        return (
            isinstance(after, dict)
            and before.keys() == after.keys()
            and all(unchanged(before[k], after[k]) for k in before)
        )
    return before == after


class Watcher:
    """The learner's function (or the reference), watched on every call: `records` holds,
    per distinct inputs, what the call returned (its signature), which arguments it
    changed, and what it returned on another device and in bfloat16 (a signature, or
    "raises ...")."""

    def __init__(self, fn: Callable, writes: frozenset[str] = frozenset()) -> None:
        self.fn, self.writes = fn, writes
        try:
            self.names = list(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            self.names = []
        self.records: dict[str, dict[str, object]] = {}

    def __call__(self, *args: object, **kwargs: object) -> object:
        key = input_key(args, kwargs)
        if key in self.records:  # seen: watched once is enough
            return self.fn(*args, **kwargs)
        named = [*zip(self.names, args, strict=False), *kwargs.items()]
        named += [(f"argument {i}", arg) for i, arg in enumerate(args[len(self.names) :])]
        before = {name: snapshot(value) for name, value in named if name not in self.writes}
        result = self.fn(*args, **kwargs)
        values = dict(named)
        changed = sorted(
            name
            for name, copy in before.items()
            if copy is not None and not unchanged(copy, values[name])
        )
        record: dict[str, object] = {"result": signature(result), "changed": tuple(changed)}
        # Run again only a call of plain data (a model is copied to move it): one handed an
        # object (a cache, a scheduler) may change it, and a second call would find it
        # changed; nor one that writes into its arguments.
        inputs = (args, list(kwargs.values()))
        if not self.writes and plain(inputs):
            if holds(inputs, (torch.Tensor, torch.device, torch.nn.Module)):
                record["meta"] = self.again(elsewhere, args, kwargs)
            if any(
                isinstance(value, torch.Tensor) and value.is_floating_point() for _, value in named
            ):
                record["bfloat16"] = self.again(in_bfloat16, args, kwargs)
        self.records[key] = record
        return result

    def again(self, to: Callable, args: tuple, kwargs: dict) -> object:
        try:
            with ToElsewhere():
                result = self.fn(*moved(args, to), **{k: moved(v, to) for k, v in kwargs.items()})
        except Exception as error:  # what it raised is the finding (or tells nothing)
            return f"raises {one_line(error)}"
        return signature(result)


def watched_outcomes(probe: Callable[[Callable], object], fn: Callable, writes) -> dict:
    """`probe(fn)`'s outcomes with, under PROPERTIES, what watching each call found."""
    watcher = Watcher(fn, writes)
    outcomes = dict(probe(watcher))
    outcomes.setdefault(PROPERTIES, watcher.records)  # (an answer from the check's process)
    return outcomes


def breach(seen: dict, wanted: dict, dtypes: frozenset[str] = frozenset()) -> str | None:
    """The first clause of the contract the learner's calls break, as the reference's
    calls on the same inputs show it (`dtypes`: results' dtypes it allows besides the
    reference's); None when they break none."""
    mine, theirs = seen.get(PROPERTIES) or {}, wanted.get(PROPERTIES) or {}
    if not isinstance(mine, dict):
        return None
    for key, want in theirs.items():
        got = mine.get(key)
        if not isinstance(got, dict):
            continue
        call = f"(a call with {key})"
        if got.get("changed"):
            names = " and ".join(got["changed"])
            return (
                f"your function changes its argument {names} in place {call}: what the "
                "caller passed is not yours to change (build a new one, or copy first)"
            )
        result = found_in(got.get("result"), want.get("result"), dtypes)
        if result is not None:
            return f"your function returns {result} {call}"
        meta = got.get("meta")
        if "meta" in want and not isinstance(want["meta"], str):  # the reference runs there
            if isinstance(meta, str):
                return (
                    f"with its inputs on another device (meta) your function {meta} {call}: "
                    "a tensor made without the inputs' device meets them there (pass "
                    "device=... from an input)"
                )
            found = found_in(meta, want["meta"], dtypes)
            if found is not None:
                return (
                    f"with its inputs on another device (meta) your function returns "
                    f"{found} {call}: make new tensors on the inputs' device (and keep none "
                    "from an earlier call: it stands where that call's inputs did)"
                )
        low = got.get("bfloat16")
        if "bfloat16" in want and not isinstance(want["bfloat16"], str):
            if isinstance(low, str):
                return f"with its inputs in bfloat16 your function {low} {call}"
            found = found_in(low, want["bfloat16"], dtypes)
            if found is not None:
                return (
                    f"with its inputs in bfloat16 your function returns {found} {call}: "
                    "keep the inputs' dtype (an intermediate in float32 must not leak out)"
                )
    return None


def found_in(got: object, want: object, dtypes: frozenset[str] = frozenset()) -> str | None:
    """Where the signature `got` leaves `want` in dtype or device (shapes and values are
    the probe's to compare), in words."""
    if isinstance(want, tuple) and want and want[0] == "tensor":
        if not (isinstance(got, tuple) and got and got[0] == "tensor"):
            return None
        if got[2] != want[2] and got[2] not in dtypes:
            return f"{got[2]} where the contract's is {want[2]}"
        if got[3] != want[3]:
            return f"a tensor on {got[3]} where its inputs' device, {want[3]}, is right"
        return None
    if isinstance(want, tuple) and isinstance(got, tuple) and len(got) == len(want):
        for g, w in zip(got, want, strict=True):
            found = found_in(g, w, dtypes)
            if found is not None:
                return found
    return None


def overflow(seen: dict, wanted: dict) -> str | None:
    """The first probe on which the learner's function gives NaN where the reference's
    values are numbers (inf/inf, inf - inf: a computation that overflowed), in words."""
    for label, want in wanted.items():
        got = seen.get(label)
        if (
            isinstance(got, torch.Tensor)
            and isinstance(want, torch.Tensor)
            and got.shape == want.shape
            and got.is_floating_point()
            and want.is_floating_point()
            and bool((got.isnan() & ~want.isnan()).any())
        ):
            return (
                f"on {label}: your function gives NaN where the values are numbers: "
                "something overflowed (exp() of a score past about 88 does: take each row's "
                "max off before exp, as torch.softmax does)"
            )
    return None
