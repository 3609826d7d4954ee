"""The explicit stack that runs blocks past `monadl.fold._run.DEPTH`
levels (`evaluate`): its entries, and how an error unwinds it.

Its pending builds are on the heap, so a tree of depth 100,000 never
reaches Python's recursion limit. A block's error is thrown into the build
waiting for its output (``gen.throw``), so a block of one's own may catch a
sub-block's error around ``yield from call(...)``; one that no build catches
is raised as it was, each build and parallel block it leaves marking its
step on the run's `_Trail`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final, TypeVar, final

from monadl.fold._inputs import shown
from monadl.fold._kinds import COMPOSITION, IMMEDIATE, PARALLEL, ROUTE
from monadl.fold._trail import _asked, _step, _Trail

if TYPE_CHECKING:
    from monadl.fold._block import Block, Request
    from monadl.fold._loom import Loom

__all__ = ["LIMIT", "evaluate"]

X = TypeVar("X")
Y = TypeVar("Y")

Open = tuple[tuple[int, int], Any]
"""On the evaluator's stack: a forward declaration building an input, until
its output comes: the two objects' ids (its key in the set of those open)
and the input, held so that no other object takes its id meanwhile."""

LIMIT: Final = 1_000_000
"""Entries open at once on the explicit stack (its pending blocks, the
declarations open, and the routes followed to the block at hand) before a
run raises `RecursionError`. A tree's level holds a few of them (a
Tree-LSTM's: three, and one for its `OneOf`'s case taken; a block of one's
own around a declaration adds one), so
a tree of depth 100,000 builds with up to ten a level; a recursion that
makes no progress and is not caught sooner (a new input object a level,
walked by a `Map`) stops there in a few seconds, at about 350 MB."""


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
class _Taken:
    """On the explicit stack, a `OneOf`'s case taken for an input: on an
    error's way out, its step (`Case`); else passed by."""

    __slots__ = ("chosen", "route", "x")

    def __init__(self, route: Any, chosen: Any, x: Any) -> None:
        self.route, self.chosen, self.x = route, chosen, x


@final
class _Then:
    """On the evaluator's stack: the second block of a composition, waiting for the first's output."""

    __slots__ = ("block",)

    def __init__(self, block: Block[Any, Any]) -> None:
        self.block = block


def evaluate(block: Block[X, Y], x: X, trail: _Trail | None = None, loom: Loom | None = None) -> Y:
    """Run ``block`` on ``x`` with an explicit stack of suspended builds
    (for inputs deeper than `DEPTH`: its memory is the heap's); an error's
    path marked on ``trail``; a batch's `Function` calls recorded by its ``loom``.

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
                            arg = (
                                first._output(arg)
                                if loom is None or first._cell is None
                                else loom.caller(first._cell)(arg)
                            )
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
                        if sub._cases:  # (a `OneOf`: an error's path names its case)
                            chosen = sub._route(arg)
                            stack.append(_Taken(sub, chosen, arg))
                            sub = chosen
                        else:
                            sub = sub._route(arg)
                    elif kind is PARALLEL and sub.blocks:  # its first block now, the others as outputs come
                        stack.append(_Outputs(sub.blocks, arg))
                        sub = sub.blocks[0]
                    else:
                        break
                if kind is IMMEDIATE:
                    sent = sub._output(arg) if loom is None or sub._cell is None else loom.caller(sub._cell)(arg)
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
            if type(top) is _Taken:
                stack.pop()
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
        if type(build) is _Taken:
            if trail is not None:
                trail.mark(thrown, build.route._taken(build.chosen), build.chosen, build.x)
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
