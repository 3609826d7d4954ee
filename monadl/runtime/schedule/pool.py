"""Running a coarse layer graph on a pool of worker threads.

Forking costs tens of microseconds (a thread hop, a lock, a BLAS setting), so
the runtime forks only where that is small against the work: a graph may run
on the pool when the last two evaluations of a graph built at the same line of
user code each did at least twice ``fork_threshold_s`` of work in all, and at
least `MIN_NODE_SECONDS` per node. (Two, because a first evaluation pays for
first-touch allocations and would look coarser than it is.) Everything else
runs inline on the event loop's thread, which costs nothing extra.

Coarse is not enough: inline, BLAS has every core for each call; forked, each
branch's calls get ``cores // workers``, and where the work is large matrix
products BLAS may use the cores as well as branches do or better (on 2 cores,
the columns benchmark at 512 hidden units and batch 256 trained 10% faster
forked with all 20 classifiers, 5% slower with one). So a coarse graph is
timed both ways, its wall time on the pool against its time inline (forward,
and backward when it trains), each the smaller of its last two measurements,
and runs the faster way; every `REPROBE`-th evaluation runs the other way, so
the choice follows the machine and the data.

On the pool, scheduling is by dependency counts. A worker that finishes a node
goes straight on with one consumer it made ready and queues only the others,
so new work reaches the queue (and another thread) only where the graph
branches, not once per node. The backward pass runs the same way over the
reference counts of the paper: a record whose last consumer released it is
ready; its backward is `backprop`, as everywhere. While the pool runs, BLAS
gets ``cores // workers`` threads per call, so branch threads and BLAS threads
never oversubscribe the cores (the limit is set from the event loop's thread:
see `monadl.runtime.process.blas_limited`), and the event loop stays free (the
pool is awaited through a worker thread).

Nothing here runs unless ``workers > 1``: with one worker no graph is timed
and no cost is kept.

The first exception raised in a branch stops the others from starting new
nodes and surfaces as itself once every branch has stopped.
"""

from __future__ import annotations

import contextvars
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import TYPE_CHECKING, Any, Final

import anyio.to_thread

from monadl.layers._layer import Layer
from monadl.layers._weight import Weight
from monadl.runtime.backward import backprop
from monadl.runtime.evaluation import Evaluation
from monadl.runtime.node import compute
from monadl.runtime.process import blas_limited

if TYPE_CHECKING:
    from monadl.layers._site import Site

__all__ = ["MIN_NODE_SECONDS", "REPROBE", "backward", "forward", "measured", "settle", "worth_forking"]

MIN_NODE_SECONDS: Final = 20e-6
"""Below this mean work per node, per-node scheduling would cost too much."""

REPROBE: Final = 32
"""A coarse graph runs the way it did not choose once in this many
evaluations, times how many times slower that way measured (a probe then
costs at most about 1/32 of the time, however badly that way loses: a
batched graph of a user's GNN, six times slower on the pool unbatched,
lost a quarter of its time to a probe every 32 steps)."""

_COSTS_LIMIT: Final = 4096


class _Cost:
    """What the evaluations of one graph measured, by the way they ran.

    ``inline`` and ``forked`` hold the last two measurements of each way, in
    seconds (the forward, with the backward when trained; see `settle`); a
    way is judged by the smaller, 0.0 standing for "not measured".
    """

    __slots__ = ("forked", "inline", "nodes", "visits")

    def __init__(self, nodes: int) -> None:
        self.inline = (0.0, 0.0)
        self.forked = (0.0, 0.0)
        self.nodes = nodes
        self.visits = 0


# By the site (code and instruction) that built a graph's root, and whether
# it was trained (forward and backward timed) or not. A bounded cache, not a
# registry: losing an entry only means measuring again.
_costs: dict[tuple[Site, bool], _Cost] = {}


def _site(order: list[Any]) -> Site:
    site: Site = order[-1]._site
    return site


