"""Whether a traced cell read the values of its NumPy data arguments.

A data argument's placeholder (`monadl.layers._data.Data`) refuses NumPy
computation through its own methods and NumPy's protocols, but NumPy reads
an array's buffer in C where neither is asked: a constant indexed by it
(``TABLE[idx]``, ``np.eye(n)[idx]``), a constant's method taking it
(``T.take(idx)``, ``C.repeat(idx)``, ``M.dot(x)``), a copy of it
(``np.array(x)``, ``np.asarray(x, dtype=...)``, ``x.tobytes()``). What it
read is then a constant of the trace, the first call's for every call.

A cell that reads none of its data arguments' values records the same
program whatever they are. So a signature with NumPy data arguments is
traced a second time on arrays of the same shapes and dtypes whose every
element differs (`perturbed`), and `check_unread` refuses, with
`OperandError`, a second run that raises where the first did not, or that
records other constants, parameters, steps or results. No cheaper check
catches all of the above: a copy is a new array with the data's values or
not (``np.asarray(x, dtype=np.float32)``, ``np.frombuffer(x.tobytes())``),
and a constant's row picked by an index shares nothing with it. Tracing is
once per signature, so the second run costs once per new shape of the
arguments (measured: `examples/tree_lstm.py`'s two cells, 0.2 ms more on a
first step of about 41 ms; a graph cell's ``segment_sum(h[src] @ W, dst,
n)`` traced for 200 sizes, 0.17 ms more a size, 85 ms against 52 ms).
The other values take one array the size of each data argument, for the
second run: a 160 MB float64 argument takes 160 MB more, for that run, and
0.04 s at its first call, up to 0.4 s where the system must first find the
memory (measured on a shared 2-core machine; the first touch of the pages
is most of it).

A cell that records another program on the *same* arguments (a random
constant drawn inside it) is left as before: it reads something other than
its arguments, once, at its trace, as the operation's docs say.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any, Final, final

import numpy as np

from monadl._namespace import is_array, namespace
from monadl.errors import OperandError
from monadl.layers._site import site_text
from monadl.layers._step import Step
from monadl.layers._weight import Weight

__all__ = ["Recorded", "check_unread", "perturbed"]


@final
@dataclasses.dataclass(frozen=True, slots=True)
class Recorded:
    """One run of a cell on placeholders (`monadl.layers._tracing`): its
    result's template, the operand leaves and source nodes its program uses,
    the weights it adds, and the program's operand count, constants, steps
    and output slots (no outputs: it computes nothing)."""

    shape: Any
    used: tuple[int, ...] = ()
    sources: tuple[int, ...] = ()
    weights: tuple[Weight[Any, Any], ...] = ()
    size: int = 0
    consts: tuple[Any, ...] = ()
    steps: tuple[Step, ...] = ()
    outputs: tuple[int, ...] = ()


def perturbed(leaves: list[Any], only: int | None = None) -> list[Any] | None:
    """``leaves`` with each NumPy array of numbers or bools (or only the one
    at ``only``) replaced by one of its shape and dtype whose every element
    differs (``~x``, ``x + 1``; 0.5 where ``x + 1`` is ``x``: NaN, infinity,
    a float too large to move); None when there is none to replace."""
    found = list(leaves)
    changed = False
    for i, x in enumerate(leaves):
        if (only is None or i == only) and isinstance(x, np.ndarray) and x.size and x.dtype.kind in "biufc":
            found[i] = _moved(np.ndarray.view(x, np.ndarray))  # (a placeholder already, where operations nest)
            changed = True
    return found if changed else None


def _moved(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """One array the size of ``x`` and no other of its size: a data argument
    may be most of the memory a program holds, so the elements that ``x + 1``
    leaves as they were are found a block at a time."""
    moved = np.empty(x.shape, x.dtype)
    one = x.dtype.type(1)
    with np.errstate(all="ignore"):
        if x.dtype.kind == "b":
            np.logical_not(x, out=moved)
        else:
            np.add(x, one, out=moved)
        if x.dtype.kind in "fc":
            blocks = np.nditer(
                [x, moved], ["external_loop", "buffered"], [["readonly"], ["readwrite"]], buffersize=1 << 14
            )
            with blocks:
                for a, b in blocks:
                    np.copyto(b, one / 2, where=(b == a) | (b != b))
    return moved


def check_unread(
    name: str,
    f: Callable[..., Any],
    call: Any,
    leaves: list[Any],
    first: Recorded,
    record: Callable[[list[Any]], Recorded],
) -> None:
    """Refuse a cell whose trace ``first`` depends on the values of its
    data arguments (``leaves``): ``record`` runs it on other leaves (see the
    module). The argument is found by changing one at a time, and the line
    by the first step that differs."""
    other = perturbed(leaves)
    found = None if other is None else _differs(first, record, other)
    if found is None:
        return
    if _differs(first, record, leaves) is not None:
        return  # (it records another program on the same arguments: not theirs to blame)
    where = "its data arguments"
    for i in range(len(leaves)):
        one = perturbed(leaves, i)
        alone = None if one is None else _differs(first, record, one)
        if alone is not None:
            found, where = alone, _argument(f, call, leaves[i])
            break
    what, error = found
    raise OperandError(
        f"operation {name}: NumPy read the values of {where} inside the cell, past its placeholder (a constant "
        "array indexed by it, TABLE[idx] or np.eye(n)[idx]; a constant's method taking it, T.take(idx), "
        "C.repeat(idx) or M.dot(x); a copy, np.array(x) or np.asarray(x, dtype=...)): run on other values of "
        f"it, the cell {what}; the trace would keep what the first call read for every later call: compute it "
        "before the call and pass the result, or compute it with monadl functions on the argument "
        "(ml.as_layer(TABLE)[idx], ml.embedding(TABLE, idx), ml.as_layer(M) @ x)"
    ) from error


def _differs(
    first: Recorded, record: Callable[[list[Any]], Recorded], leaves: list[Any]
) -> tuple[str, BaseException | None] | None:
    """How the trace on ``leaves`` differs from ``first`` (what the cell did
    otherwise, and the exception it raised), or None where it does not."""
    try:
        second = record(leaves)
    except Exception as exc:
        return f"raised {type(exc).__name__} ({exc})", exc
    what = _difference(first, second)
    return None if what is None else (what, None)


def _difference(a: Recorded, b: Recorded) -> str | None:
    """Where recording ``b`` went otherwise than ``a``, in words, or None."""
    for s, t in zip(a.steps, b.steps):
        if s.op is not t.op or s.refs != t.refs or s.grads != t.grads or s.takes != t.takes:
            return f"built other layers from the one built at {site_text(s.site)} on"
        if not all(map(_same_parameter, s.params, t.params, s.takes or (None,) * len(s.params))):
            return f"built the layer at {site_text(s.site)} with other parameters"
        for r in s.refs:
            k = r - a.size
            if 0 <= k < min(len(a.consts), len(b.consts)) and not _same(a.consts[k], b.consts[k]):
                return f"built the layer at {site_text(s.site)} from another constant"
    if len(a.steps) != len(b.steps) or a.size != b.size or not _same(a.consts, b.consts):
        return "built other layers"
    if a.used != b.used or a.sources != b.sources or a.weights != b.weights or a.outputs != b.outputs:
        return "built other layers"
    if not _same(a.shape, b.shape):
        return "returned another result"
    return None


def _same_parameter(p: Any, q: Any, takes: int | tuple[int | None, ...] | None) -> bool:
    """Whether two steps' parameters are the same, where they are not the
    call's data arguments (`Step.takes`: read per call, each trace its own)."""
    if takes is None:
        return _same(p, q)
    if isinstance(takes, int):
        return True
    return all(s is not None or _same(x, y) for x, y, s in zip(p, q, takes))


