"""Every weight a model holds, by a stable dotted name: what a checkpoint
stores them under (`monadl.checkpoint`) and how data parallelism finds and
orders them on every rank (`monadl.distributed`)."""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Iterable, Mapping
from typing import Any, Final

import numpy as np

from monadl.errors import CheckpointError
from monadl.layers import Layer, Weight
from monadl.layers._operation import Operation

__all__ = ["named_weights"]

# Objects that hold no weights worth walking into: code, classes, modules, arrays.
_OPAQUE: Final = (
    type,
    types.ModuleType,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    Layer,  # a built expression: its weights belong to whoever built it
    np.ndarray,
    np.generic,
    str,
    bytes,
    int,
    float,
    complex,
)


def named_weights(model: object) -> dict[str, Weight[Any, Any]]:
    """Every weight reachable from ``model``, by a stable dotted name, in the
    order the model's containers hold them.

    Dict keys, list and tuple indices, dataclass fields and attribute names
    (``__dict__`` and ``__slots__``) make up the names. A weight reached twice
    (shared) is named once, by its first path. Built layers are not walked
    into. The walk is iterative, so deep models are fine.

    >>> import numpy as np, monadl as ml
    >>> from dataclasses import dataclass
    >>> @dataclass
    ... class Dense:
    ...     weight: ml.ArrayWeight
    ...     bias: ml.ArrayWeight
    >>> model = {"layers": [Dense(ml.Weight(np.ones((2, 2))), ml.Weight(np.zeros(2)))]}
    >>> list(named_weights(model))
    ['layers.0.weight', 'layers.0.bias']
    """
    found: dict[str, Weight[Any, Any]] = {}
    seen: set[int] = set()
    stack: list[tuple[str, object]] = [("", model)]
    while stack:
        name, node = stack.pop()
        if id(node) in seen:
            continue
        if isinstance(node, Weight):
            seen.add(id(node))
            found[name] = node
            continue
        children = _children(node)
        if children is None:
            continue
        seen.add(id(node))  # cycles (a child pointing back at its parent) end here
        stack.extend(reversed([(f"{name}.{key}" if name else str(key), child) for key, child in children]))
    return found


def _children(node: object) -> Iterable[tuple[object, object]] | None:
    if isinstance(node, _OPAQUE) or node is None:
        return None
    if isinstance(node, Mapping):
        return list(node.items())
    if isinstance(node, (set, frozenset)):
        if any(isinstance(item, Weight) for item in node):
            raise CheckpointError("weights in a set have no stable name: keep them in a list or a dict")
        return None
    if isinstance(node, tuple) and hasattr(node, "_fields"):
        return list(zip(node._fields, node))
    if isinstance(node, (list, tuple)):
        return list(enumerate(node))
    if dataclasses.is_dataclass(node):
        return [(f.name, getattr(node, f.name)) for f in dataclasses.fields(node) if hasattr(node, f.name)]
    if type(node) is Operation:  # what its function holds, not its traces' weights (a global's would get their path)
        return [("_closure", node._closure)]
    attributes: dict[str, object] = dict(getattr(node, "__dict__", {}))
    for cls in type(node).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for slot in (slots,) if isinstance(slots, str) else slots:
            if slot not in ("__dict__", "__weakref__") and slot not in attributes and hasattr(node, slot):
                attributes[slot] = getattr(node, slot)
    return list(attributes.items()) or None
