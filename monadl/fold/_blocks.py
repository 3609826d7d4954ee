"""The blocks of TF Fold (Looks et al. 2017, section 3), over monadl layers.

Array outputs are rows: a block's array for one input has a leading axis of
length 1 (`Scalar` gives shape ``(1,)``, ``Vector(n)`` gives ``(1, n)``), as
the per-node states of a model written by hand are, so the runtime's dynamic
batching stacks the rows of equal operations across nodes and inputs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Final, TypeVar, final

import numpy as np
import numpy.typing as npt
from typing_extensions import TypeVar as DefaultedTypeVar

from monadl.fold._block import Block, Build, Immediate, call
from monadl.fold._inputs import shown, unordered
from monadl.layers import ArrayLayer
from monadl.layers._layer import built_at
from monadl.layers._operation import Operation
from monadl.layers._primitives import AS_LAYER
from monadl.layers._site import caller_site

X = TypeVar("X")
Y = TypeVar("Y")
S = TypeVar("S")
V = DefaultedTypeVar("V", bound="Sequence[float] | npt.NDArray[Any]", default="Sequence[float]", contravariant=True)
"""A `Vector`'s input: a flat sequence of numbers unless its context (the
block before it in ``>>``) or an annotation says a NumPy array
(``Vector[npt.NDArray[np.float64]](2)``)."""

Real = float | np.floating[Any] | np.integer[Any]
"""A `Scalar`'s input: a Python number or a NumPy real scalar (``np.float32(1.0)``)."""


# ---- inputs to layers -----------------------------------------------------------------------------
REAL: Final = "iuf"
"""The NumPy dtype kinds of real numbers (integers, unsigned, floating) that
`Scalar` and `Vector` take; a bool is no number to them: a flag that reaches
a number block (a JSON ``true`` routed to the number case) is more often a
mistake than a feature, and ``float(flag)`` says it is meant."""


def _is_real(x: object) -> bool:
    """Whether ``x`` is one real number: an int, a float, a NumPy integer or
    floating scalar, a 0-d array of one; not a bool."""
    if isinstance(x, int | float | np.integer | np.floating):
        return not isinstance(x, bool)
    return isinstance(x, np.ndarray) and x.ndim == 0 and x.dtype.kind in REAL


def _hint(x: object) -> str:
    """What to do instead, for the inputs a number block is most often given
    by mistake (``x``: the input, or a sequence's numbers as an array)."""
    kind = x.dtype.kind if isinstance(x, np.ndarray | np.generic) else ""
    if isinstance(x, bool) or kind == "b":
        return "; for flags as numbers, convert them (float(flag), mask.astype(np.float32))"
    if isinstance(x, str) or kind == "U":
        return "; parse a number's text first (float(text))"
    if isinstance(x, np.ndarray) and x.ndim > 1:
        return "; np.ravel(x) if its numbers are one row"
    return ""


@final
class Scalar(Immediate[Real, ArrayLayer]):
    """A real number (an int, a float, a NumPy real scalar) as a constant
    layer of shape ``(1,)`` (no gradient). Anything else is refused with a
    `TypeError`: None, a bool, a string, a sequence (``Vector(n)``'s).

    >>> import anyio
    >>> anyio.run(Scalar("float64")(2).predict)
    array([2.])
    >>> Scalar()(None)
    Traceback (most recent call last):
    TypeError: Scalar('float32') takes a real number (an int, a float, a NumPy real scalar), and was given None
    monadl.fold: while building the call's input (None) with Scalar('float32')
    """

    __slots__ = ("_site", "dtype")
    _shown = ("dtype",)

    def __init__(self, dtype: npt.DTypeLike = np.float32) -> None:
        self.dtype = np.dtype(dtype)
        self._site = caller_site()  # (its rows' line: where it was made, found once, as `Function`'s)

    def _output(self, x: Real) -> ArrayLayer:
        if type(x) is not float and not _is_real(x):  # (the usual input first: a float)
            raise TypeError(
                f"{self!r} takes a real number (an int, a float, a NumPy real scalar), and was given {shown(x)}"
                + _hint(x)
            )
        try:
            return built_at(AS_LAYER, (np.array([x], self.dtype),), self._site)
        except OverflowError:  # (an int past every float: 10**400)
            raise ValueError(f"{self!r} was given {shown(x)}, past the largest {self.dtype}") from None


