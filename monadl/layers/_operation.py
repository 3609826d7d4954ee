"""`operation`: a Python function over layers (a cell) as ONE node of the graph.

TF Fold batches *operations* (an LSTM cell), not single ops; ``jax.jit``
traces a function once per signature; ``torch.utils.checkpoint`` draws a
cell's boundary. ``ml.operation(f)`` does the three: the first call with a
new signature runs ``f`` on placeholder layers and records the layers it
builds as a `Program` (its *trace*: primitives of `PRIMITIVES`, in order);
every call then builds one node whose operands are the call's layers, arrays
and numbers plus the weights the trace uses, and whose rule runs the program
on arrays (its backward: the steps' VJPs in reverse, the same rules). A
function returning several layers (a structure of them: a tuple, a
dataclass) gets one node whose value is an `Outputs` tuple, and one cheap
view node per output; an operation called on another's outputs takes that
node as its operand and reads them inside its program, so cells chained by
their states (a Tree-LSTM's h and c) need no view nodes in the graph. The
structures of arguments and results: `monadl.layers._structures`.

The batching scheduler sees such a node as any other: nodes of one trace
whose operands have equal shapes run as ONE call of the program on stacked
operands, each step through its batching rule (`BATCHING_RULES`), so a weight
used by a whole group gets one ``X_cat.T @ dY``. A step with no rule sends
the group back to member-by-member evaluation.

A *signature* is what the Python function could see: the structure of the
arguments (tuples, lists, dicts, dataclasses), which leaves are layers or
weights (operands with a delta) and which are arrays or floats (data), the
other leaves (ints, strings, objects: by value if hashable, else by
identity), and the objects its closure holds. Shapes are not part of it:
layers are lazy, so a trace is a program over any shapes, and its groups
are by shape at run time. Control flow on values cannot be traced: a layer
built from a ``Do`` (``bind``, ``@ml.direct``) or one built before the call
and not passed in is refused with `OperandError`. Reading a weight's
``.data`` in ``f`` reads it once, at the trace: don't.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import itertools
from collections.abc import Callable
from typing import Any, Final, Generic, ParamSpec, TypeVar, final

import numpy as np

from monadl.errors import OperandError
from monadl.layers._layer import Expr, Layer, Site, _build, _next_serial, site_text
from monadl.layers._outputs import ARGUMENT, OUTPUT
from monadl.layers._primitives import Primitive
from monadl.layers._program import Program, Step
from monadl.layers._structures import filler, flatten, items, rebuild, template
from monadl.layers._weight import Weight

__all__ = ["Operation", "operation"]

P = ParamSpec("P")
R = TypeVar("R")
_ids = itertools.count(1)
Value = Any


# ---- tracing ----------------------------------------------------------------------------------
@final
@dataclasses.dataclass(frozen=True, slots=True)
class _Trace:
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


def _trace(
    name: str,
    f: Callable[..., Any],
    call: Any,
    leaves: list[Any],
    keep: tuple[Any, ...],
    views: dict[int, tuple[int, int]],
) -> _Trace:
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
        return _Trace(None, (), (), (), 0, shape, keep, _maker(None, (), (), (), 0, shape))
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
        {position[id(x)] for layer in ordered for x in (*layer._inputs, *layer._params) if id(x) in position}
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
        takes = tuple(slot.get(id(p)) if id(p) in position else None for p in params)  # data arguments as parameters
        program_steps.append(
            Step(layer._op, refs, params, layer._site, grads, takes if takes.count(None) < len(takes) else None)
        )
        grads_of.append(any(grads))
    program = Program(name, size, tuple(consts), tuple(program_steps), tuple(slot[id(o)] for o in outs), len(weights))
    op = Primitive(f"{name}#{next(_ids)}", program)
    make = _maker(op, tuple(used), tuple(sources), tuple(weights), len(outs), shape)
    return _Trace(op, tuple(used), tuple(sources), tuple(weights), len(outs), shape, keep, make)


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
    first = len(used)
    prefix = used == tuple(range(first)) and sources == tuple(range(len(sources)))
    count = len(sources)

    def make(leaves: list[Any], nodes: list[Any], site: Site | None) -> Any:
        if prefix and len(nodes) == count:
            inputs = (*leaves[:first], *nodes, *weights)
        else:
            inputs = (*[leaves[i] for i in used], *[nodes[s] for s in sources], *weights)
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


_DATA_READ: Final = (
    "operation: a data argument of the cell went into a NumPy computation inside it; the trace would keep "
    "that computation's result from the first call for every later one: compute it before the call and pass "
    "the result, or compute it with monadl functions"
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


# ---- the decorator ----------------------------------------------------------------------------
_TRACES_LIMIT: Final = 256


@final
class Operation(Generic[P, R]):
    """A function over layers marked as one operation (see `operation`)."""

    __slots__ = ("__name__", "__wrapped__", "_closure", "_ids", "_site", "_traces")

    def __init__(self, f: Callable[P, R], site: Site | None = None) -> None:
        """``site``: where every node of this operation is built, if not each
        call's caller (a Fold `Function` block: where the block was made)."""
        if inspect.iscoroutinefunction(f):
            raise OperandError(
                f"operation: {getattr(f, '__qualname__', f)} is async; a cell awaits no values (it is traced once)"
            )
        self.__wrapped__ = f
        held: list[Any] = []
        inner: Any = f
        while isinstance(inner, functools.partial):  # its arguments are held as a closure's
            held += [_Held(x) for x in (*inner.args, *inner.keywords.values())]
            inner = inner.func
        self.__name__: str = getattr(inner, "__qualname__", None) or type(inner).__name__
        owner = getattr(inner, "__self__", None)  # a bound method: its object is part of the signature
        held += getattr(inner, "__closure__", None) or ()
        if owner is not None:
            held.append(_Held(owner))
        self._closure: tuple[Any, ...] | None = tuple(held) or None
        fixed = self._closure is not None and all(type(c) is _Held for c in self._closure)
        self._ids = tuple([id(c.cell_contents) for c in held]) if fixed else None
        self._traces: dict[Any, _Trace] = {}
        self._site = site

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        # This runs once per node of a user's graph (a Tree-LSTM: 8,000 a
        # batch), so it is kept lean: the signature's parts in flat tuples, a
        # trace's node and result made by closures compiled with the trace.
        leaves: list[Any] = []
        keep: list[Any] = []
        found: list[int] = []
        key: Any = items(args, leaves, keep, found) if not kwargs else flatten((args, kwargs), leaves, keep, found)
        sources: list[Layer[Any, Any]] = []
        views: list[tuple[int, int, int]] = []
        if found:  # outputs of other operations: their nodes are the operands
            for j in found:
                x = leaves[j]
                node = x._inputs[0]
                if node in sources:  # (a handful, scanned in C: layers compare by identity)
                    s = sources.index(node)
                else:
                    s = len(sources)
                    sources.append(node)
                views.append((j, s, x._params[0]))
            key = (key, tuple(views))
        held: list[Any] = []
        if self._ids is not None:  # what a partial or a bound method holds: the same objects every call
            key = (key, self._ids)
        elif self._closure is not None:
            held = [_contents(c) for c in self._closure]
            key = (key, tuple([id(x) for x in held]))
        trace = self._traces.get(key)
        if trace is None:
            if len(self._traces) >= _TRACES_LIMIT:
                self._traces.clear()
            keep.extend(held)  # (the trace holds them: their ids stay theirs while it is cached)
            placed = {j: (s, k) for j, s, k in views}
            trace = _trace(self.__name__, self.__wrapped__, (args, kwargs), leaves, tuple(keep), placed)
            self._traces[key] = trace
        result: R = trace.make(leaves, sources, self._site)  # (Any: no cast, a call per node)
        return result

    def __repr__(self) -> str:
        return f"operation({self.__name__})"


