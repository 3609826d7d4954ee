"""The signatures that group nodes: what nodes must share to run as one kernel.

`signature` is the key by which `monadl.runtime.schedule.batched` (and its
agenda, `monadl.runtime.schedule.batched_agenda`) groups nodes: the
primitive, its operands' kinds, shapes and dtypes (an earlier group's
member by its part of the key, computed once per group: its `Place`),
shared weights by identity, plain numbers by kind or by value, and the
parameters by `_param_key`. It runs once per node on the batching hot path;
apart from `monadl.runtime.schedule.batched_records`, which rewrites a group
that ran into ordinary records, it only reads nodes.
"""

from __future__ import annotations

import logging
from typing import Any, Final

import numpy as np
from numpy import ndarray

from monadl.layers._layer import Layer
from monadl.layers._operands import NUMBERS
from monadl.layers._outputs import Outputs
from monadl.layers._program import Program
from monadl.layers._weight import Weight
from monadl.runtime.evaluation import Record
from monadl.runtime.schedule.batched_groups import Place

__all__ = ["batched_kind", "number_key", "operand_parts", "signature"]


def signature(records: dict[Any, Record], node: Any, where: dict[Any, Place] | None = None) -> tuple[Any, ...] | None:
    """What nodes must share to run as one kernel; None: never batched.
    ``where``: the places of earlier groups' members, whose part of the key
    their group computed once. A plain number is in it by kind where the
    group may stack the members' numbers (an elementwise primitive, an
    operation), else by value.

    >>> import numpy as np, monadl as ml
    >>> w = ml.Weight(np.ones((3, 2)))
    >>> a, b, c = np.ones(3) @ w, np.zeros(3) @ w, np.zeros(4) @ w
    >>> signature({}, a) == signature({}, b) != signature({}, c)
    True
    """
    op = node._op
    key: list[Any] = [op.name]  # (a list: a stack of 40,000 parts grew a tuple 40,000 times)
    for x in node._inputs:
        kind = type(x)
        if kind is Layer:
            if where is not None:
                place = where.get(x)
                if place is not None:
                    key += place[2]
                    continue
            value = records[x].value
            if type(value) is Outputs:  # an operation node's outputs: their shapes
                part = value.signature()
                if part is None:
                    return None
                for p in part:
                    if p[0] is not ndarray and not batched_kind(p[0]):
                        return None
                key.append(len(part))  # (its count: two operands of 4 and 3 outputs alike, flattened, were 3 and 4)
                key += part
                continue
            value_kind = type(value)
            if value_kind is not ndarray and not batched_kind(value_kind):
                return None  # a plain number, or another library's array
            key += (value_kind, value.shape, value.dtype)
        elif kind is Weight:
            data_kind = type(x._data)
            if data_kind is not ndarray and data_kind is not float and not batched_kind(data_kind):
                return None  # (another library's weight: its node runs alone)
            key.append(x)
        elif kind in NUMBERS:
            # By kind where the group stacks its members' numbers, else by value.
            key += (kind,) if op.elementwise or type(op.rule) is Program else (kind, number_key(x))
        elif kind is ndarray or batched_kind(kind):
            key += (kind, x.shape, x.dtype)
        else:
            return None  # (another library's array, or an object)
    params = node._params
    if params:
        for p in params:
            k = _param_key(p)
            if k is None:
                return None
            key.append(k)
    return tuple(key)


def operand_parts(records: dict[Any, Record], node: Any, where: dict[Any, Place]) -> list[tuple[str, Any]]:
    """``node``'s signature (see `signature`) operand by operand and
    parameter by parameter, each named (``operand 1``, ``parameter 0``), for
    the DEBUG log to say in what two signatures differ; after the run, so a
    group's member is read by its place (its record may not exist)."""
    op = node._op
    parts: list[tuple[str, Any]] = [("primitive", op)]
    for i, x in enumerate(node._inputs):
        kind = type(x)
        part: Any
        if kind is Layer:
            place = where.get(x)
            value = dict.get(records, x) if place is None else None  # (not `records[x]`: it would make one)
            if place is not None:
                part = place[2]
            elif value is None:
                part = None
            elif type(value.value) is Outputs:
                sig = value.value.signature()
                part = None if sig is None else (len(sig), *sig)
            else:
                part = (type(value.value), getattr(value.value, "shape", None), getattr(value.value, "dtype", None))
        elif kind is Weight:
            part = x
        elif kind in NUMBERS:
            part = (kind,) if op.elementwise or type(op.rule) is Program else (kind, number_key(x))
        else:
            part = (kind, getattr(x, "shape", None), getattr(x, "dtype", None))
        parts.append((f"operand {i}", part))
    parts += [(f"parameter {j}", _param_key(p)) for j, p in enumerate(node._params)]
    return parts


_KINDS: Final[dict[type, bool]] = {}
_log: Final = logging.getLogger("monadl.batching")


def batched_kind(kind: type) -> bool:
    """Whether values of type ``kind`` batch: NumPy's arrays and scalars and
    CuPy's arrays. The batched records index stacked arrays by an int and by
    NumPy index arrays, which the array API standard leaves to each library
    (``array_api_strict`` refuses both): another library's arrays run node by
    node, with the same values. A plain number does not batch either.

    >>> batched_kind(np.ndarray), batched_kind(np.float32), batched_kind(float)
    (True, True, False)
    """
    found = _KINDS.get(kind)
    if found is None:
        found = _KINDS[kind] = issubclass(kind, (np.ndarray, np.generic)) or kind.__module__.split(".")[0] == "cupy"
        # (said once a type of array: a plain number is not news, nor a value whose type says it has no shape, a loom's)
        if not found and getattr(kind, "shape", None) is not None:
            _log.debug(
                "arrays of %s.%s run node by node: batching stacks NumPy's and CuPy's arrays only",
                kind.__module__,
                kind.__qualname__,
            )
    return found


def number_key(x: Any) -> Any:
    """A plain number as a key: its value (``-0.0 == 0.0``, but not in a product)."""
    return x if x else (x, str(x))


def _param_key(p: Any) -> Any:
    """A hashable stand-in for a parameter (slices are unhashable before
    Python 3.12); arrays stand for their shape and dtype (they may differ per
    member, and are stacked); None where unsupported."""
    kind = type(p)
    if kind is slice:  # (first: a cell's gate slices are most of the parameters a graph has)
        return (slice, p.start, p.stop, p.step)
    if p is None or kind in NUMBERS or kind is str or p is Ellipsis:
        return (kind, p)
    if kind is tuple:
        key: list[Any] = [tuple]
        for q in p:
            if type(q) is slice:  # (a gate's cut, ``[:, a:b]``: no call a part)
                key.append((slice, q.start, q.stop, q.step))
                continue
            k = _param_key(q)
            if k is None:
                return None
            key.append(k)
        return tuple(key)
    if kind is Weight:  # (in an index: refused when the node runs; a weight has a shape, but it is no data)
        return None
    shape = getattr(p, "shape", None)
    if shape is not None and hasattr(p, "dtype"):
        return (kind, shape, p.dtype)
    return None
