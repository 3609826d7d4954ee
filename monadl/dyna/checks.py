"""What a program refuses in the rules, axioms, weights and options it is
run or differentiated with: what a misspelt name or a wrong number of
arguments would make silently wrong (an axiom never read, a weight whose
gradient is zero, a rule that never applies), or would fail only when a
goal's layer first runs (an option its run does not take)."""

from __future__ import annotations

import difflib
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from monadl.dyna.layer import Source, bound_data
from monadl.dyna.syntax import Item, Rule, as_item, is_variable

__all__ = [
    "check_array_positions",
    "check_array_sizes",
    "check_axioms",
    "check_goal",
    "check_options",
    "check_reads",
    "declared_inputs",
]


def check_goal(
    goal: Item,
    rules: Sequence[Rule],
    axioms: Mapping[Item, float] | None,
    weights: Mapping[Any, Source] | None,
    dimensions: bool = True,
    inputs: Collection[Any] = (),
) -> None:
    """Refuse what a misspelt name or a wrong shape would make silently wrong:
    a goal whose functor nothing can give a value (no rule's head, no axiom
    and no weight has it: it would read the semiring's zero), a binding that
    is no `Source` (`bound_data`), a weight or an
    axiom of a functor no rule reads or derives (it would change nothing, and
    its gradient would be zero), where ``dimensions``, a weight whose
    dimensions are not the arguments the rules read its functor with, and a
    rule that reads what nothing gives, unless it is one of the ``inputs``
    (`check_reads`).

    >>> from monadl.dyna.syntax import parse_rules
    >>> rules = parse_rules("stop += pathto(I) * edge(I, J).")
    >>> check_goal(("stpo",), rules, {("edge", 0, 1): 1.0}, None)
    Traceback (most recent call last):
    ...
    ValueError: goal ('stpo',): no rule derives stpo, and no axiom or weight gives it (rules derive stop)
    >>> check_goal(("stop",), rules, {("egde", 0, 1): 1.0}, None)
    Traceback (most recent call last):
    ...
    ValueError: axioms of egde: no rule reads or derives egde (rules read edge, pathto; derive stop)
    """
    heads = {rule.head[0] for rule in rules}
    reads: dict[str, set[int]] = {}
    arities: dict[str, set[int]] = {}  # (the numbers of arguments the rules read or derive each functor with)
    for rule in rules:
        arities.setdefault(rule.head[0], set()).add(len(rule.head) - 1)
        for item in rule.body:
            reads.setdefault(item[0], set()).add(len(item) - 1)
            arities.setdefault(item[0], set()).add(len(item) - 1)
    said = _said(rules)
    if not isinstance(goal, tuple) or not goal:
        raise TypeError(f"goal {goal!r} is a {type(goal).__name__}: an item is a tuple, {as_item(goal)}")
    if not (goal[0] in heads or any(item[0] == goal[0] for item in axioms or {}) or goal[0] in (weights or {})):
        raise ValueError(
            f"goal {goal}: no rule derives {goal[0]}, and no axiom or weight gives it "
            f"(rules derive {', '.join(sorted(map(str, heads))) or 'nothing'})"
        )
    check_axioms(axioms or {}, rules, goal)
    for functor in weights or {}:
        given = [a for a in axioms or {} if a[0] == functor]
        if given:  # (the weight's entries would replace them silently, each run)
            raise ValueError(
                f"{functor}: both axioms ({given[0]}{', ...' if len(given) > 1 else ''}) and weights[{functor!r}] "
                f"give it: the weight's entries would replace the axioms; give {functor} one way"
            )
    known = arities.get(goal[0])
    if known is not None and len(goal) - 1 not in known:  # (an item of another arity: no rule meets it)
        raise ValueError(
            f"goal {goal} has {len(goal) - 1} arguments, and the rules read or derive {goal[0]} with "
            f"{' or '.join(map(str, sorted(known)))}: its value would be the semiring's zero"
        )
    for functor, weight in (weights or {}).items():
        if functor == goal[0] and functor not in reads:  # (the goal itself, given: as it is)
            continue
        if functor not in reads:
            raise ValueError(
                f"weights[{functor!r}]: no rule reads {functor} ({said}): its entries would change nothing"
            )
        data = bound_data(functor, weight)
        ndim = None if data is None else data.ndim  # (a layer's: when it is computed)
        if dimensions and ndim is not None and ndim not in reads[functor]:
            read = " or ".join(map(str, sorted(reads[functor])))
            raise ValueError(
                f"weights[{functor!r}] has {ndim} dimensions, and the rules read {functor} with {read} "
                "arguments: its entry at an index is the item of those arguments"
            )
    check_reads(rules, axioms or {}, weights or {}, inputs)


