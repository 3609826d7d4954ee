"""Everything monadl does to the whole process, in one place.

The process is the user's: importing monadl changes nothing. Three tunings
were each measured to pay, and each is applied only while or after monadl
computes, and only when the settings allow it:

* **malloc** (`tune_malloc`): glibc serves large allocations with ``mmap``
  and gives them back with ``munmap`` on free, so every training step pays
  page faults to map its weight-sized temporaries again (here that tripled a
  small MLP step). Raising the mmap threshold (to its maximum, 32 MiB on
  64-bit) and the trim threshold keeps freed blocks in the heap for the next
  step, as other frameworks' caching allocators do; freed memory then stays
  with the process. Applied once, on the first ``train()``, ``predict()`` or gradients,
  when ``Settings.tune_process`` is on (``MONADL_TUNE_PROCESS=0`` in the
  environment turns it off by default), on glibc only.
* **The cyclic GC** (`advance`): paused during each synchronous stretch of
  the runtime (never across an await), when ``Settings.pause_gc`` and
  ``tune_process`` are on. An evaluation allocates thousands of short-lived
  objects and no cycles; collections would find nothing. A caller who turned
  the collector off keeps it off. And building a graph (user code, between
  evaluations) allocates a layer object per operation: at CPython's default
  threshold of 700 allocations the collector ran 746 times while a batch of
  32 Tree-LSTM trees was built (126,308 layers), 76-84% of the build's time,
  promoting the whole young graph again and again. On the first ``train()`` or
  ``predict()`` (`tune_gc`) the first generation's threshold is raised to
  `GC_THRESHOLD` (never lowered): 5 collections for that build, which took
  0.4-1.1 s instead of 2.5-2.9 s here. After each evaluation (`fit_gc`) it is
  raised further, to `GC_PER_NODE` allocations per layer of the graph just
  evaluated (at most `GC_THRESHOLD_MAX`): a program that builds and trains
  graphs of that size then never collects while it builds or evaluates one,
  since a graph freed after its step gives its allocations back to the count
  (CPython lowers the young generation's count when a tracked object is
  freed). The price:
  cyclic garbage (which only a collection frees) may wait for as many
  allocations before it goes.
* **BLAS threads** (`blas_limited`): while a graph runs on the worker pool
  (``workers > 1`` only), BLAS gets ``cores // workers`` threads per call so
  that branch threads and BLAS threads never oversubscribe the cores.
  OpenBLAS's thread count is process-wide, so the cap holds for other tasks'
  BLAS calls too while the graph is on the pool; it is restored after.

And one guarantee: **Ctrl-C held while weights are written** (`hold`,
`release`). Python raises `KeyboardInterrupt` between any two bytecodes of
the main thread; a commit checks every step before it writes any, but one
raised among its writes (several weights, each its data, its state) left
some weights stepped and others not (a user's notebook: 3 in 25 interrupted
loops under plain SGD). While a commit, ``ml.load`` or a rank's broadcast
writes, a handler that only notes the signal is in place, and the old one
is put back and called with it once every write is done. Only in the main
thread (the only one Python runs handlers in), when ``tune_process`` is on,
and where the handler in place raises at once: Python's own (a script, the
``python -m asyncio`` REPL, a notebook) or trio's. asyncio's runner
(``asyncio.run``, ``anyio.run``) turns a first Ctrl-C into a cancellation
at an await, never inside a commit, so there the swap's two system calls
(about 10 us on a loaded 2-core VM) are not paid on every step; a second
Ctrl-C there raises at once and is not held. SIGTERM, SIGHUP, SIGALRM,
SIGUSR1 and SIGUSR2 are held likewise where a Python handler is in place
(`OTHERS`): a user's, which may raise (``sys.exit`` on a scheduler's
SIGTERM).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import importlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import TYPE_CHECKING, Any, Final

from monadl.runtime.settings import current_settings

if TYPE_CHECKING:
    from threadpoolctl import ThreadpoolController, _ThreadpoolLimiter

__all__ = [
    "GC_PER_NODE",
    "GC_THRESHOLD",
    "GC_THRESHOLD_MAX",
    "advance",
    "blas_limited",
    "first_use",
    "fit_gc",
    "hold",
    "malloc_tuned",
    "release",
    "tune_gc",
    "tune_malloc",
]

GC_THRESHOLD: Final = 100_000
"""Allocations between two young-generation collections, once tuned (CPython's default: 700)."""

GC_PER_NODE: Final = 16
"""Young-generation threshold per layer of the largest graph evaluated. Building a
layer makes about 4 tracked objects (4.1 for a Tree-LSTM with every op a layer,
3.1 with its cell an operation), and evaluating it more, alive until the step
ends (6.2-6.5 a layer in all for the Tree-LSTM, 6.8-11.2 with operations): a
threshold under that peak makes one collection per step scan the whole live
graph (285 ms of a 1.4 s step, collecting nothing), so this leaves margin."""

GC_THRESHOLD_MAX: Final = 4_000_000
"""`fit_gc` raises the threshold no further (graphs of 250,000 layers)."""

_M_TRIM_THRESHOLD: Final = -1
_M_MMAP_THRESHOLD: Final = -3
_MMAP_THRESHOLD_MAX: Final = 32 * 1024 * 1024
_TRIM_THRESHOLD: Final = 1024 * 1024 * 1024

_malloc_tried = False
malloc_tuned = False
"""Whether glibc's thresholds have been raised in this process."""


def tune_malloc() -> bool:
    """Raise glibc's mmap and trim thresholds, once; returns whether that took effect.

    >>> isinstance(tune_malloc(), bool)
    True
    """
    global _malloc_tried, malloc_tuned  # a one-way, process-wide fact, like the allocator it describes
    if _malloc_tried:
        return malloc_tuned
    _malloc_tried = True
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    malloc_tuned = bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)) and bool(
        mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)
    )
    return malloc_tuned


