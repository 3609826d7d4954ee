"""The blocks of TF Fold (Looks et al. 2017, section 3) that choose and
structure: `OneOf` dispatches on the input, `Optional` maps None to a
default, `AllOf` and `Record` make tuples of their blocks' outputs."""

from __future__ import annotations

import reprlib
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, TypeVar, cast, final, overload

from monadl.fold._block import Block, Build, Parallel, Route, call
from monadl.fold._inputs import shown
from monadl.fold._trail import Case

X = TypeVar("X")
Y = TypeVar("Y")
K = TypeVar("K", bound=Hashable)
T = TypeVar("T")
X1 = TypeVar("X1")
X2 = TypeVar("X2")
X3 = TypeVar("X3")
X4 = TypeVar("X4")
Y1 = TypeVar("Y1")
Y2 = TypeVar("Y2")
Y3 = TypeVar("Y3")
Y4 = TypeVar("Y4")

__all__ = ["AllOf", "OneOf", "Optional", "Record"]


# ---- choice and structure -------------------------------------------------------------------------
@final
class OneOf(Route[X, Y]):
    """The case chosen by ``key(x)``, applied to ``x``: a dispatch on the
    input (a leaf or an internal node). ``key`` runs once per input, so it
    may be random; a key with no case raises `KeyError`, naming the input.

    >>> from monadl.fold import InputTransform
    >>> sign = OneOf(lambda n: n >= 0, {True: InputTransform(lambda n: "+"), False: InputTransform(lambda n: "-")})
    >>> sign(-2), sign(3)
    ('-', '+')

    Cases whose input types differ (`Zeros` takes any object, `Vector` a
    sequence) are joined by mypy to ``object`` in a dict literal, which it
    then rejects (``dict[bool, object]``: mypy joins a contravariant type
    argument as an invariant one). Name the types where mypy can read them:
    annotate the variable (``choose: Block[Sequence[float], ArrayLayer] =
    OneOf(...)``), name the block's types (``OneOf[Sequence[float],
    ArrayLayer](is_empty, {True: Zeros((2,)), False: Vector(2)})``), or
    annotate the dict (``dict[bool, Block[Sequence[float], ArrayLayer]]``).
    """

    __slots__ = ("cases", "key")
    _shown = ("key", "cases")
    _cases = True

    def __init__(self, key: Callable[[X], K], cases: Mapping[K, Block[X, Y]]) -> None:
        self.key: Callable[[X], Hashable] = key
        self.cases: Mapping[Any, Block[X, Y]] = cases  # keys as K, read back by key(x)

    def _route(self, x: X) -> Block[X, Y]:
        return self._case(self.key(x), x)

    def _case(self, k: Hashable, x: X) -> Block[X, Y]:
        try:
            known = k in self.cases
        except TypeError:  # (a dict's: the key is unhashable)
            raise TypeError(
                f"{self!r}: its key function gave {k!r:.80}, a {type(k).__name__}, which is unhashable, so no "
                f"case of the {type(self.cases).__name__} matches it; return a hashable key (a tuple for a list)"
            ) from None
        if not known:  # (named by its key function alone: its cases are listed by key, not each block again)
            key = getattr(self.key, "__qualname__", None) or reprlib.repr(self.key)
            raise KeyError(
                f"OneOf({key}, ...): no case for key {k!r}, the key of its input {shown(x)}"
                f"; the keys of its cases: {reprlib.repr(list(self.cases))}"
            )
        return self.cases[k]

    def _taken(self, chosen: Block[X, Y] | None) -> str:
        """``<case 'leaf' of OneOf>``: the key of the case ``chosen`` (the first of several keys of one block)."""
        keys = [k for k, block in self.cases.items() if block is chosen]
        return Case.of(keys[0]) if keys else ""

    def _keyed(self) -> tuple[Callable[[X], Hashable], Callable[[Hashable, X], Block[X, Y]]]:
        return self.key, self._case


@final
class Optional(Block[X | None, Y]):
    """``block(x)``, or ``default(None)`` when the input is None (zeros, say).

    >>> import anyio
    >>> from monadl.fold import Vector, Zeros
    >>> maybe = Optional(Vector(2, "float64"), Zeros((2,), "float64"))
    >>> anyio.run(maybe(None).predict), anyio.run(maybe([1, 2]).predict)
    (array([[0., 0.]]), array([[1., 2.]]))
    """

    __slots__ = ("block", "default")
    _shown = ("block", "default")

    def __init__(self, block: Block[X, Y], default: Block[None, Y]) -> None:
        self.block = block
        self.default = default

    def _build(self, x: X | None) -> Build[Y]:
        if x is None:
            y = yield from call(self.default, None)
        else:
            y = yield from call(self.block, x)
        return y

    def _step(self, build: Mapping[str, Any]) -> str:
        return ""


@final
class AllOf(Parallel[X, T]):
    """Several blocks applied to the same input: the tuple of their outputs.

    >>> from monadl.fold import InputTransform
    >>> AllOf(InputTransform(len), InputTransform(str.upper))("ab")
    (2, 'AB')
    """

    __slots__ = ("blocks",)
    _shown = ("*blocks",)

    @overload
    def __init__(self: AllOf[X, tuple[Y1]], b1: Block[X, Y1], /) -> None: ...
    @overload
    def __init__(self: AllOf[X, tuple[Y1, Y2]], b1: Block[X, Y1], b2: Block[X, Y2], /) -> None: ...
    @overload
    def __init__(
        self: AllOf[X, tuple[Y1, Y2, Y3]], b1: Block[X, Y1], b2: Block[X, Y2], b3: Block[X, Y3], /
    ) -> None: ...
    @overload
    def __init__(
        self: AllOf[X, tuple[Y1, Y2, Y3, Y4]],
        b1: Block[X, Y1],
        b2: Block[X, Y2],
        b3: Block[X, Y3],
        b4: Block[X, Y4],
        /,
    ) -> None: ...
    @overload
    def __init__(self: AllOf[X, tuple[Any, ...]], *blocks: Block[X, Any]) -> None: ...
    def __init__(self, *blocks: Block[X, Any]) -> None:
        self.blocks = blocks


