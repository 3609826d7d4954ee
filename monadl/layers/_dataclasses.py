"""The dataclasses in an `monadl.operation`'s arguments and results: each
class's fields, read once (`fields`), what reads their values (`READERS`)
and what makes one from them per call (`maker`): its constructor, or what
does the constructor's work where it can (`monadl.layers._structures`
rebuilds a traced result with it)."""

from __future__ import annotations

import dataclasses
import operator
import types
from collections.abc import Callable
from typing import Any

__all__ = ["READERS", "fields", "maker"]

_FIELDS: dict[type, tuple[str, ...]] = {}


def fields(kind: type) -> tuple[str, ...]:
    """A dataclass's fields, those its constructor does not take included
    (looked up once per class; `maker` rebuilds it from them)."""
    found = _FIELDS.get(kind)
    if found is None:
        found_fields = dataclasses.fields(kind)
        found = _FIELDS[kind] = tuple(f.name for f in found_fields)
        if not all(f.init for f in found_fields):
            _MAKERS[kind] = _setter(kind, found)
        else:  # (what does its constructor's work in half the time, where it can: a cell's state, made per call)
            setters = _slot_setters(kind, found)
            if setters is not None:
                _MAKERS[kind] = _slotted(kind, setters)
            elif any(f.kw_only for f in found_fields) and _generated_init(kind) is not None:
                _MAKERS[kind] = _by_name(kind, found)  # (positionally, a TypeError at every call)
            else:
                _MAKERS[kind] = kind
        if found:
            get = operator.attrgetter(*found)
            READERS[kind] = get if len(found) > 1 else lambda x: (get(x),)
    return found


_MAKERS: dict[type, Callable[..., Any]] = {}


def maker(kind: type) -> Callable[..., Any]:
    """What makes a dataclass from its `fields`' values: its constructor;
    where some fields are not the constructor's (``field(init=False)``), a
    new object with each field set (the constructor would give them their
    defaults: a value the function did not see, silently); where some are
    keyword-only, the constructor given each by name; where the constructor
    only stores each in its slot, those stores (`_slot_setters`)."""
    fields(kind)
    return _MAKERS[kind]


def _setter(kind: type, names: tuple[str, ...]) -> Callable[..., Any]:
    def make(*values: Any) -> Any:
        made: Any = object.__new__(kind)
        for name, value in zip(names, values):
            object.__setattr__(made, name, value)  # (a frozen dataclass's too)
        return made

    return make


def _by_name(kind: type, names: tuple[str, ...]) -> Callable[..., Any]:
    def make(*values: Any) -> Any:
        return kind(**dict(zip(names, values)))

    return make


def _generated_init(kind: type) -> types.CodeType | None:
    """The code of ``kind``'s own ``__init__`` where dataclasses wrote it (not
    one written in the class or its subclass), else None. Read once per
    class (`fields`): an ``__init__`` set on the class after its first use
    is not seen."""
    code = getattr(kind.__dict__.get("__init__"), "__code__", None)
    if code is None or code.co_filename != "<string>" or code.co_qualname != "__create_fn__.<locals>.__init__":
        return None
    return code  # type: ignore[no-any-return]


def _slot_setters(kind: type, names: tuple[str, ...]) -> list[Callable[[Any, Any], None]] | None:
    """Where ``kind(*values)`` does nothing but store each field in its slot,
    the slots' setters; else None. So for a dataclass whose constructor is
    its generated one, called by ``type.__call__`` (no metaclass's own),
    frozen (a frozen class's constructor stores past its ``__setattr__``)
    or with ``__setattr__`` not its own, with no
    ``__post_init__``, no `InitVar` or keyword-only field, ``__new__`` not
    its own, and every field in a slot (``slots=True``). A frozen slotted
    dataclass's constructor costs 2-3 times its stores (it calls
    ``object.__setattr__`` by name per field), and an operation's call makes
    its result per call: 8,000 a Tree-LSTM's batch.

    >>> @dataclasses.dataclass(frozen=True, slots=True)
    ... class State:
    ...     h: int
    ...     c: int
    >>> maker(State)(1, 2)
    State(h=1, c=2)
    >>> maker(State) is State, _slot_setters(State, ("h", "c")) is None
    (False, False)
    """
    params = getattr(kind, "__dataclass_params__", None)
    code = _generated_init(kind)
    if (
        params is None
        or code is None
        or type(kind).__call__ is not type.__call__  # (a metaclass's own call: it may do more)
        or code.co_argcount != len(names) + 1
        or code.co_kwonlyargcount
        or hasattr(kind, "__post_init__")
        or vars(object)["__new__"] is not getattr(kind, "__new__", None)
        or not (params.frozen or getattr(kind, "__setattr__", None) is vars(object)["__setattr__"])
    ):
        return None
    setters: list[Callable[[Any, Any], None]] = []
    for name in names:
        slot = next((base.__dict__[name] for base in kind.__mro__ if name in base.__dict__), None)
        if type(slot) is not types.MemberDescriptorType:
            return None
        setters.append(slot.__set__)
    return setters


SLOTTED: dict[Callable[..., Any], tuple[type, tuple[Callable[[Any, Any], None], ...]]] = {}
"""Per maker of two fields made by their slots' stores (`_slotted`), its
class and the stores: a loom's recorder makes such a result in its own
lines, one call less per call (`monadl.fold._loom_recorders`)."""


def _slotted(kind: type, setters: list[Callable[[Any, Any], None]]) -> Callable[..., Any]:
    """``kind(*values)`` as `_slot_setters` found it: a new object, each value in its slot."""
    new: Callable[[type], Any] = object.__new__
    if len(setters) == 2:  # (a cell's state, ``State(h, c)``: unrolled)
        first, second = setters

        def two(a: Any, b: Any) -> Any:
            made = new(kind)
            first(made, a)
            second(made, b)
            return made

        SLOTTED[two] = (kind, tuple(setters))
        return two

    def make(*values: Any) -> Any:
        if len(values) != len(setters):  # (as the constructor refuses)
            return kind(*values)
        made = new(kind)
        for store, value in zip(setters, values):
            store(made, value)
        return made

    return make


READERS: dict[type, Callable[[Any], tuple[Any, ...]]] = {}
"""Per dataclass seen by `fields`: its fields' values as a tuple, read in C."""
