"""The interpreter's continuation frames and fibers, as named records.

Each frame says what to do with the value that the computation below it
yields; `monadl.runtime.interpret` pushes and pops them. A fiber is one
branch of a parallel applicative, with a stack of its own.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from typing import Any

__all__ = [
    "Bind",
    "BindDone",
    "Direct",
    "DirectDone",
    "Fiber",
    "FromDo",
    "Graph",
    "Join",
    "Map",
    "Opened",
    "Root",
    "Roots",
    "SharedDone",
    "Stepped",
]


class Fiber:
    """One branch of a parallel applicative: its stack and where it stands."""

    __slots__ = ("_place", "cur", "descending", "join", "slot", "stack", "tok", "val")

    def __init__(self, cur: Any, join: Join | None, slot: int) -> None:
        self.stack: list[Any] = []
        self.cur = cur
        self.val: Any = None
        self.tok: Any = None
        self.descending = True
        self.join = join
        self.slot = slot
        self._place: tuple[int, ...] | None = None

    def place(self) -> tuple[int, ...]:
        """Where this branch sits in the computation: its slots from the root
        fiber's down (the order its branches were written in, whichever of
        them a task finished first)."""
        place = self._place
        if place is None:  # (iteratively: fibers nest as deep as the user's recursion)
            path: list[Fiber] = []
            fiber: Fiber | None = self
            while fiber is not None and fiber._place is None:
                path.append(fiber)
                join = fiber.join
                fiber = None if join is None else join.fiber
            known: tuple[int, ...] = () if fiber is None or fiber._place is None else fiber._place
            for f in reversed(path):
                known = f._place = () if f.join is None else (*known, f.slot)
            return known
        return place

    def example(self) -> str | None:
        """Which of the examples evaluated together this fiber runs, for an
        error's note: the layer built from a ``Do`` (an ``@ml.direct`` call)
        it evaluates, its place among the graph's layers built from a ``Do``
        in the order they were built (``ml.stack([model(x) for x in
        batch])``: the batch's order, whichever of them ran first), and so
        for each example it runs inside of, the outermost first; None for
        the root, or a branch of another kind. Examples are such layers built
        at one line; one alone at its line (a black box beside the model's
        layers) is named by its line only, not as an example (a new user's
        loss of two was told of "example 1 of 2")."""
        from monadl.layers._site import site_text

        places: list[str] = []
        fiber: Fiber | None = self
        while fiber is not None and fiber.join is not None:
            join = fiber.join
            if fiber.stack and type(fiber.stack[0]) is FromDo and join.graph is not None:
                node = fiber.stack[0].node
                alike = [n for n in join.graph.order or () if n._op is None and n._site == node._site]
                if len(alike) > 1 and node in alike:
                    where = f"built at {site_text(node._site)}"
                    places.append(
                        f"example {alike.index(node)} (from 0, in the order built) of {len(alike)} evaluated "
                        f"together, {where}"
                    )
                elif node in alike:
                    places.append(f"layer built from a Do at {site_text(node._site)}")
            fiber = join.fiber
        if not places:
            return None
        outer, *inner = reversed(places)
        return ("the " if outer.startswith("layer") else "") + outer + "".join(f"; in its {p}" for p in inner)

    def note_example(self, error: BaseException) -> None:
        """Note on a user's error from a direct-style step, a bind or a map which
        example raised it (`example`): a batch's examples run one function
        built at one line, so its traceback alone could not tell them apart
        (a new user's 32 decoders). Once: an exception object may be raised
        again, evaluation after evaluation."""
        example = self.example()
        if example is not None and isinstance(error, Exception):
            note = f"monadl: raised in {example}"
            if note not in getattr(error, "__notes__", ()):
                error.add_note(note)

    def save(self, stack: list[Any], cur: Any, val: Any, tok: Any, descending: bool) -> None:
        self.stack = stack
        self.cur = cur
        self.val = val
        self.tok = tok
        self.descending = descending


class Join:
    """A fiber waiting for its branches: their values and release tokens, in order."""

    __slots__ = ("fiber", "graph", "remaining", "tokens", "values")

    def __init__(self, fiber: Fiber, count: int, graph: Graph | None = None) -> None:
        self.fiber = fiber
        self.values: list[Any] = [None] * count
        self.tokens: list[Any] = [None] * count
        self.remaining = count
        self.graph = graph  # (the graph whose layers built from a Do these branches evaluate: `Fiber.example`)


class Map:
    """Apply ``function`` to the value."""

    __slots__ = ("function",)

    def __init__(self, function: Callable[[Any], Any]) -> None:
        self.function = function


class Bind:
    """Evaluate ``function(value)`` next."""

    __slots__ = ("function",)

    def __init__(self, function: Callable[[Any], Any]) -> None:
        self.function = function


class BindDone:
    """After a bind's inner computation: release it before the outer one."""

    __slots__ = ("token",)

    def __init__(self, token: Any) -> None:
        self.token = token


class SharedDone:
    """A shared computation's value: memoise it for the rest of the evaluation."""

    __slots__ = ("do",)

    def __init__(self, do: Any) -> None:
        self.do = do


class Opened:
    """An effect awaited in a task: ``(value, release token)`` arrives."""

    __slots__ = ()


class Graph:
    """A layer graph being computed: its roots, order, and how far it got."""

    __slots__ = ("index", "order", "redo", "resumed", "roots", "started")

    def __init__(self, roots: list[Any]) -> None:
        self.roots = roots
        self.order: list[Any] | None = None
        self.index = 0
        self.resumed = False  # computed in part: a Do evaluated meanwhile may have computed more
        self.redo = False  # back from its Do layers: what they held back may batch now
        self.started = 0.0  # when its inline forward began, for the fork rule (workers > 1)


class Root:
    """The tape of one layer, once its graph is computed."""

    __slots__ = ("node",)

    def __init__(self, node: Any) -> None:
        self.node = node


class Roots:
    """The tapes of several layers forwarded together, once their graph is computed."""

    __slots__ = ("dos",)

    def __init__(self, dos: tuple[Any, ...]) -> None:
        self.dos = dos


class FromDo:
    """A layer built from a ``Do``: its ``Do`` yielded its tape."""

    __slots__ = ("node",)

    def __init__(self, node: Any) -> None:
        self.node = node


class Direct:
    """A direct-style coroutine, the release tokens of what it awaited,
    whether it awaited one layer or several, and its context variables: its
    own, from the task that made it, as a task of its own would have them
    (its steps run in whatever task the runtime chose: what it set before an
    await of layers was lost after it, and a set reset across one failed)."""

    __slots__ = ("context", "coroutine", "held", "single")

    def __init__(self, coroutine: Any) -> None:
        self.coroutine = coroutine
        self.held: list[Any] = []
        self.single = False
        self.context = contextvars.copy_context()


class Stepped:
    """A task stepped ``direct``'s coroutine: ``(returned, what)`` arrives."""

    __slots__ = ("direct",)

    def __init__(self, direct: Direct) -> None:
        self.direct = direct


class DirectDone:
    """A direct-style layer's returned layer: released before what it awaited."""

    __slots__ = ("held",)

    def __init__(self, held: tuple[Any, ...]) -> None:
        self.held = held
