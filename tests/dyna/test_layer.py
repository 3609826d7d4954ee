"""Goals as layers: what a goal layer refuses, and what it gives."""

from __future__ import annotations

import inspect
from typing import Any

import anyio
import numpy as np
import pytest

import monadl as ml
from monadl.dyna import LOG_REAL, REAL, ArrayProgram, ArrayRunOptions, Program, Rule, RunOptions, parse

CYCLE = "c(X) += lex(X). c(X) += unary(X, Y) * c(Y). goal += c(X) * top(X)."
LEX_TOP = {("lex", x): 0.5 for x in range(3)} | {("top", 0): 1.0, ("top", 1): 0.0, ("top", 2): 0.0}
DIVERGENT = np.array([[0.475, 0.201, 0.031], [0.012, 0.607, 0.681], [0.453, 0.544, 0.406]])  # (spectral radius 1.2)


@pytest.mark.parametrize("arrays", [False, True], ids=["item at a time", "batched"])
def test_a_goal_whose_run_diverged_is_an_error(arrays: bool) -> None:
    """The goal layer gave the run's value, 8.7e307 item at a time, inf
    batched, though the run reached no fixpoint (``converged`` False)."""
    program = parse(CYCLE)
    if arrays:
        shapes = {"c": {0: 3}, "lex": {0: 3}, "unary": {0: 3, 1: 3}, "top": {0: 3}}
        goal = ArrayProgram(program.rules, REAL, arrays=shapes).goal(
            ("goal",), LEX_TOP, {"unary": ml.Weight(DIVERGENT)}
        )
    else:
        goal = program.goal(("goal",), LEX_TOP, {"unary": ml.Weight(DIVERGENT)})
    with np.errstate(over="ignore", invalid="ignore"), pytest.raises(ml.NonFiniteError, match="no fixpoint") as info:
        anyio.run(goal.predict)
    assert f"its layer built at {__file__}:" in str(info.value)  # (the user's line, as a layer's error names)


def test_a_goal_stopped_early_gives_the_stopped_value() -> None:
    """``max_pops`` is early stopping, documented: its run has not converged,
    and the goal layer gives the value it reached."""
    goal = parse(CYCLE).goal(("goal",), LEX_TOP, {"unary": ml.Weight(DIVERGENT)}, max_pops=40)
    value = anyio.run(goal.predict)
    assert (
        np.isfinite(value)
        and value
        == parse(CYCLE)
        .run({**LEX_TOP, **{("unary", x, y): DIVERGENT[x, y] for x in range(3) for y in range(3)}}, max_pops=40)
        .chart[("goal",)]
    )


def test_a_functor_given_both_as_axioms_and_as_a_weight_is_refused() -> None:
    """x(0) = 5 was replaced by the weight's entry, silently."""
    program = parse("s += x(I) * y(I).")
    with pytest.raises(ValueError, match=r"x: both axioms \(\('x', 0\)\) and weights\['x'\] give it"):
        program.goal(("s",), {("x", 0): 5.0, ("y", 0): 1.0}, {"x": ml.Weight(np.ones(2))})


@pytest.mark.parametrize("arrays", [False, True], ids=["item at a time", "batched"])
def test_a_functor_bound_to_a_layer_or_to_plain_data(arrays: bool) -> None:
    """A layer (rule probabilities normalised in the graph) or an array
    failed with AttributeError ('Layer' object has no attribute 'data')."""
    rules = parse("s += x(I) * y(I).", LOG_REAL).rules
    program = ArrayProgram(rules, LOG_REAL, arrays={"x": {0: 3}, "y": {0: 3}}) if arrays else Program(rules, LOG_REAL)
    scores = ml.Weight(np.array([0.1, 0.2, 0.3]))
    y = np.log(np.array([1.0, 2.0, 3.0]))
    p = np.exp(scores.data) / np.exp(scores.data).sum()
    goal = program.goal(("s",), None, {"x": ml.log_softmax(scores), "y": y})
    value, grads = anyio.run(ml.value_and_gradients, goal)
    assert value == pytest.approx(np.log(p @ np.exp(y)), rel=1e-12)
    share = p * np.exp(y) / (p @ np.exp(y))  # (d s / d log x, through log_softmax)
    np.testing.assert_allclose(grads[scores], share - p, rtol=1e-9, atol=1e-15)
    ml.check_grads(lambda x: program.goal(("s",), None, {"x": x, "y": y}), np.log(p))


def test_a_binding_that_is_no_weight_layer_or_array_or_of_other_dimensions_is_refused() -> None:
    program = parse("s += x(I) * y(I).")
    with pytest.raises(
        TypeError, match=r"weights\['x'\] is a dict: a functor is bound to a Weight, a Layer or an array"
    ):
        program.goal(("s",), {("y", 0): 1.0}, {"x": {0: 1.0}})  # type: ignore[dict-item]
    goal = program.goal(("s",), {("y", 0): 1.0}, {"x": ml.Weight(np.ones((2, 2))) * 2.0})  # (known when it ran)
    with pytest.raises(ValueError, match=r"weights\['x'\] has 2 dimensions, and the rules read x with 1"):
        anyio.run(goal.predict)