@final
class Vector(Immediate[V, ArrayLayer]):
    """Exactly ``size`` real numbers, in a flat sequence or a 1-D array, as a
    constant row of shape ``(1, size)``. A nested list or an array of another
    shape is refused, an ``(n, 1)`` or ``(1, n)`` array included: taking any
    shape of ``n`` numbers would flatten a ``(2, 2)`` matrix into
    ``Vector(4)`` without a word, and a list of lists is refused likewise;
    ``np.ravel(x)`` says a column is meant as a row. Numbers NumPy does not
    infer as real (strings, None, a list of bools: see `Scalar`) are
    refused with a `TypeError`, a wrong count or shape with a `ValueError`.
    mypy types its input from the context: a sequence of numbers alone, an
    array after a block that gives one (``InputTransform(one_hot) >>
    Vector(10)``), or as annotated (``Vector[npt.NDArray[Any]](10)``).

    >>> import anyio
    >>> anyio.run(Vector(2, "float64")([1, 2]).predict)
    array([[1., 2.]])
    >>> Vector(2)([[1.0, 2.0]])
    Traceback (most recent call last):
    ValueError: Vector(2) takes 2 real numbers in a flat sequence or a 1-D array, and was given [[1.0, 2.0]] (a list) of shape (1, 2); np.ravel(x) if its numbers are one row
    monadl.fold: while building the call's input (a list) with Vector(2, 'float32')
    """

    __slots__ = ("_site", "dtype", "size")
    _shown = ("size", "dtype")

    def __init__(self, size: int, dtype: npt.DTypeLike = np.float32) -> None:
        self.size = size
        self.dtype = np.dtype(dtype)
        self._site = caller_site()

    def _output(self, x: V) -> ArrayLayer:
        given: object = x
        try:
            numbers = np.asarray(x)  # (its dtype as NumPy infers it: a string or a None is no number then)
        except ValueError:  # (a ragged nesting)
            numbers = np.asarray(None)
        if numbers.ndim != 1 or numbers.dtype.kind not in REAL:
            takes = f"Vector({self.size}) takes {self.size} real numbers in a flat sequence or a 1-D array"
            if numbers.dtype.kind not in REAL or numbers.ndim == 0:
                raise TypeError(f"{takes}, and was given {shown(x)}{_hint(numbers)}")
            shape = "" if isinstance(given, np.ndarray) else f" of shape {numbers.shape}"  # (an array's: shown)
            raise ValueError(f"{takes}, and was given {shown(x)}{shape}{_hint(numbers)}")
        if len(numbers) != self.size:
            n = len(numbers)
            raise ValueError(f"Vector({self.size}) was given {n} number{'s' * (n != 1)}: {shown(x)}")
        return built_at(AS_LAYER, (numbers.astype(self.dtype, copy=False).reshape(1, self.size),), self._site)


@final
class Zeros(Immediate[object, ArrayLayer]):
    """Zeros of shape ``(1, *shape)`` whatever the input (an initial state).

    >>> import anyio
    >>> anyio.run(Zeros((2,), "float64")(None).predict)
    array([[0., 0.]])
    """

    __slots__ = ("_site", "dtype", "shape")
    _shown = ("shape", "dtype")

    def __init__(self, shape: tuple[int, ...], dtype: npt.DTypeLike = np.float32) -> None:
        self.shape = shape
        self.dtype = np.dtype(dtype)
        self._site = caller_site()

    def _output(self, x: object) -> ArrayLayer:
        return built_at(AS_LAYER, (np.zeros((1, *self.shape), self.dtype),), self._site)


# ---- functions ----------------------------------------------------------------------------------
@final
class Function(Immediate[X, Y]):
    """A Python function over layers (a cell using weights, a loss), built
    as one `monadl.operation`: traced once per signature, one node of the
    graph per input, batched as a unit.

    >>> import anyio, monadl as ml
    >>> scale = ml.Weight(np.array([2.0]))
    >>> anyio.run((Scalar("float64") >> Function(lambda x: x * scale))(3.0).predict)
    array([6.])
    """

    __slots__ = ("_call", "_cell", "f")
    _shown = ("f",)

    def __init__(self, f: Callable[[X], Y]) -> None:
        # Its nodes are built where the block is made, the user's line an
        # error names: the frames above a node are the runner's, as deep as
        # the input, and not walked per node.
        operation = Operation(f, caller_site())
        self.f: Callable[[X], Y] = operation
        self._cell = operation
        # (the runner calls a bound method: per node, without the lookup that calling an instance makes)
        self._call: Callable[[X], Y] = operation.__call__

    def _output(self, x: X) -> Y:
        return self._call(x)

    def _function(self) -> Callable[[X], Y]:
        return self._call


@final
class InputTransform(Immediate[X, Y]):
    """Plain Python pre-processing of an input (Fold's ``InputTransform``):
    its function builds no operation of the graph, so it reads as the
    boundary between data and network. (Given layers, it hands them to its
    function as they are: `Identity` passes them on unchanged.)

    >>> InputTransform(str.upper)("tree")
    'TREE'
    """

    __slots__ = ("f",)
    _shown = ("f",)

    def __init__(self, f: Callable[[X], Y]) -> None:
        self.f = f

    def _output(self, x: X) -> Y:
        return self.f(x)

    def _function(self) -> Callable[[X], Y]:
        return self.f


@final
class Identity(Immediate[X, X]):
    """Its input as it is (data or layers): the field of a `Record` that
    passes the state of a `Fold`'s step through to the cell.

    >>> Identity[str]()("tree")
    'tree'
    """

    __slots__ = ()
    _shown = ()

    def _output(self, x: X) -> X:
        return x


