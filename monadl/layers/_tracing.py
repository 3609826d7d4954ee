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
(``bind``, ``@ml.direct``, an object's own ``forward()``, whose ``Do`` a
trace cannot see inside either) or one built before the call and not passed in is
refused with `OperandError`; a NumPy data argument computed with inside the
function is refused too (`monadl.layers._data`, and `monadl.layers._unread`
where NumPy reads it past its placeholder), since the trace would keep the
first call's result; so is a weight's ``.data`` or ``.state`` read or
assigned, its ``.optimizer`` assigned, or the weight copied, while the
function runs (`monadl.layers._traced_now`).
"""

from __future__ import annotations

import dataclasses
import itertools
import weakref
from collections.abc import Callable
from operator import itemgetter
from threading import get_ident
from typing import Any, final

import numpy as np

from monadl.do import Do
from monadl.errors import OperandError
from monadl.layers._data import Data, check_kept, name_the_cell, params_read, take
from monadl.layers._layer import Expr, Layer, _build, _next_serial
from monadl.layers._operand import numbers_given
from monadl.layers._outputs import ARGUMENT, OUTPUT
from monadl.layers._primitives import WEIGHT_LAYER, Primitive
from monadl.layers._program import Program
from monadl.layers._recording import RECORDING
from monadl.layers._site import Site, site_text
from monadl.layers._step import Step
from monadl.layers._structures import filler, rebuild, template
from monadl.layers._trace_advice import Argument, called
from monadl.layers._traced_now import NUMBERS, TRACING
from monadl.layers._unread import Recorded, check_unread
from monadl.layers._weight import Weight

__all__ = ["Trace", "traced"]

_ids = itertools.count(1)


@final
@dataclasses.dataclass(frozen=True, slots=True, weakref_slot=True)
class Trace:
    """One signature's trace: the node's primitive (None when the function
    computes nothing: its result is then rebuilt from the call's arguments),
    which operand leaves the node takes, the weights it adds, how many
    outputs it has and the result's template; ``keep`` holds the objects
    whose ids are in the signature; ``make`` builds a call's node and result
    from the call's leaves and source nodes (compiled from the rest);
    ``called``, the call's arrays, static values, lengths and which of its
    layers are outputs of which call, and ``cell``, the function traced, for
    the advice of an operation that keeps many traces
    (`monadl.layers._trace_advice`) and the batching log's, which reaches a
    trace from its nodes' program (`Program.trace`, a weak reference: the
    operation keeps its traces)."""

    op: Primitive | None
    used: tuple[int, ...]
    sources: tuple[int, ...]  # of the distinct operation nodes whose outputs are arguments
    weights: tuple[Weight[Any, Any], ...]
    outputs: int
    template: Any
    keep: tuple[Any, ...]
    make: Callable[[list[Any], list[Any], Site | None], Any]
    called: tuple[Argument, ...] = ()  # (the call it was traced for, as the advice of many traces reads it)
    cell: Callable[..., Any] | None = None


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
    node becomes the operand, and the program reads the output itself.

    Where some leaves are NumPy arrays, ``f`` runs a second time on arrays
    of other values (`check_unread`): NumPy reads an array's buffer in C,
    past the placeholder's hooks (``TABLE[idx]``, ``M.dot(x)``,
    ``np.array(x)``), and only a trace that comes out the same shows that
    none of the first call's values were kept."""
    first = _record(name, f, call, leaves, views)
    check_unread(name, f, call, leaves, first, lambda other: _record(name, f, call, other, views))
    if not first.outputs:
        made = _maker(None, (), (), (), 0, first.shape)
        return Trace(None, (), (), (), 0, first.shape, keep, made, called(call, leaves, views), f)
    # The weights' slots, those passed as arguments and those the function closes over: a product's
    # delta goes to them as factors (`Program.factors`; a weight's leaf is its own signature's).
    factors = [s for s, i in enumerate(first.used) if type(leaves[i]) is Weight]
    factors += range(first.size - len(first.weights), first.size)
    program = Program(name, first.size, first.consts, first.steps, first.outputs, frozenset(factors))
    op = Primitive(f"{name}#{next(_ids)}", program)
    count = len(first.outputs)
    make = _maker(op, first.used, first.sources, first.weights, count, first.shape)
    signature = called(call, leaves, views)
    trace = Trace(op, first.used, first.sources, first.weights, count, first.shape, keep, make, signature, f)
    program.trace = weakref.ref(trace)
    return trace


