"""Weighted logic programs with items batched into arrays: the same values and
gradients as item-at-a-time forward chaining, exact after early stops too."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import anyio
import numpy as np
import pytest

import monadl as ml
from examples import dyna_programs as dp
from monadl.dyna import LOG_REAL, MAX_TIMES, MIN_PLUS, REAL, ArrayProgram, Item, Program, Rule, Semiring, bind_weight
from monadl.dyna.syntax import parse_rules
from tests.dyna.test_scalar import PATH, closed_form, path_axioms

N = 4
PATH_ARRAYS = {"pathto": {0: N}, "edge": {0: N, 1: N}, "edgezero": {0: N}, "stop": {0: N}}


def hmm(n: int = 4, steps: int = 6, seed: int = 0) -> tuple[dict[Item, float], dict[str, dict[int, int]]]:
    rng = np.random.default_rng(seed)
    init = rng.dirichlet(np.ones(n))
    trans = rng.dirichlet(np.ones(n), size=n)
    emit = rng.dirichlet(np.ones(3), size=n)
    axioms = dp.hmm_axioms(init, trans, emit, list(rng.integers(0, 3, steps)))
    return axioms, {"alpha": {1: n}, "init": {0: n}, "trans": {0: n, 1: n}, "emit": {0: n}}


def finite_difference(
    program: ArrayProgram, axioms: Mapping[Item, float], goal: Item, eps: float = 1e-6, **options: Any
) -> dict[Item, float]:
    grads = {}
    for item in axioms:
        up, down = dict(axioms), dict(axioms)
        up[item] += eps
        down[item] -= eps
        grads[item] = (program.run(up, **options).value(goal) - program.run(down, **options).value(goal)) / (2 * eps)
    return grads


@pytest.mark.parametrize("semiring", [REAL, LOG_REAL], ids=lambda s: s.name)
def test_the_hmm_batched_agrees_with_item_at_a_time(semiring: Any) -> None:
    axioms, arrays = hmm()
    if semiring is LOG_REAL:
        axioms = {k: math.log(v) for k, v in axioms.items()}
    scalar = Program(dp.HMM.rules, semiring).run(axioms)
    batched = ArrayProgram(dp.HMM.rules, semiring, arrays=arrays).run(axioms)
    # Whole vectors pop: init, trans, emit(o) for 3 symbols, 6 obs, 5 succ, final; alpha(t) for 6 t; likelihood.
    assert batched.pops == 1 + 1 + 3 + 6 + 5 + 1 + 6 + 1
    assert batched.pops < scalar.pops / 2
    goal = ("likelihood",)
    assert batched.value(goal) == pytest.approx(scalar.chart[goal], rel=1e-12)
    expected = scalar.gradient(goal)
    got = batched.gradient(goal)
    assert set(got) == set(axioms)
    for item in axioms:
        assert got[item] == pytest.approx(expected.get(item, 0.0), rel=1e-9, abs=1e-15), item


def test_path_values_match_the_closed_form_on_a_cyclic_graph() -> None:
    axioms = path_axioms(0)
    run = ArrayProgram(PATH.rules, arrays=PATH_ARRAYS).run(axioms, tolerance=1e-14, max_pops=10_000)
    path, total = closed_form(axioms)
    for i in range(N):
        assert run.value(("pathto", i)) == pytest.approx(path[i], rel=1e-9)
    assert run.value(("total",)) == pytest.approx(total, rel=1e-9)


@pytest.mark.parametrize("pops", [7, 10, 15, None])
def test_path_gradients_match_finite_differences_after_early_stops(pops: int | None) -> None:
    axioms = path_axioms(1)
    axioms[("edge", 2, 3)] = 0.0  # an entry that is exactly zero still gets its gradient
    program = ArrayProgram(PATH.rules, arrays=PATH_ARRAYS)
    options: dict[str, Any] = {"max_pops": pops} if pops else {"tolerance": 1e-13, "max_pops": 10_000}
    grads = program.run(axioms, **options).gradient(("total",))
    numeric = finite_difference(program, axioms, ("total",), **options)
    assert any(abs(v) > 1e-3 for v in numeric.values())  # the goal was reached
    if pops is None:
        assert grads[("edge", 2, 3)] > 0.0
    for item, value in numeric.items():
        assert grads.get(item, 0.0) == pytest.approx(value, rel=1e-5, abs=1e-8), item


def test_what_cannot_be_batched_is_refused_clearly() -> None:
    rule = Rule(("y", "J"), [("w", "I", "J"), ("x", "I")])
    boolean = Semiring("boolean", 0.0, 1.0, max, min)  # max-times and min-plus batch now; others still do not
    with pytest.raises(ValueError, match="real, log-real, max-times or min-plus"):
        ArrayProgram([rule], boolean, arrays={"w": {0: 2}})
    with pytest.raises(ValueError, match="must be a variable"):
        ArrayProgram([Rule(("y",), [("w", 0, "J")])], arrays={"w": {0: 2}})
    with pytest.raises(ValueError, match="cannot be plain arguments"):
        ArrayProgram([rule], arrays={"w": {0: 2, 1: 2}, "x": {}})
    with pytest.raises(ValueError, match="occurs twice"):
        ArrayProgram([Rule(("y",), [("w", "I", "I")])], arrays={"w": {0: 2, 1: 2}})
    program = ArrayProgram([rule], arrays={"w": {0: 2, 1: 2}, "x": {0: 2}, "y": {0: 2}})
    with pytest.raises(ValueError, match="outside the array axes"):
        program.run({("w", 0, 0): 1.0, ("x", 5): 1.0})


def test_a_batched_goal_is_a_layer_whose_weights_train() -> None:
    import anyio

    import monadl as ml

    full = path_axioms(2)
    edges = np.zeros((N, N))
    for (functor, *index), value in full.items():
        if functor == "edge":
            edges[tuple(index)] = value
    axioms = {item: value for item, value in full.items() if item[0] != "edge"}
    options: dict[str, Any] = {"tolerance": 1e-14, "max_pops": 10_000}
    program = ArrayProgram(PATH.rules, arrays=PATH_ARRAYS)
    gradient = program.run(full, **options).gradient(("total",))

    weight = ml.Weight(edges, optimizer=ml.optim.sgd(0.1))
    total = program.goal(("total",), axioms, bind_weight("edge", weight), **options)
    assert anyio.run(total.predict) == pytest.approx(closed_form(full)[1], rel=1e-9)
    anyio.run(total.train)
    step = np.array([[gradient[("edge", i, j)] for j in range(N)] for i in range(N)]) * 0.1
    np.testing.assert_allclose(weight.data, edges - step, rtol=1e-12)


def test_constant_rules_batched_match_item_at_a_time() -> None:
    axioms = path_axioms(6)
    del axioms[("pathto", 0)]
    rules = [*PATH.rules, Rule(("pathto", 0), [], 1.0), Rule(("edge", 3, 0), [], 0.125)]
    options: dict[str, Any] = {"tolerance": 1e-14, "max_pops": 100_000}
    scalar = Program(rules).run(axioms, **options)
    batched = ArrayProgram(rules, arrays=PATH_ARRAYS).run(axioms, **options)
    assert batched.value(("total",)) == pytest.approx(scalar.chart[("total",)], rel=1e-9)
    assert batched.value(("edge", 3, 0)) == pytest.approx(axioms[("edge", 3, 0)] + 0.125)  # beside an axiom: plus
    for derived in (False, True):
        expected = scalar.gradient(("total",), derived=derived)
        got = batched.gradient(("total",), derived=derived)
        assert set(got) == set(expected)
        for item, value in expected.items():
            assert got[item] == pytest.approx(value, rel=1e-7, abs=1e-12), item
    with pytest.raises(ValueError, match="outside the array axes"):
        ArrayProgram([Rule(("pathto", 9), [], 1.0)], arrays=PATH_ARRAYS).run({})


def test_an_array_axis_argument_must_be_an_index_in_range() -> None:
    program = ArrayProgram([Rule(("y",), [("x", "I")])], arrays={"x": {0: 3}})
    for wrong in (1.7, -1, 3, True, "1"):
        with pytest.raises(ValueError, match="outside the array axes"):
            program.run({("x", wrong): 5.0})
    run = program.run({("x", 1): 5.0, ("x", np.int64(2)): 7.0})
    assert run.value(("y",)) == 12.0 and run.value(("x", 1)) == 5.0
    with pytest.raises(ValueError, match="outside the array axes"):
        run.value(("x", -1))  # not the last entry


def test_a_log_real_goal_of_probability_zero_has_gradient_zero_not_nan() -> None:
    from monadl.dyna import LOG_REAL, parse

    text = "pathto(0) += 0. pathto(J) += edge(I, J) * pathto(I). stop += final(I) * pathto(I)."
    program = parse(text, LOG_REAL, inputs={"edge"})  # (a graph of no edges)
    axioms = {("final", 1): 0.0}  # (pathto(1) is never reached: stop is -inf)
    shapes = {"pathto": {0: 2}, "edge": {0: 2, 1: 2}, "final": {0: 2}}
    arrays = ArrayProgram(program.rules, LOG_REAL, arrays=shapes, inputs={"edge"})
    assert arrays.run(axioms).gradient(("stop",)) == {("final", 1): 0.0}  # (exp(-inf + x + inf): NaN)
    assert program.run(axioms).gradient(("stop",)) == {("final", 1): 0.0}


def test_log_real_operands_that_peak_apart_do_not_underflow() -> None:
    """a(I) * b(I) with a = [0, -800] and b = [-800, 0] is log(2 e^-800),
    finite: shifting each operand by its own largest entry made every term
    e^-800, 0.0 in floats, and the batched value -inf with gradients 0."""
    rules = parse_rules("y += a(I) * b(I).")
    axioms = {("a", 0): 0.0, ("a", 1): -800.0, ("b", 0): -800.0, ("b", 1): 0.0}
    run = ArrayProgram(rules, LOG_REAL, arrays={"a": {0: 2}, "b": {0: 2}}).run(axioms)
    assert run.value(("y",)) == pytest.approx(math.log(2.0) - 800.0, rel=1e-15)
    assert run.gradient(("y",)) == pytest.approx(dict.fromkeys(axioms, 0.5), rel=1e-12)


def test_a_log_real_hmm_with_soft_masks_batched_agrees_with_item_at_a_time() -> None:
    """-1000 for an impossible emission or transition (a common stand-in for
    -inf) made the batched likelihood -inf; the true one is about -1001."""
    half, sure = math.log(0.5), 0.0
    trans = np.array([[math.log(0.9), -1000.0], [half, half]])  # (state 0 never goes to 1)
    emit = np.array([[sure, -1000.0], [-1000.0, sure]])  # (state s emits only s)
    logs = dp.hmm_axioms(np.array([half, half]), trans, emit, [0, 1, 1])
    logs.update({k: 0.0 for k in logs if k[0] in ("obs", "succ", "final")})  # (log 1)
    arrays = {"alpha": {1: 2}, "init": {0: 2}, "trans": {0: 2, 1: 2}, "emit": {0: 2}}
    want = Program(dp.HMM.rules, LOG_REAL).run(logs)
    got = ArrayProgram(dp.HMM.rules, LOG_REAL, arrays=arrays).run(logs)
    assert math.isfinite(want.chart[("likelihood",)])
    assert got.value(("likelihood",)) == pytest.approx(want.chart[("likelihood",)], rel=1e-12)
    expected = want.gradient(("likelihood",))
    for item, g in got.gradient(("likelihood",)).items():
        assert g == pytest.approx(expected.get(item, 0.0), rel=1e-9, abs=1e-12), item


def test_a_batched_run_whose_values_diverge_has_not_converged() -> None:
    """pathto doubles round a cycle of weight 2 until it is infinite, and then
    stands still: the item-at-a-time run and the batched one both say it did
    not converge (it reached no fixpoint)."""
    text = "pathto(0) += 1. pathto(J) += pathto(I) * edge(I, J)."
    axioms = {("edge", 0, 1): 2.0, ("edge", 1, 0): 1.0}
    with np.errstate(over="ignore", invalid="ignore"):  # (NumPy's warnings of the overflow stay the user's)
        batched = ArrayProgram(parse_rules(text), arrays={"pathto": {0: 2}, "edge": {0: 2, 1: 2}}).run(axioms)
    assert np.isinf(batched.chart[("pathto",)]).all() and not batched.converged
    assert not Program(parse_rules(text)).run(axioms).converged


def test_an_update_zero_in_every_entry_keeps_its_gradient() -> None:
    """pathto gets edge(2, 4) * pathto(2) = 0 in every entry after its first
    update: it changes nothing and waits on the agenda, and d stop / d edge(2, 4)
    = pathto(2) * final(4) = 1 (it was 0)."""
    from tests.dyna.test_scalar import ZEROS

    n = 5
    program = ArrayProgram(parse_rules(ZEROS), arrays={"pathto": {0: n}, "edge": {0: n, 1: n}, "final": {0: n}})
    run = program.run({("edge", 0, 2): 1.0, ("edge", 2, 4): 0.0, ("final", 4): 1.0})
    assert run.converged and list(run.pending) == [("pathto",)]
    assert run.gradient(("stop",))[("edge", 2, 4)] == 1.0


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("semiring", [REAL, LOG_REAL], ids=lambda s: s.name)
def test_exactly_zero_weights_batched_get_the_gradients_item_at_a_time(seed: int, semiring: Semiring) -> None:
    """Batched and item at a time (itself checked against finite differences
    in `test_scalar`) agree where a third of the weights are exactly zero, the
    derived items' gradients included (log-real's once missed the entries a
    later update reached)."""
    from tests.dyna.test_scalar import ZEROS, zero_path_axioms

    axioms = zero_path_axioms(seed)
    n = 1 + max(int(i) for item in axioms for i in item[1:])
    if semiring is LOG_REAL:
        axioms = {k: math.log(v) if v > 0 else -math.inf for k, v in axioms.items()}
    rules = parse_rules(ZEROS)
    batched = ArrayProgram(rules, semiring, arrays={"pathto": {0: n}, "edge": {0: n, 1: n}, "final": {0: n}})
    everything = dict(axioms)  # (the batched axioms' missing entries are the semiring's zero)
    for i in range(n):
        everything.setdefault(("final", i), semiring.zero)
        for j in range(n):
            everything.setdefault(("edge", i, j), semiring.zero)
    one_at_a_time = Program(rules, semiring).run(everything)
    want = one_at_a_time.gradient(("stop",), derived=True)
    got = batched.run(axioms).gradient(("stop",), derived=True)
    for item in axioms:
        assert got.get(item, 0.0) == pytest.approx(want.get(item, 0.0), rel=1e-7, abs=1e-9), item
    # derived items of nonzero value (batched, an entry exists once its array does)
    derived = [x for x in want if x[0] == "pathto" and one_at_a_time.chart[x] != semiring.zero]
    assert {x for x in got if x[0] == "pathto"} == set(derived)
    for item in derived:
        assert got[item] == pytest.approx(want[item], rel=1e-7, abs=1e-9), item


def test_a_nan_entry_does_not_freeze_its_item() -> None:
    """One NaN entry made the largest change NaN, so the update counted as
    unchanged and waited forever, the other entries' changes with it."""
    n = 3
    rules = parse_rules("y(I) += w(I) * x(I).")
    program = ArrayProgram(rules, arrays={"y": {0: n}, "w": {0: n}, "x": {0: n}})
    run = program.run({("w", 0): 1.0, ("w", 1): float("nan"), ("w", 2): 3.0, ("x", 0): 1.0, ("x", 2): 1.0})
    np.testing.assert_equal(run.chart[("y",)], [1.0, np.nan, 3.0])
    changed = ArrayProgram._changed(np.array([1.0, 2.0]), np.array([1.5, np.nan]), 0.1)
    assert changed and not ArrayProgram._changed(np.array([np.nan]), np.array([np.nan]), 0.0)


