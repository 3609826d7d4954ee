"""An ``ml.loom()`` block: the calls of marked operations made in it are
recorded in a loom (`monadl.fold._loom`), open in the block's context while it
runs, and computed by depth as one node when the graph runs."""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager, suppress
from contextvars import Token
from typing import TYPE_CHECKING, Final, final

from monadl.fold._loom import Loom, in_words
from monadl.layers._recording import RECORDING, Recorder
from monadl.layers._site import caller_site, site_text

if TYPE_CHECKING:
    from monadl.layers._site import Site

__all__ = ["loom"]

_log: Final = logging.getLogger("monadl.batching")


@final
class _Block:
    """An ``ml.loom()`` block: its loom, open in this context while it runs."""

    __slots__ = ("loom", "site", "token")

    def __init__(self, site: Site) -> None:
        self.site = site
        self.loom: Loom | None = None
        self.token: Token[Recorder | None] | None = None

    def __enter__(self) -> None:
        if self.loom is not None:
            raise RuntimeError("ml.loom(): a block is entered once; write `with ml.loom():` for each")
        self.loom = Loom(self.site)
        self.token = RECORDING.set(self.loom)

    def __exit__(self, *exc: object) -> None:
        loom = self.loom
        assert loom is not None and self.token is not None
        with suppress(ValueError):  # (exited in another context: an abandoned generator's; closed, it records no more)
            RECORDING.reset(self.token)
        loom.done()  # (on an error too: the calls recorded so far are a graph the user may still hold)
        if loom.unrecorded and _log.isEnabledFor(logging.DEBUG):
            recorded = sum(len(g.firsts) for g in loom.groups.values())
            _log.debug(
                "the ml.loom() block at %s recorded %d calls and built %d as nodes: %s",
                site_text(self.site),
                recorded,
                sum(loom.unrecorded.values()),
                "; ".join(f"{n} with {in_words(reason)}" for reason, n in loom.unrecorded.items()),
            )


def loom() -> AbstractContextManager[None]:
    """A block whose calls of marked operations (`ml.operation`) are
    recorded and, when the graph runs, computed by depth: per depth and
    trace, one call of the operation's program on the members' stacked
    operands, as TF Fold's loom does (a Fold batch's `Function` calls are
    recorded so already: ``block.batch(inputs)``).

    A natural recursion over a batch of trees, each node a call of a marked
    cell, is then ONE node of the graph and a read per output, where without
    the block each call is a node that the runtime walks, groups and
    gathers every step (a Tree-LSTM at H = 128, 32 128-leaf trees:
    1.40-1.45x the trees a second; `BENCHMARKS.md`). Values and gradients are
    those of the same calls built outside a block.

    Recorded is a call made in the block's thread, before it ends, whose
    operands are each an output of the block's earlier recorded calls, a
    row of data (``X[i:i + 1]``, or ``ml.as_layer(x)`` of any shape), or an
    integer or boolean NumPy array (indices), and whose weights are NumPy's
    (it closes over them); any other call builds its node as outside a block
    (a float argument, a larger data array, a layer built otherwise, a
    weight passed in, another thread's call), and so does each call that reads its
    output: compute what joins calls inside the cell (``cell(l, r)``, not
    ``cell(ml.concatenate([l, r]))``, whose calls would all be nodes, slower
    than without the block); the logger ``monadl.batching`` says at DEBUG
    how many calls a block built as nodes and why. Every recorded call is
    computed when the graph that reads any of them runs, read or not, so
    keep a block to the calls one graph reads; the calls' data (index
    arrays, rows) are read when it runs, as a node's. It pays where many calls
    share a depth (the trees of a batch); a single sequence's steps are a
    group of one each (a chain of 2,000 steps: 2.7x the time of its nodes
    without the block). Batching off (``Settings(batching=False)``)
    or ``check_finite`` runs the calls one by one, an error naming the
    operation's line; so does a cell with a step that has no batching rule
    (a product by a stack of matrices, a convolution) with its own calls.
    Calls whose operands differ in shape (each example's own length: a CTC
    recursion's alpha) run as one batched call per pattern of shapes, as the
    runtime groups nodes (a new user's GRU+CTC, 1 example of 24 2 wider:
    50 ms, its nodes' 53; 299 ms before, every call one by one); many
    shapes make small groups, so pad them to a few where that pays. A block is one node: blocks in each of many
    examples evaluated together (``@ml.direct``) do not batch with each
    other (32 examples: 3.7x the time of no block), so make one block
    around the examples' calls, or none; an ``@ml.direct`` example makes
    its calls while it runs, after a block around the line that built it
    has closed (that block records nothing): write none for direct style,
    whose examples' nodes the runtime batches as they park.
    As one node, a block gives the event loop no turn among its calls: a
    cancellation or a timeout (``anyio.move_on_after``) takes effect when
    all of them have run (a new user's 2 ms timeout, batching off: 97 ms). A recorded call's output is read
    after the block: a graph run inside it that reads one is refused.
    Called without ``with`` (on a line of its own), it records nothing and
    warns so when it is dropped.

    >>> import anyio, numpy as np, monadl as ml
    >>> w = ml.Weight(np.ones((2, 2)))
    >>> cell = ml.operation(lambda h: ml.tanh(h @ w))
    >>> with ml.loom():
    ...     ends = [cell(cell(ml.as_layer(np.full((1, 2), x)))) for x in (0.5, 1.0)]
    >>> anyio.run(ml.concatenate(ends, axis=0).predict).round(3).tolist()
    [[0.909, 0.909], [0.959, 0.959]]
    """
    return _Block(caller_site())
