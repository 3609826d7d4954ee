"""A MkDocs hook: ``::: monadl.name`` documents the object users import.

The API pages name objects as users import them (``::: monadl.direct``),
while griffe resolves a dotted path through the modules that define them,
where a submodule can shadow a re-exported name (``monadl.direct`` is also a
module) and modules move (the runtime is being restructured). So before
mkdocstrings reads a page, each ``::: monadl.name`` line whose object is a
function or class defined elsewhere is pointed at its definition, by
``__module__`` and ``__qualname__`` at build time, and keeps the heading
``monadl.name``. Type aliases and names defined in ``monadl`` itself stay as
written (griffe follows those aliases).
"""

from __future__ import annotations

import importlib
import inspect
import re
from typing import Any

_DIRECTIVE = re.compile(r"^::: (monadl(?:\.optim)?)\.(\w+)$", re.MULTILINE)


def definition(package: str, name: str) -> str | None:
    """Where ``package.name`` is defined, or None where griffe can follow it.

    >>> definition("monadl", "exp")
    'monadl.layers._functions.exp'
    >>> definition("monadl", "ArrayLayer") is None  # a type alias
    True
    >>> definition("monadl", "dyna") is None  # a submodule
    True
    """
    module = importlib.import_module(package)
    if name not in module.__all__:  # a submodule (monadl.dyna): griffe documents it as it is
        return None
    obj = getattr(module, name)
    if not (inspect.isfunction(obj) or inspect.isclass(obj)):
        return None
    where = f"{obj.__module__}.{obj.__qualname__}"
    return None if where == f"{package}.{name}" else where


def _redirect(match: re.Match[str]) -> str:
    package, name = match.group(1), match.group(2)
    where = definition(package, name)
    if where is None:
        return match.group(0)
    return f'::: {where}\n    options:\n      heading: "{package}.{name}"\n      toc_label: "{package}.{name}"'


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    """Point the page's ``::: monadl.name`` lines at their definitions."""
    return _DIRECTIVE.sub(_redirect, markdown)