def test_a_goal_never_derived_has_the_keys_of_item_at_a_time() -> None:
    text = "p += a * b. g += p * c."  # c is never given: g is never derived
    axioms = {("a",): 0.5, ("b",): 0.25}
    for derived in (False, True):
        want = Program(parse_rules(text), inputs={"c"}).run(axioms).gradient(("g",), derived=derived)
        got = ArrayProgram(parse_rules(text), arrays={}, inputs={"c"}).run(axioms).gradient(("g",), derived=derived)
        assert got == want == dict.fromkeys(want, 0.0)


@pytest.mark.parametrize(
    ("shape", "refused"),
    [
        ((4, 4, 4), r"has 3 dimensions, and the rules read edge with 2"),
        ((4,), r"has 1 dimensions"),
        ((5, 5), r"has shape \(5, 5\), .* entries past 3"),
    ],
)
def test_a_weight_of_another_shape_than_its_arrays_is_refused(shape: tuple[int, ...], refused: str) -> None:
    """A 4 x 4 x 4 weight bound to edge(I, J) read as 0 silently; a 1-D or a
    5 x 5 one failed at its run with an error that named neither."""
    text = "pathto(0) += 1. pathto(J) += edge(I, J) * pathto(I). stop(I) += edgezero(I) * pathto(I)."
    arrays = {"pathto": {0: 4}, "edge": {0: 4, 1: 4}, "stop": {0: 4}, "edgezero": {0: 4}}
    program = ArrayProgram(parse_rules(text), arrays=arrays)
    with pytest.raises(ValueError, match=rf"weights\['edge'\] {refused}"):
        program.goal(("stop", 3), {("edgezero", 3): 1.0}, {"edge": ml.Weight(np.full(shape, 0.5))})


