"""How an error names the input a block was given: its type with its
article, and a short repr, bounded whatever the input's size (a whole JSON
document, a list that contains itself)."""

from __future__ import annotations

import reprlib
from collections.abc import Mapping

import numpy as np


def a_type(x: object) -> str:
    """``x``'s type with its article, as a message reads it.

    >>> a_type(3), a_type([]), a_type(None)
    ('an int', 'a list', 'None')
    """
    if x is None:
        return "None"
    name = type(x).__name__
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def shown(x: object) -> str:
    """``x`` short (`reprlib`'s limits), and its type; an array by its shape and dtype.

    >>> shown("five"), shown(None), shown(np.ones((2, 1)))
    ("'five' (a str)", 'None', 'a float64 array of shape (2, 1)')
    >>> loop: list[object] = [1.0]
    >>> loop.append(loop)
    >>> shown(loop)
    '[1.0, [...]] (a list)'
    """
    if isinstance(x, np.ndarray):
        return f"a {x.dtype} array of shape {x.shape}"
    text = reprlib.repr(x)
    return text if x is None else f"{text} ({a_type(x)})"


def unordered(xs: object) -> str | None:
    """Why ``xs``, given as a sequence, is not one, and what to pass: a
    mapping (its iteration gives its keys alone: a JSON object sent to a
    list's case by mistake would be read as its keys) or a set (its order is
    its hashes'); None for anything else (a dict's keys() and items() are in
    its order: taken).

    >>> unordered([1]), unordered({1})
    (None, "which has no order (its hashes'): pass sorted(x), or list(x) where the order does not matter")
    """
    if isinstance(xs, Mapping):
        return "whose iteration gives its keys alone: pass list(x.values()), x.items() or list(x)"
    if isinstance(xs, set | frozenset):
        return "which has no order (its hashes'): pass sorted(x), or list(x) where the order does not matter"
    return None
