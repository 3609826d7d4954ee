"""The rule for one operation's operands, and how messages show them.

One float dtype per operation, by one rule (PyTorch's): two float arrays of
different precision raise `DTypeError`; an integer or boolean array beside a
float one takes the float's dtype (NumPy alone would promote ``int64 *
float32`` to float64), as does a NumPy integer or bool scalar, and so does a float scalar (a NumPy float, an array
or weight of no dimensions: ``ml.Weight(0.0)`` as a float32 model's bias),
as PyTorch's 0-d tensors do. Beside no float array with dimensions, the
value of a layer or a weight is a tensor of no dimensions whatever its type
(``ml.sum``'s is a NumPy scalar, as NumPy's reductions give): it sets the
dtype of a NumPy float that is data, as PyTorch's 0-d tensor sets a Python
number's (``np.float64(0.3) * ml.sum(x)`` is float32 for a float32 ``x``);
two such tensors of different dtypes promote as NumPy (and PyTorch) does.
The runtime applies it to every node (`monadl.runtime.node.compute`, which
knows which operands are layers), a traced operation (`monadl.operation`)
to every step of its program (which steps are computed from the call's
layers and weights, `monadl.layers._program.Program`), and a batched group
to its members' operands (`member_float_dtype`), so marking a cell or
batching it changes no dtype and no error.

>>> import numpy as np
>>> [a.dtype for a in one_float_dtype("mul", (np.ones(2, np.float32), np.arange(2)), "f.py:3")]
[dtype('float32'), dtype('float32')]
>>> [a.dtype for a in one_float_dtype("add", (np.ones(2, np.float32), np.float64(1.0)), "f.py:3")]
[dtype('float32'), dtype('float32')]
>>> [a.dtype for a in one_float_dtype("mul", (np.ones(2, np.float32), np.int64(2)), "f.py:3")]
[dtype('float32'), dtype('float32')]
>>> [a.dtype for a in one_float_dtype("mul", (np.array(0.5, np.float32), np.arange(2)), "f.py:3")]
[dtype('float32'), dtype('float32')]
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any, Final, final

import numpy as np

from monadl._namespace import is_array, library_name, namespace
from monadl.errors import DTypeError

__all__ = [
    "NUMBERS",
    "Numbers",
    "as_dtype",
    "cast_numbers",
    "describe",
    "member_float_dtype",
    "number_dtype",
    "one_float_dtype",
    "step_numbers",
]

NUMBERS: Final = frozenset({float, int, bool})
"""The types of plain Python numbers."""

_WEAK: Final[dict[type, float | int | bool]] = {float: 0.0, int: 0, bool: False}
"""A plain number of each kind, as NumPy's promotion sees one ("weak": it
takes the dtype of the arrays beside it)."""

_HOLDS: Final[dict[type, type[np.generic]]] = {float: np.float64, int: np.int64, bool: np.bool_}
"""The host dtype that holds plain numbers of each kind (ints up to 64 bits)."""


def one_float_dtype(
    name: str,
    args: tuple[Any, ...],
    where: str | Callable[[], str] | None,
    tensors: Sequence[bool] | Callable[[], Sequence[bool]] | None = None,
) -> tuple[Any, ...]:
    """``args`` with integer and boolean arrays, and float scalars (NumPy
    floats, arrays of no dimensions) of another precision, cast to the float
    dtype of the others; `DTypeError` (naming ``name``, the operands and
    ``where``, or what it returns: a node's line is found only for an error;
    None: the caller's caller adds it) if two float arrays with dimensions
    differ. ``tensors`` (or what it returns, asked only where it decides):
    per operand, whether it is a layer's or a weight's value, a tensor
    whatever its type (a reduction's is a NumPy scalar, as NumPy's are);
    None: none is. Of float scalars alone, those of tensors and arrays of
    no dimensions (PyTorch's 0-d tensors) set the dtype, NumPy's promotion
    of theirs where they differ, for NumPy floats that are data (PyTorch's
    Python numbers); of NumPy floats alone, NumPy's promotion of theirs.

    >>> import numpy as np
    >>> [type(a) for a in one_float_dtype("mul", (np.float32(2.0), np.float64(0.3)), "f.py:3", (True, False))]
    [<class 'numpy.float32'>, <class 'numpy.float32'>]
    """
    first = None
    for a in args:
        if is_array(a) and a.ndim and namespace(a).isdtype(a.dtype, "real floating"):
            if first is None:
                first = a.dtype
            elif a.dtype != first:
                line = "" if where is None else f"; layer built at {where() if callable(where) else where}"
                raise DTypeError(
                    f"{name}: operands {describe(args)} mix {dtype_name(first)} and {dtype_name(a.dtype)} arrays; "
                    "cast one first (x.astype(dtype) in NumPy, xp.astype(x, dtype) in the array API)" + line
                )
    if first is None:  # no float array with dimensions: a float of none (a 0-d weight) sets it for integers
        flags = tensors() if callable(tensors) else tensors
        zero = [
            a
            for i, a in enumerate(args)
            if (flags is not None and flags[i] and isinstance(a, np.floating))
            or (not isinstance(a, np.generic) and is_array(a) and _real_float(a))
        ]
        if zero:  # (beside tensors, NumPy floats are numbers, as Python's are beside PyTorch's)
            first = zero[0].dtype
            if any(a.dtype != first for a in zero):
                first = namespace(zero[0]).result_type(*zero)
        else:
            floats = {a.dtype for a in args if isinstance(a, np.floating)}
            first = next(iter(floats)) if len(floats) == 1 else None
    if first is None or not any(map(_cast, args, (first,) * len(args))):
        return args  # (the same tuple: nothing to cast)
    return tuple([_as(a, first) if _cast(a, first) else a for a in args])


def member_float_dtype(
    values: Sequence[Any], stacked: Sequence[bool], scalars: Sequence[bool | None] | None
) -> Sequence[Any] | None:
    """A group's operands (``stacked``: which hold its members along a new
    first axis) cast as `one_float_dtype` casts each member's: an operand's
    dimensions are a member's (a stacked column of NumPy floats is a float
    scalar in each member, not a float64 array beside float32 ones).
    ``scalars``: per operand, whether its members are NumPy scalars that
    are data, numbers (True), or are tensors (a layer's or a weight's value,
    a NumPy scalar or not) or arrays (False), or None: unknown; for an
    operand not stacked, None reads its type (a NumPy scalar is a number).
    ``values`` itself where nothing is cast; None where a member would raise
    `DTypeError` (its members then run alone, and raise it at their lines),
    or where the dtype hangs on what is unknown: float scalars of several
    dtypes, some of them unknown.

    >>> import numpy as np
    >>> x, t = np.ones((2, 1, 3), np.float32), np.array([0.5, 2.0])  # two members' rows, their np.float64
    >>> [v.dtype for v in member_float_dtype((x, t), (True, True), (False, True))]
    [dtype('float32'), dtype('float32')]
    >>> [v.dtype for v in member_float_dtype((np.array(1.0, np.float32), t), (False, True), (None, True))]
    [dtype('float32'), dtype('float32')]
    """
    first = None
    scalar: list[tuple[Any, bool | None]] = []  # (floats of no dimensions in a member: dtype, NumPy's or not)
    for i, a in enumerate(values):
        dtype = getattr(a, "dtype", None)
        if getattr(dtype, "kind", None) != "f":
            continue
        if a.ndim > stacked[i]:
            if first is None:
                first = dtype
            elif dtype != first:
                return None
        elif first is None:
            number = None if scalars is None else scalars[i]
            if number is None and not stacked[i]:
                number = isinstance(a, np.generic)
            scalar.append((dtype, number))
    if first is None and scalar:
        dtypes = {d for d, _ in scalar}
        if len(dtypes) == 1:
            first = dtypes.pop()
        else:
            if any(number is None for _, number in scalar):
                return None
            # (a tensor's sets the numbers'; of several, as one member's: NumPy's promotion of them)
            floats = {d for d, number in scalar if not number} or dtypes
            first = next(iter(floats)) if len(floats) == 1 else np.result_type(*floats)
    if first is None:
        return values
    cast = [_as(a, first) if _member_cast(a, s, first) else a for a, s in zip(values, stacked)]
    return values if all(map(operator.is_, cast, values)) else tuple(cast)


def _member_cast(a: Any, s: bool, dtype: Any) -> bool:
    """`_cast` for a group's operand ``a`` (``s``: stacked)."""
    if not s:
        return _cast(a, dtype)
    kind = getattr(getattr(a, "dtype", None), "kind", None)
    return kind in ("i", "u", "b") or (kind == "f" and a.ndim == 1 and a.dtype != dtype)


