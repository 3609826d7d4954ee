"""Copying a Python function as ``copy.deepcopy`` would if Python copied
functions (it returns a function as itself): what `monadl.layers._operation`'s
``Operation.__deepcopy__`` does to a marked function, so that a copied model's
cell reads the copy's weights, not the original's."""

from __future__ import annotations

import copy
import types
from collections.abc import Callable
from typing import Any, cast

__all__ = ["function_shell", "holds"]


def holds(f: types.FunctionType) -> bool:
    return bool(f.__closure__ or f.__defaults__ or f.__kwdefaults__)


def _copied_function(f: types.FunctionType, memo: dict[int, Any]) -> types.FunctionType:
    """``f`` as ``copy.deepcopy`` would copy it if Python copied functions:
    a function over the same code whose closure cells, defaults and
    keyword defaults hold deep copies (through ``memo``: the copied model's
    own objects), functions among them copied so too (a helper ``def
    proj(h): return h @ self.W`` the cell calls). A cell two functions share
    (a ``nonlocal``) stays one in the copy; what does not copy (a module, a
    lock, an open file) is held as it is, as by the function before."""
    found = memo.get(id(f))
    if found is not None:
        return cast(types.FunctionType, found)
    if not holds(f):
        return f
    g, fill = function_shell(f, memo)
    fill()
    return g


def function_shell(f: types.FunctionType, memo: dict[int, Any]) -> tuple[types.FunctionType, Callable[[], None]]:
    """`_copied_function`'s function, its cells still empty, and what fills
    them and its defaults (after the caller has put what holds it in ``memo``)."""
    cells = tuple([_cell_shell(c, memo) for c in f.__closure__ or ()])
    g = types.FunctionType(f.__code__, f.__globals__, f.__name__, None, cells or None)
    memo[id(f)] = g
    _keep(f, memo)
    g.__qualname__, g.__module__, g.__doc__ = f.__qualname__, f.__module__, f.__doc__

    def fill() -> None:
        for old, new in zip(f.__closure__ or (), cells):
            if _bound(old) and not _bound(new):  # (a shared cell: filled by the first function)
                new.cell_contents = _copied_contents(old.cell_contents, memo)
        if f.__defaults__:
            g.__defaults__ = tuple([_copied_contents(x, memo) for x in f.__defaults__])
        if f.__kwdefaults__:
            g.__kwdefaults__ = {k: _copied_contents(x, memo) for k, x in f.__kwdefaults__.items()}
        g.__dict__.update({k: _copied_contents(x, memo) for k, x in f.__dict__.items()})

    return g, fill


def _bound(cell: types.CellType) -> bool:
    try:
        cell.cell_contents  # noqa: B018
    except ValueError:  # (a variable not bound yet)
        return False
    return True


def _cell_shell(cell: types.CellType, memo: dict[int, Any]) -> types.CellType:
    """The copy's cell for ``cell``: one per cell (shared by the functions
    that share it), filled by the first function's `_function_shell`."""
    found = memo.get(id(cell))
    if found is not None:
        return cast(types.CellType, found)
    made = memo[id(cell)] = types.CellType()
    _keep(cell, memo)
    return made


def _copied_contents(x: Any, memo: dict[int, Any]) -> Any:
    if type(x) is types.FunctionType:
        return _copied_function(x, memo)
    if isinstance(x, types.ModuleType):
        return x
    try:
        return copy.deepcopy(x, memo)
    except (TypeError, copy.Error):  # (a lock, a file: held by the copy as by the function before)
        return x


def _keep(x: Any, memo: dict[int, Any]) -> None:
    """Keep ``x`` alive as long as ``memo``, as ``copy.deepcopy`` keeps what
    it keys by id (another object made meanwhile could take the id)."""
    memo.setdefault(id(memo), []).append(x)
