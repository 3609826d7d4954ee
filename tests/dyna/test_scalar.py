"""Weighted logic programs: forward chaining, the tape's backward pass, and
the program as a monadl layer."""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from itertools import pairwise
from typing import Any

import anyio
import numpy as np
import pytest

import monadl as ml
from monadl.dyna import LOG_REAL, MIN_PLUS, Item, Program, Rule, Semiring, parse
from monadl.dyna.syntax import parse_rules

SQUARE = Program([Rule(("a",), [("a",), ("a",)]), Rule(("a",), [("r",)])])
PATH = Program(
    [
        Rule(("stop", "I"), [("edgezero", "I"), ("pathto", "I")]),
        Rule(("pathto", "J"), [("edge", "I", "J"), ("pathto", "I")]),
        Rule(("total",), [("stop", "I")]),
    ]
)


def finite_difference(
    program: Program, axioms: Mapping[Item, float], goal: Item, eps: float = 1e-6, **options: Any
) -> dict[Item, float]:
    grads = {}
    for item in axioms:
        up, down = dict(axioms), dict(axioms)
        up[item] += eps
        down[item] -= eps
        hi = program.run(up, **options).chart.get(goal, 0.0)
        lo = program.run(down, **options).chart.get(goal, 0.0)
        grads[item] = (hi - lo) / (2 * eps)
    return grads


def test_square_after_two_pops_of_a() -> None:
    run = SQUARE.run({("r",): 0.3}, max_pops=3)
    assert [e.item for e in run.tape] == [("r",), ("a",), ("a",)]
    assert run.chart[("a",)] == pytest.approx(0.3 + 0.3**2)
    assert run.gradient(("a",))[("r",)] == pytest.approx(1 + 2 * 0.3)


def test_square_converges_monotonically_to_the_fixed_point() -> None:
    r = 0.21
    values, grads = [], []
    for pops in range(3, 400, 20):
        run = SQUARE.run({("r",): r}, max_pops=pops)
        values.append(run.chart[("a",)])
        grads.append(run.gradient(("a",))[("r",)])
    assert values[-1] == pytest.approx(0.3, abs=1e-6)  # a = r + a^2
    assert grads[-1] == pytest.approx(1 / np.sqrt(1 - 4 * r), abs=1e-4)  # 2.5
    assert all(b >= a for a, b in pairwise(values))
    assert all(b >= a for a, b in pairwise(grads))


def path_axioms(seed: int, n: int = 4, cyclic: bool = True) -> dict[Item, float]:
    rng = np.random.default_rng(seed)
    edges = rng.uniform(0.05, 0.3, (n, n))
    if not cyclic:
        edges = np.triu(edges, 1)
    axioms: dict[Item, float] = {("pathto", 0): 1.0}
    axioms.update({("edge", i, j): float(edges[i, j]) for i in range(n) for j in range(n) if edges[i, j]})
    axioms.update({("edgezero", i): float(rng.uniform(0.1, 1.0)) for i in range(n)})
    return axioms


def closed_form(axioms: Mapping[Item, float], n: int = 4) -> tuple[np.ndarray, float]:
    edges = np.zeros((n, n))
    for item, value in axioms.items():
        if item[0] == "edge":
            edges[item[1], item[2]] = value
    start = np.zeros(n)
    start[0] = 1.0
    path = np.linalg.solve(np.eye(n) - edges.T, start)  # (I - E)^-1, read along the edges
    zero = np.array([axioms[("edgezero", i)] for i in range(n)])
    return path, float(zero @ path)


@pytest.mark.parametrize("cyclic", [True, False])
def test_path_values_match_the_closed_form(cyclic: bool) -> None:
    axioms = path_axioms(0, cyclic=cyclic)
    run = PATH.run(axioms, tolerance=1e-13, max_pops=100_000)
    path, total = closed_form(axioms)
    for i in range(4):
        assert run.chart[("pathto", i)] == pytest.approx(path[i], rel=1e-9)
    assert run.chart[("total",)] == pytest.approx(total, rel=1e-9)


@pytest.mark.parametrize("pops", [5, 12, 30, None])
def test_path_gradients_match_finite_differences_after_early_stops(pops: int | None) -> None:
    axioms = path_axioms(1)
    options: dict[str, Any] = {"max_pops": pops} if pops else {"tolerance": 1e-12, "max_pops": 100_000}
    run = PATH.run(axioms, **options)
    grads = run.gradient(("total",))
    numeric = finite_difference(PATH, axioms, ("total",), **options)
    for item, value in numeric.items():
        assert grads.get(item, 0.0) == pytest.approx(value, rel=1e-5, abs=1e-8), item


