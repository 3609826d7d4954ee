"""A layer graph's nodes: collecting them, and computing one node's forward.

Every scheduler (inline, thread pool, CUDA streams) computes a node with
`compute`, which checks its operands (one array library, one float dtype),
calls the primitive's rule, and turns a failure into an error that names the
operation, the operands and the user's line that built the layer. The error
text of the runtime lives here too, so every message reads the same.
"""

from __future__ import annotations

from collections.abc import Generator
from itertools import islice
from operator import attrgetter
from time import perf_counter
from typing import Any, Final

import numpy as np

from monadl._namespace import (
    _HOST,
    all_finite,
    common_namespace,
    host_scalars_to_python,
)
from monadl.errors import DeviceError, DTypeError, IndexRangeError, NonFiniteError, ShapeError
from monadl.layers._batch_site import built_for
from monadl.layers._layer import Layer
from monadl.layers._non_finite import data_held, made
from monadl.layers._operands import describe, one_float_dtype
from monadl.layers._outputs import Outputs, arrays_of, finite_value
from monadl.layers._primitives import WEIGHT_LAYER, shown
from monadl.layers._program import Program
from monadl.layers._site import site_text
from monadl.layers._weight import Weight, weight_sites
from monadl.runtime.evaluation import Evaluation, Record
from monadl.runtime.requests import CHECKPOINT

__all__ = [
    "all_finite",
    "collect",
    "collecting",
    "compute",
    "describe",
    "failed",
    "host_integers",
    "one_library",
    "where",
]

_PYTHON_NUMBERS: Final = frozenset({float, int, bool})
_NUMPY_FLOATS: Final = frozenset({np.float16, np.float32, np.float64})
_NUMPY_SCALARS: Final = frozenset(  # (each takes the float dtype of the other operand: `one_float_dtype`)
    {np.float16, np.float32, np.float64, np.bool_, np.int8, np.int16, np.int32, np.int64}
    | {np.uint8, np.uint16, np.uint32, np.uint64}
)
_LOCAL: Final = _HOST | {Outputs}  # (an operation node's outputs: checked part by part, `_host_outputs`)
_ARRAYS_ONLY: Final = {np.ndarray}
_serial = attrgetter("_serial")


def collect(ev: Evaluation, roots: list[Any]) -> list[Any]:
    """The layers under ``roots`` not evaluated yet, in construction order.

    A layer is always built after its operands, so sorting by construction
    serial gives a topological order, with no recursion. Weights met on the
    way get their records here. The walk stops at layers built from a ``Do``:
    what they need is evaluated when their ``Do`` runs.
    """
    try:
        next(collecting(ev, roots, False))
    except StopIteration as done:
        order: list[Any] = done.value
        return order
    raise AssertionError("a walk without turns yielded")


PIECE: Final = 8192
"""Nodes a paced walk (`collecting`) visits between two looks at the clock."""


def collecting(ev: Evaluation, roots: list[Any], paced: bool = True) -> Generator[object, None, list[Any]]:
    """`collect`, yielding `CHECKPOINT` between pieces of the walk once the
    evaluation's deadline has passed (``paced``): a turn for the event loop
    within a large graph's walk (a 90,000-node chain's took 34 ms)."""
    records = ev.records
    places = records.places  # (batched groups' members: computed, their records made when read)
    order = list(dict.fromkeys(roots))
    seen = set(order)
    walking = iter(order)  # (a list's iterator goes on over what is appended while it walks: breadth first)
    visited = 0
    while True:
        for node in islice(walking, PIECE):
            for x in node._inputs:
                kind = type(x)
                if kind is Layer:
                    if x not in seen and x not in records and x not in places:
                        seen.add(x)
                        order.append(x)
                elif kind is Weight and x not in records:
                    ev.weight_record(x)
        visited += PIECE
        if visited >= len(order):
            break
        if paced and perf_counter() > ev.deadline:
            yield CHECKPOINT
    order.sort(key=_serial)
    ev.nodes += len(order)
    return order


