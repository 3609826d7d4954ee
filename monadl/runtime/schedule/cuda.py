"""CuPy on the GPU: a CUDA stream per parallel branch, and waiting without blocking.

The rules already compute in CuPy when their operands are CuPy arrays
(`monadl._namespace`); kernels are queued on the current CUDA stream and the
host goes on. This module adds what a GPU needs beyond that:

* **Streams.** A layer graph on the device is launched from the event loop's
  thread (no worker threads: launching is cheap, the GPU runs the kernels),
  with its independent branches on separate non-blocking streams so that
  their kernels may overlap. Streams are assigned walking back from the
  roots: a node's first operand continues the node's stream, every other
  operand subgraph opens a branch on the next stream of a small reused pool
  (`Settings.cuda_streams` of them; 1 keeps everything on the caller's
  stream). Where a consumer runs on another stream than its producer, the
  consumer's stream waits for an event recorded after the producer: the GPU
  waits, the host never does. Every branch starts after the work already
  queued on the caller's stream, and at the end the caller's stream waits for
  every branch, so the backward pass and the optimizer steps (on the caller's
  stream) see every value. A stream is entered only around one node's
  synchronous launch, never across an ``await``.
* **Memory.** CuPy's pool keeps a free list per stream. Values made on a
  branch stream are freed only in the backward pass or later, after the
  caller's stream has waited for that branch, and a branch stream's next use
  waits for the caller's stream first, so a block is never reused while a
  kernel of another stream may still read it.
* **Waiting.** ``train()`` and ``predict()`` return device values that are
  ready to read: the caller's stream records an event and the coroutine polls
  ``Event.done`` with exponential back-off (10 us up to 1 ms), so the event
  loop keeps serving other tasks while the GPU works.

Nothing here runs unless CuPy is imported: `loaded` is one dict lookup.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import anyio

if TYPE_CHECKING:
    import cupy

    from monadl.runtime.evaluation import Records

__all__ = ["forward", "loaded", "on_device", "ready"]

_POLL_FIRST_S = 1e-5
_POLL_MAX_S = 1e-3


def loaded() -> bool:
    """Whether CuPy has been imported (if not, no value can be on a GPU)."""
    return "cupy" in sys.modules


def is_device_array(x: object) -> bool:
    return loaded() and isinstance(x, sys.modules["cupy"].ndarray)


def on_device(records: Records, order: list[Any]) -> bool:
    """Whether a graph computes on the GPU: some operand of its first layers is a CuPy array."""
    from monadl.layers._layer import Layer
    from monadl.layers._outputs import Outputs, StackedOutputs
    from monadl.layers._weight import Weight

    cp = sys.modules["cupy"]
    members = set(order)
    for node in order:
        for x in node._inputs:
            if type(x) is Layer and x in members:
                continue
            if type(x) is Layer or type(x) is Weight:
                # (not records[x]: a batched member's record would be made, holding its group for nobody to release)
                rec = records.get(x)
                value = records.places[x][0].value if rec is None else rec.value
            else:
                value = x
            kind = type(value)
            if kind is Outputs or kind is StackedOutputs:  # an operation's outputs: the library of its arrays
                value = value[0] if kind is Outputs else value.parts[0]
            if isinstance(value, cp.ndarray):
                return True
    return False


# ---- streams -------------------------------------------------------------------------------
_pool: list[cupy.cuda.Stream] = []


def _streams(count: int) -> list[cupy.cuda.Stream]:
    """``count`` non-blocking streams, created once and reused by every graph."""
    import cupy

    while len(_pool) < count:
        _pool.append(cupy.cuda.Stream(non_blocking=True))
    return _pool[:count]


def assign(order: list[Any], streams: int) -> list[int]:
    """The stream (0 .. streams-1) of each node of ``order``, branches apart.

    Walks back from the roots (nodes no other member consumes): a node's first
    operand in the graph continues its stream; each further operand that has
    no stream yet opens a branch on the next stream, round robin.

    >>> from monadl.layers._layer import Layer
    >>> a, b = Layer.__new__(Layer), Layer.__new__(Layer)
    >>> a._inputs = b._inputs = ()
    >>> c = Layer.__new__(Layer); c._inputs = (a, b)
    >>> assign([a, b, c], 4)
    [0, 1, 0]
    """
    from monadl.layers._layer import Layer

    index = {node: i for i, node in enumerate(order)}
    stream: list[int | None] = [None] * len(order)
    branches = 0
    for i in range(len(order) - 1, -1, -1):
        if stream[i] is None:  # a root (or a value only a later root uses)
            stream[i] = branches % streams
            branches += 1
        first = True
        for x in order[i]._inputs:
            j = index.get(x) if type(x) is Layer else None
            if j is None or stream[j] is not None:
                continue
            if first:
                stream[j] = stream[i]
                first = False
            else:
                stream[j] = branches % streams
                branches += 1
    return [s if s is not None else 0 for s in stream]


def forward(order: list[Any], streams: int, compute: Callable[[Any], Any]) -> None:
    """Run ``compute`` on each node of ``order``, with branches on their own streams."""
    import cupy

    from monadl.layers._layer import Layer

    colour = assign(order, streams)
    if max(colour) == 0:  # a single chain: the caller's stream, no events
        for node in order:
            compute(node)
        return
    caller = cupy.cuda.get_current_stream()
    pool = _streams(max(colour) + 1)
    start = caller.record()
    for s in set(colour):
        pool[s].wait_event(start)
    index = {node: i for i, node in enumerate(order)}
    # A producer needs an event only if a consumer runs on another stream.
    crossing = {
        index[x]
        for i, node in enumerate(order)
        for x in node._inputs
        if type(x) is Layer and x in index and colour[index[x]] != colour[i]
    }
    events: dict[int, cupy.cuda.Event] = {}
    for i, node in enumerate(order):
        stream = pool[colour[i]]
        for x in node._inputs:
            j = index.get(x) if type(x) is Layer else None
            if j is not None and colour[j] != colour[i]:
                stream.wait_event(events[j])
        with stream:  # entered only around a synchronous launch
            compute(node)
            if i in crossing:
                events[i] = stream.record()
    for s in set(colour):
        caller.wait_event(pool[s].record())


# ---- waiting ------------------------------------------------------------------------------
async def ready() -> None:
    """Return once everything queued so far on the current stream has run,
    polling an event with back-off instead of blocking the event loop."""
    import cupy

    event = cupy.cuda.Event(disable_timing=True)
    event.record()
    delay = _POLL_FIRST_S
    while not event.done:
        await anyio.sleep(delay)
        delay = min(2 * delay, _POLL_MAX_S)
