"""How blocks run: as nested Python calls while the recursion is shallow,
on an explicit stack of their own beyond that.

Each block a runner meets is compiled once per `run` into a closure of its
kind (``block._kind``): a composition calls its second block's closure on
its first's result, a route calls the closure of the block it routes to (a
`OneOf` keeps one per key; a resolved declaration is its block's closure),
a parallel block makes the tuple of its blocks' closures' results, an
immediate block is its ``_output``, and a block that builds drives its
generator with its sub-blocks' closures. A node of a Tree-LSTM is then a
handful of Python calls, where the explicit stack pays a loop's turn and a
frame object per block (the Fold Tree-LSTM's build: a fifth more than the
same cells called from a loop).

Recursion goes through routes (a forward declaration is one) and blocks
that build, so they count the depth: past `DEPTH` of them open, the rest of
that input runs on `evaluate`'s explicit stack (`monadl.fold._stack`),
whose pending builds are on the heap, and a tree of depth 100,000 never
reaches Python's recursion limit. Compositions and parallel blocks nest as deep as the structure, so a
structure deeper than `NESTING` runs on the explicit stack from there.

A recursion that makes no progress raises `RecursionError`, as Python's
own would, where it would spin or fill the memory: on the explicit stack, a
forward declaration applied to an input object it is already building (an
input that contains itself, a `OneOf` case that applies its own declaration
to its input) at once, since a block's output is a function of its input;
any other (an input that makes a new object a level, a block of one's own
that calls itself) past `LIMIT` levels. A block's error is thrown into the
build waiting for its output (``gen.throw``), so a block of one's own may
catch a sub-block's error around ``yield from call(...)``; one that no build
catches is raised as it was.

Where it came from is gathered on its way out, and only then (a `_Trail`,
in `monadl.fold._trail`): each build it leaves says which part of its input
it was building, read from the build's live variables (`Block._step`), and
a parallel block which of its blocks; `run` adds them to its note as a path
into the input (``input 0['children'][1]``), and what the innermost block
was given.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Final, TypeVar, final

from monadl.fold._inputs import a_type
from monadl.fold._kinds import BUILD, COMPOSITION, IMMEDIATE, PARALLEL, ROUTE
from monadl.fold._loom import Loom
from monadl.fold._stack import evaluate
from monadl.fold._trail import _Trail, parallel
from monadl.layers._batch_site import BatchBuild
from monadl.layers._layer import _next_serial

if TYPE_CHECKING:
    from monadl.fold._block import Block
    from monadl.layers._site import Site

X = TypeVar("X")
Y = TypeVar("Y")

DEPTH: Final = 32
"""Routes and builds open at once before the explicit stack takes over: a
Tree-LSTM's level is one (its declaration is its leaf-or-internal choice),
and random 128-leaf trees are 11-20 levels deep."""
NESTING: Final = 8
"""Compositions and parallel blocks nested in one closure; with `DEPTH`,
at most 512 frames of the runner on Python's stack (its limit: 1,000)."""
LOOM_INPUTS: Final = 2
"""Inputs of a batch from which its `Function` calls are recorded and run
by depth as one node (`monadl.fold._loom`). One input's calls form groups
only within it: a sequence's steps are a group each, and a loom of 1,500
groups of one ran a reviewer's RNN at 2.2x the time of its nodes, which the
runtime's own cost rule leaves unbatched; a tree's levels still batch there."""
Run = Callable[[Any], Any]


def run(block: Block[X, Y], xs: Iterable[X], batch: bool = True, site: Site | None = None) -> list[Y]:
    """The outputs of ``block`` on each of ``xs``, its sub-blocks compiled once
    for all of them (``batch`` False: ``xs`` is a call's one input). With the
    ``site`` of a batch's call, the layers each input built are kept for an
    error raised when the graph runs to name that input (`BatchBuild`).

    >>> from monadl.fold import InputTransform
    >>> run(InputTransform(len) >> InputTransform(str), ["ab", "c"])
    ['2', '1']
    """
    if batch and not isinstance(xs, list | tuple):
        xs = list(xs)  # (how many: a loom for two or more)
    loom = Loom(site) if batch and site is not None and len(xs) >= LOOM_INPUTS else None  # type: ignore[arg-type]
    runner = _Runner(loom)
    f = runner.compiled(block)
    outputs: list[Y] = []
    build = None if site is None else BatchBuild(block, site)
    starts = None if build is None else build.starts
    try:
        for x in xs:  # (an error of ``xs`` itself is no input's: no note)
            if starts is not None:
                starts.append(_next_serial())
            try:
                outputs.append(f(x))
            except Exception as exc:  # which input, and the block: the blocks' own lines are in the traceback
                n = len(outputs)
                where = runner.trail.where(exc, f"input {n}")
                if batch:
                    exc.add_note(
                        f"monadl.fold: while building input {n} ({a_type(x)}) of the batch with {block!r}{where}"
                    )
                else:  # (a call's one input, a list too: `Block.batch` takes a batch)
                    exc.add_note(f"monadl.fold: while building the call's input ({a_type(x)}) with {block!r}{where}")
                raise
        if loom is not None:
            loom.done()
        if build is not None:
            build.done(_next_serial())
    finally:  # (its closures hold the runner: a cycle a batch, 13 MB of them in a soak test, till a collection)
        runner.closures.clear()
        for table in runner.tables:  # (and a recursive route's table holds itself, its loom with it: the same)
            table.clear()
        if loom is not None:  # (as its recorders hold the loom: `monadl.fold._loom_recorders`)
            loom.recorders.clear()
        runner.trail = _Trail()
    return outputs