def compute(ev: Evaluation, node: Any, count: bool) -> Record:
    """The forward of one primitive layer whose operands are all computed.

    ``count``: take this consumer's hold on each operand here (the worker
    pool counts holds before it starts instead).
    """
    records = ev.records
    op = node._op
    inputs = node._inputs
    # One and two operands are nearly every node: unrolled, as this is the hot loop.
    if len(inputs) == 2:
        x, y = inputs
        kind = type(x)
        if kind is Layer or kind is Weight:
            rx = records[x]
            rx.refcount += count
            x = rx.value
            needs = rx.needs_grad
        else:
            rx, needs = None, False
        kind = type(y)
        if kind is Layer or kind is Weight:
            ry = records[y]
            ry.refcount += count
            y = ry.value
            needs = needs or ry.needs_grad
        else:
            ry = None
        args: tuple[Any, ...] = (x, y)
        ins: tuple[Record | None, ...] = (rx, ry)
        kx, ky = type(x), type(y)
        # Beside a plain number (not a layer's value), an operand's delta has its shape.
        fits = op.elementwise and ((rx is None and kx in _PYTHON_NUMBERS) or (ry is None and ky in _PYTHON_NUMBERS))
        if kx is ky:
            if kx is np.ndarray:
                if op.same_dtype and x.dtype is not y.dtype:
                    args = _check_dtypes(node, args)
            elif kx not in _HOST and op.same_dtype and x.dtype != y.dtype:  # both from one other library (CuPy ...)
                args = _check_dtypes(node, args)
        elif (
            (kx not in _LOCAL or ky not in _LOCAL or kx is Outputs or ky is Outputs)
            and kx not in _PYTHON_NUMBERS
            and ky not in _PYTHON_NUMBERS
        ):
            args = _foreign_operands(node, args)  # (a Python number fits any library as it is)
        elif (
            op.same_dtype
            and (kx in _NUMPY_SCALARS or ky in _NUMPY_SCALARS)  # (a NumPy scalar: cast it where it differs)
            and not (kx is np.ndarray and ky in _NUMPY_FLOATS and x.dtype == y.dtype)
            and not (ky is np.ndarray and kx in _NUMPY_FLOATS and x.dtype == y.dtype)
        ):  # (not an array and a NumPy float of its dtype, as `/ np.sqrt(d)` gives: nothing to cast there)
            args = _check_dtypes(node, args)
    elif len(inputs) == 1:
        x = inputs[0]
        kind = type(x)
        if kind is Layer or kind is Weight:
            rx = records[x]
            rx.refcount += count
            x = rx.value
            needs = rx.needs_grad
        else:
            rx, needs = None, False
        args, ins = (x,), (rx,)
        fits = op.elementwise
    elif len(inputs) == 3 and type(inputs[1]) is Weight and type(inputs[2]) is Weight:
        # A dense layer over its weight and bias (every layer of an MLP): unrolled too.
        x, y, z = inputs
        kind = type(x)
        if kind is Layer or kind is Weight:
            rx = records[x]
            rx.refcount += count
            x = rx.value
            needs = rx.needs_grad
        else:
            rx, needs = None, False
        ry, rz = records[y], records[z]
        ry.refcount += count
        rz.refcount += count
        y, z = ry.value, rz.value
        needs = needs or ry.needs_grad or rz.needs_grad
        args, ins, fits = (x, y, z), (rx, ry, rz), False
        if not (type(x) is np.ndarray and type(y) is np.ndarray and type(z) is np.ndarray):
            if not {type(x), type(y), type(z)} <= _LOCAL:
                args = _foreign_operands(node, args)
            if op.floats_from() is not None:  # (`where` between two weights too)
                args = _check_dtypes(node, args)
        elif (op.same_dtype and not (x.dtype is y.dtype is z.dtype)) or (
            op.elementwise and y.dtype != z.dtype and op.floats_from()  # (`where`: its two sides)
        ):
            args = _check_dtypes(node, args)
    else:
        args, ins, needs = _operands(records, inputs, count)
        fits = False
        kinds = {type(a) for a in args}
        if not kinds <= _LOCAL or (Outputs in kinds and not _host_outputs(args)):
            args = _foreign_operands(node, args)
        if op.same_dtype:
            if kinds != _ARRAYS_ONLY or len({a.dtype for a in args}) > 1:
                args = _check_dtypes(node, args)  # (NumPy arrays of one dtype pass without it)
        elif op.elementwise and op.floats_from():  # (`where`: its two sides, knowing which are tensors)
            _, y, z = args
            if not (type(y) is np.ndarray and type(z) is np.ndarray and y.dtype == z.dtype):
                args = _check_dtypes(node, args)  # (NumPy arrays of one dtype pass without it)
    params = node._params
    try:
        if ev.check_finite:
            out, vjps = _checked(node, args, params)
        else:
            out, vjps = op.rule(*args, *params) if params else op.rule(*args)
    except Exception as exc:  # (raised without a local: one would hold the error's traceback, which holds this frame)
        ev.failed = node
        raise failed(exc, op, args, where(node), node._inputs)  # noqa: B904 - failed sets a new error's cause
    if not vjps:  # a rule without delta rules (stop_gradient): no delta flows through it
        needs = False
    return Record(out, vjps if needs else None, ins, needs, node, fits)