def test_one_variable_of_two_sizes_is_refused_naming_the_rule() -> None:
    """J of 3 in w and 2 in y made y a vector of 3 (its entry 2 then refused
    as outside y's axes); I of 3 in w and 2 in x failed in NumPy's einsum."""
    rules = parse_rules("y(J) += w(I, J) * x(I).")
    with pytest.raises(ValueError) as refused:
        ArrayProgram(rules, arrays={"w": {0: 2, 1: 3}, "x": {0: 2}, "y": {0: 2}})
    assert str(refused.value) == (
        "rule y(J) += w(I, J) * x(I): J is argument 1 of w, an array axis of 3, "
        "and argument 0 of y, one of 2: give J one size"
    )
    with pytest.raises(ValueError) as refused:
        ArrayProgram(rules, arrays={"w": {0: 3, 1: 2}, "x": {0: 2}, "y": {0: 2}})
    assert str(refused.value) == (
        "rule y(J) += w(I, J) * x(I): I is argument 0 of w, an array axis of 3, "
        "and argument 0 of x, one of 2: give I one size"
    )
    run = ArrayProgram(rules, arrays={"w": {0: 2, 1: 3}, "x": {0: 2}, "y": {0: 3}}).run(
        {("w", 0, 2): 5.0, ("w", 0, 1): 1.0, ("x", 0): 1.0}
    )
    assert run.value(("y", 2)) == 5.0 and np.shape(run.chart[("y",)]) == (3,)


