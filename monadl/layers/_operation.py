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
the group back to member-by-member evaluation. Floats that differ per call
(a scale, a mask of 0.0 and 1.0) do not split a group: they are stacked as
a column whose dtype each step decides as it would decide a float's alone
(`monadl.layers._operands.Numbers`: float32 beside a float32 array), and a
step of floats only computes member by member, as Python does; where a step
cannot take them so (one that is not elementwise, a float among the
results), the calls group by their floats' values. NumPy floats of one dtype
(``np.linspace``'s items) are stacked as an array, and each step casts them as
one call's operand rule would (`monadl.layers._operands.member_float_dtype`:
an ``np.float64`` beside a float32 layer is float32; in an operator on plain
data alone, float64 beside a float32 array, as NumPy's arithmetic gives it unmarked).

A *signature* is what the Python function could see: the structure of the
arguments (tuples, lists, dicts, dataclasses), which leaves are layers and
which weights (operands with a delta; a weight's, from a few rows' product,
comes as factors, as for one the function closes over: a layer could not
read them) and which are arrays or floats (data), the
other leaves (ints and bools, NumPy's too, strings, objects: by value if
hashable, else by identity), and the objects its closure holds. Shapes are
not part of it: layers are lazy, so a trace is a program over any shapes,
and its groups are by shape at run time. Control flow on values cannot be
traced: a layer built from a ``Do`` (``bind``, ``@ml.direct``) or one
built before the call and not passed in is refused with `OperandError`.
A weight's ``.data`` or ``.state`` read or assigned in ``f``, its
``.optimizer`` assigned, or the weight copied, is refused
(`monadl.layers._traced_now`): the trace would keep the first call's.

Most calls skip the signature's walk. Where each argument is a layer,
weight, array or float, or a dataclass, tuple or list of them (`reader`),
a *plan* per tuple of the arguments' types reads the leaves, and the
leaves' types and which of them are outputs of which other operations'
nodes find the trace (a Tree-LSTM cell's call: 0.3-0.4 us of about 4 less).
The rest take the walk, about 0.2-0.6 us slower than before plans: a dict
or an int among the arguments, or a dataclass whose fields hold other
structures. A function with a closure is planned while its cells hold the
objects they held when its plans were learned (checked each call: a cell
may be rebound); one whose cells change takes the walk from then on, which
keys their contents. The walk, and the traces an operation keeps:
`monadl.layers._operation_traces`.
"""

from __future__ import annotations

import copy
import functools
import inspect
import threading
import types
from collections.abc import Callable
from operator import attrgetter, is_
from typing import Any, ClassVar, Final, Generic, ParamSpec, TypeVar, final

from monadl.errors import OperandError
from monadl.layers._function_copy import function_shell, holds
from monadl.layers._held import Held, reach
from monadl.layers._operation_traces import walked
from monadl.layers._outputs import OUTPUT
from monadl.layers._plans import UNSEEN, Plan, keyed
from monadl.layers._recording import MISS, RECORDING
from monadl.layers._site import Site
from monadl.layers._tracing import Trace

__all__ = ["Operation", "operation"]

P = ParamSpec("P")
R = TypeVar("R")


# ---- the decorator ----------------------------------------------------------------------------
_CONTENTS: Final = attrgetter("cell_contents")
_REBINDS: Final = 4  # (times a closure's cells may change before its plans stop: `_learned_under`)


@final
class Operation(Generic[P, R]):
    """A function over layers marked as one operation (see `operation`)."""

    holds_a_function: ClassVar[bool] = True  # (its ``__wrapped__``: what `reach` walks into)

    __slots__ = (
        "__name__",
        "__wrapped__",
        "_closure",
        "_evictions",
        "_ids",
        "_learning",
        "_live",
        "_method",
        "_planned",
        "_plans",
        "_rebinds",
        "_seen",
        "_site",
        "_traces",
    )

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
            held += [Held(x) for x in (*inner.args, *inner.keywords.values())]
            inner = inner.func
        self.__name__: str = getattr(inner, "__qualname__", None) or type(inner).__name__
        owner = getattr(inner, "__self__", None)  # a bound method: its object is part of the signature
        held += getattr(inner, "__closure__", None) or ()
        if owner is not None:
            held.append(Held(owner))
        self._closure: tuple[Any, ...] | None = tuple(held) or None
        cells, objects = reach(self._closure or ())
        fixed = self._closure is not None and all(type(c) is Held for c in cells)  # (no cell: nothing rebinds)
        self._ids = tuple([id(x) for x in objects]) if fixed else None
        self._traces: dict[Any, Trace] = {}
        self._evictions = 0  # (traces forgotten past the limit: `evict`'s turn)
        self._plans: dict[tuple[type, ...], Plan | None] = {}  # (None: these types fix no signature)
        # A closure's cells (and those of functions it holds: `reach`) may come to hold other objects:
        # its plans hold for the cells and objects they were learned with (`_live`, `_seen`), checked
        # each call; cells that change make them learned again, and past a few times, stop them.
        self._live: tuple[Any, ...] | None = None if fixed or self._closure is None else ()
        self._seen: tuple[Any, ...] | None = None
        self._rebinds = 0
        self._learning = threading.Lock()
        self._planned = True
        self._site = site
        self._method = False  # a function defined in a class body, marked there (see `__set_name__`)

    def __copy__(self) -> Operation[P, R]:
        return self._remade(copy.copy(self.__wrapped__))

    def __deepcopy__(self, memo: dict[int, Any]) -> Operation[P, R]:
        """An operation over the copy's objects: a bound method's copy binds
        the copied object, a partial's holds copied arguments, a function's
        (``def cell(h, x)`` over ``self`` or the weights, in ``__init__``)
        is a function whose closure, defaults and the functions they hold
        hold copies (`monadl.layers._function_copy`), and none of this one's traces
        (they hold the objects it was traced with, and are keyed by their
        ids: a copied model would read and train the original's weights, as
        a closure's copy did, silently, until a new user's ensemble of
        copies trained one set of cell weights). A function that holds
        nothing (no closure, no defaults) copies as itself (Python copies no
        function), so the copy is this operation, traces and all."""
        f = self.__wrapped__
        if type(f) is types.FunctionType and holds(f):
            g, fill = function_shell(f, memo)
            made = memo[id(self)] = self._remade(g)  # (before its cells: one that holds this operation gets the copy)
            fill()
            return made
        wrapped = copy.deepcopy(f, memo)
        return self if wrapped is f else self._remade(wrapped)

    def _remade(self, f: Callable[P, R]) -> Operation[P, R]:
        """A new operation of ``f`` as this one was made: no trace or plan."""
        made = Operation(f, self._site)
        made._method = self._method
        return made

    def __set_name__(self, owner: type, name: str) -> None:
        inner = self.__wrapped__
        qualname = getattr(inner, "__qualname__", "")
        self._method = (
            isinstance(inner, types.FunctionType)
            and qualname.startswith(f"{owner.__qualname__}.")
            and not qualname.endswith("<lambda>")
        )

    def __get__(self, obj: object, owner: type | None = None) -> Operation[P, R]:
        """As a class attribute: itself (the function it marks binds no
        object); a method marked in its class body, read from an object, is
        refused with what to do (an operation bound per object would keep
        each object alive as long as its class, and go with its copies)."""
        if obj is not None and self._method:
            raise OperandError(
                f"operation: {self.__name__} is a method marked with @ml.operation; mark the bound method "
                f"instead, once per object (in __init__: self.cell = ml.operation(self._cell)), or a "
                f"function that takes the weights as arguments"
            )
        return self

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        loom = RECORDING.get()
        if loom is not None:  # (an ``ml.loom()`` block's: the call is recorded there, or built as here)
            if not kwargs:  # (calls like earlier ones, by code compiled for them: `monadl.fold._loom_recorders`)
                for recorder in loom.recorders.get(self, ()):
                    made: R = recorder(args)
                    if made is not MISS:
                        return made
            recorded: R = loom.record(self, args, kwargs)
            return recorded
        trace, leaves, sources = self.found(args, kwargs)
        result: R = trace.make(leaves, sources, self._site)  # (Any: no cast, a call per node)
        return result

    def found(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Trace, list[Any], list[Any]]:
        """The trace of a call (tracing a new signature), the call's leaves,
        and the distinct operation nodes whose outputs are among them: what
        ``trace.make`` builds the call's node and result from (a Fold batch's
        loom records the call instead: `monadl.fold._loom`)."""
        # This runs once per node of a user's graph (a Tree-LSTM: 8,000 a
        # batch), so it is kept lean: a call that a plan reads (see `Plan`)
        # finds its trace by its leaves' types and views, with no walk; a
        # trace's node and result are made by closures compiled with the trace.
        kinds = None
        if not kwargs and self._planned:
            kinds = tuple(map(type, args))
            plan = self._plans.get(kinds, UNSEEN)
            if plan is None:  # (these types do not fix a signature: the walk, as before plans)
                kinds = None
            elif self._live is None or self._unchanged():
                if plan.readers is None:  # every argument a leaf: its type is its leaf's
                    leaves: list[Any] | None = list(args)
                    entry = plan.entries.get(kinds)
                else:
                    leaves = plan.leaves(args)
                    entry = None if leaves is None else plan.entries.get(tuple(map(type, leaves)))
                if entry is not None:
                    assert leaves is not None
                    sources: list[Any] = []
                    views: list[tuple[int, int, int]] = []
                    for j in entry.layers:  # (as `walked` finds them in its walk's leaves)
                        x = leaves[j]
                        if x._op is OUTPUT:
                            node = x._inputs[0]
                            # (by identity: `in` and `index` call a node's Python __eq__, twice, for
                            # every other node before it: a Tree-LSTM's cell, 0.5 us of its 3 a call)
                            s = 0
                            for seen in sources:
                                if seen is node:
                                    break
                                s += 1
                            else:
                                sources.append(node)
                            views.append((j, s, x._params[0]))
                    arrays = entry.arrays
                    if not arrays:
                        trace = entry.traces.get(tuple(views))
                    elif len(arrays) == 1:  # (`keyed`, unrolled: a tree's node has its symbol)
                        x = leaves[arrays[0]]
                        trace = entry.traces.get((tuple(views), x.shape, x.dtype))
                    else:
                        trace = entry.traces.get(keyed(views, leaves, arrays))
                    if trace is not None:
                        return trace, leaves, sources
        return walked(self, args, kwargs, kinds)

    def _unchanged(self) -> bool:
        """Whether the closure's cells hold the objects its plans were learned with."""
        seen = self._seen
        if seen is None:  # (no plan learned yet)
            return True
        assert self._live is not None
        try:
            return all(map(is_, map(_CONTENTS, self._live), seen))
        except ValueError:  # (a cell emptied: the walk's `contents` reads it as None)
            return False

    def _learned_under(self, cells: list[Any], held: list[Any]) -> bool:
        """Whether plans may be learned under ``cells`` (those `reach` finds)
        holding ``held``: the first seen, or the same objects again. Other
        objects (a model rebuilt) drop the plans, to be learned under them;
        past `_REBINDS` times (a loop's variable, rebound every call) this
        operation's calls take the walk for good, which keys them."""
        seen = self._seen
        if seen is not None and len(held) == len(seen) and all(map(is_, held, seen)):
            return True
        self._plans.clear()
        if seen is not None:
            self._rebinds += 1
            if self._rebinds > _REBINDS:
                self._planned, self._seen = False, None
                return False
        self._live, self._seen = tuple(cells), tuple(held)
        return True

    def __repr__(self) -> str:
        return f"operation({self.__name__})"


def operation(f: Callable[P, R]) -> Operation[P, R]:
    """Mark a Python function over layers (a cell) as one operation.

    Called with a new signature (the structure of the arguments: tuples,
    lists, dicts, dataclasses; which leaves are layers or weights, which are
    data (arrays, by shape and dtype, and floats, NumPy's too), the other
    arguments by value (ints and bools, NumPy's too: ``np.int64(3)`` is
    static as ``3`` is), and the objects its closure holds, and those that
    functions among them hold: a helper closure, a decorator's wrapper), ``f`` runs
    once on placeholder layers and its layers become a program; every call
    then builds ONE node of the graph (and one view per output when ``f``
    returns several layers in a tuple, list, dict or dataclass). Values and
    gradients are those of ``f`` unmarked; the batching scheduler runs nodes
    of one operation that are ready together as one call of the program on
    stacked operands.

    ``f`` may use its arguments, weights and constants (arrays, numbers),
    and Python control flow on its static arguments (each value is its own
    trace) and on a data array's shape and dtype; not a layer built outside
    the call (pass it in), nor values (a layer from ``bind`` or
    ``@ml.direct``, a data argument's items, ``int()``, ``bool()``,
    ``.item()``, NumPy computation on it, a constant indexed by it,
    ``TABLE[idx]``, or a copy, ``np.array(x)``): `OperandError` (NumPy
    reads an array past its placeholder, so where ``f`` has array
    arguments it runs a second time, on other values of the same shapes,
    and a trace that changes is refused). A float argument is data too, a
    layer inside ``f``: ``if bond:``, ``bond > 1.5``, ``bond == 2.0``,
    ``bond != 2.0`` and ``bond in (1.0, 2.0)`` are refused, and a dict
    lookup by it compares the layer, not its value (KeyError): pass what
    the cell branches on as an int or a string (each value its own trace). What ``f`` reads from
    elsewhere (a global, an attribute, the items of a dict, list or tuple
    that a partial or the closure holds: functions there too) is read once,
    at its trace, as ``jax.jit`` reads it (a NumPy array so read is kept, not
    copied: changed in place, later calls see its contents, as a layer's
    data are read when it runs; rebound, they do not): change a weight's ``.data``
    outside ``f`` (reading or assigning it inside ``f`` is refused: ``f``
    uses the weight itself, read at each call), or pass a new weight as an
    argument. Mark a method per object, bound
    (``self.cell = ml.operation(self._cell)``): marked in its class body,
    it is refused when read from an object, with that advice.

    The operation is typed with ``f``'s signature: mypy checks its calls as
    ``f``'s. Not a ``functools.partial``'s, nor a lambda's: mypy checks the
    calls of a partial itself, but passed on it is ``(*args: Any, **kwargs:
    Any)``, as a lambda's parameters are Any; to keep the types, mark a
    ``def`` that calls the function (a closure, where the bound value
    varies) or a bound method.

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