def failed(exc: Exception, op: Any, args: tuple[Any, ...], place: str, inputs: tuple[Any, ...]) -> Exception:
    """The error to raise for ``exc``, raised by the rule of ``op`` on
    ``args``: named for the layer built at ``place`` (its user's line, and the
    Fold batch's input: `where`), with the weights among ``inputs``. An
    index out of range and a dtype error say so in their own words; a
    value error is a `ShapeError` of the operands, caused by it; any other gets a note.
    (A primitive whose errors are named already: as they are.)"""
    if op.names_errors:
        return exc
    if isinstance(exc, IndexRangeError):  # (the shapes fit: a value does not)
        if type(op.rule) is Program:  # (named at the step's line inside already: the call's line too)
            exc.args = (f"{exc.args[0]} called at {place}",)
        else:
            exc.args = (f"{shown(op)}: {exc.args[0]}; layer built at {place}" + weight_sites(inputs),)
        return exc
    if isinstance(exc, ValueError):
        if type(op.rule) is Program:  # (a marked cell's step failed, named with its operands and line: not the call)
            text = f"{shown(op)} (called on {describe(args)}): {exc}"
        else:  # (one operand: nothing to fit together; an empty axis to reduce, say)
            fit = f"operands {describe(args)} do not fit together" if len(args) > 1 else f"cannot take {describe(args)}"
            text = f"{shown(op)}: {fit} ({exc})"
        shape = ShapeError(f"{text}; layer built at {place}" + weight_sites(inputs))
        shape.__cause__ = exc  # (as ``raise ... from exc``)
        return shape
    if isinstance(exc, NonFiniteError):
        return exc
    if isinstance(exc, DTypeError):
        if type(op.rule) is Program and exc.args and type(exc.args[0]) is str:  # (as a ShapeError: the call's line too)
            exc.args = (f"{exc.args[0]} called at {place}", *exc.args[1:])
        elif exc.args and type(exc.args[0]) is str and "layer built at" not in exc.args[0]:  # (a rule's own: `where`)
            exc.args = (f"{exc.args[0]}; layer built at {place}", *exc.args[1:])
        return exc
    exc.add_note(f"monadl: in {shown(op)}{f' of {describe(args)}' if args else ''}; layer built at {place}")
    return exc


def _checked(node: Any, args: tuple[Any, ...], params: tuple[Any, ...]) -> tuple[Any, Any]:
    """A node's rule under ``check_finite``: `NonFiniteError` where its value
    holds a NaN or an infinity, and where any step inside a marked cell's
    does (at that step's line), naming the operand that already held one;
    NumPy's warnings of the same (an error under ``-W error``) are quiet."""
    op = node._op
    with np.errstate(all="ignore"):
        if type(op.rule) is Program:
            out, vjps = op.rule(*args, *params, called=where(node))
        else:
            out, vjps = op.rule(*args, *params)
    if not finite_value(out):
        if op.name == "stop_gradient" and type(node._inputs[0]) is not Layer and type(node._inputs[0]) is not Weight:
            raise NonFiniteError(data_held(args[0], where(node)))  # (`ml.as_layer(data)`)
        raise NonFiniteError(made(shown(op), args, where(node)))
    return out, vjps