def test_an_array_axis_past_its_functors_arguments_is_refused() -> None:
    """{5: 2} for a w of 2 arguments was accepted, and its run blamed the
    well-formed axiom w(0, 0): 'argument 5 of w is None'."""
    rules = parse_rules("y(J) += w(I, J) * x(I).")
    with pytest.raises(ValueError) as refused:
        ArrayProgram(rules, arrays={"w": {0: 2, 1: 2, 5: 2}, "x": {0: 2}, "y": {0: 2}})
    assert str(refused.value) == (
        "arrays['w'] makes argument 5 an array axis, but the rules read or derive w with 2 arguments (0..1): "
        "there is no argument 5"
    )
    with pytest.raises(ValueError, match=r"arrays\['x'\] has the position -1: an argument's position is an int"):
        ArrayProgram(rules, arrays={"x": {-1: 2}})
    with pytest.raises(ValueError, match=r"arrays\['x'\]\[0\] is 0: an array axis's size is an int, 1 or more"):
        ArrayProgram(rules, arrays={"x": {0: 0}})
    program = ArrayProgram(rules, arrays={"w": {0: 2, 1: 2}, "x": {0: 2}, "y": {0: 2}})
    with pytest.raises(ValueError, match=r"\('w', 0\): w has 1 arguments here, and its argument 1 is an array axis"):
        program.locate(("w", 0))


