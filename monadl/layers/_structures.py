"""The arguments and results of an `monadl.operation` as structures: what
a call's signature is made of, and how a traced result is rebuilt per call.

A structure is tuples, lists, dicts and dataclasses (named tuples too) of
*leaves*: layers and weights (operands with a delta, `NODE` and `WEIGHT`), arrays and
floats, NumPy's among them (data, `DATA`), and anything else, static (by
value if hashable, else by identity; NumPy's integers and bools too, as
Python's). `flatten` gives a call's hashable shape and its operand leaves;
`rebuild` puts placeholders in their places; `template` and `filler`
rebuild a traced function's result around each call's nodes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Final

import numpy as np

from monadl._namespace import is_array
from monadl.errors import OperandError
from monadl.layers._dataclasses import READERS as _READERS
from monadl.layers._dataclasses import fields as _fields
from monadl.layers._dataclasses import maker as _maker
from monadl.layers._layer import Expr, Layer
from monadl.layers._outputs import OUTPUT
from monadl.layers._weight import Weight

__all__ = [
    "DATA",
    "LEAVES",
    "MISMATCH",
    "NODE",
    "WEIGHT",
    "Reader",
    "filler",
    "flatten",
    "items",
    "read_parts",
    "reader",
    "rebuild",
    "template",
]

NODE: Final = "node"  # a leaf that is a layer: an operand with a delta
# A weight: an operand with a delta too, told apart from a layer because its trace sends
# a product's delta to it as factors (`monadl.layers._program.Program.factors`), which a
# layer's rules could not read.
WEIGHT: Final = "weight"
DATA: Final = "data"  # an array or a float: an operand without one


# ---- structures of arguments and results ------------------------------------------------------
_STATIC: Final = frozenset({int, bool, str, type(None)})
_STATIC_SCALARS: Final = (np.integer, np.bool_)  # (NumPy's ints and bools, by value as Python's; its floats are data)


def flatten(x: Any, leaves: list[Any], keep: list[Any], views: list[int]) -> Any:
    """The hashable shape of ``x`` (its structure and static leaves); its
    operand leaves go to ``leaves`` (and the places of those that are other
    operations' outputs to ``views``), unhashable static ones to ``keep``
    (held by the cache, so that their ids stay theirs)."""
    kind = type(x)
    if kind is Layer:
        if x._op is OUTPUT:
            views.append(len(leaves))
        leaves.append(x)
        return NODE
    if kind is Weight:
        leaves.append(x)
        return WEIGHT
    if kind is np.ndarray or kind is float:
        leaves.append(x)
        return DATA
    if kind in _STATIC:
        return (kind, x)
    read = _READERS.get(kind)
    if read is not None:  # a dataclass seen before (checked first: a model's states are)
        return (kind, items(read(x), leaves, keep, views))
    if kind is tuple or kind is list:
        return (kind, items(x, leaves, keep, views))
    if kind is dict:  # (keys with their types: True, 1 and 1.0 are equal keys, not one signature)
        return (dict, tuple(x), tuple(map(type, x)), items(x.values(), leaves, keep, views))
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return (kind, tuple([flatten(getattr(x, name), leaves, keep, views) for name in _fields(kind)]))
    if isinstance(x, tuple):  # a named tuple
        return (kind, tuple([flatten(y, leaves, keep, views) for y in x]))
    if isinstance(x, Expr):
        leaves.append(x)
        return NODE
    if isinstance(x, _STATIC_SCALARS):  # (a count read from a NumPy array or record: static, as an int is)
        return (kind, x)
    if isinstance(x, np.generic) or is_array(x):
        leaves.append(x)
        return DATA
    if isinstance(x, dict) and any(isinstance(y, Expr) for y in x.values()):
        raise OperandError(
            f"operation: layers in a {kind.__name__} are not read as arguments; pass a plain dict "
            "(or a tuple, a list or a dataclass) of them"
        )
    try:
        hash(x)
    except TypeError:
        keep.append(x)
        return ("id", id(x))
    return ("static", kind, _typed(x) if kind is frozenset else x)


def _typed(x: Any) -> Any:
    """A frozenset's members with their types (True, 1 and 1.0 are equal
    members, not one signature), nested ones too."""
    if type(x) is frozenset:
        return frozenset([(type(y), _typed(y)) for y in x])
    if type(x) is tuple:
        return tuple([(type(y), _typed(y)) for y in x])
    return x


def items(xs: Iterable[Any], leaves: list[Any], keep: list[Any], views: list[int]) -> tuple[Any, ...]:
    """`_flatten` of a container's items, with layers and weights (most of
    them) taken without a call: this runs for every call of an operation."""
    shape: list[Any] = []
    for y in xs:
        kind = type(y)
        if kind is Layer:
            if y._op is OUTPUT:
                views.append(len(leaves))
            leaves.append(y)
            shape.append(NODE)
        elif kind is Weight:
            leaves.append(y)
            shape.append(WEIGHT)
        elif kind is np.ndarray or kind is float:
            leaves.append(y)
            shape.append(DATA)
        else:
            read = _READERS.get(kind)
            if read is not None:  # a dataclass seen before (a cell's state): as `flatten` takes it
                shape.append((kind, items(read(y), leaves, keep, views)))
            elif kind is tuple or kind is list:  # (a Fold block's tuple of states)
                shape.append((kind, items(y, leaves, keep, views)))
            else:
                shape.append(flatten(y, leaves, keep, views))
    return tuple(shape)


LEAVES: Final = frozenset({Layer, Weight, np.ndarray, float})
"""The leaves whose type says their kind (`NODE`, `WEIGHT` or `DATA`)."""

MISMATCH: Final = object()
"""What a `reader` returns for a tuple or list whose items' types are not its own."""

