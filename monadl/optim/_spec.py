"""What an optimizer is, as text: monadl's transformations and the
hyperparameters they hold (their functions are closures: ``adam(0.1)``
closes over ``b1``, ``b2``, ``eps`` and the rate). Two optimizers built alike
read alike, in any process; another rate, another text. Data parallelism
compares it across ranks (`monadl.distributed`), and a transformation's repr
shows it; a refused step looks in it for an ``eps`` its weight's dtype
rounds to 0 (`monadl.optim._refusals`).

Only monadl's own closures are read, and only their numbers (in full: the
lists and tuples they hold opened, `join_schedules`' pieces): a function or
object of the user's (a schedule, a transformation of one's own) is named,
not opened. What it holds may rightly differ between processes (the rank
it logs on, a set whose order follows the process's hash seed, an object's
addresses) or be large (a table of rates), and two ranks would part over it
or wait for it.

>>> from monadl.optim import adam, constant_schedule, exponential_decay, join_schedules, sgd
>>> spec(adam(0.1))
'chain(scale_by_adam(b1=0.9, b2=0.999, eps=1e-08), scale(-0.1))'
>>> spec(sgd(exponential_decay(0.5, 0.9)))
'scale_by_learning_rate(schedule=exponential_decay(decay_rate=0.9, init_value=0.5, transition_steps=1))'
>>> spec(sgd(join_schedules([constant_schedule(0.1), constant_schedule(0.01)], [100])))
'scale_by_learning_rate(schedule=join_schedules(boundaries=[100], schedules=[constant_schedule(value=0.1), constant_schedule(value=0.01)]))'
>>> spec(sgd(lambda step: 0.1 / (step + 1)))
'scale_by_learning_rate(schedule=<lambda>)'
"""

from __future__ import annotations

import types
from typing import Any, Final

import numpy as np

__all__ = ["closure", "maker", "ours", "spec"]

DEPTH: Final = 8
"""How deeply monadl's closures are described (deeper: ``...``)."""


def spec(optimizer: Any) -> str:
    """``optimizer`` (a `GradientTransformation`, or any function or value an
    optimizer holds) as text: each of monadl's closures by the function that
    made it and the numbers it closes over (exactly: their repr), the user's
    functions and objects by their qualified names (`_named`)."""
    return _text(optimizer, DEPTH)


def _text(x: Any, depth: int) -> str:
    from monadl.optim.transforms import GradientTransformation, Scale

    if depth < 0:
        return "..."
    if x is None or isinstance(x, (bool, int, float, str)):
        return repr(x)
    if isinstance(x, np.generic) and x.dtype.kind in "biuf":
        return repr(x.item())
    if isinstance(x, GradientTransformation):
        return _transformation(x.init, x.update, depth)
    if isinstance(x, Scale):
        return f"scale({x.factor!r})"
    if type(x) is tuple:
        return f"({', '.join(_text(v, depth - 1) for v in x)})"
    if type(x) is list:  # (join_schedules' schedules and boundaries: a list held as its type's name hid them)
        return f"[{', '.join(_text(v, depth - 1) for v in x)}]"
    if isinstance(x, types.FunctionType) and ours(x):
        values = closure(x)
        if x.__qualname__ == "chain.<locals>.update":
            return f"chain({', '.join(_text(t, depth - 1) for t in values['transforms'])})"
        shown = ", ".join(f"{k}={_text(v, depth - 1)}" for k, v in sorted(values.items()))
        return f"{maker(x)}({shown})" if values else maker(x)
    return _named(x)


def _named(x: Any) -> str:
    """A function or object of the user's: its qualified name
    (``make_schedule.<locals>.<lambda>``), or its type's."""
    if isinstance(x, types.MethodType):
        return f"{_named(x.__self__)}.{x.__func__.__name__}"
    name = getattr(x, "__qualname__", None)
    if isinstance(name, str) and callable(x):
        return name
    return type(x).__qualname__


def ours(f: types.FunctionType) -> bool:
    return (f.__module__ or "").startswith("monadl.")


def _transformation(init: Any, update: Any, depth: int) -> str:
    """A transformation: its update's text, the numbers only its init holds
    added (adagrad's initial accumulator)."""
    text = _text(update, depth)
    if not (isinstance(init, types.FunctionType) and ours(init)):
        return text
    extra = {k: v for k, v in closure(init).items() if not _closure_holds(update, k)}
    if not extra:
        return text
    shown = ", ".join(f"{k}={_text(v, depth - 1)}" for k, v in sorted(extra.items()))
    return f"{text} with init({shown})"


def closure(f: types.FunctionType) -> dict[str, Any]:
    """The values a function closes over, by name (a cell not yet filled: skipped)."""
    values: dict[str, Any] = {}
    for name, cell in zip(f.__code__.co_freevars, f.__closure__ or ()):
        try:
            values[name] = cell.cell_contents
        except ValueError:
            continue
    return values


def _closure_holds(f: Any, name: str) -> bool:
    return isinstance(f, types.FunctionType) and name in f.__code__.co_freevars


def maker(f: types.FunctionType) -> str:
    """The function that made a closure (``scale_by_adam`` for its ``update``),
    or the function's own qualified name."""
    head, _, _ = f.__qualname__.partition(".<locals>.")
    return head
