"""A griffe extension: show the ``>>>`` examples of docstrings as code.

monadl's docstrings put their runnable examples (checked by pytest's
doctests) in the text, as the standard library does, not always under an
``Examples:`` heading. Markdown would read ``>>>`` as nested quotes and
``[1, 2]`` in an output as a link, so each run of example lines (a ``>>>``
line, its ``...`` continuations and its output, up to a blank line) is fenced
as ``pycon`` when the package is loaded. The source files are not changed.
"""

from __future__ import annotations

from typing import Any

from griffe import Extension, GriffeLoader, Module, Object


def fence_examples(text: str) -> str:
    """Wrap each run of doctest lines in a ``pycon`` code fence.

    >>> fence_examples("Adds.\\n\\n>>> 1 + 1\\n2\\n\\nDone.").splitlines()
    ['Adds.', '', '```pycon', '>>> 1 + 1', '2', '```', '', 'Done.']
    """
    out: list[str] = []
    fenced = False
    fence = ""
    for line in text.splitlines():
        stripped = line.lstrip()
        if stripped.startswith("```"):
            fence = "" if fence else stripped[:3]  # an existing fence: leave its contents alone
        if not fenced and not fence and stripped.startswith(">>>"):
            indent = line[: len(line) - len(stripped)]
            out.append(f"{indent}```pycon")
            fenced = True
        elif fenced and not stripped:
            out.append(f"{indent}```")
            fenced = False
        out.append(line)
    if fenced:
        out.append(f"{indent}```")
    return "\n".join(out)


def _walk(obj: Object) -> None:
    # Iterative: a module's members, their members, and so on (aliases are
    # skipped: their targets are visited where they are defined).
    stack: list[Object] = [obj]
    while stack:
        current = stack.pop()
        if current.docstring is not None:
            current.docstring.value = fence_examples(current.docstring.value)
        stack.extend(member for member in current.members.values() if isinstance(member, Object))


class DoctestBlocks(Extension):
    """Fences the doctest examples of every docstring of a loaded package."""

    def on_package(self, *, pkg: Module, loader: GriffeLoader, **kwargs: Any) -> None:
        """Runs once per package, after griffe has loaded all of it."""
        _walk(pkg)