def check_options(options: Mapping[str, object], known: Sequence[str], method: str) -> None:
    """Refuse a run option that ``method`` does not take, when the goal is
    built: a goal passes its options on to each of its runs, so a misspelt one
    (``max_pop``) or one this kind of program has not (``priority`` for an
    `ArrayProgram`) failed only at ``predict()``, naming a private method.

    >>> check_options({"max_pop": 3}, ["max_pops", "tolerance", "stop"], "ArrayProgram.goal")
    Traceback (most recent call last):
    ...
    TypeError: ArrayProgram.goal() takes no option max_pop (did you mean max_pops?): its options are max_pops, tolerance, stop
    """
    for name in options:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise TypeError(f"{method}() takes no option {name}{hint}: its options are {', '.join(known)}")


def check_axioms(axioms: Mapping[Item, Any], rules: Sequence[Rule], goal: Item | None = None) -> None:
    """Refuse axioms that are no items (a string: ``"start"`` for
    ``("start",)``), of functors no rule reads or derives, nor the goal (a
    misspelt name, silently ignored), or of another number of arguments than
    the rules read or derive their functor with (no rule would read them):
    what a run and a goal check.

    >>> from monadl.dyna.syntax import parse_rules
    >>> check_axioms({"start": 1.0}, parse_rules("goal += start."))
    Traceback (most recent call last):
    ...
    TypeError: axiom 'start' is a str: an item is a tuple, ('start',)
    """
    for item in axioms:
        if not isinstance(item, tuple) or not item:
            raise TypeError(f"axiom {item!r} is a {type(item).__name__}: an item is a tuple, {as_item(item)}")
    arities: dict[Any, set[int]] = {}  # (the numbers of arguments the rules read or derive each functor with)
    for rule in rules:
        for pattern in (rule.head, *rule.body):
            arities.setdefault(pattern[0], set()).add(len(pattern) - 1)
    unread = sorted(
        {str(item[0]) for item in axioms if item[0] not in arities and (goal is None or item[0] != goal[0])}
    )
    if unread:
        raise ValueError(
            f"axioms of {', '.join(unread)}: no rule reads or derives {' or '.join(unread)} ({_said(rules)})"
        )
    for item in axioms:
        known = arities.get(item[0])
        if known is not None and len(item) - 1 not in known:  # (an item of another arity: no rule meets it)
            raise ValueError(
                f"axiom {tuple(item)} has {len(item) - 1} arguments, and the rules read or derive {item[0]} with "
                f"{' or '.join(map(str, sorted(known)))}: no rule would read it"
            )


def check_reads(
    rules: Sequence[Rule], axioms: Mapping[Item, Any], weights: Mapping[Any, Source], inputs: Collection[Any] = ()
) -> None:
    """Refuse a rule whose body reads a functor, with its number of
    arguments, that no rule derives and no axiom or weight gives: a
    misspelt name (``patho`` for ``pathto``) or a wrong arity made the rule
    never apply, the goal silently the semiring's zero. What a run and a
    goal check, with the axioms (and weights) they are given: a functor may
    come from them alone, and one of the ``inputs`` (declared so: as
    Prolog's ``dynamic``) may be given nothing in a run (a graph of no edges).

    >>> from monadl.dyna.syntax import parse_rules
    >>> rules = parse_rules("pathto(0) += 1. pathto(J) += patho(I) * edge(I, J).")
    >>> check_reads(rules, {("edge", 0, 1): 0.5}, {})
    Traceback (most recent call last):
    ...
    ValueError: rule pathto(J) += patho(I) * edge(I, J): no rule derives patho, and no axiom or weight gives it, so the rule never applies (rules derive pathto; axioms and weights give edge): correct its name, or give patho (one that a run may leave empty: declare it, inputs={'patho'})
    >>> check_reads(parse_rules("pathto(J) += pathto(I) * edge(I, J). pathto(0) += 1."), {}, {}, inputs={"edge"})
    """
    given: dict[Any, set[int] | None] = {}  # (functor -> its numbers of arguments; None: any, a layer's)
    for rule in rules:
        _give(given, rule.head[0], len(rule.head) - 1)
    for item in axioms:
        _give(given, item[0], len(item) - 1)
    for functor, source in weights.items():
        data = bound_data(functor, source)
        if data is None:
            given[functor] = None
        else:
            _give(given, functor, data.ndim)
    for rule in rules:
        for item in rule.body:
            functor, arity = item[0], len(item) - 1
            if functor in inputs:
                continue
            if functor not in given:
                outside = sorted({str(a[0]) for a in axioms} | set(map(str, weights)))
                raise ValueError(
                    f"rule {rule}: no rule derives {functor}, and no axiom or weight gives it, so the rule never "
                    f"applies (rules derive {', '.join(sorted({str(r.head[0]) for r in rules}))}; axioms and weights "
                    f"give {', '.join(outside) or 'nothing'}): correct its name, or give {functor} (one that a run "
                    f"may leave empty: declare it, inputs={{{functor!r}}})"
                )
            known = given[functor]
            if known is not None and arity not in known:
                numbers = " or ".join(map(str, sorted(known)))
                raise ValueError(
                    f"rule {rule}: it reads {functor} with {arity} arguments, and {functor} is derived or given "
                    f"with {numbers}, so the rule never applies: write {functor} with {numbers} arguments"
                )


