"""Every weight a model holds, by a stable dotted name: what a checkpoint
stores them under (`monadl.checkpoint`) and how data parallelism finds and
orders them on every rank (`monadl.distributed`)."""

from __future__ import annotations

import array
import dataclasses
import functools
import types
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, MutableSequence, ValuesView
from typing import Any, Final

import numpy as np

from monadl.errors import CheckpointError
from monadl.layers import Layer, Weight
from monadl.layers._operation import Operation

__all__ = ["ModelWrapper", "named_weights", "named_weights_and_aliases"]


class ModelWrapper(ABC):
    """An object that trains a model on the model's behalf (`monadl.distributed.DataParallel`):
    walked as its `model`, so that ``ml.save(path, wrapper)`` writes the
    model's own names and ``ml.load(path, wrapper)`` reads them, and a
    checkpoint moves between the wrapped model and the plain one as it is.
    (PyTorch's DDP prefixes every name with ``module.``, so its checkpoints
    load into the plain model only once the prefix is stripped.)"""

    __slots__ = ()

    @property
    @abstractmethod
    def model(self) -> object:
        """The model, as it was given."""


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
    Built layers are not walked into, nor a module's globals; a
    `ModelWrapper` (a `monadl.distributed.DataParallel`) is walked as the
    model it wraps, under the same names. The walk is
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
    return _walk_model(model).found


def named_weights_and_aliases(model: object) -> tuple[dict[str, Weight[Any, Any]], dict[str, str], int]:
    """`named_weights`, and every other path by which ``model`` reaches a
    named weight (its aliases: a tied embedding's ``proj`` for ``embed``, or
    each weight of a block held in two places), each mapped to the weight's
    name, so that a checkpoint loads into a model that reaches the weight by
    another of its paths first, or by two weights of its own (untied); and
    how many such paths were left out (0: none).

    The paths are the walk's own, key by key (a dict key with a dot in it
    is one key: ``{"a.b": ...}`` is not under ``"a"``), in the order the
    walk meets them. A path that runs round a cycle is none. The shortest
    are made first, and no more past 100,000 aliases or 1,000,000
    characters of them (a chain of blocks each shared twice has
    exponentially many paths, and blocks that each point at the one before
    quadratically many, ever longer): the paths left out are counted. A
    model that reaches no object twice has none, for no work.

    >>> import numpy as np, monadl as ml
    >>> embedding = ml.Weight(np.ones((5, 3)))
    >>> block = {"w": ml.Weight(np.ones(3))}
    >>> names, aliases, left_out = named_weights_and_aliases({"embed": embedding, "proj": embedding, "a": block, "b": block})
    >>> list(names), aliases, left_out
    (['embed', 'a.w'], {'proj': 'embed', 'b.w': 'a.w'}, 0)
    """
    walk = _walk_model(model)
    return walk.found, *_aliases(walk)


_MOST_ALIASES: Final = 100_000
_MOST_ALIAS_TEXT: Final = 1_000_000
"""Characters of aliases and the names they stand for: a checkpoint's header grows by about this much at most."""


@dataclasses.dataclass(slots=True)
class _Walk:
    """What a walk met: the weights by name, each object's first path
    (``seen``), each object met first under a container as its key and its
    position among the container's children (``tree``: its parent's id, the
    key, the position), and each object met again where it does not close a
    cycle (``again``: the container's id, the key, the position, the
    object's id)."""

    found: dict[str, Weight[Any, Any]] = dataclasses.field(default_factory=dict)
    seen: dict[int, str] = dataclasses.field(default_factory=dict)
    tree: dict[int, tuple[int | None, str, int]] = dataclasses.field(default_factory=dict)
    again: list[tuple[int, str, int, int]] = dataclasses.field(default_factory=list)


_Entry = tuple[str, object, "int | None", str, int]  # (name, object, parent's id, key, position)


def _walk_model(model: object) -> _Walk:
    walk = _Walk()
    held_by_code: list[_Entry] = []
    _walk([("", model, None, "", 0)], walk, held_by_code)  # what data holds: its names as before code was walked
    _walk(sorted(held_by_code, key=_private), walk, None)  # then what code holds, public first
    return walk


_Path = tuple[
    "_Path | None", str, int, int, bool
]  # (the path it extends, key, position, object's id, all first visits)