def _entry(ev: Evaluation, order: list[Any]) -> _Cost:
    key = (_site(order), ev.train)
    cost = _costs.get(key)
    if cost is None:
        if len(_costs) >= _COSTS_LIMIT:
            _costs.clear()
        cost = _costs[key] = _Cost(len(order))
    cost.nodes = len(order)
    return cost


def measured(ev: Evaluation, order: list[Any], seconds: float, forked: bool = False) -> None:
    """Note one graph's forward time in ``ev``: its work inline, or its wall
    time on the pool when ``forked``."""
    ev.timings.append((_entry(ev, order), forked, seconds))


def settle(ev: Evaluation, backward_seconds: float) -> None:
    """At the end of an evaluation, record the times its graphs took.

    When it timed one graph, the backward (of the whole evaluation, forked
    with that graph or not) counts with it: a training graph is judged by its
    forward and backward together. With more, each is judged by its forward.
    """
    timings = ev.timings
    for cost, forked, seconds in timings:
        if len(timings) == 1:
            seconds += backward_seconds
        if forked:
            cost.forked = (cost.forked[1], seconds)
        else:
            cost.inline = (cost.inline[1], seconds)
    timings.clear()


def worth_forking(ev: Evaluation, order: list[Any]) -> bool:
    cost = _costs.get((_site(order), ev.train))
    if cost is None:
        return False
    inline = min(cost.inline)  # 0.0 until two evaluations were measured
    if inline < 2 * ev.fork_threshold_s or inline < MIN_NODE_SECONDS * cost.nodes:
        return False
    # Layers built from a Do may await: those graphs stay on the event loop.
    if not all(node._op is not None for node in order):
        return False
    forked = min(cost.forked)
    if not forked:  # coarse, and not yet timed on the pool twice
        return True
    cost.visits += 1
    faster = forked < inline
    slower = max(forked, inline) / min(forked, inline)
    return not faster if cost.visits % (REPROBE * max(1, int(slower))) == 0 else faster


# ---- the pool ---------------------------------------------------------------------------
class _Helpers:
    """The process's pool of helper threads, with the process it belongs to.

    A child that ``fork()`` made inherits the parent's pool without its
    threads (fork copies only the calling thread): work submitted to it
    would wait forever. So the pool is its process's, by id, and a child
    makes its own (``os.getpid()``: about 0.2 us a pass, against tens of
    microseconds of a thread hop), with no hook on the whole process
    (``os.register_at_fork``). The lock is the process's too: one held by
    another of the parent's threads at the fork stays held in the child."""

    __slots__ = ("lock", "pid", "pool", "size")

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.lock = threading.Lock()
        self.pool: ThreadPoolExecutor | None = None
        self.size = 0


_pool = _Helpers()


def _helpers(workers: int) -> ThreadPoolExecutor:
    """The shared pool of ``workers - 1`` helper threads (the caller is the last worker)."""
    global _pool  # one pool per process, resized when the setting changes
    helpers = _pool
    if helpers.pid != os.getpid():  # a fork's child: the parent's threads are not here
        helpers = _pool = _Helpers()
    with helpers.lock:
        if helpers.pool is None or helpers.size != workers - 1:
            if helpers.pool is not None:
                helpers.pool.shutdown(wait=False)
            helpers.pool = ThreadPoolExecutor(max_workers=workers - 1, thread_name_prefix="monadl-worker")
            helpers.size = workers - 1
        return helpers.pool


def _run(workers: int, worker: Callable[[], None]) -> None:
    """Run ``worker`` on this thread and ``workers - 1`` helpers, each in a
    copy of this thread's context (the evaluation running, `READING`, and the
    settings: a backward of one's own that a helper runs sees them, so a
    train() there is refused as on this thread); re-raise the first error."""
    helpers = _helpers(workers) if workers > 1 else None  # (one worker: this thread alone)
    futures = [helpers.submit(contextvars.copy_context().run, worker) for _ in range(workers - 1) if helpers]
    try:
        worker()
    finally:
        errors = [f.exception() for f in futures]
    for error in errors:
        if error is not None:
            raise error