@final
class Record(Block[X, T]):
    """Each field of the input through its own block: ``Record(b1, b2)``
    takes a tuple ``(x1, x2)``; ``Record({"a": b1, "b": b2})`` (or
    ``Record([("a", b1), ("b", b2)])``) a mapping with those keys. The output is the tuple of the fields' outputs, in the
    order the blocks are given. A mapping's other keys are left unread (a
    record's id, its source: as TF Fold's `Record`); a key missing is a
    `KeyError` that names it and the keys given.

    >>> from monadl.fold import InputTransform
    >>> Record(InputTransform(len), InputTransform(abs))(("ab", -3))
    (2, 3)
    >>> Record({"n": InputTransform(len)})({"n": "abc"})
    (3,)
    >>> Record([("b", InputTransform(len)), ("a", InputTransform(len))])({"a": "x", "b": "yz", "id": 7})
    (2, 1)

    The tuple form is typed field by field up to four blocks, and as
    ``tuple[Any, ...]`` beyond. In the mapping form, mypy joins blocks of
    different input types to ``object`` (see `OneOf`) and rejects the dict
    literal: annotate the variable (``rec: Block[Mapping[str, Any],
    tuple[ArrayLayer, ...]] = Record({...})``) or the dict
    (``dict[str, Block[Any, ArrayLayer]]``).
    """

    __slots__ = ("blocks", "keys")
    _shown = ("*_given",)

    @overload
    def __init__(self: Record[Mapping[K, X1], tuple[Y1, ...]], fields: Mapping[K, Block[X1, Y1]], /) -> None: ...
    @overload
    def __init__(
        self: Record[Mapping[K, X1], tuple[Y1, ...]], fields: Sequence[tuple[K, Block[X1, Y1]]], /
    ) -> None: ...
    @overload
    def __init__(self: Record[tuple[X1], tuple[Y1]], b1: Block[X1, Y1], /) -> None: ...
    @overload
    def __init__(self: Record[tuple[X1, X2], tuple[Y1, Y2]], b1: Block[X1, Y1], b2: Block[X2, Y2], /) -> None: ...
    @overload
    def __init__(
        self: Record[tuple[X1, X2, X3], tuple[Y1, Y2, Y3]],
        b1: Block[X1, Y1],
        b2: Block[X2, Y2],
        b3: Block[X3, Y3],
        /,
    ) -> None: ...
    @overload
    def __init__(
        self: Record[tuple[X1, X2, X3, X4], tuple[Y1, Y2, Y3, Y4]],
        b1: Block[X1, Y1],
        b2: Block[X2, Y2],
        b3: Block[X3, Y3],
        b4: Block[X4, Y4],
        /,
    ) -> None: ...
    @overload
    def __init__(  # (five or more: of one to four, a wrong field is an error, not this)
        self: Record[tuple[Any, ...], tuple[Any, ...]],
        b1: Block[Any, Any],
        b2: Block[Any, Any],
        b3: Block[Any, Any],
        b4: Block[Any, Any],
        b5: Block[Any, Any],
        /,
        *blocks: Block[Any, Any],
    ) -> None: ...
    def __init__(self, *fields: Any) -> None:
        if len(fields) == 1 and isinstance(fields[0], Mapping | Sequence):
            pairs = list(fields[0].items() if isinstance(fields[0], Mapping) else fields[0])
            self.keys: tuple[Any, ...] | None = tuple(k for k, _ in pairs)
            self.blocks: tuple[Block[Any, Any], ...] = tuple(b for _, b in pairs)
        else:
            self.keys = None
            self.blocks = fields

    @property
    def _given(self) -> tuple[Any, ...]:
        """What the constructor was given: the blocks, or one mapping of the keys to them (for the repr)."""
        return self.blocks if self.keys is None else (dict(zip(self.keys, self.blocks)),)

    def _build(self, x: X) -> Build[T]:
        fields: Sequence[Any]
        if self.keys is None:
            if not isinstance(x, tuple) or len(x) != len(self.blocks):
                raise ValueError(f"Record of {len(self.blocks)} blocks was given {x!r:.80}, not a tuple of as many")
            fields = x
        else:
            if not isinstance(x, Mapping):
                raise ValueError(f"Record with keys {list(self.keys)} was given {type(x).__name__}, not a mapping")
            try:
                fields = [x[k] for k in self.keys]
            except KeyError:
                missing = [k for k in self.keys if k not in x]
                if not missing:  # (a mapping whose own lookup failed)
                    raise
                raise KeyError(
                    f"{self!r} was given a {type(x).__name__} without the key{'s' * (len(missing) > 1)} "
                    f"{', '.join(map(repr, missing))} (its keys: {reprlib.repr(list(x))})"
                ) from None
        ys = []
        for block, field in zip(self.blocks, fields):
            ys.append((yield from call(block, field)))
        return cast(T, tuple(ys))  # the overloads of __init__ type it per field

    def _step(self, build: Mapping[str, Any]) -> str:
        i = len(build["ys"])
        return f"[{i if self.keys is None else repr(self.keys[i])}]"