def _aliases(walk: _Walk) -> tuple[dict[str, str], int]:
    """The paths other than its name by which the walk reaches each named
    weight, shortest first (breadth first, over the objects' first visits
    and their visits again), and how many are left out past the limits."""
    if not walk.again:
        return {}, 0
    children: dict[int, list[tuple[str, int, int, bool]]] = {}
    root = None
    for child, (parent, key, position) in walk.tree.items():
        if parent is None:
            root = child
        else:
            children.setdefault(parent, []).append((key, position, child, True))
    for parent, key, position, child in walk.again:
        children.setdefault(parent, []).append((key, position, child, False))
    names = {id(weight): name for name, weight in walk.found.items()}
    taken = set(walk.found)
    made: list[tuple[tuple[int, ...], str, str]] = []
    text = explored = spelt_alike = 0
    if root is None:
        return {}, 0
    level: list[_Path] = [(None, "", 0, root, True)]
    full = False
    while level and not full:
        following: list[_Path] = []
        for entry in level:
            for key, position, child, first in children.get(entry[3], ()):
                path: _Path = (entry, key, position, child, entry[4] and first)
                if not path[4]:
                    explored += 1
                    if explored > 2 * _MOST_ALIASES:
                        full = True
                        break
                    name = names.get(child)
                    if name is not None:
                        keys, positions = _spell(path)
                        alias = ".".join(keys)
                        if alias in taken:  # (a name, or a shorter path, spelt the same: the name keeps it)
                            spelt_alike += 1
                            continue
                        text += len(alias) + len(name)
                        if len(made) == _MOST_ALIASES or text > _MOST_ALIAS_TEXT:
                            full = True
                            break
                        taken.add(alias)
                        made.append((positions, alias, name))
                if child in children:
                    following.append(path)
            if full:
                break
        level = following
    made.sort()
    aliases = {alias: name for _, alias, name in made}
    if not full:
        return aliases, 0
    return aliases, max(_count_paths(root, children, names) - len(aliases) - spelt_alike, 1)


def _spell(path: _Path) -> tuple[list[str], tuple[int, ...]]:
    keys, positions = [], []
    at: _Path | None = path
    while at is not None and at[0] is not None:
        keys.append(at[1])
        positions.append(at[2])
        at = at[0]
    return keys[::-1], tuple(positions[::-1])


def _count_paths(root: int, children: dict[int, list[tuple[str, int, int, bool]]], names: dict[int, str]) -> int:
    """How many paths other than its name reach each named weight, all
    together: counted, not made (in topological order; what only a cycle
    through code reaches, which the walk cannot tell from data, is not
    counted)."""
    incoming: dict[int, int] = {}
    for edges in children.values():
        for _, _, child, _ in edges:
            incoming[child] = incoming.get(child, 0) + 1
    ways = {root: 1}
    ready = [root]
    while ready:
        node = ready.pop()
        for _, _, child, _ in children.get(node, ()):
            ways[child] = ways.get(child, 0) + ways[node]
            incoming[child] -= 1
            if not incoming[child]:
                ready.append(child)
    return sum(ways.get(weight, 1) - 1 for weight in names)


def _walk(start: list[_Entry], walk: _Walk, defer: list[_Entry] | None) -> None:
    """Name the weights below ``start``, depth first; code met is put in
    ``defer``, or (None) walked too: a bound method as its object and an
    operation as its function, each named once where first met. A weight or
    a container met again is recorded in ``walk.again``, unless it is one
    the path it is met at runs through (a cycle)."""
    found, seen, tree = walk.found, walk.seen, walk.tree
    stack = start[::-1]
    while stack:
        name, node, parent, key, position = stack.pop()
        while isinstance(node, ModelWrapper):
            node = node.model
        while defer is None and type(node) in (types.MethodType, Operation):
            node = node.__self__ if type(node) is types.MethodType else node.__wrapped__  # type: ignore[attr-defined]
        if id(node) in seen:
            if parent is not None and not _above(id(node), parent, tree):
                walk.again.append((parent, key, position, id(node)))
            continue
        if isinstance(node, Weight):
            seen[id(node)] = name
            tree[id(node)] = (parent, key, position)
            if name in found:  # (the checkpoint would keep one of them, and load it into one)
                raise CheckpointError(
                    f"two weights have the name {name!r} (a key with a dot, or 0 and '0'): rename a key, so that "
                    "each weight has a name of its own"
                )
            found[name] = node
            continue
        if defer is not None and isinstance(node, _CODE):
            defer.append((name, node, parent, key, position))
            continue
        if defer is None and _large(node):
            continue  # (a data set a loss closes over: seconds to walk, and no weights)
        children = _children(node)
        if children is None:
            continue
        seen[id(node)] = name  # cycles (a child pointing back at its parent) end here
        tree[id(node)] = (parent, key, position)
        here = id(node)
        entries = []
        for i, (k, child) in enumerate(children):
            text = str(k)
            entries.append((f"{name}.{text}" if name else text, child, here, text, i))
        stack.extend(reversed(entries))


def _above(node: int, under: int, tree: dict[int, tuple[int | None, str, int]]) -> bool:
    """Whether ``node`` is ``under`` or a container above it (a path from it back to it: a cycle)."""
    at: int | None = under
    while at is not None:
        if at == node:
            return True
        at = tree[at][0]
    return False


def _large(node: object) -> bool:
    """A container of more items than `_LARGEST_HELD_BY_CODE` (walked where data holds it, not code)."""
    if type(node) is np.ndarray:
        return node.dtype == object and node.size > _LARGEST_HELD_BY_CODE
    return isinstance(node, (list, tuple, Mapping, MutableSequence, ValuesView)) and len(node) > _LARGEST_HELD_BY_CODE


def _private(entry: _Entry) -> bool:
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