class _Schedule:
    """A ready queue with dependency counts, shared by the workers of one pass."""

    def __init__(self, ready: list[Any]) -> None:
        self.cv = threading.Condition()
        self.ready = deque(ready)
        self.active = 0  # items taken and not finished
        self.error: BaseException | None = None

    def take(self) -> Any:
        """The next ready item, or None when the pass is over (or failed)."""
        with self.cv:
            while not self.ready and self.active and self.error is None:
                self.cv.wait()
            if self.error is not None or not self.ready:
                self.cv.notify_all()
                return None
            self.active += 1
            return self.ready.popleft()

    def fail(self, error: BaseException) -> None:
        with self.cv:
            if self.error is None:
                self.error = error
            self.active -= 1
            self.cv.notify_all()

    def finish(self, newly_ready: list[Any]) -> Any:
        """Called under ``cv``: one finished item; keep one new item, queue the rest."""
        self.active -= 1
        keep = None
        if newly_ready and self.error is None:
            keep = newly_ready.pop()
            self.active += 1
            if newly_ready:
                self.ready.extend(newly_ready)
                self.cv.notify(len(newly_ready))
        if not self.active and not self.ready:
            self.cv.notify_all()
        return keep

    def work(self, step: Callable[[Any], Any]) -> None:
        """Loop: take an item, run ``step`` on it, continue with what it returns."""
        item = self.take()
        while item is not None:
            try:
                item = step(item)
            except BaseException as error:
                self.fail(error)
                return
            if item is None:
                item = self.take()


# ---- forward ------------------------------------------------------------------------------
async def forward(ev: Evaluation, order: list[Any]) -> None:
    """Compute every record of ``order`` on the pool (awaited from the event
    loop), and time it there and back."""
    started = time.perf_counter()
    with blas_limited(ev.workers):
        await anyio.to_thread.run_sync(partial(_forward, ev, order))
    measured(ev, order, time.perf_counter() - started, forked=True)


def _forward(ev: Evaluation, order: list[Any]) -> None:
    records = ev.records
    members = set(order)
    pending = dict.fromkeys(order, 0)
    holds = dict.fromkeys(order, 0)
    consumers: dict[Any, list[Any]] = {node: [] for node in order}
    for node in order:
        for x in node._inputs:
            kind = type(x)
            if kind is Layer and x in members:
                pending[node] += 1
                holds[x] += 1
                consumers[x].append(node)
            elif kind is Layer or kind is Weight:
                records[x].refcount += 1  # evaluated before this graph: hold it now
    schedule = _Schedule([node for node in order if not pending[node]])

    def step(node: Any) -> Any:
        rec = compute(ev, node, False)
        with schedule.cv:
            rec.refcount = holds[node]
            records[node] = rec
            ready = []
            for consumer in consumers[node]:
                pending[consumer] -= 1
                if not pending[consumer]:
                    ready.append(consumer)
            return schedule.finish(ready)

    _run(ev.workers, partial(schedule.work, step))
    if schedule.error is not None:
        raise schedule.error


# ---- backward --------------------------------------------------------------------------------
async def backward(ev: Evaluation, token: Any) -> None:
    """Release ``token`` with back-propagation on the pool."""
    with blas_limited(ev.workers):
        await anyio.to_thread.run_sync(partial(_backward, ev, token))


def _backward(ev: Evaluation, token: Any) -> None:
    roots: list[Any] = []
    work = [token]
    while work:  # a token of a forked graph is a record or a tuple of them
        t = work.pop()
        if type(t) is tuple:
            work.extend(t)
        elif t is not None:
            t.refcount -= 1
            if not t.refcount:
                roots.append(t)
    schedule = _Schedule(roots)

    def step(rec: Any) -> Any:
        backprop((rec,), ev.check_finite, schedule.cv)
        with schedule.cv:
            ready = []
            # (a record holding more than its inputs lists the rest as its release token)
            for r in rec.inputs if rec.release is None else (*rec.inputs, *rec.release):
                if r is not None:
                    r.refcount -= 1
                    if not r.refcount:
                        ready.append(r)
            return schedule.finish(ready)

    _run(ev.workers, partial(schedule.work, step))
    if schedule.error is not None:
        raise schedule.error