# ---- sequences ----------------------------------------------------------------------------------
def _elements(block: Block[Any, Any], xs: Iterable[X]) -> Iterator[X]:
    """An iterator over a sequence block's input; anything else (None, a
    number) refused naming the block, where Python's own error names
    neither it nor the input. So are a mapping (its iterator gives its keys
    alone: a JSON object sent to a list's case by mistake would be read as
    its keys) and a set (its order is its hashes')."""
    kind = type(xs)
    if kind is not list and kind is not tuple:  # (the common inputs: no checks for them)
        why = unordered(xs)
        if why is not None:
            raise TypeError(f"{block!r} takes a sequence, and was given {shown(xs)}, {why}")
    try:
        return iter(xs)
    except TypeError:
        raise TypeError(f"{block!r} takes a sequence, and was given {shown(xs)}") from None


@final
class Map(Block[Sequence[X], list[Y]]):
    """A block applied to each element of a sequence.

    >>> Map(InputTransform(len))(["a", "bcd"])
    [1, 3]
    """

    __slots__ = ("block",)
    _shown = ("block",)

    def __init__(self, block: Block[X, Y]) -> None:
        self.block = block

    def _build(self, xs: Sequence[X]) -> Build[list[Y]]:
        ys = []
        for x in _elements(self, xs):
            ys.append((yield from call(self.block, x)))
        return ys

    def _step(self, build: Mapping[str, Any]) -> str:
        return f"[{len(build['ys'])}]"


@final
class Fold(Block[Sequence[X], S]):
    """A left fold: ``step((... step((init, x0), x1) ...), xn)``, an RNN over
    the sequence when ``step`` is a cell; ``init`` is built from ``None``.

    >>> Fold(InputTransform(lambda sx: sx[0] * 10 + sx[1]), InputTransform(lambda _: 0))([1, 2, 3])
    123

    The step is given ``(state, element)`` as they are: the state a layer,
    the element the sequence's raw item. An RNN's step is then a `Record`
    that passes the state through (`Identity`, its type named) and makes
    the element a row, composed with the cell over both layers:

    >>> import anyio, monadl as ml
    >>> from monadl.fold import Record
    >>> w = ml.Weight(np.eye(2) * 0.5)
    >>> def cell(state_x: tuple[ml.ArrayLayer, ml.ArrayLayer]) -> ml.ArrayLayer:
    ...     state, x = state_x
    ...     return ml.tanh(state @ w + x)
    >>> step = Record(Identity[ml.ArrayLayer](), Vector(2, "float64")) >> Function(cell)
    >>> rnn = Fold(step, Zeros((2,), "float64"))
    >>> anyio.run(rnn([[1.0, 0.0], [0.0, 1.0]]).predict).round(6)
    array([[0.363399, 0.761594]])

    mypy types ``S``, the state, from both blocks. Its error ``Cannot infer
    value of type parameter "S" of "Fold"`` means that no one type fits
    both: ``init``'s output is not the state that ``step`` takes (the first
    field of its input) and returns, or the step's fields are swapped (the
    state comes first). ``reveal_type(step)`` and ``reveal_type(init)``
    show which.
    """

    __slots__ = ("init", "step")
    _shown = ("step", "init")

    def __init__(self, step: Block[tuple[S, X], S], init: Block[None, S]) -> None:
        self.step = step
        self.init = init

    def _build(self, xs: Sequence[X]) -> Build[S]:
        elements = _elements(self, xs)
        state = yield from call(self.init, None)
        for _i, x in enumerate(elements):  # (``_i``: for `_step`)
            state = yield from call(self.step, (state, x))
        return state

    def _step(self, build: Mapping[str, Any]) -> str:
        return f"[{build['_i']}]" if "_i" in build else "<init of Fold>"


@final
class Reduce(Block[Sequence[Y], Y]):
    """A balanced reduction of a non-empty sequence with a binary block:
    neighbours are joined level by level (an odd last one waits for the next
    level), so the depth is log n and each level's joins batch together.

    >>> Reduce(InputTransform(lambda ab: f"({ab[0]} {ab[1]})"))("abcde")
    '(((a b) (c d)) e)'
    """

    __slots__ = ("block",)
    _shown = ("block",)

    def __init__(self, block: Block[tuple[Y, Y], Y]) -> None:
        self.block = block

    def _build(self, xs: Sequence[Y]) -> Build[Y]:
        level = list(_elements(self, xs))
        if not level:
            raise ValueError(
                f"{self!r} joins one or more elements, and was given {shown(xs)}; an input that may be empty "
                "needs a case of its own (a OneOf on its length, with Zeros for none)"
            )
        _n, width = len(level), 1  # (an element of ``level`` joins ``width`` of the input's: `_step` reads them)
        while len(level) > 1:
            joined = []
            for i in range(0, len(level) - 1, 2):
                joined.append((yield from call(self.block, (level[i], level[i + 1]))))
            level = joined + level[len(level) - len(level) % 2 :]
            width *= 2
        return level[0]

    def _step(self, build: Mapping[str, Any]) -> str:
        """The input's elements the failing join joins, as a slice: ``[4:8]``."""
        i, width = build["i"], build["width"]
        return f"[{i * width}:{min((i + 2) * width, build['_n'])}]"
