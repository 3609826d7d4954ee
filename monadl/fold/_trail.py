"""Where an error going out of the blocks came from: its path into the input.

A note's ``, at input 0['children'][1]: ..., given to ...`` is gathered on
the error's way out, and only then (a `_Trail`): each build it leaves says
which part of its input it was building, read from the build's live
variables (`Block._step`, through `_step` and `_asked`), and a parallel
block which of its blocks (its closures: `parallel`; on the explicit stack,
`_unwind`'s). Kept apart from the runner (`monadl.fold._run`, which marks
the trail and reads it for `run`'s note): how blocks run and where their
errors came from are two concerns, and the second costs nothing until an
error leaves a block.
"""

from __future__ import annotations

import reprlib
from collections import deque
from collections.abc import Callable
from types import GeneratorType
from typing import TYPE_CHECKING, Any, Final, final

from monadl.fold._inputs import shown

if TYPE_CHECKING:
    from monadl.fold._block import Block

Run = Callable[[Any], Any]  # (a compiled block, as `monadl.fold._run.Run`)

SHOWN: Final = 10
"""Steps of an error's path shown at each end: a tree thousands of levels
deep has a path as long, whose middle is cut."""


@final
class Case(str):
    """A `OneOf`'s step of an error's path, ``<case 'leaf' of OneOf>``: the
    case its input took, named for the innermost `OneOf` the error left."""

    __slots__ = ()

    @staticmethod
    def of(key: Any) -> Case:
        return Case(f"<case {reprlib.repr(key)} of OneOf>")


@final
class _Trail:
    """Where the error going out of the blocks came from: the steps of its
    path into the input (``[2]``, ``['children']``, ``<block 1 of AllOf>``),
    innermost first, the first and last `SHOWN` of them kept, and the block
    and input the innermost build had asked for. Marked by each build and
    parallel block the error leaves (none on the way in: building a node
    pays nothing for it); a build that catches the error forgets it."""

    __slots__ = ("block", "cased", "error", "inner", "outer", "skipped", "x")

    def __init__(self) -> None:
        self.error: BaseException | None = None
        self.inner: list[str] = []
        self.outer: deque[str] = deque(maxlen=SHOWN)
        self.skipped = 0
        self.block: Block[Any, Any] | None = None
        self.x: Any = None
        self.cased = False  # (the error's path names a OneOf's case: `case`)

    def mark(self, error: BaseException, step: str, block: Block[Any, Any], x: Any) -> None:
        """``error`` leaves a build at ``step``, which had asked ``block`` for its output on ``x``."""
        if error is not self.error:  # (a new error: its path starts here)
            self.error, self.block, self.x = error, block, x
            self.inner, self.outer, self.skipped, self.cased = [], deque(maxlen=SHOWN), 0, False
        if not step:
            return
        if type(step) is Case:  # (the innermost case alone: each level's of a tree would double a deep path)
            if self.cased:
                return
            self.cased = True
        if len(self.inner) < SHOWN:
            self.inner.append(step)
            return
        self.skipped += len(self.outer) == SHOWN
        self.outer.append(step)

    def forget(self) -> None:
        """The error was caught by a build: its path is no error's."""
        self.error = None

    def where(self, error: BaseException, name: str) -> str:
        """For the note of ``error``: the path into the input ``name``, the
        part there and the block it was given to; empty where no build or
        parallel block marked it."""
        if error is not self.error or self.block is None:
            return ""
        cut = f"...{self.skipped:,} more..." if self.skipped else ""
        path = "".join([*reversed(self.outer), cut, *reversed(self.inner)])
        return f", at {name}{path}: {shown(self.x)}, given to {self.block!r}"


def _step(build: GeneratorType[Any, Any, Any]) -> str:
    """The step of a suspended build's path (`Block._step`, from its live
    variables: its ``self``, the block, among them); read before an error
    is thrown into it, which ends it."""
    state = build.gi_frame.f_locals if build.gi_frame is not None else {}
    block = state.get("self")
    return block._step(state) if block is not None and hasattr(block, "_step") else "<...>"


def _asked(build: GeneratorType[Any, Any, Any]) -> tuple[Any, Any]:
    """The block and input a suspended build asked for (through `call`: that generator's variables)."""
    inner = build.gi_yieldfrom
    frame = getattr(inner, "gi_frame", None)  # (None where it asked with a bare ``yield``)
    state = frame.f_locals if frame is not None else {}
    return state.get("block"), state.get("x")


def parallel(block: Any, parts: list[Run], trail: _Trail) -> Run:
    """A parallel block's tuple, and on an error the step of its block that raised it (``i``: a local's store a block)."""
    mark = trail.mark

    def failed(exc: Exception, i: int, x: Any) -> None:
        mark(exc, f"<block {i} of AllOf>", block.blocks[i], x)

    if len(parts) == 2:
        a, b = parts

        def pair(x: Any) -> Any:
            i = 0
            try:
                y = a(x)
                i = 1
                return (y, b(x))
            except StopIteration:  # (not marked, as builds and routes leave it)
                raise
            except Exception as exc:
                failed(exc, i, x)
                raise

        return pair
    if len(parts) == 3:
        a, b, c = parts

        def triple(x: Any) -> Any:
            i = 0
            try:
                y = a(x)
                i = 1
                z = b(x)
                i = 2
                return (y, z, c(x))
            except StopIteration:
                raise
            except Exception as exc:
                failed(exc, i, x)
                raise

        return triple

    def every(x: Any) -> Any:
        ys: list[Any] = []
        try:
            for f in parts:
                ys.append(f(x))
        except StopIteration:
            raise
        except Exception as exc:
            failed(exc, len(ys), x)
            raise
        return tuple(ys)

    return every
