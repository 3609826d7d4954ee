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
that input runs on `evaluate`'s explicit stack, whose pending builds are on
the heap, and a tree of depth 100,000 never reaches Python's recursion
limit. Compositions and parallel blocks nest as deep as the structure, so a
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

from monadl.fold._inputs import a_type, shown
from monadl.fold._trail import _asked, _step, _Trail, parallel

if TYPE_CHECKING:
    from monadl.fold._block import Block, Request

X = TypeVar("X")
Y = TypeVar("Y")

COMPOSITION: Final = "composition"
ROUTE: Final = "route"
PARALLEL: Final = "parallel"
IMMEDIATE: Final = "immediate"
BUILD: Final = "build"

DEPTH: Final = 32
"""Routes and builds open at once before the explicit stack takes over: a
Tree-LSTM's level is one (its declaration is its leaf-or-internal choice),
and random 128-leaf trees are 11-20 levels deep."""
NESTING: Final = 8
"""Compositions and parallel blocks nested in one closure; with `DEPTH`,
at most 512 frames of the runner on Python's stack (its limit: 1,000)."""
LIMIT: Final = 1_000_000
"""Entries open at once on the explicit stack (its pending blocks, the
declarations open, and the routes followed to the block at hand) before a
run raises `RecursionError`. A tree's level holds a few of them (a
Tree-LSTM's: three; a block of one's own around a declaration adds one), so
a tree of depth 100,000 builds with up to ten a level; a recursion that
makes no progress and is not caught sooner (a new input object a level,
walked by a `Map`) stops there in a few seconds, at about 350 MB."""

Run = Callable[[Any], Any]
Open = tuple[tuple[int, int], Any]
"""On the evaluator's stack: a forward declaration building an input, until
its output comes: the two objects' ids (its key in the set of those open)
and the input, held so that no other object takes its id meanwhile."""


def run(block: Block[X, Y], xs: Iterable[X]) -> list[Y]:
    """The outputs of ``block`` on each of ``xs``, its sub-blocks compiled once for all of them.

    >>> from monadl.fold import InputTransform
    >>> run(InputTransform(len) >> InputTransform(str), ["ab", "c"])
    ['2', '1']
    """
    runner = _Runner()
    f = runner.compiled(block)
    outputs: list[Y] = []
    for x in xs:  # (an error of ``xs`` itself is no input's: no note)
        try:
            outputs.append(f(x))
        except Exception as exc:  # which input, and the block: the blocks' own lines are in the traceback
            n = len(outputs)
            where = runner.trail.where(exc, f"input {n}")
            exc.add_note(f"monadl.fold: while building input {n} ({a_type(x)}) of the batch with {block!r}{where}")
            raise
    return outputs


