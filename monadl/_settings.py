"""Runtime settings, scoped with a context variable (no global mutable state).

Context variables follow anyio tasks and worker threads, so a setting made
around ``await loss.train()`` holds for everything that training runs.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, replace

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
            (forward, and backward when trained; see `monadl._parallel`).
        check_finite: raise `NonFiniteError` at the first operation whose
            forward value or backward delta holds a NaN or an infinity (on a
            GPU this waits for each value: for debugging).
        cuda_streams: CUDA streams that the independent branches of a graph
            of CuPy arrays spread over (see `monadl._cuda`); 1 runs every
            kernel on the caller's current stream.
        pause_gc: pause Python's cyclic garbage collector while the runtime
            computes (between the awaits of an evaluation; never across one).
            An evaluation allocates thousands of short-lived objects and no
            reference cycles, so the collections it would trigger find nothing
            and cost about an eighth of a small graph's time. Cycles that user
            code makes meanwhile are collected later, as usual.
    """

    workers: int = 1
    fork_threshold_s: float = 1e-3
    check_finite: bool = False
    cuda_streams: int = 4
    pause_gc: bool = True

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"workers must be at least 1, got {self.workers}")
        if self.fork_threshold_s < 0:
            raise ValueError(f"fork_threshold_s must be >= 0, got {self.fork_threshold_s}")
        if self.cuda_streams < 1:
            raise ValueError(f"cuda_streams must be at least 1, got {self.cuda_streams}")


def _default() -> Settings:
    workers = int(os.environ.get("MONADL_WORKERS", "1"))
    return Settings(workers=workers)


_current: ContextVar[Settings] = ContextVar("monadl_settings", default=_default())  # noqa: B039 - frozen, not mutable


def current_settings() -> Settings:
    """The settings in force here."""
    return _current.get()


@contextmanager
def settings(
    *,
    workers: int | None = None,
    fork_threshold_s: float | None = None,
    check_finite: bool | None = None,
    cuda_streams: int | None = None,
    pause_gc: bool | None = None,
) -> Iterator[Settings]:
    """Override settings inside a ``with`` block.

    >>> with settings(check_finite=True) as s:
    ...     s.check_finite
    True
    """
    old = _current.get()
    new = replace(
        old,
        workers=old.workers if workers is None else workers,
        fork_threshold_s=old.fork_threshold_s if fork_threshold_s is None else fork_threshold_s,
        check_finite=old.check_finite if check_finite is None else check_finite,
        cuda_streams=old.cuda_streams if cuda_streams is None else cuda_streams,
        pause_gc=old.pause_gc if pause_gc is None else pause_gc,
    )
    token = _current.set(new)
    try:
        yield new
    finally:
        _current.reset(token)
