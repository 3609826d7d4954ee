"""Where a layer was built: the line of user code that error messages name.

A site is found by walking out of monadl's own frames to the first caller
outside the package (`caller_site`); it is kept as a code object and an
instruction offset, and turned into ``file:line`` only when a message needs
it (`site_text`).
"""

from __future__ import annotations

import os
import sys
import typing
from types import CodeType
from typing import TypeAlias

__all__ = ["PACKAGE_DIR", "Site", "caller_site", "site_place", "site_text"]

PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
"""monadl's own directory: frames whose code is under it are never a user's site."""

_TYPING = typing.__file__

Site: TypeAlias = "tuple[CodeType, int]"
"""Where a layer was built: the code object and instruction offset of the
first caller outside monadl. The line is looked up only when a message needs
it (`site_text`): finding it costs more than building the layer."""


def caller_site() -> Site:
    """Where the user's code is building something: the first frame outside
    monadl, from the caller of the function that asks outwards.

    >>> def build() -> Site:
    ...     return caller_site()
    >>> site_text(build()).endswith(":1")  # (this doctest's line)
    True
    """
    frame = sys._getframe(2)
    while (
        frame.f_code.co_filename.startswith(PACKAGE_DIR) or frame.f_code.co_filename == _TYPING
    ) and frame.f_back is not None:  # (typing's: a generic class called with its types, Function[X, Y](f))
        frame = frame.f_back
    return frame.f_code, frame.f_lasti


def site_text(site: Site) -> str:
    """``file:line`` of a site."""
    filename, line = site_place(site)
    return f"{filename}:{line}"


def site_place(site: Site) -> tuple[str, int]:
    """The file and line of a site (a warning's place, a graph's source line)."""
    code, offset = site
    line = next((n for start, end, n in code.co_lines() if start <= offset < end and n is not None), None)
    return code.co_filename, code.co_firstlineno if line is None else line