def _cast(a: Any, dtype: Any) -> bool:
    """Whether operand ``a`` takes the float dtype ``dtype`` of the others: an
    integer or boolean array, or a float scalar of another precision."""
    if isinstance(a, np.floating):
        return bool(a.dtype != dtype)
    if isinstance(a, (np.integer, np.bool_)):  # (np.int64(2): as a Python 2, not a float64 promotion)
        return True
    if not is_array(a):
        return False
    xp = namespace(a)
    if xp.isdtype(a.dtype, ("integral", "bool")):
        return True
    return not a.ndim and bool(a.dtype != dtype) and bool(xp.isdtype(a.dtype, "real floating"))


def _real_float(a: Any) -> bool:
    return bool(namespace(a).isdtype(a.dtype, "real floating"))


def as_dtype(a: Any, dtype: Any) -> Any:
    """``a`` (an array or a NumPy scalar) in ``dtype``, as the rule casts it."""
    return _as(a, dtype)


def _as(a: Any, dtype: Any) -> Any:
    if isinstance(a, np.generic):
        return np.dtype(dtype).type(a)
    return namespace(a).astype(a, dtype)


SHOWN: Final = 12
"""How many operands a message shows (a concatenation of hundreds: the first
ones, how many more, and those of another shape)."""


def describe(args: Sequence[Any]) -> str:
    """Operands as a message shows them: ``float32[16, 64], float 2.0``; of
    more than `SHOWN`, the first ones and how many more of each kind.

    >>> describe([np.ones((120, 10))] + [np.ones((1, 4))] * 200)
    'float64[120, 10], float64[1, 4], float64[1, 4], float64[1, 4], float64[1, 4], float64[1, 4], float64[1, 4], float64[1, 4], float64[1, 4], float64[1, 4], float64[1, 4], float64[1, 4], ... and 189 more (189 float64[1, 4])'
    """
    if len(args) > SHOWN:
        rest: dict[str, int] = {}
        for text in _parts(args[SHOWN:]):
            rest[text] = rest.get(text, 0) + 1
        kinds = ", ".join(f"{n} {text}" for text, n in list(rest.items())[:SHOWN])
        more = ", ..." if len(rest) > SHOWN else ""
        return f"{', '.join(_parts(args[:SHOWN]))}, ... and {len(args) - SHOWN} more ({kinds}{more})"
    return ", ".join(_parts(args))