def first_use(allowed: bool) -> None:
    """The tuning that ``Settings.tune_process`` allows, once, on the first
    ``train()``, ``predict()`` or gradients (a cheap test after that)."""
    if allowed and not _malloc_tried:
        tune_malloc()
        tune_gc()


def tune_gc() -> None:
    """Raise the young generation's collection threshold to `GC_THRESHOLD` (never lower it).

    >>> import gc
    >>> tune_gc(); gc.get_threshold()[0] >= GC_THRESHOLD
    True
    """
    first, *rest = gc.get_threshold()
    if first and first < GC_THRESHOLD:  # 0 means the user disabled automatic collection
        gc.set_threshold(GC_THRESHOLD, *rest)


def fit_gc(nodes: int) -> None:
    """Raise the young generation's threshold to ``GC_PER_NODE`` allocations per
    layer of a graph of ``nodes`` layers (at most `GC_THRESHOLD_MAX`; never lower
    it; never if the program disabled automatic collection), so that building
    such a graph again triggers no collection.

    >>> import gc
    >>> saved = gc.get_threshold()
    >>> fit_gc(200_000); gc.get_threshold()[0] >= 200_000 * GC_PER_NODE
    True
    >>> gc.set_threshold(*saved)
    """
    want = min(nodes * GC_PER_NODE, GC_THRESHOLD_MAX)
    first, *rest = gc.get_threshold()
    if first and want > first:
        gc.set_threshold(want, *rest)


def advance(step: Callable[[Any], Any], arg: Any, pause_gc: bool) -> Any:
    """One synchronous stretch of the runtime, with the cyclic GC paused if
    asked (and if it is on: a caller who turned it off keeps it off)."""
    # (``arg`` dropped once sent: where the step fails, this frame is in the traceback, and ``arg``
    # may hold an earlier failure, a cycle that kept the evaluation until a full collection)
    if not pause_gc or not gc.isenabled():
        try:
            return step(arg)
        finally:
            del arg
    gc.disable()
    try:
        return step(arg)
    finally:
        del arg
        gc.enable()


_blas: ThreadpoolController | None = None
_limit_lock = threading.Lock()
_limited = 0  # graphs on the pool now, in any event loop
_limiter: _ThreadpoolLimiter | None = None