def test_an_axiom_of_value_zero_still_gets_its_gradient() -> None:
    axioms = path_axioms(2, cyclic=False)
    axioms[("edge", 0, 3)] = 0.0
    run = PATH.run(axioms, tolerance=0.0)
    grad = run.gradient(("total",))[("edge", 0, 3)]
    # d total / d edge(0,3) = pathto(0) * d total / d pathto(3) = 1 * edgezero(3) (no edges out of 3)
    assert grad == pytest.approx(axioms[("edgezero", 3)])


@pytest.mark.parametrize("seed", range(6))
def test_random_programs_match_finite_differences_and_ignore_pop_order(seed: int) -> None:
    rng = np.random.default_rng(seed)
    program = Program(
        [
            Rule(("b", "X"), [("a", "X"), ("w", "X", "Y"), ("a", "Y")], coeff=0.5),
            Rule(("a", "Y"), [("b", "X"), ("v", "X", "Y")]),
            Rule(("goal",), [("b", "X"), ("b", "X")]),
            Rule(("goal",), [("a", "X")], coeff=float(rng.uniform(0.5, 2))),
        ]
    )
    n = 3
    axioms: dict[Item, float] = {("a", i): float(rng.uniform(0.1, 0.5)) for i in range(n)}
    axioms.update({("w", i, j): float(rng.uniform(0.0, 0.2)) for i in range(n) for j in range(n)})
    axioms.update({("v", i, j): float(rng.uniform(0.0, 0.3)) for i in range(n) for j in range(n)})
    options: dict[str, Any] = {"tolerance": 1e-14, "max_pops": 200_000}
    fifo = program.run(axioms, **options)
    numeric = finite_difference(program, axioms, ("goal",), **options)
    grads = fifo.gradient(("goal",))
    for item, value in numeric.items():
        assert grads.get(item, 0.0) == pytest.approx(value, rel=1e-4, abs=1e-7), item
    shuffled = program.run(axioms, priority=lambda item, value: hash((seed, item)) % 97, **options)
    assert shuffled.chart[("goal",)] == pytest.approx(fifo.chart[("goal",)], rel=1e-9)
    other = shuffled.gradient(("goal",))
    for item in axioms:
        assert other.get(item, 0.0) == pytest.approx(grads.get(item, 0.0), rel=1e-6, abs=1e-9), item
    early = program.run(axioms, max_pops=17)
    early_numeric = finite_difference(program, axioms, ("goal",), max_pops=17)
    early_grads = early.gradient(("goal",))
    for item, value in early_numeric.items():
        assert early_grads.get(item, 0.0) == pytest.approx(value, rel=1e-5, abs=1e-8), item


@pytest.mark.anyio
async def test_a_goal_is_a_layer_whose_weights_train() -> None:
    axioms = path_axioms(3)
    n = 4
    edges = np.zeros((n, n))
    for item, value in axioms.items():
        if item[0] == "edge":
            edges[item[1], item[2]] = value
    fixed = {k: v for k, v in axioms.items() if k[0] != "edge"}
    w = ml.Weight(edges.copy(), optimizer=ml.optim.sgd(0.01))
    total = PATH.goal(("total",), fixed, {"edge": w}, tolerance=1e-13, max_pops=100_000)
    assert await total.predict() == pytest.approx(closed_form(axioms)[1], rel=1e-9)
    [grad] = await ml.gradients(total, [w])
    run = PATH.run(axioms, tolerance=1e-13, max_pops=100_000)
    expected = run.gradient(("total",))
    for i in range(n):
        for j in range(n):
            assert grad[i, j] == pytest.approx(expected.get(("edge", i, j), 0.0), rel=1e-9)
    before = await total.predict()
    target = before * 0.5
    for _ in range(20):
        await ((PATH.goal(("total",), fixed, {"edge": w}, tolerance=1e-13, max_pops=100_000) - target) ** 2.0).train()
    after = await PATH.goal(("total",), fixed, {"edge": w}, tolerance=1e-13, max_pops=100_000).predict()
    assert abs(after - target) < abs(before - target)


def test_rules_must_be_range_restricted() -> None:
    with pytest.raises(ValueError, match="range-restricted"):
        Rule(("path", "X", "Z"), [("edge", "X", "Y")])
    with pytest.raises(ValueError, match="range-restricted"):  # a constant's head is ground
        Rule(("pathto", "J"), [], 1.0)


def test_text_syntax() -> None:
    from monadl.dyna import parse

    program = parse(
        """
        % the path program of the appendix
        stop(I) += edgezero(I) * pathto(I).
        pathto(J) += edge(I, J) * pathto(I).
        total += stop(I).
        half(X) += 0.5 * stop(X).
        """
    )
    assert [str(r) for r in program.rules] == [str(r) for r in PATH.rules] + ["half(X) += 0.5 * stop(X)"]
    axioms = path_axioms(0)
    assert program.run(axioms, tolerance=1e-13, max_pops=100_000).chart[("total",)] == pytest.approx(
        PATH.run(axioms, tolerance=1e-13, max_pops=100_000).chart[("total",)]
    )
    with pytest.raises(ValueError, match="range-restricted"):
        parse("path(X, Z) += edge(X, Y).")
    with pytest.raises(ValueError, match="does not end"):
        parse("a += b")
    with pytest.raises(ValueError, match="not an item"):
        parse("a += 3b.")


