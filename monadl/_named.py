"""Every weight a model holds, by a stable dotted name: what a checkpoint
stores them under (`monadl.checkpoint`) and how data parallelism finds and
orders them on every rank (`monadl.distributed`)."""

from __future__ import annotations

import array
import dataclasses
import functools
import types
from collections.abc import Iterable, Mapping, MutableSequence, ValuesView
from typing import Any, Final

import numpy as np

from monadl.errors import CheckpointError
from monadl.layers import Layer, Weight
from monadl.layers._operation import Operation

__all__ = ["named_weights", "named_weights_and_aliases"]

# Objects that hold no weights worth walking into: classes, modules, arrays.
# (A function, a bound method and a partial hold what their code reads:
# `_held_by_code`.)
_OPAQUE: Final = (
    bytearray,  # (mutable sequences of numbers: walked item by item, 5 s for 50 MB)
    array.array,
    memoryview,
    type,
    types.ModuleType,
    types.BuiltinFunctionType,
    Layer,  # a built expression: its weights belong to whoever built it
    np.ndarray,
    np.generic,
    str,
    bytes,
    int,
    float,
    complex,
)


_CODE: Final = (types.FunctionType, types.MethodType, functools.partial, Operation)

_LARGEST_HELD_BY_CODE: Final = 10_000
"""A list, tuple or mapping of more items than this that only code holds is
not walked: a million samples a loss's partial holds took 3 s a save."""

# Leaves that hold no weight, left out of a container's children before they are named
# (a partial over a million samples made a million names for nothing).
_LEAVES: Final = (str, bytes, int, float, complex, np.generic, np.ndarray)


def named_weights(model: object) -> dict[str, Weight[Any, Any]]:
    """Every weight reachable from ``model``, by a stable dotted name, in the
    order the model's containers hold them.

    Dict keys, list and tuple indices (a deque's, a dict's values', an
    array of objects' flat ones), dataclass fields and attribute names
    (``__dict__`` and ``__slots__``, and a weight an object's class holds
    as a class attribute: not a class's list or dict, which may be a
    registry of every instance) make up the names. A
    generator or an iterator is not walked (that would consume it). What code holds is
    walked after all that data holds (so a weight data reaches keeps its
    name), by the names its code reads: a closure's free variables and a
    function's defaults by their names, a ``functools.partial``'s arguments
    by position (``0``) and keyword, its function under ``func``; a bound
    method and an `ml.operation` hold what their object or function holds;
    a path without a private name (``_x``) first; a list, tuple or mapping
    of more than 10,000 items that only code holds (a data set) is not
    walked. A weight reached twice
    (shared, tied) is named once, by its first path; its other paths are
    its aliases (`named_weights_and_aliases`), which a checkpoint records.
    Built layers are not walked into, nor a module's globals. The walk is
    iterative, so deep models are fine.

    >>> import numpy as np, monadl as ml
    >>> from dataclasses import dataclass
    >>> @dataclass
    ... class Dense:
    ...     weight: ml.ArrayWeight
    ...     bias: ml.ArrayWeight
    >>> model = {"layers": [Dense(ml.Weight(np.ones((2, 2))), ml.Weight(np.zeros(2)))]}
    >>> list(named_weights(model))
    ['layers.0.weight', 'layers.0.bias']
    >>> import functools
    >>> scale = ml.Weight(np.ones(2))
    >>> def scaled(w: ml.ArrayWeight, x: ml.Array) -> ml.ArrayLayer:
    ...     return w * x
    >>> list(named_weights({"head": functools.partial(scaled, scale), "tail": lambda x: scale * x}))
    ['head.0']
    """
    return _walk_model(model)[0]


def named_weights_and_aliases(model: object) -> tuple[dict[str, Weight[Any, Any]], dict[str, str]]:
    """`named_weights`, and every other path by which ``model`` reaches a
    named weight (its aliases: a tied embedding's ``proj`` for ``embed``, or
    each weight of a block held in two places), each mapped to the weight's
    name, so that a checkpoint loads into a model that reaches the weight by
    another of its paths first, or by two weights of its own (untied).

    A path that runs round a cycle is none; past 10,000 aliases (a chain of
    blocks each shared twice has exponentially many paths) no more are made.

    >>> import numpy as np, monadl as ml
    >>> embedding = ml.Weight(np.ones((5, 3)))
    >>> block = {"w": ml.Weight(np.ones(3))}
    >>> names, aliases = named_weights_and_aliases({"embed": embedding, "proj": embedding, "a": block, "b": block})
    >>> list(names), aliases
    (['embed', 'a.w'], {'proj': 'embed', 'b.w': 'a.w'})
    """
    found, revisits = _walk_model(model)
    return found, _aliases(found, revisits)


_MOST_ALIASES: Final = 10_000


def _walk_model(model: object) -> tuple[dict[str, Weight[Any, Any]], list[tuple[str, str]]]:
    found: dict[str, Weight[Any, Any]] = {}
    seen: dict[int, str] = {}
    revisits: list[tuple[str, str]] = []
    held_by_code: list[tuple[str, object]] = []
    _walk([("", model)], found, seen, revisits, held_by_code)  # what data holds: its names as before code was walked
    _walk(sorted(held_by_code, key=_private), found, seen, revisits, None)  # then what code holds, public first
    return found, revisits