@final
class _Runner:
    """The closures of one run, by block, and the routes and builds now open."""

    __slots__ = ("closures", "depth", "loom", "tables", "trail")

    def __init__(self, loom: Loom | None = None) -> None:
        self.closures: dict[Block[Any, Any], Run] = {}
        self.tables: list[dict[Any, tuple[Run, Any]]] = []  # (the routes': `run` clears them, as the closures)
        self.depth = 0
        self.trail = _Trail()
        self.loom = loom  # (a batch's: its `Function` blocks' calls are recorded there)

    def compiled(self, block: Block[Any, Any], nesting: int = 0) -> Run:
        f = self.closures.get(block)
        if f is None:
            f = self.closures[block] = self._compile(block, nesting)
        return f

    def _compile(self, block: Any, nesting: int) -> Run:  # (Any: each kind's attributes are read by its kind)
        kind = block._kind
        if kind is IMMEDIATE:
            cell = block._cell
            if cell is not None and self.loom is not None:
                return self.loom.caller(cell)
            f: Run = block._function()
            return f
        if nesting >= NESTING:
            return lambda x: evaluate(block, x, self.trail, self.loom)
        if kind is COMPOSITION:
            first = self.compiled(block.first, nesting + 1)
            then = block.second
            if then._kind is IMMEDIATE and then._cell is not None and self.loom is not None:
                return self.loom.caller(then._cell, first)  # (a `Function` after: one call less a node)
            if then._kind is ROUTE:  # (a route after, a recursion's child: as one)
                return self._routing(then, first)
            second = self.compiled(then, nesting + 1)
            return lambda x: second(first(x))
        if kind is PARALLEL:
            return parallel(block, [self.compiled(b, nesting + 1) for b in block.blocks], self.trail)
        if kind is ROUTE:
            return self._routing(block)
        return self._build(block)

    def _routing(self, block: Any, first: Run | None = None) -> Run:
        """A route's closure, on what ``first`` makes of the input if given."""
        fixed = block._fixed()
        if fixed is not None and (fixed._kind is BUILD or (fixed._kind is ROUTE and fixed._fixed() is None)):
            if first is None or fixed._kind is BUILD:  # (a resolved declaration: its block's, which counts the depth)
                then = self.compiled(fixed)
                return then if first is None else lambda x: then(first(x))
            block = fixed
        keyed = block._keyed()  # (else the block it routes to is its own key)
        key, case = (block._route, _itself) if keyed is None else keyed
        return self._route(block, key, case, keyed is not None, first)

    def _route(
        self, block: Any, key: Callable[[Any], Any], case: Callable[[Any, Any], Any], cases: bool, first: Run | None
    ) -> Run:
        """A route (a `OneOf`, a forward declaration) that picks ``case(k, x)``
        for its input's key ``k``: the closure of each key's block, compiled
        when first picked (a declaration refers to itself); the key is
        computed once per input (it may be random). ``cases``: a `OneOf`'s
        (an error's path names its case: `Case`); ``first``: made of the
        input first (a composition's), as one closure."""
        table: dict[Any, tuple[Run, Any]] = {}
        self.tables.append(table)
        compiled, trail = self.compiled, self.trail

        def routed(x: Any) -> Any:
            if first is not None:
                x = first(x)
            if self.depth >= DEPTH:
                return evaluate(block, x, trail, self.loom)  # (the rest of this input, on the heap)
            k = key(x)
            try:
                found = table.get(k)
            except TypeError:  # (an unhashable key, which a mapping of cases may take: no closure kept)
                chosen = case(k, x)
                found = compiled(chosen), chosen
            else:
                if found is None:
                    chosen = case(k, x)  # (a key with no case: the route's error)
                    found = table[k] = compiled(chosen), chosen
            self.depth += 1
            try:
                return found[0](x)
            except StopIteration:  # (not thrown into the builds, which mark no step for it: none here either)
                raise
            except Exception as exc:
                if cases:
                    trail.mark(exc, block._taken(found[1]), found[1], x)
                raise
            finally:
                self.depth -= 1

        return routed

    def _build(self, block: Any) -> Run:
        closures, compiled, trail = self.closures, self.compiled, self.trail

        def built(x: Any) -> Any:
            if self.depth >= DEPTH:
                return evaluate(block, x, trail, self.loom)
            requests = block._build(x)
            sent = None
            self.depth += 1
            try:
                while True:
                    try:
                        sub, arg = requests.send(sent)
                    except StopIteration as done:
                        return done.value
                    while True:  # (a second turn only where the build caught a sub-block's error and asks again)
                        try:
                            sent = (closures.get(sub) or compiled(sub))(arg)
                            break
                        except StopIteration:  # (not thrown in: a generator would turn it into a RuntimeError)
                            raise
                        except Exception as exc:  # thrown into the build, which may catch it
                            traceback = exc.__traceback__
                            step = block._step(requests.gi_frame.f_locals)  # (before the throw ends it)
                            try:
                                asked = sub, arg
                                sub, arg = requests.throw(exc)
                            except StopIteration as done:
                                trail.forget()
                                return done.value
                            except Exception as passed:
                                if passed is exc:  # (not caught: raised as it came, the build's frames not added)
                                    passed.__traceback__ = traceback
                                    trail.mark(exc, step, *asked)
                                raise
                            trail.forget()
            finally:
                self.depth -= 1

        return built


def _itself(block: Any, x: Any) -> Any:
    return block