def test_a_constant_rule_replaces_the_extra_axiom() -> None:
    axioms = path_axioms(6)
    del axioms[("pathto", 0)]
    program = Program([*PATH.rules, Rule(("pathto", 0), [], 1.0)])
    options: dict[str, Any] = {"tolerance": 1e-13, "max_pops": 100_000}
    run = program.run(axioms, **options)
    with_axiom = PATH.run({**axioms, ("pathto", 0): 1.0}, **options)
    assert run.chart[("total",)] == pytest.approx(closed_form({**axioms, ("pathto", 0): 1.0})[1], rel=1e-9)
    grads, expected = run.gradient(("total",)), with_axiom.gradient(("total",))
    assert set(grads) == set(expected) - {("pathto", 0)}  # a constant is no axiom
    for item, value in grads.items():
        assert value == pytest.approx(expected[item], rel=1e-9), item
    assert run.gradient(("total",), derived=True)[("pathto", 0)] == pytest.approx(expected[("pathto", 0)], rel=1e-9)
    # beside an axiom of the same item, the two add
    both = program.run({**axioms, ("pathto", 0): 0.5}, **options)
    assert both.chart[("total",)] == pytest.approx(1.5 * run.chart[("total",)], rel=1e-9)


@pytest.mark.anyio
async def test_a_goal_never_derived_is_the_semirings_zero() -> None:
    from monadl.dyna import LOG_REAL, MIN_PLUS, parse

    shortest = parse("path(J) += path(I) * edge(I, J). path(0) += 0.", MIN_PLUS)
    assert await shortest.goal(("path", 2), {("edge", 0, 1): 1.0}).predict() == np.inf  # unreachable: not 0.0
    assert await parse("b(X) += a(X).", LOG_REAL).goal(("b", 2), {("a", 1): 0.0}).predict() == -np.inf  # prob. 0
    w = ml.Weight(np.array([0.5, 0.25]))
    assert await ml.gradients(parse("s(I) += x(I) * x(I).").goal(("s", 5), weights={"x": w}), [w]) == [
        pytest.approx(np.zeros(2))
    ]
    with pytest.raises(ValueError, match=r"goal \('stpo', 2\): no rule derives stpo.*\(rules derive path\)"):
        shortest.goal(("stpo", 2), {("edge", 0, 1): 1.0})  # misspelt: it would read the zero, silently


def await_value(layer: ml.ScalarLayer) -> float:
    return float(anyio.run(layer.predict))


def test_axioms_and_weights_of_a_functor_no_rule_reads_or_of_other_dimensions_are_refused() -> None:
    # Each was silently wrong: an axiom ignored, a weight's gradient zero (a user's trial).
    paths = parse("pathto(0) += 1. pathto(J) += pathto(I) * edge(I, J).", inputs={"edge"})
    with pytest.raises(ValueError, match=r"axioms of egde: no rule reads or derives egde \(rules read edge, pathto"):
        paths.goal(("pathto", 1), {("egde", 0, 1): 0.5})
    with pytest.raises(ValueError, match=r"weights\['edg'\]: no rule reads edg"):
        paths.goal(("pathto", 1), weights={"edg": ml.Weight(np.ones((2, 2)))})
    for data in (np.ones(2), np.ones((2, 2, 2)), 0.5):
        with pytest.raises(ValueError, match=r"weights\['edge'\] has \d dimensions, and the rules read edge with 2"):
            paths.goal(("pathto", 1), weights={"edge": ml.Weight(data)})
    assert paths.run({("pathto", 0): 2.0}).chart[("pathto", 0)] == 3.0  # (a derived functor's axiom: as before)
    # The goal given by an axiom or a weight that no rule reads: its value, as before.
    sums = parse("s += x(I).", inputs={"x"})
    assert await_value(sums.goal(("g",), {("g",): 2.0})) == 2.0
    assert await_value(sums.goal(("g",), weights={"g": ml.Weight(3.0)})) == 3.0


PATHS = "pathto(0) += 1. pathto(J) += {} * edge(I, J). goal += pathto(3)."


