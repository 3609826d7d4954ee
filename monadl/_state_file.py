"""An optimizer state's tree as a checkpoint holds it: its structure and its
numbers as JSON, in the manifest, its arrays beside the weights' in the
safetensors file (`encode`), and back, in the shape of the model's own state
(`decode`), and the names of its arrays in the file (`arrays_of`, what a
load reads of it); an array's way into the file (`put`) and out of it, into the
model's array library (`to_library`); and what a state may be at all
(`unstorable`, which a weight asks of its optimizer's state when ``init``
makes it and at each step, not at the first save)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final, Literal

import numpy as np

from monadl._namespace import is_array, library_name, namespace
from monadl.errors import CheckpointError

__all__ = ["STATE_RULE", "arrays_of", "decode", "encode", "put", "to_library", "unstorable"]


def put(tensors: dict[str, Any], key: str, value: Any) -> None:
    if key in tensors:
        raise CheckpointError(f"save: two arrays would be stored under the name {key!r}; rename one of them")
    # C order: safetensors writes an array's memory as it lies, so a transposed
    # (Fortran-ordered) array would come back scrambled. (Not ascontiguousarray:
    # it makes a 0-d array 1-d.)
    # Native byte order: safetensors stores little-endian, and a digest of big-endian bytes would not match.
    array = np.asarray(_to_host(value), order="C")
    tensors[key] = array if array.dtype.isnative else array.astype(array.dtype.newbyteorder("="))


def _to_host(value: Any) -> Any:
    if isinstance(value, (np.ndarray, np.generic)):
        return np.asarray(value)
    if library_name(value) == "cupy":
        return value.get()  # CuPy refuses implicit host copies, so ask for one
    return np.from_dlpack(value)


STATE_RULE: Final = (
    "a state is stored as None, a number, an array, or a tuple or NamedTuple of these (an optimizer of your own: "
    "make its state one; a NamedTuple's arrays shaped like the weight also step row by row for an embedding's rows)"
)
"""What an optimizer's state may be, in the words of every refusal of one."""


def _kind(state: Any) -> Literal["none", "number", "tuple", "array"] | None:
    """How a checkpoint stores ``state`` itself (a tuple: its items, each so);
    None where it cannot (a dict, a list, a dataclass, a str)."""
    if state is None:
        return "none"
    if type(state) in (bool, int, float):  # exactly: np.float64 is a float too, and goes with the arrays
        return "number"
    if isinstance(state, tuple):
        return "tuple"
    if isinstance(state, np.generic) or hasattr(state, "shape"):
        return "array"
    return None


def _labels(state: tuple[Any, ...]) -> list[str]:
    fields = getattr(state, "_fields", None)
    return [f".{f}" for f in fields] if fields is not None else [f"[{i}]" for i in range(len(state))]


def _storable(state: Any) -> bool:
    """Whether a checkpoint can store every part of ``state`` (`_kind`'s rule, with no names)."""
    if state is None or type(state) is np.ndarray:
        return True
    if isinstance(state, tuple):
        return all(map(_storable, state))
    return _kind(state) is not None


def unstorable(state: Any, key: str) -> str | None:
    """Where in ``state`` (named ``key``) lies the first part a checkpoint
    cannot store, and its type; None where every part can be.

    >>> unstorable((np.zeros(2), {"count": 0}), "state"), unstorable((None, 3, np.float32(1)), "state")
    ("dict at 'state[1]'", None)
    """
    if _storable(state):  # (every step checks its state: the places are named only for a refusal)
        return None
    pending = [(state, key)]
    while pending:
        part, where = pending.pop()
        kind = _kind(part)
        if kind is None:
            return f"{type(part).__name__} at {where!r}"
        if kind == "tuple":
            pending.extend(reversed([(s, where + label) for s, label in zip(part, _labels(part))]))
    return None


def encode(state: Any, key: str, tensors: dict[str, Any]) -> Any:
    """The JSON form of an optimizer state; its arrays go to ``tensors``."""
    kind = _kind(state)
    if kind == "none":
        return {"kind": "none"}
    if kind == "number":
        return {"kind": type(state).__name__, "value": state}
    if kind == "tuple":
        items = [encode(s, key + label, tensors) for s, label in zip(state, _labels(state))]
        return {"kind": "tuple", "type": type(state).__name__, "items": items}
    if kind == "array":
        put(tensors, key, state)
        return {"kind": "array", "tensor": key, "scalar": isinstance(state, np.generic)}
    raise CheckpointError(f"save: cannot store optimizer state of type {type(state).__name__} at {key!r}: {STATE_RULE}")


def to_library(array: Any, like: Any) -> Any:
    """``array`` (NumPy, from the file) in the array library of ``like``."""
    if isinstance(like, (np.ndarray, np.generic, float, int)):
        return array
    return namespace(like).asarray(array)


def decode(node: Any, like: Any, tensors: Mapping[str, Any], where: str) -> Any:
    """The saved optimizer state ``node`` rebuilt in the shape of ``like``,
    the model's own state (whose NamedTuple classes it reuses)."""
    kind = node["kind"]
    if kind == "tuple":
        items = node["items"]
        if not isinstance(like, tuple) or type(like).__name__ != node["type"] or len(like) != len(items):
            found = f"{type(like).__name__} of {len(like)}" if isinstance(like, tuple) else type(like).__name__
            raise CheckpointError(
                f"{where}: the checkpoint has {node['type']} of {len(items)}, the model's optimizer has {found} "
                "(was the weight built with the same optimizer?)"
            )
        parts = [decode(n, s, tensors, where + label) for n, s, label in zip(items, like, _labels(like))]
        return type(like)(*parts) if hasattr(like, "_fields") else tuple(parts)
    if kind == "array":
        array = tensors[node["tensor"]]
        if not isinstance(like, (np.generic, float, int)) and not is_array(like):
            raise CheckpointError(
                f"{where}: the checkpoint has an array, the model's optimizer has {type(like).__name__} "
                "(was the weight built with the same optimizer?)"
            )
        if node["scalar"] and isinstance(like, (np.ndarray, np.generic)):
            return array[()]
        return to_library(array, like)
    if kind == "none":
        return None
    return node["value"]


def arrays_of(node: Any) -> list[str]:
    """The names of the arrays in the file of a saved optimizer state (its
    tree as `encode` wrote it in the manifest)."""
    pending = [node]
    names = []
    while pending:
        node = pending.pop()
        if node["kind"] == "array":
            names.append(node["tensor"])
        elif node["kind"] == "tuple":
            pending.extend(node["items"])
    return names
