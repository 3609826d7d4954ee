"""Ctrl-C held while weights are written, so that a step lands whole or not at all.

Python raises `KeyboardInterrupt` between any two bytecodes of the main
thread. A commit checks every step before it writes any, so an interrupt
there changes nothing; but one in the middle of its writes (several
weights, each its data, its state) left some weights stepped and others
not (a user's notebook: 3 in 25 interrupted loops under plain SGD). While a
commit writes, `hold` puts a handler in place that only notes the signal;
`release` puts the old one back and calls it with the noted signal, once
every write is done.

Only where the handler in place raises at once: Python's own (a script, the
``python -m asyncio`` REPL, a notebook) or trio's (which raises in code it
does not protect). asyncio's runner (``asyncio.run``, ``anyio.run``) turns
a Ctrl-C into the cancellation of its main task, which takes effect at an
await, never inside a commit; there the two system calls of a swap (7-14 us
on a loaded 2-core VM) are not paid. Only the main thread runs signal
handlers, so elsewhere nothing is held.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

__all__ = ["hold", "release"]

Held = tuple[Any, list[FrameType | None]] | None


def hold() -> Held:
    """Note Ctrl-C instead of acting on it, until `release`."""
    if threading.get_ident() != threading.main_thread().ident:
        return None
    handler = signal.getsignal(signal.SIGINT)
    if handler is not signal.default_int_handler and not getattr(handler, "__module__", "").startswith("trio"):
        return None  # (asyncio's runner: a cancellation at an await; ignored; the system's; set outside Python)
    noted: list[FrameType | None] = []
    signal.signal(signal.SIGINT, lambda signum, frame: noted.append(frame))
    return handler, noted


def release(held: Held) -> None:
    """Put the handler back, and call it if a Ctrl-C came meanwhile."""
    if held is None:
        return
    handler, noted = held
    signal.signal(signal.SIGINT, handler)
    if noted:
        handler(signal.SIGINT, noted[0])