def test_a_rule_reading_what_nothing_gives_is_refused_naming_the_rule() -> None:
    """patho for pathto, or pathto(I, J) where pathto has one argument, made the
    rule never apply: the goal 0 and its gradient 0, silently (a user's trial)."""
    edges = {"edge": ml.Weight(np.full((4, 4), 0.1))}
    assert await_value(parse(PATHS.format("pathto(I)")).goal(("goal",), None, edges)) == pytest.approx(1 / 6)
    typo = parse(PATHS.format("patho(I)"))
    refused = (
        "rule pathto(J) += patho(I) * edge(I, J): no rule derives patho, and no axiom or weight gives it, so the rule "
        "never applies (rules derive goal, pathto; axioms and weights give edge): correct its name, or give patho "
        "(one that a run may leave empty: declare it, inputs={'patho'})"
    )
    with pytest.raises(ValueError) as error:
        typo.goal(("goal",), None, edges)
    assert str(error.value) == refused
    with pytest.raises(ValueError) as error:
        typo.run({("edge", 0, 1): 0.5})
    assert str(error.value) == refused
    arity = parse(PATHS.format("pathto(I, J)"))
    with pytest.raises(ValueError) as error:
        arity.run({("edge", 0, 1): 0.5})
    assert str(error.value) == (
        "rule pathto(J) += pathto(I, J) * edge(I, J): it reads pathto with 2 arguments, and pathto is derived or "
        "given with 1, so the rule never applies: write pathto with 1 arguments"
    )
    # A functor the axioms alone give: given in this run, or declared an input that a run may leave empty.
    paths = parse(PATHS.format("pathto(I)"))
    assert paths.run({("edge", 0, 3): 0.5}).chart[("goal",)] == 0.5
    with pytest.raises(ValueError, match="no rule derives edge, and no axiom or weight gives it"):
        paths.run({})
    no_edges = parse(PATHS.format("pathto(I)"), inputs={"edge"})
    assert no_edges.run({}).chart == {("pathto", 0): 1.0}
    assert await_value(no_edges.goal(("pathto", 0))) == 1.0
    with pytest.raises(
        ValueError, match=r"inputs: no rule reads egde \(rules read edge, pathto; derive goal, pathto\)"
    ):
        parse(PATHS.format("pathto(I)"), inputs={"egde"})


def test_a_run_refuses_an_axiom_of_another_arity_as_a_goal_does() -> None:
    """run() kept edge(0, 1, 2), which no rule reads, unread in its chart."""
    paths = parse(PATHS.format("pathto(I)"))
    refused = "axiom ('edge', 0, 1, 2) has 3 arguments, and the rules read or derive edge with 2: no rule would read it"
    for check in (lambda: paths.run({("edge", 0, 1, 2): 0.5}), lambda: paths.goal(("goal",), {("edge", 0, 1, 2): 0.5})):
        with pytest.raises(ValueError) as error:
            check()
        assert str(error.value) == refused


def test_a_cycle_that_diverges_to_nan_stops() -> None:
    from monadl.dyna import parse

    # Updates alternate to +inf and -inf; their sum is NaN, and NaN != NaN popped it forever.
    run = parse("a += -2 * a. a += 1.").run({})
    assert np.isnan(run.chart[("a",)]) and run.pops < 5000


@pytest.mark.anyio
async def test_a_goal_layer_gives_the_event_loop_its_turns_while_it_chains() -> None:
    import time

    import anyio

    from monadl.dyna import parse

    program = parse("a += 1.")
    ticks = 0
    moved: list[int] = []

    def slow(run: Any) -> bool:  # a run longer than the loop may wait (5 ms): later ones go to a thread
        time.sleep(0.02)
        return True

    def stop(run: Any) -> bool:  # after a pop, in the run's thread: does the event loop move meanwhile?
        start, deadline = ticks, time.monotonic() + 10.0
        while ticks == start and time.monotonic() < deadline:
            time.sleep(0.001)
        moved.append(ticks - start)
        return True  # (one pop is enough)

    async def tick() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await anyio.sleep(0.001)

    assert await program.goal(("a",), stop=slow).predict() == 1.0  # (inline: a short run costs no thread hop)
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(tick)
        assert await program.goal(("a",), stop=stop).predict() == 1.0
        tasks.cancel_scope.cancel()
    assert moved and moved[0] > 0  # (run in the loop's own thread, nothing moved until it ended)
    # With no event loop (check_grads, predict_sync) a long program's goal runs inline all the same.
    program = parse("s += x(I) * x(I).")
    program.timing.seconds = 1.0  # (as after a long run)

    def f(x: Any) -> Any:  # (check_grads calls it on weights, then on plain data for finite differences)
        return program.goal(("s",), weights={"x": x}) if isinstance(x, ml.Weight) else float((x * x).sum())

    ml.check_grads(f, np.array([0.5, 0.25]))  # (it failed: 'this computation awaits something')