@contextmanager
def blas_limited(workers: int) -> Iterator[None]:
    """BLAS at ``cores // workers`` threads per call while a graph is on the pool.

    Entered on the event loop's thread, never on a pool thread. OpenBLAS's
    threads are one process-wide pool, and threadpoolctl (from 3.8) lets only
    the thread that first set a limit change it, ignoring the others without
    a word: set from a pool thread, the limit was lost wherever the main
    thread had set one (a benchmark does), and each branch's products took
    every core (forking measured 30-40% slower than inline on 2 cores).
    Graphs on the pool at once share one limit, set by the first and restored
    by the last (from its own thread: with event loops in several threads
    forking at once, a restore from a thread other than threadpoolctl's
    controlling one is ignored too, and the limit stays until that thread
    sets one).
    """
    global _blas, _limited, _limiter
    with _limit_lock:
        if not _limited:
            if _blas is None:  # the controller scans the loaded libraries once
                from threadpoolctl import ThreadpoolController

                _blas = ThreadpoolController()
            _limiter = _blas.limit(limits=max(1, cores() // workers), user_api="blas")
        _limited += 1
    try:
        yield
    finally:
        with _limit_lock:
            _limited -= 1
            if not _limited and _limiter is not None:
                _limiter.restore_original_limits()
                _limiter = None


def cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# ---- Ctrl-C held while weights are written -------------------------------------------------
Held = tuple[list[tuple[int, Any]], list[tuple[int, FrameType | None]]] | None

_getsignal: Callable[[int], Any] = getattr(importlib.import_module("_signal"), "getsignal", signal.getsignal)
"""The C module's: `signal.getsignal` tries the handler as an enum first, and
the failed try formats its repr, under asyncio's runner a partial holding
the main task, whose repr formats the coroutine: 30 us on every step."""

_LOOPS: Final = ("asyncio", "trio")
"""The modules whose handlers of `OTHERS` are no user's: an event loop's,
which hands the signal to the loop (asyncio's wakes it through a file and
does nothing in the handler): held, they would cost a swap on every step."""

OTHERS: Final = tuple(
    getattr(signal, name) for name in ("SIGTERM", "SIGHUP", "SIGALRM", "SIGUSR1", "SIGUSR2") if hasattr(signal, name)
)
"""Signals held as Ctrl-C is where a Python handler of the user's is in place
(a batch scheduler's SIGTERM calling ``sys.exit``, a SIGALRM watchdog): its
exception, raised among a plain-SGD step's writes, left a large weight
stepped and the others not (a new user's trial: 4 in 12 interrupted runs).
Looking costs 0.2 us a step; a swap is made only where one is in place."""


def hold() -> Held:
    """Note Ctrl-C (and `OTHERS` with a Python handler) instead of acting on
    it, until `release` (see the module)."""
    if threading.get_ident() != threading.main_thread().ident or not current_settings().tune_process:
        return None
    handlers: list[tuple[int, Any]] = []
    handler = _getsignal(signal.SIGINT)
    if handler is signal.default_int_handler or getattr(handler, "__module__", "").startswith("trio"):
        handlers.append((signal.SIGINT, handler))  # (not asyncio's runner's: a cancellation at an await)
    for signum in OTHERS:
        handler = _getsignal(signum)
        if callable(handler) and not getattr(handler, "__module__", "").startswith(_LOOPS):
            handlers.append((signum, handler))  # (not the system's, ignored, set outside Python, or a loop's)
    if not handlers:
        return None
    noted: list[tuple[int, FrameType | None]] = []
    for signum, _ in handlers:
        signal.signal(signum, lambda signum, frame: noted.append((signum, frame)))
    return handlers, noted


def release(held: Held) -> None:
    """Put the handlers back, and call each whose signal came meanwhile: the
    first here (Ctrl-C's with the frame it came in), the others raised again,
    so that Python runs them as it runs signals that come together (one that
    raises leaves the next for the next line, not lost). Called after the
    writes' lock is let go: a handler may save a checkpoint, which takes it."""
    if held is None:
        return
    handlers, noted = held
    for signum, handler in handlers:
        signal.signal(signum, handler)
    came = list(dict.fromkeys([signum for signum, _ in noted]))  # (once each, in the order they came)
    if not came:
        return
    first = came[0]
    try:
        dict(handlers)[first](first, next(frame for signum, frame in noted if signum == first))
    finally:
        for signum in came[1:]:
            signal.raise_signal(signum)