@final
class _Held:
    """An object held by an operation's signature as a closure cell holds one."""

    __slots__ = ("cell_contents",)

    def __init__(self, x: Any) -> None:
        self.cell_contents = x


def _contents(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # a cell not yet filled
        return None


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


def operation(f: Callable[P, R]) -> Operation[P, R]:
    """Mark a Python function over layers (a cell) as one operation.

    Called with a new signature (see the module `monadl.layers._operation`:
    the structure of the arguments, which are layers or weights, which are
    data, and the other arguments by value), ``f`` runs once on placeholder
    layers and its layers become a program; every call then builds ONE node
    of the graph (and one view per output when ``f`` returns several layers
    in a tuple, list, dict or dataclass). Values and gradients are those of
    ``f`` unmarked; the batching scheduler runs nodes of one operation that
    are ready together as one call of the program on stacked operands.

    ``f`` may use its arguments, weights and constants (arrays, numbers),
    and Python control flow on its non-layer arguments (each value is its
    own trace); not a layer built outside the call (pass it in), nor values
    (a layer from ``bind`` or ``@ml.direct``): `OperandError`.

    >>> import anyio, numpy as np, monadl as ml
    >>> w = ml.Weight(np.ones((2, 2)))
    >>> @ml.operation
    ... def cell(x: ml.ArrayOperand, h: ml.ArrayOperand) -> tuple[ml.ArrayLayer, ml.ArrayLayer]:
    ...     z = ml.tanh(x @ w) + h
    ...     return z, z * 2.0
    >>> a, b = cell(np.ones((1, 2)), np.zeros((1, 2)))
    >>> anyio.run((a + b).sum().predict).round(4)
    np.float64(5.7842)
    """
    return Operation(f)