@final
class _Runner:
    """The closures of one run, by block, and the routes and builds now open."""

    __slots__ = ("closures", "depth", "trail")

    def __init__(self) -> None:
        self.closures: dict[Block[Any, Any], Run] = {}
        self.depth = 0
        self.trail = _Trail()

    def compiled(self, block: Block[Any, Any], nesting: int = 0) -> Run:
        f = self.closures.get(block)
        if f is None:
            f = self.closures[block] = self._compile(block, nesting)
        return f

    def _compile(self, block: Any, nesting: int) -> Run:  # (Any: each kind's attributes are read by its kind)
        kind = block._kind
        if kind is IMMEDIATE:
            f: Run = block._function()
            return f
        if nesting >= NESTING:
            return lambda x: evaluate(block, x, self.trail)
        if kind is COMPOSITION:
            first, second = self.compiled(block.first, nesting + 1), self.compiled(block.second, nesting + 1)
            return lambda x: second(first(x))
        if kind is PARALLEL:
            return parallel(block, [self.compiled(b, nesting + 1) for b in block.blocks], self.trail)
        if kind is ROUTE:
            fixed = block._fixed()
            if fixed is not None and (fixed._kind is BUILD or (fixed._kind is ROUTE and fixed._fixed() is None)):
                return self.compiled(fixed)  # (a resolved declaration: its block's closure, which counts the depth)
            keyed = block._keyed()  # (else the block it routes to is its own key)
            key, case = (block._route, _itself) if keyed is None else keyed
            return self._route(block, key, case)
        return self._build(block)

    def _route(self, block: Any, key: Callable[[Any], Any], case: Callable[[Any, Any], Any]) -> Run:
        """A route (a `OneOf`, a forward declaration) that picks ``case(k, x)``
        for its input's key ``k``: the closure of each key's block, compiled
        when first picked (a declaration refers to itself); the key is
        computed once per input (it may be random)."""
        table: dict[Any, Run] = {}
        compiled, trail = self.compiled, self.trail

        def routed(x: Any) -> Any:
            if self.depth >= DEPTH:
                return evaluate(block, x, trail)  # (the rest of this input, on the heap)
            k = key(x)
            try:
                f = table.get(k)
            except TypeError:  # (an unhashable key, which a mapping of cases may take: no closure kept)
                f = compiled(case(k, x))
            else:
                if f is None:
                    f = table[k] = compiled(case(k, x))  # (a key with no case: the route's error)
            self.depth += 1
            try:
                return f(x)
            finally:
                self.depth -= 1

        return routed

    def _build(self, block: Any) -> Run:
        closures, compiled, trail = self.closures, self.compiled, self.trail

        def built(x: Any) -> Any:
            if self.depth >= DEPTH:
                return evaluate(block, x, trail)
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


def _cyclic(block: Block[Any, Any], x: Any) -> RecursionError:
    return RecursionError(
        f"monadl.fold: {block!r} was applied to {shown(x)} while building that same object: a recursion that makes "
        "no progress, since a block's output is a function of its input; a cyclic input (a node that is its own "
        "descendant), or a route that reaches itself on the same input (a OneOf case that starts with the "
        "declaration it defines)"
    )


def _too_deep(block: Block[Any, Any]) -> RecursionError:
    return RecursionError(
        f"monadl.fold: more than {LIMIT:,} levels of recursion open at {block!r}; probably a recursion that makes "
        "no progress: a declaration resolved to itself, a route that reaches itself on the same input (a OneOf "
        "case that starts with the declaration it defines), or a cyclic input (a node that is its own descendant)"
    )


# ---- the explicit stack ---------------------------------------------------------------------------
@final
class _Outputs:
    """On the evaluator's stack: a parallel block's input and the outputs
    of its blocks so far."""

    __slots__ = ("blocks", "x", "ys")

    def __init__(self, blocks: tuple[Block[Any, Any], ...], x: Any) -> None:
        self.blocks = blocks
        self.x = x
        self.ys: list[Any] = []


@final
class _Then:
    """On the evaluator's stack: the second block of a composition, waiting for the first's output."""

    __slots__ = ("block",)

    def __init__(self, block: Block[Any, Any]) -> None:
        self.block = block


