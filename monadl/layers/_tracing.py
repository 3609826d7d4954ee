"""Tracing an `monadl.operation`: a Python function over layers, run once on
placeholders, becomes a `Program`, and each call one node of the graph.

The first call of an operation with a new signature (`monadl.layers._operation`)
runs the function on placeholder layers for its operand leaves and records
the layers it builds (`traced`): primitives of `PRIMITIVES`, in order, over
the node's operands (the call's layers, arrays and numbers, then the weights
the trace uses), its constants and each other. A trace also compiles how a
call builds its node and its result (`_maker`): one node whose rule runs the
program, and, for a function returning several layers (a structure of them:
a tuple, a dataclass), one cheap view node per output. An operation called
on another's outputs takes that node as its operand and reads them inside
its program, so cells chained by their states (a Tree-LSTM's h and c) need
no view nodes in the graph.

Control flow on values cannot be traced: a layer built from a ``Do``
(``bind``, ``@ml.direct``) or one built before the call and not passed in is
refused with `OperandError`; a NumPy data argument computed with inside the
function is refused too (`_Data`), since the trace would keep the first
call's result.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from operator import itemgetter
from typing import Any, Final, final

import numpy as np

from monadl.errors import OperandError
from monadl.layers._layer import Expr, Layer, _build, _next_serial
from monadl.layers._outputs import ARGUMENT, OUTPUT
from monadl.layers._primitives import Primitive
from monadl.layers._program import Program, Step
from monadl.layers._site import Site, site_text
from monadl.layers._structures import filler, rebuild, template
from monadl.layers._weight import Weight

__all__ = ["Trace", "traced"]

_ids = itertools.count(1)


@final
@dataclasses.dataclass(frozen=True, slots=True)
class Trace:
    """One signature's trace: the node's primitive (None when the function
    computes nothing: its result is then rebuilt from the call's arguments),
    which operand leaves the node takes, the weights it adds, how many
    outputs it has and the result's template; ``keep`` holds the objects
    whose ids are in the signature; ``make`` builds a call's node and result
    from the call's leaves and source nodes (compiled from the rest)."""

    op: Primitive | None
    used: tuple[int, ...]
    sources: tuple[int, ...]  # of the distinct operation nodes whose outputs are arguments
    weights: tuple[Weight[Any, Any], ...]
    outputs: int
    template: Any
    keep: tuple[Any, ...]
    make: Callable[[list[Any], list[Any], Site | None], Any]


def traced(
    name: str,
    f: Callable[..., Any],
    call: Any,
    leaves: list[Any],
    keep: tuple[Any, ...],
    views: dict[int, tuple[int, int]],
) -> Trace:
    """Run ``f`` on placeholders for ``leaves`` and record what it builds.

    ``views``: the leaves that are outputs of other operations' nodes, each
    as (its node's index among the call's distinct such nodes, output): the
    node becomes the operand, and the program reads the output itself."""
    start = _next_serial()  # layers built from here on are the trace's
    holders = [_placeholder(x, i) for i, x in enumerate(leaves)]
    args, kwargs = rebuild(call, iter(holders))
    result = f(*args, **kwargs)
    position = {id(h): i for i, h in enumerate(holders)}
    outs: list[Layer[Any, Any]] = []

    def leaf(y: Any) -> tuple[str, Any]:
        if id(y) in position:
            return ("arg", position[id(y)])
        if type(y) is Layer:
            if id(y) in position:
                return ("arg", position[id(y)])
            _check_inner(name, y, start)
            if y not in outs:
                outs.append(y)
            return ("out", outs.index(y))
        return ("const", y)

    shape = template(result, leaf)
    if not outs:
        return Trace(None, (), (), (), 0, shape, keep, _maker(None, (), (), (), 0, shape))
    # The trace's layers, children first (construction order is topological).
    inner: dict[Layer[Any, Any], None] = dict.fromkeys(outs)
    todo = list(outs)
    weights: dict[Weight[Any, Any], None] = {}
    while todo:
        for x in todo.pop()._inputs:
            if type(x) is Layer and id(x) not in position and x not in inner:
                _check_inner(name, x, start)
                inner[x] = None
                todo.append(x)
            elif isinstance(x, Weight):
                weights[x] = None
    ordered = sorted(inner, key=lambda layer: layer._serial)
    found = sorted(
        {position[id(x)] for layer in ordered for x in (*layer._inputs, *_params_read(layer)) if id(x) in position}
    )
    used = [i for i in found if i not in views]
    read = [i for i in found if i in views]  # outputs of other operations' nodes
    sources = sorted({views[i][0] for i in read})
    slot: dict[int, int] = {id(holders[i]): s for s, i in enumerate(used)}
    source_slot = {src: len(used) + s for s, src in enumerate(sources)}
    size = len(used) + len(sources)
    for w in weights:
        slot[id(w)] = size
        size += 1
    consts: list[Any] = []
    viewed = {id(holders[i]) for i in read}
    for layer in ordered:  # constants: arrays and numbers the cell holds
        for x in layer._inputs:
            if id(x) not in slot and id(x) not in viewed and not (type(x) is Layer and x in inner):
                slot[id(x)] = size + len(consts)
                consts.append(x)
    base = size + len(consts)
    program_steps = []
    for j, i in enumerate(read):  # first, the outputs read from other operations' nodes
        slot[id(holders[i])] = base + j
        src, k = views[i]
        program_steps.append(Step(OUTPUT, (source_slot[src],), (k,), holders[i]._site, (True,)))
    base += len(read)
    for j, layer in enumerate(ordered):
        slot[id(layer)] = base + j
    grads_of = [_is_node(leaves[i]) for i in used] + [True] * (len(sources) + len(weights)) + [False] * len(consts)
    grads_of += [True] * len(read)
    for layer in ordered:
        refs = tuple(slot[id(x)] for x in layer._inputs)
        grads = tuple(grads_of[r] for r in refs)
        assert layer._op is not None  # (_check_inner refused the others)
        params = layer._params
        takes = tuple([_take(name, layer, p, position, slot) for p in params])  # data arguments as parameters
        program_steps.append(
            Step(layer._op, refs, params, layer._site, grads, takes if takes.count(None) < len(takes) else None)
        )
        grads_of.append(any(grads))
    _check_kept(name, leaves, consts, program_steps)
    program = Program(name, size, tuple(consts), tuple(program_steps), tuple(slot[id(o)] for o in outs), len(weights))
    op = Primitive(f"{name}#{next(_ids)}", program)
    make = _maker(op, tuple(used), tuple(sources), tuple(weights), len(outs), shape)
    return Trace(op, tuple(used), tuple(sources), tuple(weights), len(outs), shape, keep, make)


def _check_kept(name: str, leaves: list[Any], consts: list[Any], steps: list[Step]) -> None:
    """Refuse a constant or parameter that is a data argument's memory under
    another name (``np.asarray(d)``, ``d.view(np.ndarray)``): the trace would
    keep the first call's array."""
    data = [x for x in leaves if isinstance(x, np.ndarray)]
    if not data:
        return
    kept = [c for c in consts if isinstance(c, np.ndarray)]
    for step in steps:
        for p in step.params:
            kept += [q for q in (p if type(p) is tuple else (p,)) if isinstance(q, np.ndarray) and type(q) is not _Data]
    for k in kept:
        if any(np.may_share_memory(k, d) for d in data):
            raise OperandError(_DATA_KEPT)


def _params_read(layer: Layer[Any, Any]) -> list[Any]:
    """A layer's parameters and the items of its tuple parameters (an
    index such as ``x[:, d]``), where a data argument may stand."""
    found: list[Any] = []
    for p in layer._params:
        found.append(p)
        if type(p) is tuple:
            found += p
    return found


def _take(
    name: str, layer: Layer[Any, Any], p: Any, position: dict[int, int], slot: dict[int, int]
) -> int | tuple[int | None, ...] | None:
    """Where a traced parameter reads the call's data arguments: the slot of
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
    if type(p) is _Data:
        return True
    if type(p) in (tuple, list):
        return any(map(_holds_data, p))
    if type(p) is dict:
        return any(map(_holds_data, p.values()))
    return False


def _maker(
    op: Primitive | None,
    used: tuple[int, ...],
    sources: tuple[int, ...],
    weights: tuple[Weight[Any, Any], ...],
    outputs: int,
    shape: Any,
) -> Callable[[list[Any], list[Any], Site | None], Any]:
    """How a call of a trace builds its node, its output views and its
    result, as one closure (what is the same every call, worked out once)."""
    result = filler(shape)
    if op is None:
        return lambda leaves, nodes, site: result((), leaves)
    # Most cells use their leading leaves (the data and layer arguments) and
    # every source node, in order: then the inputs are two slices.
    # Others (a Fold block's cell takes its children's states before its
    # input) pick their leaves with one C call.
    first = len(used)
    in_order = sources == tuple(range(len(sources)))
    prefix = used == tuple(range(first)) and in_order
    count = len(sources)
    take = _taker(used)

    def make(leaves: list[Any], nodes: list[Any], site: Site | None) -> Any:
        if in_order and len(nodes) == count:
            inputs = (*leaves[:first], *nodes, *weights) if prefix else (*take(leaves), *nodes, *weights)
        else:
            inputs = (*take(leaves), *[nodes[s] for s in sources], *weights)
        # (its site: the frame that called the operation, make and __call__ up; or the one it was given)
        node = _build(op, inputs, (), 3) if site is None else _built_at(op, inputs, site)
        if outputs == 1:
            return result((node,), leaves)
        if outputs == 2:  # (a cell's state, h and c: its two views built here, no call each)
            one: Layer[Any, Any] = _new(Layer)
            one._op, one._inputs, one._params, one._site = OUTPUT, (node,), _FIRST, node._site
            one._serial = _next_serial()
            two: Layer[Any, Any] = _new(Layer)
            two._op, two._inputs, two._params, two._site = OUTPUT, one._inputs, _SECOND, node._site
            two._serial = _next_serial()
            return result((one, two), leaves)
        return result(tuple([_output(node, k) for k in range(outputs)]), leaves)

    return make


def _taker(positions: tuple[int, ...]) -> Callable[[list[Any]], tuple[Any, ...]]:
    """The items of a list at ``positions``, as a tuple, in one call."""
    if len(positions) > 1:
        return itemgetter(*positions)
    if positions:
        (i,) = positions
        return lambda xs: (xs[i],)
    return lambda xs: ()


@final
class _Data(np.ndarray[Any, Any]):
    """A NumPy data argument while its cell is traced: it may meet layers and
    be a primitive's parameter (an embedding's indices), but not be computed
    with in NumPy, whose result the trace would keep as a constant."""

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        if any(isinstance(x, Expr) for x in inputs):
            return NotImplemented  # the layer's operator builds the layer
        raise OperandError(_DATA_READ)

    def __array_function__(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        raise OperandError(_DATA_READ)

    # Its values read in Python (a branch, an int, an index): the trace would
    # keep the first call's. Its shape and dtype are the signature's.
    def __getitem__(self, index: Any) -> Any:
        raise OperandError(_VALUE_READ)

    def __iter__(self) -> Any:
        raise OperandError(_VALUE_READ)

    def __bool__(self) -> bool:
        raise OperandError(_VALUE_READ)

    def __int__(self) -> int:
        raise OperandError(_VALUE_READ)

    def __float__(self) -> float:
        raise OperandError(_VALUE_READ)

    def __complex__(self) -> complex:
        raise OperandError(_VALUE_READ)

    def __index__(self) -> int:
        raise OperandError(_VALUE_READ)

    def item(self, *args: Any) -> Any:
        raise OperandError(_VALUE_READ)

    def dot(self, *args: Any, **kwargs: Any) -> Any:  # (methods that compute without a ufunc)
        raise OperandError(_DATA_READ)

    def argmax(self, *args: Any, **kwargs: Any) -> Any:
        raise OperandError(_DATA_READ)

    def argmin(self, *args: Any, **kwargs: Any) -> Any:
        raise OperandError(_DATA_READ)

    def nonzero(self) -> Any:
        raise OperandError(_DATA_READ)

    @property
    def flat(self) -> Any:
        raise OperandError(_VALUE_READ)

    def view(self, *args: Any, **kwargs: Any) -> Any:
        if args[:1] != (_Data,) or len(args) > 1 or kwargs:  # (nested operations view a placeholder as itself)
            raise OperandError(_VALUE_READ)
        return super().view(_Data)

    def tolist(self) -> Any:
        raise OperandError(_VALUE_READ)


_DATA_READ: Final = (
    "operation: a data argument of the cell went into a NumPy computation inside it; the trace would keep "
    "that computation's result from the first call for every later one: compute it before the call and pass "
    "the result, or compute it with monadl functions"
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


def _placeholder(x: Any, i: int) -> Any:
    """What the traced function gets for operand leaf ``x``: a layer, or, for
    a NumPy array, a `_Data` view of it."""
    if isinstance(x, np.ndarray):  # (a _Data already when operations nest)
        return x.view(_Data)
    return _build(ARGUMENT, (), (i,), 2)


def _is_node(x: Any) -> bool:
    return isinstance(x, Expr)


def _check_inner(name: str, layer: Layer[Any, Any], start: int) -> None:
    """Refuse what a trace cannot replay: layers from before the call, and
    layers whose structure depends on values (built from a ``Do``)."""
    if layer._serial < start:
        raise OperandError(
            f"operation {name}: uses the layer built at {site_text(layer._site)}, built outside the call; "
            "pass it as an argument (a trace may hold only its arguments, weights and constants)"
        )
    if layer._op is None:
        raise OperandError(
            f"operation {name}: the layer built at {site_text(layer._site)} comes from a Do (bind, await, "
            "ml.direct): its structure depends on values, so it cannot be traced; leave it out of the operation"
        )


_new = object.__new__
_FIRST, _SECOND = (0,), (1,)


def _built_at(op: Primitive, inputs: tuple[Any, ...], site: Site) -> Layer[Any, Any]:
    """An operation's node built at a given site (no walk up the stack)."""
    layer: Layer[Any, Any] = _new(Layer)
    layer._op, layer._inputs, layer._params, layer._site = op, inputs, (), site
    layer._serial = _next_serial()
    return layer


def _output(node: Layer[Any, Any], k: int) -> Layer[Any, Any]:
    """The view node of output ``k``, built where its operation node was."""
    layer: Layer[Any, Any] = object.__new__(Layer)
    layer._op = OUTPUT
    layer._inputs = (node,)
    layer._params = (k,)
    layer._site = node._site
    layer._serial = _next_serial()
    return layer