Reader = Callable[[Any], Any]
"""Reads the parts of a value shaped like the one it was made from (`reader`):
a sequence of them, or `MISMATCH`."""


def reader(x: Any) -> Reader | None:
    """A reader of the parts of values shaped like ``x``, in `items`' order:
    a dataclass's fields as they are (its caller checks that they are
    leaves), and a tuple's or list's items, read in turn where they are
    dataclasses, tuples or lists, after checking that their types are
    ``x``'s items' types (else `MISMATCH`); None for other values (a dict, a
    named tuple, a static leaf: the signature's walk reads them).

    >>> read = reader((1.0, [np.zeros(2)]))
    >>> [type(y).__name__ for y in read((2.0, [np.ones(3)]))], read((2.0, ())) is MISMATCH
    (['float', 'ndarray'], True)
    """
    kind = type(x)
    read = _READERS.get(kind) if dataclasses.is_dataclass(x) and not isinstance(x, type) and _fields(kind) else None
    if read is not None:
        return read
    if kind is not tuple and kind is not list:
        return None
    parts: list[Reader | None] = []
    for y in x:
        part = None if type(y) in LEAVES else reader(y)
        if part is None and type(y) not in LEAVES:
            return None
        parts.append(part)
    return _sequence(tuple(map(type, x)), tuple(parts))


def read_parts(xs: Iterable[Any], parts: Iterable[Reader | None]) -> Any:
    """The leaves of ``xs``, each read by its part's reader (None: it is a
    leaf), in `items`' order; `MISMATCH` where a reader finds other types."""
    leaves: list[Any] = []
    for y, part in zip(xs, parts):
        if part is None:
            leaves.append(y)
        else:
            found = part(y)
            if found is MISMATCH:
                return MISMATCH
            leaves += found
    return leaves


def _sequence(kinds: tuple[type, ...], parts: tuple[Reader | None, ...]) -> Reader:
    def read(x: Any) -> Any:
        return MISMATCH if tuple(map(type, x)) != kinds else read_parts(x, parts)

    return read


def rebuild(x: Any, leaves: Iterator[Any]) -> Any:
    """``x`` with its operand leaves replaced by the next of ``leaves`` (the walk of `_flatten`)."""
    kind = type(x)
    if kind is Layer or kind is Weight or kind is np.ndarray or kind is float:
        return next(leaves)
    if kind is tuple or kind is list:
        return kind([rebuild(y, leaves) for y in x])
    if kind is dict:
        return {k: rebuild(y, leaves) for k, y in x.items()}
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return _maker(kind)(*[rebuild(getattr(x, name), leaves) for name in _fields(kind)])
    if isinstance(x, tuple):
        return kind(*[rebuild(y, leaves) for y in x])
    if isinstance(x, Expr) or (isinstance(x, np.generic) and not isinstance(x, _STATIC_SCALARS)) or is_array(x):
        return next(leaves)
    return x


# A result's template: how to rebuild it per call. Leaves: ("out", k) the
# program's output k, ("arg", j) the call's operand j, ("const", v) as it is.
def template(y: Any, leaf: Callable[[Any], tuple[str, Any]]) -> Any:
    kind = type(y)
    if kind is tuple or kind is list:
        return ("seq", kind, tuple(template(z, leaf) for z in y))
    if kind is dict:
        return ("dict", tuple(y), tuple(template(z, leaf) for z in y.values()))
    if dataclasses.is_dataclass(y) and not isinstance(y, type):
        return ("call", _maker(kind), tuple(template(getattr(y, name), leaf) for name in _fields(kind)))
    if isinstance(y, tuple):
        return ("call", kind, tuple(template(z, leaf) for z in y))
    return leaf(y)


def filler(t: tuple[Any, ...]) -> Callable[[tuple[Any, ...], list[Any]], Any]:
    """`fill` of template ``t`` as a closure, the walk of the template done
    once (a call of an operation then only builds its result).

    >>> filler(("seq", tuple, (("out", 1), ("arg", 0), ("const", 2))))(("a", "b"), ["x"])
    ('b', 'x', 2)
    """
    tag = t[0]
    if tag == "out":
        return _out(t[1])
    if tag == "arg":
        return _arg(t[1])
    if tag == "const":
        return _const(t[1])
    parts = [filler(z) for z in t[2]]
    kind = t[1]
    if tag == "dict":
        return lambda outs, args: dict(zip(kind, [f(outs, args) for f in parts]))
    if [z[0] for z in t[2]] == ["out"] * len(parts):  # only outputs (a cell's state): no calls per leaf
        picks = [z[1] for z in t[2]]
        if tag == "seq":
            return lambda outs, args: kind([outs[k] for k in picks])
        if picks == list(range(len(picks))):
            n = len(picks)  # (the first n outputs: a nested structure's are among more, (State(h), other))
            return lambda outs, args: kind(*outs) if len(outs) == n else kind(*outs[:n])
        return lambda outs, args: kind(*[outs[k] for k in picks])
    if tag == "seq":
        return lambda outs, args: kind([f(outs, args) for f in parts])
    return lambda outs, args: kind(*[f(outs, args) for f in parts])


def _out(k: int) -> Callable[[tuple[Any, ...], list[Any]], Any]:
    return lambda outs, args: outs[k]


def _arg(k: int) -> Callable[[tuple[Any, ...], list[Any]], Any]:
    return lambda outs, args: args[k]


def _const(v: Any) -> Callable[[tuple[Any, ...], list[Any]], Any]:
    return lambda outs, args: v
