"""The kinds of block (``block._kind``), by which the runner (`monadl.fold._run`)
and its explicit stack (`monadl.fold._stack`) treat each."""

from __future__ import annotations

from typing import Final

__all__ = ["BUILD", "COMPOSITION", "IMMEDIATE", "PARALLEL", "ROUTE"]

COMPOSITION: Final = "composition"
ROUTE: Final = "route"
PARALLEL: Final = "parallel"
IMMEDIATE: Final = "immediate"
BUILD: Final = "build"