def _give(given: dict[Any, set[int] | None], functor: Any, arity: int) -> None:
    """Add a number of arguments a functor is given with (to any but a layer's: None, any number)."""
    known = given.setdefault(functor, set())
    if known is not None:
        known.add(arity)


def _said(rules: Sequence[Rule]) -> str:
    """Which functors the rules read and derive, for an error."""
    reads = sorted({str(item[0]) for rule in rules for item in rule.body})
    heads = sorted({str(rule.head[0]) for rule in rules})
    return f"rules read {', '.join(reads) or 'nothing'}; derive {', '.join(heads)}"


def declared_inputs(inputs: Iterable[str], rules: Sequence[Rule]) -> frozenset[str]:
    """The functors a program declares its runs may give nothing of, each
    read by some rule (a misspelt declaration would let the misspelling through).

    >>> from monadl.dyna.syntax import parse_rules
    >>> sorted(declared_inputs("edge", parse_rules("p(J) += p(I) * edge(I, J).")))
    ['edge']
    >>> declared_inputs(["egde"], parse_rules("p(J) += p(I) * edge(I, J)."))
    Traceback (most recent call last):
    ...
    ValueError: inputs: no rule reads egde (rules read edge, p; derive p)
    """
    declared = frozenset([inputs] if isinstance(inputs, str) else inputs)
    read = {item[0] for rule in rules for item in rule.body}
    unread = sorted(map(str, declared - read))
    if unread:
        raise ValueError(f"inputs: no rule reads {', '.join(unread)} ({_said(rules)})")
    return declared


def check_array_positions(rules: Sequence[Rule], arrays: Mapping[str, Mapping[int, int]]) -> None:
    """Refuse an array axis that is no argument of its functor: one past the
    arity the rules give it (``{5: 2}`` for a ``w`` of 2 arguments) or a
    negative one made every axiom of it fail, blaming the axiom.

    >>> check_array_positions([Rule(("y",), [("w", "I", "J")])], {"w": {0: 2, 5: 2}})
    Traceback (most recent call last):
    ...
    ValueError: arrays['w'] makes argument 5 an array axis, but the rules read or derive w with 2 arguments (0..1): there is no argument 5
    """
    arities: dict[str, set[int]] = {}
    for rule in rules:
        for pattern in (rule.head, *rule.body):
            arities.setdefault(pattern[0], set()).add(len(pattern) - 1)
    for functor, positions in arrays.items():
        for k, size in positions.items():
            if isinstance(k, bool) or not isinstance(k, int) or k < 0:
                raise ValueError(
                    f"arrays[{functor!r}] has the position {k!r}: an argument's position is an int, from 0"
                )
            if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
                raise ValueError(f"arrays[{functor!r}][{k}] is {size!r}: an array axis's size is an int, 1 or more")
            for arity in sorted(arities.get(functor, ())):
                if k >= arity:
                    raise ValueError(
                        f"arrays[{functor!r}] makes argument {k} an array axis, but the rules read or derive "
                        f"{functor} with {arity} arguments"
                        + (f" (0..{arity - 1})" if arity else "")
                        + f": there is no argument {k}"
                    )


def check_array_sizes(rule: Rule, arrays: Mapping[str, Mapping[int, int]]) -> None:
    """Refuse a variable that indexes array axes of different sizes in one
    rule: its einsum made the head an array of the other size (not the one
    declared), or failed in NumPy naming no rule.

    >>> rule = Rule(("y", "J"), [("w", "I", "J"), ("x", "I")])
    >>> check_array_sizes(rule, {"w": {0: 2, 1: 3}, "x": {0: 2}, "y": {0: 2}})
    Traceback (most recent call last):
    ...
    ValueError: rule y(J) += w(I, J) * x(I): J is argument 1 of w, an array axis of 3, and argument 0 of y, one of 2: give J one size
    """
    seen: dict[str, tuple[str, int, int]] = {}
    for pattern in (*rule.body, rule.head):
        positions = arrays.get(pattern[0], {})
        for k, term in enumerate(pattern[1:]):
            if k not in positions or not is_variable(term):
                continue
            size = positions[k]
            first = seen.setdefault(term, (pattern[0], k, size))
            if first[2] != size:
                raise ValueError(
                    f"rule {rule}: {term} is argument {first[1]} of {first[0]}, an array axis of {first[2]}, "
                    f"and argument {k} of {pattern[0]}, one of {size}: give {term} one size"
                )
