"""What an optimizer is, as text: its functions and the hyperparameters they
hold (a `GradientTransformation`'s functions are closures: ``adam(0.1)``
closes over ``b1``, ``b2``, ``eps`` and the rate). Two optimizers built alike
read alike, in any process; another rate, another text. Data parallelism
compares it across ranks (`monadl.distributed`), and a transformation's repr
shows it.

>>> from monadl.optim.transforms import adam, exponential_decay, sgd
>>> spec(adam(0.1))
'chain(scale_by_adam(b1=0.9, b2=0.999, eps=1e-08), scale(-0.1))'
>>> spec(sgd(exponential_decay(0.5, 0.9)))
'scale_by_learning_rate(schedule=exponential_decay(decay_rate=0.9, init_value=0.5, transition_steps=1))'
"""

from __future__ import annotations

import functools
import hashlib
import types
from typing import Any, Final

import numpy as np

__all__ = ["spec"]

DEPTH: Final = 8
"""How deep a closure's values are described (deeper: ``...``)."""


def spec(optimizer: Any) -> str:
    """``optimizer`` (a `GradientTransformation`, or any function or value an
    optimizer holds) as text: the name of the function that made each closure
    and the values it closes over, numbers exactly (repr), arrays by dtype,
    shape and a digest of their bytes, other objects by type and their
    numeric attributes. A function of the user's also shows a digest of its
    code and constants (``lambda step: 0.1`` and ``lambda step: 0.2`` differ).
    """
    return _text(optimizer, DEPTH)


def _text(x: Any, depth: int) -> str:
    from monadl.optim.transforms import GradientTransformation, Scale

    if depth < 0:
        return "..."
    if x is None or isinstance(x, (bool, int, float, complex, str, bytes)):
        return repr(x)
    if isinstance(x, np.generic):
        return repr(x.item())
    if isinstance(x, np.ndarray):
        digest = hashlib.blake2b(np.ascontiguousarray(x).tobytes(), digest_size=4).hexdigest()
        return f"{x.dtype}{list(x.shape)}#{digest}"
    if isinstance(x, GradientTransformation):
        return _transformation(x.init, x.update, depth)
    if isinstance(x, Scale):
        return f"scale({x.factor!r})"
    if isinstance(x, (tuple, list)):
        inner = ", ".join(_text(v, depth - 1) for v in x)
        return f"({inner})" if isinstance(x, tuple) else f"[{inner}]"
    if isinstance(x, types.FunctionType):
        values = _closure(x)
        if x.__module__ == "monadl.optim.transforms" and x.__qualname__ == "chain.<locals>.update":
            return f"chain({', '.join(_text(t, depth - 1) for t in values['transforms'])})"
        shown = ", ".join(f"{k}={_text(v, depth - 1)}" for k, v in sorted(values.items()))
        name = _maker(x) if x.__module__.startswith("monadl.") else f"{_maker(x)}#{_code_digest(x.__code__)}"
        return f"{name}({shown})" if values else name
    if isinstance(x, functools.partial):
        args = [_text(a, depth - 1) for a in x.args]
        args += [f"{k}={_text(v, depth - 1)}" for k, v in sorted(x.keywords.items())]
        return f"partial({_text(x.func, depth - 1)}, {', '.join(args)})"
    if isinstance(x, types.MethodType):
        return f"{_text(x.__self__, depth - 1)}.{x.__func__.__name__}"
    if isinstance(x, (types.BuiltinFunctionType, type)):
        return f"{getattr(x, '__module__', None) or ''}.{x.__qualname__}".lstrip(".")
    numbers = {k: v for k, v in _attributes(x).items() if isinstance(v, (bool, int, float, np.generic, np.ndarray))}
    shown = ", ".join(f"{k}={_text(v, depth - 1)}" for k, v in sorted(numbers.items()))
    return f"{type(x).__qualname__}({shown})"


def _transformation(init: Any, update: Any, depth: int) -> str:
    """A transformation: its update's text, the values only its init holds
    added (adagrad's initial accumulator)."""
    text = _text(update, depth)
    if not isinstance(init, types.FunctionType):
        return text if init is None else f"{text} with init {_text(init, depth - 1)}"
    extra = {k: v for k, v in _closure(init).items() if not _closure_holds(update, k)}
    if not extra:
        return text
    shown = ", ".join(f"{k}={_text(v, depth - 1)}" for k, v in sorted(extra.items()))
    return f"{text} with init({shown})"


def _closure(f: types.FunctionType) -> dict[str, Any]:
    """The values a function closes over, by name (a cell not yet filled: skipped)."""
    values: dict[str, Any] = {}
    for name, cell in zip(f.__code__.co_freevars, f.__closure__ or ()):
        try:
            values[name] = cell.cell_contents
        except ValueError:
            continue
    return values


def _code_digest(code: types.CodeType) -> str:
    """A user's function by its body, whose constants (a rate written in a
    lambda) and code another rank's must share (nested code by its own)."""
    parts: list[bytes] = [code.co_code]
    for c in code.co_consts:
        parts.append(_code_digest(c).encode() if isinstance(c, types.CodeType) else repr(c).encode())
    return hashlib.blake2b(b"\0".join(parts), digest_size=4).hexdigest()


def _closure_holds(f: Any, name: str) -> bool:
    return isinstance(f, types.FunctionType) and name in f.__code__.co_freevars


def _maker(f: types.FunctionType) -> str:
    """The function that made a closure (``scale_by_adam`` for its ``update``),
    or the function's own qualified name."""
    head, _, _ = f.__qualname__.partition(".<locals>.")
    return head


def _attributes(x: Any) -> dict[str, Any]:
    found: dict[str, Any] = dict(getattr(x, "__dict__", {}))
    for klass in type(x).__mro__:
        for name in getattr(klass, "__slots__", ()):
            if isinstance(name, str) and hasattr(x, name):
                found.setdefault(name, getattr(x, name))
    return found