def _record(
    name: str, f: Callable[..., Any], call: Any, leaves: list[Any], views: dict[int, tuple[int, int]]
) -> Recorded:
    """One run of ``f`` on placeholders for ``leaves`` (see `traced`)."""
    start = _next_serial()  # layers built from here on are the trace's
    holders = [_placeholder(x, i) for i, x in enumerate(leaves)]
    args, kwargs = rebuild(call, iter(holders))
    thread = get_ident()
    outer = TRACING.get(thread)  # (an operation traced inside another's trace: its own name, then the outer's)
    outer_numbers = NUMBERS.get(thread)
    numbers = frozenset([id(h) for h, x in zip(holders, leaves) if isinstance(x, float | int | np.number)])
    TRACING[thread] = name
    NUMBERS[thread] = numbers
    token = RECORDING.set(None)  # (operations called in ``f`` are steps of this trace, not a loom's calls)
    try:
        result = f(*args, **kwargs)
    except OperandError as exc:
        name_the_cell(exc, name)
        numbers_given(exc, numbers)
        raise
    finally:
        RECORDING.reset(token)
        if outer is None:
            del TRACING[thread]
        else:
            TRACING[thread] = outer
        if outer_numbers is None:
            del NUMBERS[thread]
        else:
            NUMBERS[thread] = outer_numbers
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
    _check_result(name, shape)
    if not outs:
        return Recorded(shape)
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
        {position[id(x)] for layer in ordered for x in (*layer._inputs, *params_read(layer)) if id(x) in position}
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
        takes = tuple([take(name, layer, p, position, slot) for p in params])  # data arguments as parameters
        program_steps.append(
            Step(layer._op, refs, params, layer._site, grads, takes if takes.count(None) < len(takes) else None)
        )
        grads_of.append(any(grads))
    try:
        check_kept(leaves, consts, program_steps)
    except OperandError as exc:
        name_the_cell(exc, name)
        numbers_given(exc, {id(h) for h, x in zip(holders, leaves) if isinstance(x, float | int | np.number)})
        raise
    outputs = tuple(slot[id(o)] for o in outs)
    return Recorded(
        shape, tuple(used), tuple(sources), tuple(weights), size, tuple(consts), tuple(program_steps), outputs
    )


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


def _check_result(name: str, shape: Any) -> None:
    """Refuse a result that no call could rebuild: one holding no layer, no
    weight and no argument (a number, an array, None: the trace's own object
    for every call), or one holding a ``Do`` (a computation, not a layer)."""
    leaves: list[tuple[str, Any]] = []
    todo = [shape]
    while todo:
        t = todo.pop()
        if t[0] in ("out", "arg", "const"):
            leaves.append(t)
        else:
            todo.extend(t[2])
    found = [v for tag, v in leaves if tag == "const" and isinstance(v, Do)]
    if found:
        raise OperandError(
            f"operation {name}: returns a Do, a computation and not a layer; a cell returns layers, and "
            "holds no Do (its structure would depend on values): leave it out of the operation"
        )
    if all(tag == "const" and not isinstance(v, Expr) for tag, v in leaves):
        kinds = ", ".join(sorted({type(v).__name__ for _, v in leaves})) or "nothing"
        raise OperandError(
            f"operation {name}: returns no layer ({kinds}); a cell computes layers from its arguments: "
            "return them (what it returns otherwise would be the trace's object at every call)"
        )


def _taker(positions: tuple[int, ...]) -> Callable[[list[Any]], tuple[Any, ...]]:
    """The items of a list at ``positions``, as a tuple, in one call."""
    if len(positions) > 1:
        return itemgetter(*positions)
    if positions:
        (i,) = positions
        return lambda xs: (xs[i],)
    return lambda xs: ()


def _placeholder(x: Any, i: int) -> Any:
    """What the traced function gets for operand leaf ``x``: a layer, or, for
    a NumPy array, a `Data` view of it."""
    if isinstance(x, np.ndarray):  # (a Data already when operations nest)
        return x.view(Data)
    return _build(ARGUMENT, (), (i,), 2)


def _is_node(x: Any) -> bool:
    return isinstance(x, Expr)


def _check_inner(name: str, layer: Layer[Any, Any], start: int) -> None:
    """Refuse what a trace cannot replay: layers from before the call, and
    layers whose structure depends on values (built from a ``Do``). A
    weight's node (``ml.as_layer(w)``, one per weight) is the weight's,
    wherever it was first built."""
    if layer._serial < start and layer._op is not WEIGHT_LAYER:
        raise OperandError(
            f"operation {name}: uses the layer built at {site_text(layer._site)}, built outside the call; "
            "pass it as an argument (a trace may hold only its arguments, weights and constants)"
        )
    if layer._op is None:
        raise OperandError(
            f"operation {name}: the layer built at {site_text(layer._site)} comes from a Do (bind, await, "
            "ml.direct, ml.as_layer of an object with a forward() of its own, or a Tape with a backward of your "
            "own): a trace cannot see inside a Do, whose structure may depend on values, so it cannot be traced; "
            "build that layer outside the operation and pass it in as an argument"
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
