"""Runtime settings, scoped with a context variable (no global mutable state).

Context variables follow anyio tasks and worker threads, so a setting made
around ``await loss.train()`` holds for everything that training runs.
"""

from __future__ import annotations

import os
from contextlib import ContextDecorator
from contextvars import ContextVar, Token
from dataclasses import dataclass, replace
from typing import Final, final

import numpy as np

__all__ = ["Settings", "current_settings", "settings"]


@dataclass(frozen=True, slots=True)
class Settings:
    """How the runtime evaluates layers.

    Attributes:
        workers: worker threads available to parallel branches (the paper's
            "thread pool size"). 1 never forks.
        fork_threshold_s: a graph forks only when its measured cost on the
            last two evaluations of the same model code exceeds twice this (a
            thread hop costs tens of microseconds; forking must pay for it),
            and only while it measures faster on the pool than inline
            (forward, and backward when trained; see `monadl.runtime.schedule.pool`).
        check_finite: raise `NonFiniteError` at the first operation whose
            forward value or backward delta holds a NaN or an infinity (on a
            GPU this waits for each value: for debugging).
        cuda_streams: CUDA streams that the independent branches of a graph
            of CuPy arrays spread over (see `monadl.runtime.schedule.cuda`); 1 runs every
            kernel on the caller's current stream.
        pause_gc: pause Python's cyclic garbage collector while the runtime
            computes (between the awaits of an evaluation; never across one).
            An evaluation allocates thousands of short-lived objects and no
            reference cycles, so the collections it would trigger find nothing
            and cost about an eighth of a small graph's time. Cycles that user
            code makes meanwhile are collected later, as usual.
        batching: run nodes of equal signature as one kernel, forward and
            backward (see `monadl.runtime.schedule.batched`): None decides by a
            cost rule, True and False force it. None is usually the right
            choice: it batches the groups that pay already, and True batches
            also those the rule leaves alone (small graphs, groups under
            their minimum, members over 16,384 elements), which for small
            ops cost more than they save (a CRF's steps of 5 tags: 1.1-1.3x
            the time of None's). False: the examples of a
            batch still park at their graphs and merge, as
            `monadl.runtime.schedule.fibers` says, each merged graph run
            node by node, so that they step in one order on or off.
            Under ``check_finite`` nothing is batched. The rule: a graph of fewer than 256 nodes
            (a marked cell's node counted as its ops) runs as it is, unless 8 of its nodes read a weight of
            16,384 elements or more (across control flow, a merge of fewer than 10
            examples' graphs alike (ending at one line, or a model's steps), and of 256 nodes), as does one
            whose widest level has one node; in a graph that batches, a group of marked cells
            (`ml.operation`) batches from 2 members where the weights a call reads hold 32,768
            elements or more, from 3 where 8,192 or more or its program has 6 steps or more, else
            from 4; of another op from 8
            (from 4, products whose members each multiply 2 rows or more by a
            weight of 262,144 elements or more, 1,048,576 multiply-adds or
            more: one call packs the weight once; across control flow,
            products and lookups by a weight of 16,384 elements or more),
            and not where each member is over 16,384 elements (of an elementwise op, its result: a large layer scaled by
            many numbers runs node by node). A graph whose groups hold under a third of its nodes, none of
            them marked cells, one-row products by a weight of 16,384 elements or more or products that
            pack a weight, runs node by node until analysed again, as one that batched nothing: 1, 2, 4, ...
            and at most 32 evaluations later.
        finite_steps: refuse an optimizer step that would write a NaN or an
            infinity into a weight (``train()`` raises `NonFiniteError` naming
            the weight, and no weight changes), as a mixed-precision loss
            scaler skips such a step. One dot product per weight per step;
            on a GPU, one flag per step read back to the host, which waits
            for the step's kernels (False: a step that never waits). A NaN
            loss whose gradients are finite (``log`` of a negative number,
            whose delta is finite) still steps: ``check_finite`` stops at the
            operation that made it.
        tune_process: let monadl tune the process for its allocation pattern:
            glibc's malloc thresholds and the cyclic GC's young-generation
            threshold, raised on the first ``train()``, ``predict()`` or gradients (see
            `monadl.runtime.process`), the GC pause above, and Ctrl-C held
            while a step writes its weights (so that it lands whole). False
            leaves the whole process as it is (``pause_gc`` is then ignored). The environment variable ``MONADL_TUNE_PROCESS=0``
            sets the default.
        yield_interval_s: the longest stretch of computation between two
            checkpoints where the runtime gives the event loop a turn (other
            tasks run; cancellation, timeouts and Ctrl-C take effect there,
            with no weight changed), within an evaluation and across a loop
            of short ones. The clock is read after as many nodes as take
            about a quarter of it (1 to 32), so a turn comes within about
            the interval, unless one kernel alone runs longer (it is not
            interrupted).
    """

    workers: int = 1
    fork_threshold_s: float = 1e-3
    check_finite: bool = False
    cuda_streams: int = 4
    pause_gc: bool = True
    batching: bool | None = None
    finite_steps: bool = True
    tune_process: bool = True
    yield_interval_s: float = 0.005

    def __post_init__(self) -> None:
        # Types first: workers=2.5 failed deep in the pool later, check_finite="no" turned the check on.
        for name in ("workers", "cuda_streams"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
        for name in ("check_finite", "pause_gc", "finite_steps", "tune_process"):
            value = getattr(self, name)
            if not isinstance(value, (bool, np.bool_)):
                raise TypeError(f"{name} must be True or False, got {type(value).__name__} {value!r}")
        if self.batching is not None and not isinstance(self.batching, (bool, np.bool_)):
            raise TypeError(f"batching must be True, False or None (by the cost rule), got {self.batching!r}")
        for name in ("fork_threshold_s", "yield_interval_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
                raise TypeError(f"{name} must be a number of seconds, got {type(value).__name__} {value!r}")
        if self.workers < 1:
            raise ValueError(f"workers must be at least 1, got {self.workers}")
        if not self.fork_threshold_s >= 0:  # (NaN too; infinity: never fork)
            raise ValueError(f"fork_threshold_s must be >= 0, got {self.fork_threshold_s}")
        if self.cuda_streams < 1:
            raise ValueError(f"cuda_streams must be at least 1, got {self.cuda_streams}")
        if not self.yield_interval_s > 0:  # (NaN too; infinity: never a turn, as with no event loop)
            raise ValueError(f"yield_interval_s must be > 0, got {self.yield_interval_s}")


def _default() -> Settings:
    text = os.environ.get("MONADL_WORKERS", "1")
    try:
        workers = int(text)
    except ValueError:
        raise ValueError(f"the environment variable MONADL_WORKERS must be an int >= 1, got {text!r}") from None
    if workers < 1:
        raise ValueError(f"the environment variable MONADL_WORKERS must be an int >= 1, got {text!r}")
    tune = os.environ.get("MONADL_TUNE_PROCESS", "1") != "0"
    return Settings(workers=workers, tune_process=tune)


_current: ContextVar[Settings] = ContextVar("monadl_settings", default=_default())  # noqa: B039 - frozen, not mutable
_entered: ContextVar[tuple[tuple[Override, Token[Settings]], ...]] = ContextVar("monadl_settings_entered", default=())
"""Each context's entries of `settings` objects (a thread's, a task's): with the tokens that undo them, innermost last."""


def current_settings() -> Settings:
    """The settings in force here."""
    return _current.get()


@final
class _Keep:
    """The default of a setting whose None means something (keep it as it is)."""

    def __repr__(self) -> str:  # (as help(ml.settings) shows the default)
        return "unchanged"


_KEEP: Final = _Keep()


def settings(
    *,
    workers: int | None = None,
    fork_threshold_s: float | None = None,
    check_finite: bool | None = None,
    cuda_streams: int | None = None,
    pause_gc: bool | None = None,
    batching: bool | _Keep | None = _KEEP,
    finite_steps: bool | None = None,
    tune_process: bool | None = None,
    yield_interval_s: float | None = None,
) -> Override:
    """Override settings inside a ``with`` block (each time it is entered:
    one object may serve several blocks, over the settings of each).

    >>> with settings(check_finite=True) as s:
    ...     s.check_finite
    True
    """
    return Override(
        {
            "workers": workers,
            "fork_threshold_s": fork_threshold_s,
            "check_finite": check_finite,
            "cuda_streams": cuda_streams,
            "pause_gc": pause_gc,
            "finite_steps": finite_steps,
            "tune_process": tune_process,
            "yield_interval_s": yield_interval_s,
        },
        batching,
    )


@final
class Override(ContextDecorator):
    """What `settings` returns: a context manager that overrides the settings
    given (the others as they are where it is entered), re-entrant, and in
    several threads and tasks at once; a decorator too (in force during each
    call: `monadl._scope.Scope`)."""

    __slots__ = ("_batching", "_given")

    def __init__(self, given: dict[str, object], batching: bool | _Keep | None) -> None:
        self._given = {k: v for k, v in given.items() if v is not None}
        self._batching = batching

    def __enter__(self) -> Settings:
        old = _current.get()
        changes = dict(self._given)
        if not isinstance(self._batching, _Keep):
            changes["batching"] = self._batching
        new = replace(old, **changes)  # type: ignore[arg-type]
        _entered.set((*_entered.get(), (self, _current.set(new))))
        return new

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, *_: object) -> None:
        entered = _entered.get()
        at = next((i for i in range(len(entered) - 1, -1, -1) if entered[i][0] is self), None)
        try:
            if at is None:
                raise ValueError
            _current.reset(entered[at][1])  # (ValueError: a token of another context, a thread's that copied it)
        except ValueError:
            said = (
                "ml.settings(...) was left in a thread or task that did not enter it (a with block must end where "
                "it began); its settings stay in force where it was entered"
            )
            if error is not None:  # (the body's own failure, or a generator closed elsewhere, is the one raised)
                error.add_note(f"monadl: {said}")
                return
            raise RuntimeError(said)  # noqa: B904  (the ValueError is the context: a token of another context)
        _entered.set(entered[:at] + entered[at + 1 :])
