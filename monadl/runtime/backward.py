"""The backward of one node: the only place where a delta goes upstream.

Every scheduler calls `backprop` on records whose deltas are complete (all
their consumers have sent theirs): the reverse sweep on all of an
evaluation's records at once, the counted release and the worker pool on one
at a time. It applies the record's delta rules, undoes broadcasting,
optionally checks for NaN and infinity, and adds each operand's share into
that operand's accumulator; then the record's delta and rules are dropped,
so their memory goes as soon as it can.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager
from itertools import islice
from typing import Any, Final

import numpy as np

from monadl.deltas import Outer, SparseRows, unbroadcast
from monadl.errors import NonFiniteError
from monadl.layers._non_finite import backward_made, finite_delta
from monadl.layers._primitives import WEIGHT_LAYER, shown
from monadl.layers._products import OuterRule
from monadl.runtime.evaluation import Evaluation, Record
from monadl.runtime.node import where

__all__ = ["backprop"]

_QUIET: Final = {"divide": "ignore", "over": "ignore", "under": "ignore", "invalid": "ignore"}


def backprop(
    records: Iterable[Record],
    check_finite: bool,
    lock: AbstractContextManager[Any] | None = None,
    pace: Evaluation | None = None,
    drop: bool = False,
) -> bool:
    """Send each record's summed delta to its operands, once, in the order given.

    Each record's delta must be complete when it is reached (all its
    consumers have sent theirs). Only operands that lead to a weight get a
    share. A layer built from a ``Do`` hands its delta to its tape's backward
    instead. A weight's record keeps its delta: it is the gradient.

    Args:
        records: the records to back-propagate (one, or a whole reverse sweep).
        check_finite: raise `NonFiniteError` if a share holds a NaN or an
            infinity, naming the operation and the user's line.
        lock: held while adding into an operand's accumulator, when other
            threads back-propagate records of the same evaluation.
        pace: the evaluation whose deadline stops it early, once
            `time.perf_counter` passes it (looked at every `stride` records,
            fitted to their cost), so the caller can give the event loop a turn.
        drop: a sweep's: each record's value and links to its operands go as
            soon as it is back-propagated (every consumer is behind it), so a
            large graph's arrays are freed a piece at a time, between the
            event loop's turns, and not at once at the end (a 90,000-node
            chain's: 34 ms with no turn).

    Returns:
        True if it stopped at the deadline (the iterator has records left).
    """
    if check_finite and np.geterr() != _QUIET:  # NumPy's warnings of what the check finds (errors under -W error)
        with np.errstate(all="ignore"):
            return backprop(records, check_finite, lock, pace, drop)
    if type(records) is tuple:  # a record or a few (the counted release, the pool): no chunks, no clock
        _backprop(records, check_finite, lock, False)
        return False
    remaining = iter(records)
    if pace is None:
        _backprop(list(remaining), check_finite, lock, drop)
        return False
    started = time.perf_counter()
    while True:  # in chunks, so that looking at the clock costs nothing per record
        stride = pace.stride
        chunk = list(islice(remaining, stride))
        _backprop(chunk, check_finite, lock, drop)
        if len(chunk) < stride:
            return False
        now = time.perf_counter()
        pace.paced(started, now)
        started = now
        if now > pace.deadline:
            return True


def _backprop(
    records: Sequence[Record], check_finite: bool, lock: AbstractContextManager[Any] | None, drop: bool
) -> None:
    for rec in records:
        delta = rec.delta
        vjps = rec.vjps
        if vjps is None:
            if rec.tape_backward is not None and delta is not None:
                rec.tape_backward(delta)
                rec.delta = None
            continue
        if delta is not None:
            # A sparse delta reached a layer: its rules expect arrays (but a weight's own node,
            # `ml.as_layer(w)`, passes its table's rows on, to step as the weight's own would).
            if type(delta) is SparseRows and rec.node._op is not WEIGHT_LAYER:
                delta = delta.to_dense()
            fits = rec.fits
            i = 0  # (indexing the rules beats zipping or enumerating them here)
            for r in rec.inputs:
                if r is not None and r.needs_grad:
                    try:
                        g: Any
                        if (
                            r.is_weight
                            and type(vjps[i]) is OuterRule
                            and not check_finite
                            and type(delta) is np.ndarray
                        ):
                            g = Outer(vjps[i].left, delta)  # a weight's delta from a few rows: kept as factors
                        else:
                            g = vjps[i](delta)
                        if g is None:  # no delta reaches this operand (an operation's unused output's)
                            i += 1
                            continue
                        if not fits:
                            value = r.value
                            if type(g) is not np.ndarray or type(value) is not np.ndarray or g.shape != value.shape:
                                g = _fit(g, value)
                    except NonFiniteError:  # (a step inside an operation's: named already)
                        raise
                    except Exception as exc:
                        exc.add_note(
                            f"monadl: in the backward of {shown(rec.node._op)}, layer built at {where(rec.node)}"
                        )
                        raise
                    if check_finite and type(g) is Outer:  # (an operation's weight delta, as factors)
                        g = g.dense()
                    if check_finite and not finite_delta(g):
                        raise NonFiniteError(backward_made(shown(rec.node._op), where(rec.node)))
                    if lock is None:
                        r.delta = g if r.delta is None else r.delta + g
                    else:
                        with lock:
                            r.delta = g if r.delta is None else r.delta + g
                i += 1
        rec.delta = None
        rec.vjps = None
        if drop:
            rec.value = None
            rec.inputs = ()


def _fit(delta: Any, value: Any) -> Any:
    """``delta`` with broadcasting undone, so that it has the shape of ``value``."""
    shape = getattr(value, "shape", ())
    return delta if getattr(delta, "shape", ()) == shape else unbroadcast(delta, shape)