@pytest.mark.parametrize(
    ("semiring", "w", "c", "dc"),
    [(MAX_TIMES, 0.0, 1.0, 0.0), (MIN_PLUS, math.inf, 0.0, 1.0)],
    ids=["max-times", "min-plus"],
)
def test_a_goal_whose_derivations_tie_at_the_zero_keeps_its_best_derivation(
    semiring: Semiring, w: float, c: float, dc: float
) -> None:
    """goal = max(w0 c0, w1 c1) at w = 0 (min-plus: min at w = inf) is derived,
    its value the semiring's zero: item at a time its subgradient is 1 for w0;
    batched it was taken for underived (value == zero): no gradient and no
    best derivation ('was not derived')."""
    rules = parse_rules("goal += w(I) * c(I).")
    axioms = {("w", 0): w, ("w", 1): w, ("c", 0): c, ("c", 1): c}
    scalar = Program(rules, semiring).run(axioms)
    batched = ArrayProgram(rules, semiring, arrays={"w": {0: 2}, "c": {0: 2}}).run(axioms)
    assert batched.value(("goal",)) == scalar.chart[("goal",)] == semiring.zero
    assert batched.gradient(("goal",)) == scalar.gradient(("goal",)) == {("w", 0): 1.0, ("c", 0): dc}
    assert batched.best_derivation(("goal",)).leaves() == scalar.best_derivation(("goal",)).leaves()
    assert scalar.best_derivation(("goal",)).leaves() == [("w", 0), ("c", 0)]

    weight = ml.Weight(np.full(2, w))
    program = ArrayProgram(rules, semiring, arrays={"w": {0: 2}, "c": {0: 2}})
    goal = program.goal(("goal",), None, {"w": weight, "c": np.full(2, c)})
    _, gradients = anyio.run(lambda: ml.value_and_gradients(goal))
    np.testing.assert_array_equal(gradients[weight], [1.0, 0.0])


