"""Which input of a batch a layer was built for, for an error raised when
the graph runs.

A batch's builder (`monadl.fold`'s ``block.batch(inputs)``) builds one
graph for all its inputs, each input's layers at one line of the block, so
an error from one of them (an embedding's index out of range, a NaN under
``check_finite``) could not say which input's it was. Layers are numbered
in the order built (``Layer._serial``), so the builder keeps, per batch,
the first number of each input's layers (`BatchBuild`: one number an input,
and a weak reference to its block, whose text is made only for an error),
and an error's text looks the layer's number up (`built_for`).

Process-wide, as the numbers are: an error may be raised on any thread or
event loop, from a graph built on another. Bounded: the last `KEPT`
batches, of at most `KEPT_INPUTS` inputs in all (8 MiB), whose layers are
the ones a model evaluates next; a batch that built no layer is not kept.
A layer another thread built while a batch was built falls in that batch's
numbers too: the text says "built while".
"""

from __future__ import annotations

import weakref
from array import array
from bisect import bisect_right
from collections import deque
from typing import Any, Final, final

from monadl.layers._site import Site, site_text

__all__ = ["KEPT", "KEPT_INPUTS", "BatchBuild", "built_for"]

KEPT: Final = 64
"""Batches whose inputs an error's text can name."""
KEPT_INPUTS: Final = 1 << 20
"""Inputs of the kept batches in all (a number each): older batches go first."""


@final
class BatchBuild:
    """One batch's build: where each input's layers start (``starts[i]``, a
    layer number), where they end once `done`, its block and where."""

    __slots__ = ("block", "end", "shown", "site", "starts")

    def __init__(self, block: Any, site: Site) -> None:
        self.block = weakref.ref(block)
        self.site = site
        self.starts = array("q")
        self.end = -1
        self.shown: str | None = None  # (its block's text and line, made once: a check_finite run asks per node)

    def done(self, end: int) -> None:
        """The batch is built: layers numbered below ``end`` are its inputs'
        (each input took a number of its own: none else means no layer)."""
        self.end = end
        starts = self.starts
        if starts and end - starts[0] > len(starts):
            _keep(self)

    def text(self, serial: int) -> str:
        shown = self.shown
        if shown is None:
            block = self.block()
            what = "a Fold block's batch (the block since freed)" if block is None else f"{block!r}.batch"
            shown = self.shown = f", built while {what} at {site_text(self.site)} built input"
        return f"{shown} {bisect_right(self.starts, serial) - 1} (from 0) of {len(self.starts)}"


_KEPT: deque[BatchBuild] = deque()
_inputs = 0


def _keep(build: BatchBuild) -> None:
    global _inputs
    _KEPT.append(build)
    _inputs += len(build.starts)
    while len(_KEPT) > 1 and (len(_KEPT) > KEPT or _inputs > KEPT_INPUTS):
        _inputs -= len(_KEPT.popleft().starts)


def built_for(serial: int) -> str:
    """``, built while <block>.batch at file:line built input i (from 0) of
    n`` for a layer numbered ``serial`` built for a kept batch's input
    (outermost batch first where batches were built inside one), else
    ``""``. The kept batches end in order of their numbers, so the newest
    are read first, and a layer built after them all (any layer but a
    batch's) costs one comparison."""
    found: list[BatchBuild] = []
    for build in reversed(list(_KEPT)):
        if build.end <= serial:
            break
        if build.starts[0] <= serial:
            found.append(build)  # (an outer batch ends after the batches built inside it: first)
    return "".join(build.text(serial) for build in found)