@pytest.mark.parametrize("arrays", [False, True], ids=["item at a time", "batched"])
def test_a_run_refuses_the_axioms_a_goal_refuses(arrays: bool) -> None:
    """``"start"`` for ``("start",)`` ran as s(t, a, r, t), and a misspelt
    functor was ignored: run() said nothing where goal() refused."""
    rules = parse("goal += start * word(I).").rules
    program = ArrayProgram(rules, REAL, arrays={"word": {0: 2}}) if arrays else Program(rules)
    with pytest.raises(TypeError, match=r"axiom 'start' is a str: an item is a tuple, \('start',\)"):
        program.run({"start": 2.0, ("word", 0): 1.0})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match=r"axioms of strat: no rule reads or derives strat \(rules read start, word"):
        program.run({("strat",): 2.0, ("word", 0): 1.0})
    with pytest.raises(TypeError, match=r"goal 'goal' is a str: an item is a tuple"):
        program.goal("goal", {("start",): 1.0})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"rule: 'goal' is a str: an item or a pattern is a tuple, \('goal',\)"):
        Rule(("goal"), [("word", "I")])  # type: ignore[arg-type]  # (what mypy refuses, without mypy)


def test_a_goal_refuses_an_option_its_run_has_not_where_it_is_built() -> None:
    """``max_pop=3`` (for ``max_pops``), or ``priority`` for an `ArrayProgram`
    (its agenda is FIFO), passed ``goal()`` and failed at ``predict()``:
    'Program._run() got an unexpected keyword argument', a private name."""
    w = ml.Weight(np.array([0.5, 0.25]))
    with pytest.raises(TypeError) as refused:
        parse("s += x(I) * x(I).").goal(("s",), weights={"x": w}, max_pop=3)  # type: ignore[call-arg]
    assert str(refused.value) == (
        "Program.goal() takes no option max_pop (did you mean max_pops?): "
        "its options are max_pops, tolerance, priority, stop"
    )
    program = ArrayProgram([Rule(("s",), [("x", "I"), ("x", "I")])], arrays={"x": {0: 2}})
    with pytest.raises(TypeError) as refused:
        program.goal(("s",), weights={"x": w}, priority="value")  # type: ignore[call-arg]
    assert str(refused.value) == (
        "ArrayProgram.goal() takes no option priority: its options are max_pops, tolerance, stop"
    )
    # (the options it takes still reach its runs: x pops, s does not)
    assert anyio.run(program.goal(("s",), weights={"x": w}, max_pops=1).predict) == 0.0


def test_a_goal_refuses_a_priority_its_run_would_refuse_where_it_is_built() -> None:
    """A priority other than a function, None or "value" (or "value" in a
    semiring with no better value) failed at ``predict()``, with no line."""
    w = ml.Weight(np.array([0.5, 0.25]))
    program = parse("s += x(I) * x(I).")
    with pytest.raises(ValueError, match=r"^priority must be a function, None or 'value', not 'vlaue'$"):
        program.goal(("s",), weights={"x": w}, priority="vlaue")
    with pytest.raises(ValueError, match=r"^an agenda by value needs an idempotent semiring, not real$"):
        program.goal(("s",), weights={"x": w}, priority="value")


@pytest.mark.parametrize("arrays", [False, True], ids=["item at a time", "batched"])
def test_a_goals_options_are_its_runs_keywords(arrays: bool) -> None:
    """`RunOptions` types what ``goal()`` passes on to ``run()``: one list."""
    program_type, options = (ArrayProgram, ArrayRunOptions) if arrays else (Program, RunOptions)
    run = inspect.signature(program_type.run).parameters.values()
    assert list(options.__annotations__) == [p.name for p in run if p.kind is p.KEYWORD_ONLY]


@pytest.mark.parametrize("arrays", [False, True], ids=["item at a time", "batched"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_goals_value_is_a_scalar_of_its_weights_dtype(arrays: bool, dtype: type[np.floating[Any]]) -> None:
    """As any scalar layer's (the README's "A value's NumPy type"): a goal
    over float32 weights gave a Python float (a new user's trial)."""
    rules = parse("s += x(I) * x(I).").rules
    program = ArrayProgram(rules, REAL, arrays={"x": {0: 2}}) if arrays else Program(rules, REAL)
    x = ml.Weight(np.array([0.1, 0.2], dtype), optimizer=ml.optim.sgd(0.1))
    value: Any = anyio.run(program.goal(("s",), None, {"x": x}).predict)  # (typed float, as every scalar layer's)
    assert type(value) is dtype and value == pytest.approx(0.05, rel=1e-6)
    trained: Any = anyio.run(program.goal(("s",), None, {"x": x}).train)
    assert type(trained) is dtype and x.data.dtype == dtype
    np.testing.assert_allclose(x.data, np.array([0.1, 0.2]) * 0.8, rtol=1e-6)