def _operands(
    records: dict[Any, Record], inputs: tuple[Any, ...], count: bool
) -> tuple[tuple[Any, ...], tuple[Record | None, ...], bool]:
    """Operand values and records of a node with any number of operands."""
    args: list[Any] = []
    ins: list[Record | None] = []
    needs = False
    for x in inputs:
        kind = type(x)
        if kind is Layer or kind is Weight:
            rec = records[x]
            if count:
                rec.refcount += 1
            args.append(rec.value)
            ins.append(rec)
            needs = needs or rec.needs_grad
        else:
            args.append(x)
            ins.append(None)
    return tuple(args), tuple(ins), needs


def host_integers(a: Any) -> bool:
    """Whether ``a`` is a NumPy integer array: an operation's data argument
    that its program reads as indices (an embedding's, a loss's labels),
    which the rules that take them check on the host and copy over; used as
    an operand inside, beside a device's arrays, it is refused there."""
    return type(a) is np.ndarray and a.dtype.kind in "iu"


def _host_outputs(args: tuple[Any, ...]) -> bool:
    """Whether the operation outputs among ``args`` are NumPy arrays (then the
    operands are all the host's)."""
    return all(type(a[0]) is np.ndarray for a in args if type(a) is Outputs)


def _foreign_operands(node: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """Operands not all NumPy: one library only (else `DeviceError`), and NumPy
    scalars as Python numbers, which every array library accepts."""
    return one_library(node._op, args, where(node))


def one_library(op: Any, args: tuple[Any, ...], place: str) -> tuple[Any, ...]:
    """`_foreign_operands` of a call of ``op`` made at ``place`` (a node's, or
    a loom's call run alone): its arrays of one library, else `DeviceError`
    naming ``place``, but for an operation's host integers (indices)."""
    arrays = arrays_of(args)
    program = type(op.rule) is Program
    if program:  # an operation's host integers (indices) may go with a device's arrays
        arrays = tuple([a for a in arrays if not host_integers(a)])
    try:
        xp = common_namespace(arrays, shown(op))
    except DeviceError as exc:  # (named for the user's line, as a rule's errors are: `failed`)
        exc.args = (f"{exc.args[0]}; {'called' if program else 'layer built'} at {place}", *exc.args[1:])
        raise
    return args if xp is np else host_scalars_to_python(args)


# ---- error text ---------------------------------------------------------------------
def where(node: Any) -> str:
    """``file:line`` of the user's code that built ``node``, and the input of
    a Fold batch it was built for (`built_for`; a weight has no number, and
    its one node, reused by every graph after it, was built for none)."""
    if type(node) is not Layer or node._op is WEIGHT_LAYER:
        return site_text(node._site)
    return site_text(node._site) + built_for(node._serial)


def _check_dtypes(node: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """One float dtype per operation (`one_float_dtype`, from the operand
    `Primitive.floats_from` names; the operands that are layers' and
    weights' values are tensors, the rest data). Returns the operands to use."""
    start = node._op.floats_from()
    inputs = node._inputs
    if start:  # (`where`: its two sides, not its condition)
        sides = args[start:]
        cast = one_float_dtype(shown(node._op), sides, lambda: where(node), lambda: _tensors(inputs[start:]))
        return args if cast is sides else (*args[:start], *cast)
    return one_float_dtype(shown(node._op), args, lambda: where(node), lambda: _tensors(inputs))


def _tensors(inputs: tuple[Any, ...]) -> list[bool]:
    """Per operand, whether it is a layer's or a weight's value (a tensor, whatever its type)."""
    return [type(x) is Layer or type(x) is Weight for x in inputs]