def _parts(args: Sequence[Any]) -> list[str]:
    parts = []
    for a in args:
        if isinstance(a, np.ndarray):
            parts.append(f"{a.dtype}{list(a.shape)}")
        elif isinstance(a, np.generic):
            parts.append(f"{a.dtype} scalar")
        elif is_array(a):
            parts.append(f"{library_name(a)} {dtype_name(a.dtype)}{list(a.shape)}")
        elif isinstance(a, tuple):  # (an operation node's several outputs, `Outputs`: their shapes, not values)
            # A cell given outputs of another cell's call has that call's node as its operand, and reads
            # the outputs inside (`monadl.layers._tracing`): said so, not as the tuple type.
            parts.append(f"outputs ({', '.join(_parts(a))}) of another operation's call")
        else:
            text = repr(a)
            parts.append(f"{type(a).__name__} {text if len(text) <= _REPR else text[: _REPR - 3] + '...'}")
    return parts


_REPR: Final = 60  # (the most of an object's repr a message shows)


def dtype_name(dtype: Any) -> str:
    """A dtype's short name: ``array_api_strict.float32`` -> ``float32``."""
    return str(dtype).rsplit(".", 1)[-1]


def number_dtype(operands: Sequence[tuple[Any, bool]], kinds: Sequence[type]) -> Any:
    """The dtype that plain Python numbers of ``kinds`` compute in beside
    ``operands`` (each other array operand's dtype, and whether it has
    dimensions), as in one node: `one_float_dtype`'s float dtype if it finds
    one, else NumPy's promotion, where the number takes the arrays' dtype;
    None where nothing decides it (no array: numbers alone compute as they
    are) or one node would raise (two float arrays with dimensions differ),
    and for a library whose dtypes NumPy does not know.

    >>> import numpy as np
    >>> number_dtype([(np.dtype("float32"), True)], [float]), number_dtype([(np.dtype("int64"), True)], [float])
    (dtype('float32'), dtype('float64'))
    >>> number_dtype([(np.dtype("int64"), True), (np.dtype("float32"), False)], [float])  # the 0-d float's
    dtype('float32')
    """
    try:
        dims = {d for d, has in operands if has and np.dtype(d).kind == "f"}
        if len(dims) > 1:
            return None
        if dims:
            return dims.pop()
        floats = {d for d, has in operands if np.dtype(d).kind == "f"}
        if len(floats) == 1:  # (no float with dimensions: a float of none sets it for integers)
            return floats.pop()
        return np.result_type(*[d for d, _ in operands], *[_WEAK[k] for k in kinds]) if operands else None
    except TypeError:
        return None


