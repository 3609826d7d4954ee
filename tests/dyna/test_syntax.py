"""Rules and their text form: constants (rules with no body item)."""

from __future__ import annotations

import pytest

from monadl.dyna import MIN_PLUS, Program, Rule, parse


def test_a_constant_rule_reads_and_prints_as_dyna_writes_it() -> None:
    program = parse(
        """
        pathto(0) += 1.
        pathto(J) += edge(I, J) * pathto(I).
        start += 0.25.   % a number alone is the body
        """
    )
    assert program.rules[0] == Rule(("pathto", 0), [], 1.0)
    assert program.rules[2] == Rule(("start",), [], 0.25)
    assert [str(r) for r in program.rules] == [
        "pathto(0) += 1.0",
        "pathto(J) += edge(I, J) * pathto(I)",
        "start += 0.25",
    ]
    # A constant is its value as written, in every semiring (here a distance of 1, not min-plus's one).
    assert parse("d(0) += 1.", MIN_PLUS).run({}).chart == {("d", 0): 1.0}


def test_a_constant_needs_a_ground_head_and_a_value() -> None:
    with pytest.raises(ValueError, match="range-restricted"):
        parse("pathto(J) += 1.")
    with pytest.raises(ValueError, match="body is empty"):
        parse("pathto(0) += .")


def test_numbers_in_rules_as_python_writes_them() -> None:
    from monadl.dyna import parse

    assert parse("a += .5.").run({}).chart == {("a",): 0.5}  # (the body was 'empty')
    rule = parse("q(0.5, X) += r(X, -2, 1e3).").rules[0]
    assert rule.head == ("q", 0.5, "X") and rule.body == [("r", "X", -2, 1000.0)]  # (0.5 was the string '0.5')
    assert parse("q(0.5, X) += r(X).").run({("r", 1): 2.0}).chart[("q", 0.5, 1)] == 2.0


@pytest.mark.parametrize(
    ("text", "refused"),
    [
        ("a += b * .", r"a '\*' with nothing on one side"),  # (read as a += b)
        ("a += b(X,).", r"has the argument '': not a name"),  # (an argument '')
        ("a += b(x y).", r"has the argument 'x y'"),  # (one constant 'x y')
        ("a += b( , ).", r"has the argument ''"),
    ],
)
def test_malformed_rules_are_refused_not_read_as_others(text: str, refused: str) -> None:
    with pytest.raises(ValueError, match=refused):
        parse(text)


def test_an_empty_argument_list_is_none() -> None:
    assert parse("a += b(X) * c().").rules[0].body == [("b", "X"), ("c",)]


def test_a_number_with_a_dot_before_its_exponent_is_one_number() -> None:
    # ("a += 1.e-3 * b." was split after "1.": rule 2 'e-3 * b')
    (rule,) = parse("a += 1.e-3 * b.").rules
    assert rule.coeff == 1e-3 and rule.body == [("b",)]
    assert [str(r) for r in parse("a += 1.e(X) += b(X).").rules] == ["a += 1.0", "e(X) += b(X)"]  # (a name after)


def test_the_anonymous_variable_is_a_fresh_variable_at_each_occurrence() -> None:
    """``_`` and ``_I`` were read as the constants '_' and '_I': goal was
    never derived. As in Prolog and Dyna they are variables, and two ``_`` are
    two variables."""
    axioms = {("word", 0, 1): 1.0, ("word", 1, 2): 1.0, ("score", 1): 0.5, ("score", 2): 0.25}
    assert parse("goal += word(_, W) * score(W).").run(axioms).chart[("goal",)] == 0.75
    assert parse("goal += word(_I, W) * score(W).").run(axioms).chart[("goal",)] == 0.75
    pairs = parse("n += pair(_, _).")
    assert str(pairs.rules[0]) == "n += pair(_0, _1)"
    assert pairs.run({("pair", 0, 1): 1.0, ("pair", 2, 2): 1.0}).chart[("n",)] == 2.0  # (not only pair(2, 2))
    assert Rule(("n",), [("pair", "_", "_0")]).body == [("pair", "_1", "_0")]  # (a fresh name, not one in use)
    with pytest.raises(ValueError, match="range-restricted"):
        parse("a(_) += b.")


def test_a_list_pattern_is_refused_with_its_tuple() -> None:
    """The hint for ``["p", "J"]`` was ``(['p', 'J'],)``, a pattern whose
    functor is a list: it said to wrap the list where it has to become one."""
    with pytest.raises(TypeError, match=r"an item or a pattern is a tuple, \('p', 'J'\)$"):
        Rule(["p", "J"], [("e", "I", "J")])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"an item or a pattern is a tuple, \('e', 'I', 'J'\)$"):
        Rule(("p", "J"), [["e", "I", "J"]])  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"goal \['p', 1\] is a list: an item is a tuple, \('p', 1\)$"):
        parse("p(J) += e(I, J).").goal(["p", 1], {("e", 0, 1): 1.0})  # type: ignore[arg-type]


def test_a_constant_that_starts_with_an_underscore_is_a_variable() -> None:
    """As in Prolog (and said in the syntax's docstring and the README):
    ``"_pad"`` matches every tag, so pads counts all three."""
    axioms = {("tag", 0, "_pad"): 1.0, ("tag", 1, "noun"): 1.0, ("tag", 2, "verb"): 1.0}
    assert Program([Rule(("pads",), [("tag", "I", "_pad")])]).run(axioms).chart[("pads",)] == 3.0
    assert Program([Rule(("pads",), [("tag", "I", "pad_")])]).run({("tag", 0, "pad_"): 1.0}).chart[("pads",)] == 1.0