def _aliases(found: dict[str, Weight[Any, Any]], revisits: list[tuple[str, str]]) -> dict[str, str]:
    """The paths that ``revisits`` (a path, and the first path of the same
    weight or container) open to named weights: a path under a revisited
    container's first path, with that prefix replaced by the revisit's."""
    again: dict[str, list[str]] = {}
    for path, first in revisits:
        if path != first and not path.startswith(first + ".") and first:  # (under its own first path: a cycle)
            again.setdefault(first, []).append(path)
    target = {name: name for name in found}
    aliases: dict[str, str] = {}
    todo = list(found)[::-1]
    while todo and len(aliases) < _MOST_ALIASES:
        path = todo.pop()
        parts = path.split(".")
        for cut in range(1, len(parts) + 1):
            first = ".".join(parts[:cut])
            for other in again.get(first, ()):
                alias = other + path[len(first) :]
                if alias not in target and len(aliases) < _MOST_ALIASES:
                    target[alias] = aliases[alias] = target[path]
                    todo.append(alias)
    return aliases


def _walk(
    start: list[tuple[str, object]],
    found: dict[str, Weight[Any, Any]],
    seen: dict[int, str],
    revisits: list[tuple[str, str]],
    defer: list[tuple[str, object]] | None,
) -> None:
    """Name the weights below ``start``, depth first; code met is put in
    ``defer``, or (None) walked too: a bound method as its object and an
    operation as its function, each named once where first met. A weight or
    a container met again goes to ``revisits``, with the path it was met at
    first (`seen`)."""
    stack = start[::-1]
    while stack:
        name, node = stack.pop()
        while defer is None and type(node) in (types.MethodType, Operation):
            node = node.__self__ if type(node) is types.MethodType else node.__wrapped__  # type: ignore[attr-defined]
        if id(node) in seen:
            revisits.append((name, seen[id(node)]))
            continue
        if isinstance(node, Weight):
            seen[id(node)] = name
            if name in found:  # (the checkpoint would keep one of them, and load it into one)
                raise CheckpointError(
                    f"two weights have the name {name!r} (a key with a dot, or 0 and '0'): rename a key, so that "
                    "each weight has a name of its own"
                )
            found[name] = node
            continue
        if defer is not None and isinstance(node, _CODE):
            defer.append((name, node))
            continue
        if defer is None and _large(node):
            continue  # (a data set a loss closes over: seconds to walk, and no weights)
        children = _children(node)
        if children is None:
            continue
        seen[id(node)] = name  # cycles (a child pointing back at its parent) end here
        stack.extend(reversed([(f"{name}.{key}" if name else str(key), child) for key, child in children]))


def _large(node: object) -> bool:
    """A container of more items than `_LARGEST_HELD_BY_CODE` (walked where data holds it, not code)."""
    if type(node) is np.ndarray:
        return node.dtype == object and node.size > _LARGEST_HELD_BY_CODE
    return isinstance(node, (list, tuple, Mapping, MutableSequence, ValuesView)) and len(node) > _LARGEST_HELD_BY_CODE


def _private(entry: tuple[str, object]) -> bool:
    return any(part.startswith("_") for part in entry[0].split("."))


def _children(node: object) -> Iterable[tuple[object, object]] | None:
    if type(node) is np.ndarray and node.dtype == object:  # (an array of objects: by flat index)
        return [(i, x) for i, x in enumerate(node.flat) if x is not None and not isinstance(x, _LEAVES)]
    if isinstance(node, _OPAQUE) or node is None:
        return None
    if isinstance(node, Mapping):
        return [(k, v) for k, v in node.items() if v is not None and not isinstance(v, _LEAVES)]
    if isinstance(node, (set, frozenset)):
        if any(isinstance(item, Weight) for item in node):
            raise CheckpointError("weights in a set have no stable name: keep them in a list or a dict")
        return None
    if isinstance(node, tuple) and hasattr(node, "_fields"):
        return list(zip(node._fields, node))
    if isinstance(node, (list, tuple, MutableSequence, ValuesView)):  # (a deque too, and a dict's values)
        return [(i, x) for i, x in enumerate(node) if x is not None and not isinstance(x, _LEAVES)]
    if dataclasses.is_dataclass(node):
        return [(f.name, getattr(node, f.name)) for f in dataclasses.fields(node) if hasattr(node, f.name)]
    if isinstance(node, (types.FunctionType, functools.partial)):
        return _held_by_code(node)
    attributes: dict[str, object] = dict(getattr(node, "__dict__", {}))
    for cls in type(node).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for slot in (slots,) if isinstance(slots, str) else slots:
            if slot not in ("__dict__", "__weakref__") and slot not in attributes and hasattr(node, slot):
                attributes[slot] = getattr(node, slot)
    for cls in type(node).__mro__[:-1]:  # (a weight its class holds, as `self.name` reads it; not object's)
        for key, value in vars(cls).items():
            # (a weight only: a class's list or dict may be a registry of every instance, other models' too)
            if type(value) is Weight and key not in attributes:
                attributes[key] = value
    return list(attributes.items()) or None


def _held_by_code(f: object) -> Iterable[tuple[object, object]] | None:
    """What a function or a partial holds, by the names its code reads (not a
    module's globals: those belong to the module)."""
    if isinstance(f, functools.partial):
        return [("func", f.func), *enumerate(f.args), *f.keywords.items()]
    assert isinstance(f, types.FunctionType)
    code = f.__code__
    held: list[tuple[object, object]] = []
    for name, cell in zip(code.co_freevars, f.__closure__ or ()):
        try:
            held.append((name, cell.cell_contents))
        except ValueError:  # (a cell not yet filled)
            continue
    positional = code.co_varnames[: code.co_argcount]
    held += zip(positional[len(positional) - len(f.__defaults__ or ()) :], f.__defaults__ or ())
    held += (f.__kwdefaults__ or {}).items()
    return held or None