@final
class Numbers:
    """A group's plain numbers, one per member, as a host column (float64,
    int64 or bool) whose dtype is decided where each is used, as a Python
    number's is (`cast_numbers`): a node's group casts it once, an
    operation's program step by step (`monadl.layers._program.Program.batch`)."""

    __slots__ = ("kind", "values")

    def __init__(self, values: Sequence[Any], kind: type) -> None:
        self.kind = kind
        # (a Python int beyond int64 raises OverflowError: the members then group by value)
        self.values: np.ndarray[Any, Any] = np.asarray(values, dtype=_HOLDS[kind])

    def cast(self, dtype: Any, like: Any) -> Any:
        """The column in ``dtype`` and the array library of ``like``; None
        where an integer is not held exactly by ``dtype`` (the members then
        group by value, and each computes as it would alone)."""
        column = self.values.astype(dtype)
        if self.values.dtype.kind in "iu" and not np.array_equal(column, self.values):
            return None
        return namespace(like).asarray(column)


def cast_numbers(values: Sequence[Any], stacked: Sequence[bool]) -> tuple[Any, ...] | None:
    """``values`` (one node's or one step's operands; ``stacked``: which hold
    a group's members along a new first axis) with their `Numbers` cast to
    the dtype each member's number computes in beside the other operands
    (`number_dtype`); None where that cannot be: no array beside them (the
    numbers compute alone, as Python numbers), a dtype nothing decides, an
    integer it does not hold.

    >>> import numpy as np
    >>> x, n = np.ones((2, 1, 3), np.float32), Numbers([0.5, 2.0], float)
    >>> [v.dtype for v in cast_numbers([x, n], [True, True])]
    [dtype('float32'), dtype('float32')]
    """
    others: list[tuple[Any, bool]] = []
    kinds: list[type] = []
    like = None
    for v, lifted in zip(values, stacked):
        kind = type(v)
        if kind is Numbers:
            kinds.append(v.kind)
        elif kind in NUMBERS:
            kinds.append(kind)
        else:
            dtype = getattr(v, "dtype", None)
            if dtype is None:
                return None
            others.append((dtype, getattr(v, "ndim", 0) > lifted))  # (a member's dimensions)
            if like is None:
                like = v
    dtype = number_dtype(others, kinds)
    if dtype is None:
        return None
    cast = []
    for v in values:
        if type(v) is Numbers:
            v = v.cast(dtype, like)
            if v is None:
                return None
        cast.append(v)
    return tuple(cast)


def step_numbers(op: Any, values: Sequence[Any], stacked: Sequence[bool], n: int) -> Any:
    """An operation's step (its primitive ``op``) with a group's `Numbers`
    among its operands ``values``: the operands with them cast to the dtype
    each member's number computes in beside the others (`cast_numbers`); for
    a step of numbers only, its value as `Numbers`, member by member as one
    call computes it (Python's arithmetic, its errors and its ints); None
    where the group cannot batch so (the members then group by value): a
    step that is not elementwise, a dtype nothing decides, a value that is
    no plain number."""
    if not op.elementwise:
        return None
    if not all(type(v) is Numbers or type(v) in NUMBERS for v in values):
        return cast_numbers(values, stacked)
    columns = [v.values.tolist() if type(v) is Numbers else [v] * n for v in values]
    results = [op.rule(*members)[0] for members in zip(*columns)]
    kind = type(results[0])
    if kind not in NUMBERS or any(type(r) is not kind for r in results):
        return None
    return Numbers(results, kind)