def test_a_best_derivation_needs_a_derivation_though_its_array_exists() -> None:
    """e(1, 1), a missing entry of the batched axiom e, is neither given nor
    derived: not derived, as item at a time; a goal never derived has no
    gradient in min-plus, as item at a time (it was every popped axiom's 0)."""
    rules = parse_rules("d(0) += 0. d(J) += d(I) * e(I, J). g += h(1) * d(I).")
    axioms = {("e", 0, 1): 1.0, ("h", 0): 2.0}
    batched = ArrayProgram(rules, MIN_PLUS, arrays={"d": {0: 3}, "e": {0: 3, 1: 3}}).run(axioms)
    assert batched.value(("d", 1)) == 1.0 and batched.best_derivation(("d", 1)).leaves() == [("e", 0, 1)]
    scalar = Program(rules, MIN_PLUS).run(axioms)
    assert batched.gradient(("g",)) == scalar.gradient(("g",)) == {}
    with pytest.raises(KeyError, match=r"\('g',\) was not derived"):
        batched.best_derivation(("g",))
    with pytest.raises(KeyError, match=r"\('e', 1, 1\) was not derived"):
        batched.best_derivation(("e", 1, 1))


def test_a_batched_run_refuses_an_axiom_of_another_arity_as_a_goal_does() -> None:
    arrays = {"pathto": {0: 4}, "edge": {0: 4, 1: 4}}
    paths = ArrayProgram(parse_rules("pathto(0) += 1. pathto(J) += pathto(I) * edge(I, J)."), arrays=arrays)
    with pytest.raises(ValueError) as error:
        paths.run({("edge", 0, 1): 0.5, ("edge", 0, 1, 2): 0.5})
    assert str(error.value) == (
        "axiom ('edge', 0, 1, 2) has 3 arguments, and the rules read or derive edge with 2: no rule would read it"
    )


def test_a_batched_rule_reading_what_nothing_gives_is_refused() -> None:
    """As item at a time: a rule reading a misspelt functor; a functor
    declared an input may be given nothing."""
    typo = ArrayProgram(
        parse_rules("y(J) += w(I, J) * x(I). total += scael * y(J)."),
        arrays={"w": {0: 2, 1: 2}, "x": {0: 2}, "y": {0: 2}},
    )
    refused = r"^rule total \+= scael \* y\(J\): no rule derives scael, and no axiom or weight gives it"
    with pytest.raises(ValueError, match=refused):
        typo.goal(("total",), {("x", 0): 1.0}, {"w": ml.Weight(np.ones((2, 2)))})
    with pytest.raises(ValueError, match=refused):
        typo.run({("w", 0, 1): 0.5, ("x", 0): 1.0})
    arrays = {"pathto": {0: 4}, "edge": {0: 4, 1: 4}}
    paths = parse_rules("pathto(0) += 1. pathto(J) += pathto(I) * edge(I, J).")
    with pytest.raises(ValueError, match="no rule derives edge, and no axiom or weight gives it"):
        ArrayProgram(paths, arrays=arrays).run({})
    empty = ArrayProgram(paths, arrays=arrays, inputs={"edge"}).run({})
    np.testing.assert_array_equal(empty.chart[("pathto",)], [1.0, 0.0, 0.0, 0.0])