_BY_IDENTITY: Final[Any] = object.__eq__


def _same(a: Any, b: Any) -> bool:
    """Whether two things a trace recorded are the same: arrays by shape,
    dtype and values (NaN equal to NaN), containers item by item, numbers
    by value, other objects by ``==`` (by type where only by identity: a
    fresh object of each run)."""
    if a is b:
        return True
    kind = type(a)
    if kind is not type(b):
        return False
    if kind is tuple or kind is list:
        return len(a) == len(b) and all(map(_same, a, b))
    if kind is dict:
        return list(a) == list(b) and all(map(_same, a.values(), b.values()))
    if isinstance(a, np.ndarray):
        return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a, b, equal_nan=a.dtype.kind in "fc")
    if is_array(a):
        xp = namespace(a)
        return bool(a.shape == b.shape and a.dtype == b.dtype and xp.all((a == b) | ((a != a) & (b != b))))
    if isinstance(a, (float, complex, np.inexact)):
        return bool(a == b or (a != a and b != b))
    if kind.__eq__ is _BY_IDENTITY:
        return True
    try:
        return bool(a == b)
    except Exception:
        return False


def _argument(f: Callable[..., Any], call: Any, leaf: Any) -> str:
    """How a message names the data argument ``leaf`` of a call: by its
    parameter's name where it is one (or an item of one), with its shape."""
    kind = f"{leaf.dtype}{list(leaf.shape)}"
    args, kwargs = call
    try:
        bound = inspect.signature(f).bind(*args, **kwargs).arguments
    except (TypeError, ValueError):
        return f"a data argument ({kind})"
    for parameter, value in bound.items():
        if value is leaf:
            return f"its data argument {parameter} ({kind})"
        if type(value) in (tuple, list, dict) and any(y is leaf for y in _items(value)):
            return f"a data argument in {parameter} ({kind})"
    return f"a data argument ({kind})"


def _items(value: Any) -> list[Any]:
    return list(value.values() if type(value) is dict else value)