def evaluate(block: Block[X, Y], x: X, trail: _Trail | None = None) -> Y:
    """Run ``block`` on ``x`` with an explicit stack of suspended builds
    (for inputs deeper than `DEPTH`: its memory is the heap's); an error's
    path marked on ``trail``.

    >>> from monadl.fold import InputTransform
    >>> evaluate(InputTransform(len) >> InputTransform(str), "abc")
    '3'
    """
    stack: list[Any] = []  # suspended builds, compositions' second blocks (`_Then`), declarations open (`Open`)
    opened: set[tuple[int, int]] = set()  # (the keys of the declarations open)
    request: tuple[Block[Any, Any], Any] | None = (block, x)
    sent: Any = None
    sub: Any  # (a block of the kind read: typed Any, its attributes read without a cast per step)
    while True:
        try:
            if request is not None:
                sub, arg = request
                request = None
                levels = len(stack)  # (the recursion open: the pending blocks, and the routes followed below)
                while True:  # follow compositions and routes to a block that builds
                    kind = sub._kind
                    if kind is COMPOSITION:
                        first = sub.first
                        if first._kind is IMMEDIATE:  # its output now: no _Then to wait
                            arg = first._output(arg)
                            sub = sub.second
                            continue
                        stack.append(_Then(sub.second))
                        sub = first
                    elif kind is ROUTE:
                        levels += 1
                        if levels > LIMIT:
                            raise _too_deep(sub)
                        if sub._declares:
                            key = (id(sub), id(arg))
                            if key in opened:
                                raise _cyclic(sub, arg)
                            opened.add(key)
                            stack.append((key, arg))  # (a tuple: made without a call; it holds the input's id)
                        sub = sub._route(arg)
                    elif kind is PARALLEL and sub.blocks:  # its first block now, the others as outputs come
                        stack.append(_Outputs(sub.blocks, arg))
                        sub = sub.blocks[0]
                    else:
                        break
                if kind is IMMEDIATE:
                    sent = sub._output(arg)
                elif kind is PARALLEL:  # (of no blocks)
                    sent = ()
                else:
                    if levels >= LIMIT:
                        raise _too_deep(sub)
                    stack.append(sub._build(arg))
                    sent = None
            if not stack:
                result: Y = sent
                return result
            top = stack[-1]
            if type(top) is _Then:
                stack.pop()
                request = (top.block, sent)
                continue
            if type(top) is _Outputs:
                ys = top.ys
                ys.append(sent)
                if len(ys) < len(top.blocks):
                    request = (top.blocks[len(ys)], top.x)
                else:
                    stack.pop()
                    sent = tuple(ys)
                continue
            if type(top) is tuple:  # (an `Open`)
                stack.pop()
                opened.discard(top[0])
                continue
            try:
                request = top.send(sent)
            except StopIteration as done:
                stack.pop()
                sent = done.value
            except Exception:
                stack.pop()  # (its own code raised: it is finished)
                raise
        except Exception as exc:
            caught = _unwind(stack, opened, exc, trail)
            if caught is None:
                raise  # (as it was raised: its traceback has no frames of the builds it went through)
            request, sent = caught


def _unwind(
    stack: list[Any], opened: set[tuple[int, int]], error: Exception, trail: _Trail | None
) -> tuple[Request | None, Any] | None:
    """After a block's ``error``: the stack unwound to the nearest suspended
    build, which the error is thrown into (as a Python error goes to the
    nearest caller), the compositions, parallel blocks and declarations that
    waited above it dropped (their inputs no longer ``opened``). What that
    build does next: its next request, or None and its output. None where
    no build catches it, its traceback as it came (the
    builds it went through add no frames: through the stack they would be
    one a level); `StopIteration` is not thrown in (a generator would turn it
    into a `RuntimeError`). An error a build raises in its place goes on down
    the stack, and is raised if none catches it. Each build and parallel
    block it leaves marks its step on ``trail``."""
    if isinstance(error, StopIteration):
        return None
    thrown, traceback = error, error.__traceback__
    while stack:
        build = stack.pop()
        if type(build) is _Then:
            continue
        if type(build) is _Outputs:
            if trail is not None:
                i = len(build.ys)
                trail.mark(thrown, f"<block {i} of AllOf>", build.blocks[i], build.x)
            continue
        if type(build) is tuple:  # (an `Open`)
            opened.discard(build[0])
            continue
        if trail is not None:
            step, asked = _step(build), _asked(build)
        try:
            request = build.throw(thrown)
        except StopIteration as done:
            if trail is not None:
                trail.forget()
            return None, done.value
        except Exception as passed:
            if passed is not thrown:  # the build's own error, in place of the one thrown
                thrown, traceback = passed, passed.__traceback__
            elif trail is not None:
                trail.mark(thrown, step, *asked)
            continue
        if trail is not None:
            trail.forget()
        stack.append(build)
        return request, None
    thrown.__traceback__ = traceback
    if thrown is not error:
        raise thrown
    return None
