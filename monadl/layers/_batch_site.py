"""Which input of a batch a layer was built for, for an error raised when
the graph runs.

A batch's builder (`monadl.fold`'s ``block.batch(inputs)``) builds one
graph for all its inputs, each input's layers at one line of the block, so
an error from one of them (an embedding's index out of range, a NaN under
``check_finite``) could not say which input's it was. Layers are numbered
in the order built (``Layer._serial``), so the builder keeps, per batch,
the first number of each input's layers (`BatchBuild`: one number an input,
and the builder's text, which holds no block or weight alive), and an
error's text looks the layer's number up (`built_for`). The last `KEPT`
batches are kept, whose layers are the ones a model evaluates next.
A layer another thread built while a batch was built falls in that batch's
numbers too: the text says "built while".
"""

from __future__ import annotations

from array import array
from bisect import bisect_right
from collections import deque
from typing import Final, final

from monadl.layers._site import Site, site_text

__all__ = ["KEPT", "BatchBuild", "built_for"]

KEPT: Final = 64
"""Batches whose inputs an error's text can name (a number an input each)."""


@final
class BatchBuild:
    """One batch's build: where each input's layers start (``starts[i]``, a
    layer number), where they end once `done`, what built them and where."""

    __slots__ = ("end", "site", "starts", "what")

    def __init__(self, what: str, site: Site) -> None:
        self.what = what
        self.site = site
        self.starts = array("q")
        self.end = -1

    def done(self, end: int) -> None:
        """The batch is built: layers numbered below ``end`` are its inputs'."""
        self.end = end
        _KEPT.append(self)

    def input_of(self, serial: int) -> int | None:
        if not self.starts or not self.starts[0] <= serial < self.end:
            return None
        return bisect_right(self.starts, serial) - 1


_KEPT: deque[BatchBuild] = deque(maxlen=KEPT)


def built_for(serial: int) -> str:
    """``, built while <what> at file:line built input i of n`` for a layer
    numbered ``serial`` built for a kept batch's input (outermost batch
    first where batches were built inside one), else ``""``."""
    found = [(b, i) for b in list(_KEPT) if (i := b.input_of(serial)) is not None]
    found.sort(key=lambda bi: bi[0].starts[0] - bi[0].end)  # (the widest, outermost, first)
    return "".join(
        f", built while {b.what} at {site_text(b.site)} built input {i} (from 0) of {len(b.starts)}" for b, i in found
    )