@pytest.mark.anyio
@pytest.mark.parametrize("arrays", [False, True])
async def test_a_run_that_never_ends_is_cancelled_and_stops(arrays: bool) -> None:
    import time

    from monadl.dyna import ArrayProgram

    # a = 1, 0, 1, 0, ...: the updates alternate forever. Its first run starts inline
    # (a short program's), so it blocked the loop: a timeout never took effect, and in
    # a thread the abandoned run went on for ever. Now it leaves the loop after its
    # turn (5 ms), and a cancelled wait stops it at its next pop.
    rules = parse("a += -1 * a. a += w.").rules
    program = ArrayProgram(rules, arrays={}) if arrays else Program(rules)
    pops = 0

    def count(run: Any) -> bool:
        nonlocal pops
        pops += 1
        return False

    w = ml.Weight(1.0)
    for _ in range(2):  # (the first run moves to a thread after its turn; the second starts there)
        with anyio.fail_after(60):  # (a hang fails here; the timeout below takes effect at once)
            with anyio.move_on_after(0.2) as scope:
                await program.goal(("a",), weights={"w": w}, stop=count).train()
        assert scope.cancelled_caught and w.data == 1.0  # (nothing stepped)
        counted, deadline = -1, time.monotonic() + 30.0
        while pops != counted and time.monotonic() < deadline:  # (the run stops: its pops stop)
            counted = pops
            await anyio.sleep(0.2)
        assert pops == counted
        assert program.timing.seconds > 0.005  # (the loop's turn, by default: later runs go to a thread)
    # A run bounded by max_pops ends, and its goal is the value it reached (1, 0, 1, ...).
    assert await program.goal(("a",), weights={"w": w}, max_pops=4).predict() in (0.0, 1.0)


@pytest.mark.anyio
async def test_a_goal_layer_built_once_runs_where_its_programs_last_run_says() -> None:
    import threading
    import time

    # The choice was made when the layer was built: a layer built once and run often
    # started inline every time, blocked the loop for its turn, and was redone in a thread.
    program = parse("a += 0.5 * a. a += w.")
    starts: list[bool] = []  # per run: whether its first pop was in the loop's thread

    def slow(run: Any) -> bool:
        if run.pops == 1:
            starts.append(threading.current_thread() is threading.main_thread())
        time.sleep(0.003)  # (a run of 4 pops: longer than the loop's turn, 5 ms)
        return bool(run.pops >= 4)

    goal = program.goal(("a",), weights={"w": ml.Weight(1.0)}, stop=slow)
    for _ in range(3):
        await goal.predict()
    assert starts == [True, False, False, False]  # (inline, dropped after its turn, then a thread each run)


@pytest.mark.anyio
async def test_the_gradient_of_a_run_in_a_worker_thread_is_taken_there() -> None:
    """The backward popped the tape on the event loop's thread: a run long
    enough for a thread held the loop as long again in train()'s backward
    (a user's HMM: 0.5 s, past a deadline around train())."""
    import threading
    import time

    from monadl.dyna.scalar import Run

    program = parse("a += 0.5 * a. a += w.")
    where: list[bool] = []  # per gradient: whether it was taken on the loop's thread
    gradient = Run.gradient

    def recorded(self: Run, goal: Item, *, derived: bool = False) -> dict[Item, float]:
        where.append(threading.current_thread() is threading.main_thread())
        return gradient(self, goal, derived=derived)

    def slow(run: Any) -> bool:
        time.sleep(0.003)  # (longer than the loop's turn, 5 ms, in 4 pops: then a thread each run)
        return bool(run.pops >= 4)

    w = ml.Weight(1.0, optimizer=ml.optim.sgd(0.1))
    goal = program.goal(("a",), weights={"w": w}, stop=slow)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Run, "gradient", recorded)
        for _ in range(3):
            await goal.train()
        await goal.predict()  # (no gradient where nothing wants one)
    assert where == [False, False, False]
    assert w.data < 1.0


def test_an_array_program_stops_where_its_stop_says() -> None:
    from monadl.dyna import ArrayProgram

    program = ArrayProgram(parse("a += 0.5 * a. a += 1.").rules, arrays={})
    stopped = program.run({}, stop=lambda run: run.pops >= 3)
    assert stopped.pops == 3 and stopped.chart == program.run({}, max_pops=3).chart
    assert not stopped.converged


ZEROS = "pathto(0) += 1. pathto(J) += edge(I, J) * pathto(I). stop += final(I) * pathto(I)."


