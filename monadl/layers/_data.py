"""A cell's data arguments while it is traced (`monadl.layers._tracing`).

An `monadl.operation` runs its function once per signature, on placeholders.
A NumPy data argument's placeholder is a `Data` view of it: it may meet
layers and be a primitive's parameter (an embedding's indices, an index
array in an index tuple), which each call then reads as its own. What the
trace would keep from the first call is refused with `OperandError`: NumPy
computation on it, its values read in Python (a branch, an int, an item),
methods that compute without a ufunc, and the argument taken as a plain
array (`check_kept`). Its shape and dtype may be read: they are part of the
signature (`monadl.layers._operation`), each its own trace. What NumPy
reads in C, past these hooks (a constant indexed by it, ``np.array(x)``),
is found by a second trace on other values (`monadl.layers._unread`).
"""

from __future__ import annotations

from typing import Any, Final, NoReturn, final

import numpy as np

from monadl.errors import OperandError
from monadl.layers._layer import Expr, Layer
from monadl.layers._site import site_text

__all__ = ["Data", "check_kept", "name_the_cell", "params_read", "take"]

_DATA_READ: Final = (
    "operation: a data argument of the cell went into a NumPy computation inside it; the trace would keep "
    "that computation's result from the first call for every later one: compute it before the call and pass "
    "the result, or compute it with monadl functions (for an operator, make the argument a layer first: "
    "ml.as_layer(x) * 2.0)"
)

_DATA_KEPT: Final = (
    "operation: a data argument of the cell was taken inside it as a plain array (np.asarray, .view), "
    "which the trace would keep from the first call for every later call: give the argument itself to "
    "monadl functions"
)

_VALUE_READ: Final = (
    "operation: the cell read the values of a data argument in Python (an item, int(), float(), bool(), "
    ".item(), .tolist(), iteration); the trace would keep the first call's values for every later call: pass "
    "what the cell branches on as an int, a string or another static argument (each value its own trace), "
    "or compute with monadl functions (its shape and dtype may be read: each its own trace)"
)

_INDEXED: Final = (
    "operation: the cell indexed or sliced a data argument (x[0], x[:, None]); inside a cell a data "
    "argument is whole, its values unread: index or reshape it before the call and pass the result (a "
    "mask for ml.where, indices), or make it a layer first where its values feed the computation "
    "(ml.as_layer(x)[:, None])"
)


def name_the_cell(exc: OperandError, name: str) -> None:
    """Put the operation's name into one of this module's refusals, raised
    while ``name`` was traced (a placeholder does not know its cell; a
    nested operation's own refusal already has its name)."""
    if exc.args and exc.args[0] in (_DATA_READ, _DATA_KEPT, _VALUE_READ, _INDEXED):
        exc.args = (exc.args[0].replace("operation:", f"operation {name}:", 1), *exc.args[1:])


def _refused(message: str) -> Any:
    """A method that raises ``message`` (`OperandError`) whatever it is given."""

    def refused(self: Any, *args: Any, **kwargs: Any) -> NoReturn:
        raise OperandError(message)

    return refused


@final
class Data(np.ndarray[Any, Any]):
    """A NumPy data argument while its cell is traced (see the module)."""

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        if any(isinstance(x, Expr) for x in inputs):
            return NotImplemented  # the layer's operator builds the layer
        raise OperandError(_DATA_READ)

    def __array_function__(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        raise OperandError(_DATA_READ)

    # Its values read in Python (a branch, an int, an index): the trace would keep the first call's.
    __iter__ = __bool__ = __int__ = __float__ = __complex__ = __index__ = _refused(_VALUE_READ)
    __getitem__ = _refused(_INDEXED)
    item = tolist = _refused(_VALUE_READ)
    flat = property(_refused(_VALUE_READ))
    # Methods that compute without a ufunc.
    dot = argmax = argmin = nonzero = _refused(_DATA_READ)

    def view(self, *args: Any, **kwargs: Any) -> Any:
        if args[:1] != (Data,) or len(args) > 1 or kwargs:  # (nested operations view a placeholder as itself)
            raise OperandError(_VALUE_READ)
        return super().view(Data)


def check_kept(leaves: list[Any], consts: list[Any], steps: list[Any]) -> None:
    """Refuse a constant or parameter of the traced ``steps`` that is a data
    argument's memory under another name (``np.asarray(d)``,
    ``d.view(np.ndarray)``): the trace would keep the first call's array.
    A nested operation's data arguments are its caller's placeholders: they
    are compared as plain arrays (a placeholder refuses NumPy's functions)."""
    data = [np.ndarray.view(x, np.ndarray) for x in leaves if isinstance(x, np.ndarray)]
    if not data:
        return
    kept = [c for c in consts if isinstance(c, np.ndarray)]
    for step in steps:
        for p in step.params:
            kept += [q for q in (p if type(p) is tuple else (p,)) if isinstance(q, np.ndarray) and type(q) is not Data]
    for k in kept:
        if any(np.may_share_memory(k, d) for d in data):
            raise OperandError(_DATA_KEPT)


def params_read(layer: Layer[Any, Any]) -> list[Any]:
    """A layer's parameters and the items of its tuple parameters (an
    index such as ``x[:, d]``), where a data argument may stand."""
    found: list[Any] = []
    for p in layer._params:
        found.append(p)
        if type(p) is tuple:
            found += p
    return found


def take(
    name: str, layer: Layer[Any, Any], p: Any, position: dict[int, int], slot: dict[int, int]
) -> int | tuple[int | None, ...] | None:
    """Where a traced parameter reads the call's data arguments (``position``:
    the placeholders' ids; ``slot``: their slots in the program): the slot of
    the one it is, a slot per item of a tuple holding some (an index), or
    None. A data argument deeper in a parameter is refused: the trace would
    keep the first call's array."""
    if id(p) in position:
        return slot[id(p)]
    if type(p) is tuple and any(id(q) in position for q in p):
        return tuple([slot[id(q)] if id(q) in position else None for q in p])
    if _holds_data(p):
        raise OperandError(
            f"operation {name}: a data argument is nested inside a parameter of the layer built at "
            f"{site_text(layer._site)}; the trace would keep the first call's array: pass it directly "
            "(an index array as an item of the index tuple, indices to ml.embedding)"
        )
    return None


def _holds_data(p: Any) -> bool:
    """Whether a parameter holds a data argument's placeholder anywhere inside it."""
    if type(p) is Data:
        return True
    if type(p) in (tuple, list):
        return any(map(_holds_data, p))
    if type(p) is dict:
        return any(map(_holds_data, p.values()))
    return False
