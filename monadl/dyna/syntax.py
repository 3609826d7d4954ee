"""Items, rules and their text form.

An item is a functor and its arguments, ``("edge", 0, 1)``; a pattern is an
item some of whose arguments are variables (strings that start upper-case or
with ``_``; as in Prolog and Dyna, ``_`` alone is a fresh variable at each
occurrence, one nothing else reads). So a constant string that starts with
``_`` (``"_pad"``) is a variable, which matches any value: spell such
constants otherwise (``"pad_"``). Items and patterns are tuples,
``("edge", "I", "J")``, never lists. A rule is
``head += coeff * body_1 * ... * body_k``; with no body item it is a constant,
``pathto(0) += 1``.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

__all__ = ["Item", "Pattern", "Rule", "as_item", "bindings", "ground", "head", "is_variable", "match", "parse_rules"]

Item: TypeAlias = tuple[Any, ...]
"""A ground item: a functor and its arguments, ``("edge", 0, 1)``."""
Pattern: TypeAlias = tuple[Any, ...]
"""An item with variables: arguments that are strings starting upper-case or with ``_``."""


def is_variable(term: Any) -> bool:
    """Whether a term of a pattern is a variable (a string that starts
    upper-case or with ``_``, as in Prolog: ``"_pad"`` too).

    >>> is_variable("I"), is_variable("_I"), is_variable("_"), is_variable("edge"), is_variable(3)
    (True, True, True, False, False)
    """
    return isinstance(term, str) and (term[:1].isupper() or term[:1] == "_")


def as_item(term: Any) -> str:
    """How ``term``, refused as an item or a pattern, is written as one: a
    list's tuple, a name alone in a tuple of one; for the errors that refuse it.

    >>> as_item(["p", "J"]), as_item("goal"), as_item(())
    ("('p', 'J')", "('goal',)", "('edge', 0, 1): a functor, then its arguments")
    """
    if isinstance(term, (list, tuple)):
        return repr(tuple(term)) if term else "('edge', 0, 1): a functor, then its arguments"
    return repr((term,))


@dataclass(frozen=True, slots=True)
class Rule:
    """``head += coeff * body[0] * ... * body[k-1]``.

    Each ``_`` in it becomes a variable of its own (``_0``, ``_1``, ... not
    otherwise in the rule). A coefficient is a value of the program's semiring, taken as written (in
    log-real a logarithm, in min-plus a distance: ``d += 1 * e`` adds 1);
    None, a rule written without one, is the semiring's one. A rule with no
    body item is a constant, ``head += coeff`` with a ground head, and needs
    its value.

    >>> str(Rule(("pathto", 0), [], 1.0)), str(Rule(("b", "X"), [("a", "X")], 0.5)), str(Rule(("b",), [("a",)]))
    ('pathto(0) += 1.0', 'b(X) += 0.5 * a(X)', 'b += a')
    """

    head: Pattern
    body: Sequence[Pattern]
    coeff: float | None = None

    def __post_init__(self) -> None:
        patterns = [self.head, *self.body]
        for p in patterns:
            if not isinstance(p, tuple) or not p:  # (("goal") is "goal", read as g(o, a, l))
                raise TypeError(f"rule: {p!r} is a {type(p).__name__}: an item or a pattern is a tuple, {as_item(p)}")
        if any(t == "_" for p in patterns for t in p[1:]):  # (anonymous: each _ a variable of its own)
            taken = {t for p in patterns for t in p[1:] if is_variable(t)}
            fresh = (name for name in map("_{}".format, itertools.count()) if name not in taken)
            head, *body = [(p[0], *(next(fresh) if t == "_" else t for t in p[1:])) for p in patterns]
            object.__setattr__(self, "head", head)
            object.__setattr__(self, "body", body)
        if not self.body and self.coeff is None:
            raise ValueError(f"rule {self.head} += (nothing): a constant rule needs its value (Rule(head, [], value))")
        bound = {t for b in self.body for t in b[1:] if is_variable(t)}
        free = [t for t in self.head[1:] if is_variable(t) and t not in bound]
        if free:
            raise ValueError(
                f"rule {self}: head variables {free} do not occur in the body; only range-restricted rules are allowed"
            )

    def __str__(self) -> str:
        def show(p: Pattern) -> str:
            return f"{p[0]}({', '.join(map(str, p[1:]))})" if len(p) > 1 else str(p[0])

        if not self.body:
            return f"{show(self.head)} += {self.coeff}"
        coeff = "" if self.coeff is None else f"{self.coeff} * "
        return f"{show(self.head)} += {coeff}{' * '.join(show(b) for b in self.body)}"


def match(pattern: Pattern, item: Item, bound: dict[str, Any]) -> dict[str, Any] | None:
    """Extend the bindings ``bound`` so that ``pattern`` is ``item``, or None.

    >>> match(("edge", "I", "J"), ("edge", 0, 1), {"I": 0})
    {'I': 0, 'J': 1}
    """
    if pattern[0] != item[0] or len(pattern) != len(item):
        return None
    out = bound
    for term, value in zip(pattern[1:], item[1:]):
        if is_variable(term):
            if term in out:
                if out[term] != value:
                    return None
            else:
                out = {**out, term: value}
        elif term != value:
            return None
    return out


def ground(pattern: Pattern, bound: Mapping[str, Any]) -> Item:
    """The item a pattern names under bindings.

    >>> ground(("pathto", "J"), {"J": 2})
    ('pathto', 2)
    """
    return (pattern[0], *(bound[t] if is_variable(t) else t for t in pattern[1:]))


def bindings(rule: Rule, body: Sequence[Item]) -> dict[str, Any]:
    """The variables' values in a rule instance with these ground body items.

    >>> bindings(Rule(("p", "J"), [("e", "I", "J")]), [("e", 0, 1)])
    {'I': 0, 'J': 1}
    """
    out: dict[str, Any] = {}
    for pattern, item in zip(rule.body, body):
        matched = match(pattern, item, out)
        if matched is None:
            raise ValueError(f"rule {rule}: {item} does not match {pattern}")
        out = matched
    return out


def head(rule: Rule, body: Sequence[Item]) -> Item:
    """The head item of a rule instance with these ground body items.

    >>> head(Rule(("p", "J"), [("e", "I", "J")]), [("e", 0, 1)])
    ('p', 1)
    """
    return ground(rule.head, bindings(rule, body))


_TERM = re.compile(r"\s*([a-z_][A-Za-z0-9_]*)\s*(?:\(([^()]*)\))?\s*$")
_ARGUMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*$|[-+]?(\d+\.?\d*(e[-+]?\d+)?|\.\d+(e[-+]?\d+)?)$", re.IGNORECASE)
_NUMBER = re.compile(r"\s*[-+]?(\d+\.?\d*(e[-+]?\d+)?|\.\d+(e[-+]?\d+)?)\s*$", re.IGNORECASE)


def parse_rules(text: str) -> list[Rule]:
    """Rules from text, one per ``.``::

        stop(I) += edgezero(I) * pathto(I).
        pathto(J) += edge(I, J) * pathto(I).
        pathto(0) += 1.                        % a constant: no body item
        b(X) += 0.5 * a(X) * w(X, Y) * a(Y).   % a leading number is the coefficient

    Upper-case arguments are variables (``_`` alone: a fresh one at each
    occurrence); integers and lower-case words are
    constants; ``%`` starts a comment. (`monadl.dyna.parse` makes a `Program`
    of them.)

    >>> [str(r) for r in parse_rules("a += a * a. a += 0.5.")]
    ['a += a * a', 'a += 0.5']
    """
    rules = []
    cleaned = "\n".join(line.split("%", 1)[0] for line in text.splitlines())
    for number, statement in enumerate(s.strip() for s in _split_rules(cleaned)):
        if not statement:
            continue
        if "+=" not in statement:
            raise ValueError(f"rule {number + 1} ({statement!r}): expected 'head += body'")
        head_text, body_text = statement.split("+=", 1)
        factors = _split_top(body_text, "*")
        coeff = None  # (no number: the semiring's one; a written 1 is 1, a distance in min-plus)
        if factors and _NUMBER.match(factors[0]):
            coeff = float(factors.pop(0))
        elif not factors:
            raise ValueError(f"rule {number + 1} ({statement!r}): the body is empty (a constant is a number)")
        rules.append(Rule(_term(head_text, statement), [_term(f, statement) for f in factors], coeff))
    return rules


def _split_rules(text: str) -> list[str]:
    """Split at the '.' that ends a rule, not the one inside a number."""
    out, current = [], ""
    for i, ch in enumerate(text):
        after = text[i + 1 : i + 3]
        exponent = i > 0 and text[i - 1].isdigit() and after[:1] in ("e", "E") and after[1:2] in tuple("+-0123456789")
        if ch == "." and not (after[:1].isdigit() or exponent):  # (a rule starts with a name; 1.e-3 is a number)
            out.append(current)
            current = ""
        else:
            current += ch
    if current.strip():
        raise ValueError(f"the last rule ({current.strip()!r}) does not end with '.'")
    return out


def _split_top(text: str, separator: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for ch in text:
        depth += ch == "("
        depth -= ch == ")"
        if ch == separator and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    parts.append(current)
    if len(parts) > 1 and not all(p.strip() for p in parts):  # ("a += b * ." lost a factor)
        raise ValueError(f"{text.strip()!r}: a {separator!r} with nothing on one side")
    return [p for p in parts if p.strip()]


def _term(text: str, statement: str) -> Pattern:
    found = _TERM.match(text)
    if found is None:
        raise ValueError(f"in {statement!r}: {text.strip()!r} is not an item like name(X, 3)")
    args = [a.strip() for a in found.group(2).split(",")] if found.group(2) is not None else []
    if found.group(2) is not None and not found.group(2).strip():
        args = []  # (c() is c; b(,) is refused below)
    for a in args:  # (an empty argument, b(X,), or two words, b(x y), is no argument)
        if not _ARGUMENT.match(a):
            raise ValueError(
                f"in {statement!r}: {text.strip()!r} has the argument {a!r}: not a name, a variable or a number"
            )
    return (found.group(1), *(_constant(a) for a in args))


def _constant(text: str) -> object:
    """An argument: an int or a float where it is a number (as the items of
    axioms are written in Python), else a name or a variable, as written.

    >>> _constant("3"), _constant("+2"), _constant("-0.5"), _constant("X"), _constant("red")
    (3, 2, -0.5, 'X', 'red')
    """
    if text.lstrip("+-").isdigit():
        return int(text)
    return float(text) if _NUMBER.match(text) else text