def zero_path_axioms(seed: int) -> dict[Item, float]:
    """A random graph (cyclic for odd seeds, of small weights so paths converge)
    where a third of the edges and some final weights are exactly zero."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(3, 7))
    axioms: dict[Item, float] = {}
    for i in range(n):
        for j in range(n):
            if (i < j or (seed % 2 and i != j)) and rng.random() < 0.6:
                axioms[("edge", i, j)] = 0.0 if rng.random() < 0.4 else float(rng.uniform(0.05, 0.3))
        axioms[("final", i)] = 0.0 if rng.random() < 0.4 else float(rng.uniform(0.1, 1.0))
    return axioms


def test_a_zero_product_reaching_an_item_that_has_a_value_keeps_its_gradient() -> None:
    """final(2) = 0 after final(0) = 0: stop already has its value 0, so the
    update final(2) * pathto(2) = 0 changes nothing and never pops; it still
    came along a rule instance, and d stop / d final(2) = pathto(2) = 1 (it was
    0), also for a goal further on."""
    program = parse(ZEROS + " top += 3 * stop.")
    axioms = {("edge", 0, 1): 1.0, ("edge", 1, 2): 1.0, ("final", 0): 0.0, ("final", 2): 0.0}
    run = program.run(axioms)
    assert run.converged and run.pending == {("stop",): 0.0}
    assert run.gradient(("stop",)) == {("edge", 0, 1): 0.0, ("edge", 1, 2): 0.0, ("final", 0): 1.0, ("final", 2): 1.0}
    assert run.gradient(("top",))[("final", 2)] == 3.0
    cycle = parse("a += x * a. a += 1.").run({("x",): 0.0})  # a = 1 / (1 - x)
    assert cycle.gradient(("a",)) == {("x",): 1.0}
    assert parse("a += 0.5 * a. a += x.").run({("x",): 0.0}).gradient(("a",)) == {("x",): 2.0}


@pytest.mark.parametrize("seed", range(8))
def test_exactly_zero_weights_get_the_gradients_of_finite_differences(seed: int) -> None:
    program = parse(ZEROS)
    axioms = zero_path_axioms(seed)
    grads = program.run(axioms).gradient(("stop",))
    numeric = finite_difference(program, axioms, ("stop",))
    for item, value in numeric.items():
        assert grads.get(item, 0.0) == pytest.approx(value, rel=1e-5, abs=1e-7), item


def test_a_gradient_that_never_settles_is_an_error() -> None:
    """A cycle of weight 1 whose values are all zero: the chart converges at
    once, but the adjoint of its pending zero update grows without bound."""
    run = parse("a += a. a += x.").run({("x",): 0.0})
    with pytest.raises(ml.NonFiniteError, match="does not settle"):
        run.gradient(("a",))


@pytest.mark.parametrize("seed", range(6))
def test_a_derived_items_log_real_gradient_is_its_share_of_the_goal(seed: int) -> None:
    """In log-real, ``derived=True`` gives x * (d Z / d an amount added to x) / Z
    (an HMM's posterior): checked by finite differences of the real program with
    an amount ``extra(J)`` added to each ``pathto(J)``. It once took x's first
    update for x, which on a graph is one path of many."""
    axioms = zero_path_axioms(seed)
    n = 1 + max(int(i) for item in axioms for i in item[1:])
    real = parse(ZEROS + " pathto(J) += extra(J).")
    base = axioms | {("extra", j): 0.0 for j in range(n)}
    run = real.run(base)
    if not run.chart[("stop",)]:
        axioms[("final", 0)] = 1.0  # (a goal of probability 0 has no shares)
        base[("final", 0)] = 1.0
        run = real.run(base)
    logs = {k: float(np.log(v)) if v > 0 else -np.inf for k, v in axioms.items()}
    derived = parse(ZEROS, LOG_REAL).run(logs).gradient(("stop",), derived=True)
    added = finite_difference(real, base, ("stop",))
    checked = 0
    for j in range(n):
        value = run.chart.get(("pathto", j), 0.0)
        if value:
            share = value * added[("extra", j)] / run.chart[("stop",)]
            assert derived[("pathto", j)] == pytest.approx(share, rel=1e-5, abs=1e-8), j
            checked += 1
    assert checked >= 1


def test_an_update_too_small_to_change_its_item_waits_and_keeps_its_gradient() -> None:
    """u * b = 1e-20 added to a = 1000 changes nothing: it waits, as a zero
    does, and d g / d u = d g / d x = b = 2 (it was 1 when it popped and drove
    nothing). Found by a differential fuzz."""
    program = parse("b += 1. b += w * b. a += 1000. a += u * b. a += x * b. g += a.")
    axioms = {("w",): 0.5, ("u",): 1e-20, ("x",): 0.0}
    grads = program.run(axioms).gradient(("g",))
    assert grads[("u",)] == pytest.approx(2.0) and grads[("x",)] == pytest.approx(2.0)
    assert finite_difference(program, axioms, ("g",))[("x",)] == pytest.approx(2.0, rel=1e-6)


def test_the_adjoint_of_waiting_updates_on_a_long_cycle_of_weight_zero() -> None:
    """A chain of 1,000 nodes with edges i -> i+1 and i -> i+2 closed by a zero
    edge back to the start: one strongly connected part, whose adjoints are
    taken heads first (a FIFO took a number of pops that grew with the square
    of the chain, and ran out of them at 3,000 nodes: 17 s, now 0.2 s)."""
    n = 1000
    program = parse(ZEROS)
    axioms = {("final", n): 1.0, ("edge", n, 0): 0.0}
    for i in range(n):
        axioms[("edge", i, i + 1)] = 0.5
        if i + 2 <= n:
            axioms[("edge", i, i + 2)] = 0.5
    run = program.run(axioms)
    assert run.converged and run.pending
    got = run.gradient(("stop",))[("edge", n, 0)]
    up, down = axioms | {("edge", n, 0): 1e-6}, axioms | {("edge", n, 0): -1e-6}
    numeric = (program.run(up).chart[("stop",)] - program.run(down).chart[("stop",)]) / 2e-6
    assert got == pytest.approx(numeric, rel=1e-5)
    assert got == pytest.approx(4 / 9)  # pathto(n) * d stop / d pathto(0) = (2/3) * (2/3)


@pytest.mark.parametrize("seed", [26, 3, 7])
def test_the_adjoints_on_a_dense_convergent_cycle_settle(seed: int) -> None:
    """Five items all joined to each other (weight 0.94 for seed 26), the run's
    last updates too small to change anything: their adjoints are solved on the
    cycle in sweeps. (A heap that always took the first item with a delta ran
    through a million pops on ever smaller deltas, and raised "does not settle"
    after 10-19 s; a user's trial.) Against the closed form (I - E)^-1."""
    n = 5
    edges = np.random.default_rng(seed).uniform(0.05, 0.3, (n, n))
    program = parse("pathto(0) += 1. pathto(J) += pathto(I) * edge(I, J).")
    run = program.run({("edge", i, j): edges[i, j] for i in range(n) for j in range(n)})
    assert run.converged and run.pending
    grads = run.gradient(("pathto", n - 1))
    inverse = np.linalg.inv(np.eye(n) - edges)
    want = np.outer(inverse[0], inverse[:, n - 1])  # d pathto(n-1) / d edge(i, j)
    got = np.array([[grads[("edge", i, j)] for j in range(n)] for i in range(n)])
    np.testing.assert_allclose(got, want, rtol=1e-12)


def test_a_run_that_max_pops_stops_just_as_it_converges_counts_as_converged() -> None:
    program = parse(ZEROS)
    axioms = {("edge", 0, 1): 1.0, ("edge", 1, 2): 1.0, ("final", 0): 0.0, ("final", 2): 0.0}
    pops = program.run(axioms).pops
    stopped = program.run(axioms, max_pops=pops)
    assert stopped.converged and stopped.gradient(("stop",))[("final", 2)] == 1.0
    assert not program.run(axioms, max_pops=pops - 1).converged


def test_a_real_nan_update_pops() -> None:
    """abs(NaN) > 0 is false: a NaN update once waited unseen, the chart finite."""
    run = parse("c += 1. b += c. e += c. b += e * x.").run({("x",): float("nan")})  # b is 1 when NaN comes
    assert np.isnan(run.chart[("b",)])


@pytest.mark.parametrize(("text", "infinite"), [("a += 2 * a. a += 1.", True), ("a += -2 * a. a += 1.", False)])
def test_a_run_whose_values_diverge_has_not_converged(text: str, infinite: bool) -> None:
    """A cycle of weight 2 sums to infinity, one of weight -2 to NaN (inf - inf):
    either stands still there (nothing pending changes it), at no fixpoint."""
    run = parse(text).run({})
    value = run.chart[("a",)]
    assert (math.isinf(value) if infinite else math.isnan(value)) and not run.converged
    assert parse("a += 0.5 * a. a += 1.").run({}).converged  # (the finite fixpoint 2 is one)


def test_an_infinity_reaches_what_a_divergent_cycle_feeds() -> None:
    """c(1) and c(2) overflowed first, and later updates left them inf,
    changing nothing: c(0) and the goal stood still at 8.7e307, finite, where
    the batched run gives inf. The consumers get the infinity; goal's terms
    c(X) * top(X) with top(X) = 0 stay 0, not NaN."""
    text = "c(X) += lex(X). c(X) += unary(X, Y) * c(Y). goal += c(X) * top(X)."
    u = [[0.475, 0.201, 0.031], [0.012, 0.607, 0.681], [0.453, 0.544, 0.406]]  # (spectral radius 1.2)
    axioms: dict[Item, float] = {("unary", x, y): u[x][y] for x in range(3) for y in range(3)}
    axioms.update({("lex", x): 0.5 for x in range(3)} | {("top", 0): 1.0, ("top", 1): 0.0, ("top", 2): 0.0})
    run = parse(text).run(axioms)
    assert run.chart[("goal",)] == math.inf and not run.converged
    assert all(run.chart[("c", x)] == math.inf for x in range(3))


def test_an_item_that_diverges_leaves_a_finite_items_gradient_as_it_was() -> None:
    """d goes to infinity apart from a: the run has not converged, yet it
    settled, and a's pending zero update still gets its adjoint (da/dx = 1
    at x = 0, as without d)."""
    run = parse("a += x * a. a += 1. d += 2 * d. d += 1.").run({("x",): 0.0})
    assert math.isinf(run.chart[("d",)]) and not run.converged and run.settled
    assert run.gradient(("a",)) == {("x",): 1.0} == parse("a += x * a. a += 1.").run({("x",): 0.0}).gradient(("a",))


def test_infinity_as_the_semirings_zero_or_one_is_no_divergence() -> None:
    """In min-plus, infinity is the zero (no path); in widest paths (max, min),
    the one (the source's width): a chart holding it converged."""
    run = Program(parse_rules("d(J) += d(I) * e(I, J). d(0) += 0."), MIN_PLUS).run({("e", 0, 1): math.inf})
    assert run.chart[("d", 1)] == math.inf and run.converged
    widest = Semiring("widest", 0.0, math.inf, max, min)
    run = Program(parse_rules("w(J) += w(I) * cap(I, J). w(I) += src(I)."), widest).run(
        {("src", 0): math.inf, ("cap", 0, 1): 3.0, ("cap", 1, 2): 2.0}
    )
    assert run.chart[("w", 0)] == math.inf and run.chart[("w", 2)] == 2.0 and run.converged


@pytest.mark.parametrize("weight", [1.5, 2.0])
def test_a_zero_cycle_of_weight_above_one_is_a_diverging_gradient(weight: float) -> None:
    """Its advice was to start the weights off zero, where the sum diverges too."""
    run = parse(f"a += {weight} * a. a += x.").run({("x",): 0.0})
    with pytest.raises(ml.NonFiniteError, match="diverges") as error:
        run.gradient(("a",))
    assert "make the cycle's weight less than 1, or bound the run with max_pops" in str(error.value)
    assert "start its weights off zero" not in str(error.value)


def test_a_priority_that_ranks_anew_each_time_stops_short_and_says_so() -> None:
    """Each heap entry's rank is checked again when it pops; a priority that
    answers differently makes every entry stale, the run ends with updates
    that would still change the chart, and it is not converged (its gradient
    then gives pending updates nothing, as after an early stop)."""
    ranks = itertools.count()
    run = parse(ZEROS).run({("edge", 0, 1): 1.0, ("final", 1): 1.0}, priority=lambda item, value: next(ranks))
    assert run.pending and not run.converged


@pytest.mark.anyio
async def test_a_zero_initialised_weight_learns_through_a_goal_layer() -> None:
    """Every final weight starts at 0, so stop's updates after its first are
    zero: all four still get their gradient, -4 * pathto(i), at the first step
    (only final(0)'s did)."""
    edges = ml.Weight(np.triu(np.full((4, 4), 0.5), k=1))
    final = ml.Weight(np.zeros(4), optimizer=ml.optim.sgd(0.1))
    value = parse(ZEROS).goal(("stop",), None, {"edge": edges, "final": final})
    await ((value - 2.0) * (value - 2.0)).train()
    np.testing.assert_allclose(final.data, 0.1 * 4 * np.array([1.0, 0.5, 0.75, 1.125]))


@pytest.mark.parametrize("semiring", [MIN_PLUS, LOG_REAL], ids=lambda s: s.name)
def test_a_written_coefficient_of_one_is_one_in_every_semiring(semiring: Semiring) -> None:
    """`d += 1 * e` adds 1 in min-plus (a distance) and in log-real (a log):
    a coefficient of exactly 1 was taken for none, d was e, and 1.0000001 jumped to e + 1."""
    for coeff in (1.0, 1.0000001, 2.0):
        run = Program(parse_rules(f"d += {coeff} * e."), semiring).run({("e",): 3.0})
        assert run.chart[("d",)] == pytest.approx(3.0 + coeff, rel=1e-12)
    assert Program(parse_rules("d += e."), semiring).run({("e",): 3.0}).chart[("d",)] == 3.0  # (none: the one)
    with pytest.raises(ValueError, match="a constant rule needs its value"):
        Rule(("d",), [])


def test_a_goal_or_an_axiom_of_another_arity_than_the_rules_is_refused() -> None:
    # (no rule meets it: the goal read the semiring's zero, the axiom changed nothing, silently)
    program = parse("a += b(X) * c(X).")
    with pytest.raises(ValueError, match=r"axiom \('b', 0, 1\) has 2 arguments, and the rules read or derive b with 1"):
        program.goal(("a",), {("b", 0, 1): 1.0, ("c", 0): 2.0})
    with pytest.raises(ValueError, match=r"goal \('a', 1\) has 1 arguments, .* a with 0: its value would be"):
        program.goal(("a", 1), {("b", 0): 1.0, ("c", 0): 2.0})
