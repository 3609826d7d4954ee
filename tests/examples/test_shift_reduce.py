"""The shift-reduce example: its data and oracle, batching across its decisions, and that it learns."""

from __future__ import annotations

import anyio
import numpy as np
import pytest

import monadl as ml
from benchmarks import control_flow
from examples import shift_reduce as sr
from monadl.runtime import entry


def infix(sentence: sr.Sentence) -> str:
    """The postfix tokens back as a parenthesised Python expression."""
    stack: list[str] = []
    for t in sentence.tokens:
        if t < sr.DIGITS:
            stack.append(str(t))
        else:
            b, a = stack.pop(), stack.pop()
            stack.append(f"({a} {'+' if t == sr.PLUS else '*'} {b})")
    (text,) = stack
    return text


def gold_parse(sentence: sr.Sentence) -> set[tuple[int, int]]:
    """The spans built by following the oracle's action at every step."""
    stack: list[tuple[int, int]] = []
    built: set[tuple[int, int]] = set()
    i, n = 0, len(sentence.tokens)
    while i < n or len(stack) > 1:
        if len(stack) >= 2 and (i == n or (stack[-2][0], stack[-1][1]) in sentence.spans):
            right, left = stack.pop(), stack.pop()
            stack.append((left[0], right[1]))
            built.add(stack[-1])
        else:
            stack.append((i, i + 1))
            i += 1
    return built


def test_labels_spans_and_the_oracle() -> None:
    for s in sr.make_sentences(50, 1, 6, seed=3):
        assert s.label == eval(infix(s)) % 10
        assert len(s.tokens) == 2 * (len(s.tokens) // 2) + 1
        assert gold_parse(s) == s.spans  # the oracle's actions build exactly the gold tree
    assert sr.make_sentences(5, 2, 6, seed=3) == sr.make_sentences(5, 2, 6, seed=3)


def test_sentences_take_different_paths_and_match_one_by_one(merged: list[int]) -> None:
    assert control_flow.check(hidden=8, batch=6) < 1e-12  # on vs off, and vs the mean of one by one
    assert max(merged) == 6  # all six sentences' graphs ran as one

    parser = sr.Parser(8, seed=1)
    logs: list[sr.Log] = []
    entry.gradients_sync(parser.loss(sr.make_sentences(6, 2, 6, seed=4), logs))
    assert len({log.steps for log in logs}) > 1 and not all(log.exact for log in logs)  # untrained: paths differ


def test_float32_agrees_with_batching_off() -> None:
    parser = sr.Parser(16, seed=2, dtype=np.float32)
    sentences = sr.make_sentences(8, 2, 5, seed=5)
    results = []
    for batching in (False, None):
        with ml.settings(batching=batching):
            results.append(entry.gradients_sync(parser.loss(sentences, [])))
    (off_value, off), (on_value, on) = results
    assert on_value == pytest.approx(off_value, rel=1e-6)
    for w in parser.weights():
        a, b = np.asarray(on[w].to_dense() if hasattr(on[w], "to_dense") else on[w]), off[w]
        b = np.asarray(b.to_dense() if hasattr(b, "to_dense") else b)
        assert np.max(np.abs(a - b)) <= 1e-5 * np.max(np.abs(b))


def test_it_learns_to_parse() -> None:
    result = anyio.run(lambda: sr.run(steps=60, batch=32, hidden=32, progress=False))
    assert result.parse_accuracy >= 0.9  # exact trees on held-out sentences (an untrained parser: near 0)
    assert np.mean(result.losses[-10:]) < 0.5 * result.losses[0]


@pytest.mark.parametrize("batching", [False, None, True])
def test_direct_style_parses_alike(batching: bool | None) -> None:
    parser = sr.Parser(8, seed=1)
    sentences = sr.make_sentences(6, 2, 6, seed=4)
    results = []
    for direct in (False, True):
        logs: list[sr.Log] = []
        with ml.settings(batching=batching):
            value, grads = anyio.run(entry.gradients, parser.loss(sentences, logs, direct=direct))
        results.append((float(value), grads, [(log.steps, log.right, log.exact, log.correct) for log in logs]))
    (bind_value, bind_grads, bind_logs), (direct_value, direct_grads, direct_logs) = results
    assert direct_logs == bind_logs
    assert direct_value == pytest.approx(bind_value, rel=1e-12)
    assert direct_grads.keys() == bind_grads.keys()
    for w, g in bind_grads.items():
        np.testing.assert_allclose(
            np.asarray(g.to_dense() if hasattr(g, "to_dense") else g),
            np.asarray(direct_grads[w].to_dense() if hasattr(direct_grads[w], "to_dense") else direct_grads[w]),
            rtol=1e-10,
            atol=1e-14,
        )


@pytest.mark.parametrize("batch", [1, 7])
def test_the_parser_by_hand_has_monadls_loss_and_gradients(batch: int) -> None:
    """The limit of `benchmarks/control_flow.py` (the parser batched by hand in
    NumPy) computes the batch's loss and gradients, its decisions included;
    and Adam's first step moves each weight by ``rate * |g| / (|g| + eps)``."""
    from benchmarks import _shift_reduce_numpy as by_hand

    parser = sr.Parser(8, seed=1)  # untrained: the sentences take different, partly wrong paths
    sentences = sr.make_sentences(batch, 2, 6, seed=4)
    assert by_hand.check(parser, sentences) < 1e-12
    weights = by_hand.weights_of(parser)
    model = by_hand.Model(weights, learning_rate=0.01)
    _, grads = model.loss_and_gradients(sentences)
    for s in sentences[:3]:  # the plain one-sentence form: the batch of one's loss and gradients
        one, one_grads = model.sentence(s)
        assert one == pytest.approx(model.loss_and_gradients([s])[0], rel=1e-12)
        for k, g in model.loss_and_gradients([s])[1].items():
            np.testing.assert_allclose(one_grads[k], g, rtol=1e-10, atol=1e-14)
    model.step(grads, np.concatenate([s.tokens for s in sentences]))
    for k, g in grads.items():
        np.testing.assert_allclose(np.abs(model.w[k] - weights[k]), 0.01 * np.abs(g) / (np.abs(g) + 1e-8), atol=1e-15)


def test_the_parser_by_hand_steps_like_monadl() -> None:
    """Its Adam takes monadl's steps, the embedding table's lazily (only the rows looked up)."""
    from benchmarks import _shift_reduce_numpy as by_hand

    parser = sr.Parser(8, seed=1, learning_rate=0.05)
    model = by_hand.Model(by_hand.weights_of(parser), learning_rate=0.05)
    for k in range(4):
        batch = sr.make_sentences(3, 2, 4, seed=100 + k)  # a few tokens a batch: some table rows untouched
        anyio.run(parser.loss(batch, []).train)
        model.train(batch)
    for name, weight in by_hand.weights_of(parser).items():
        np.testing.assert_allclose(model.w[name], weight, rtol=1e-9, atol=1e-12)


def test_the_benchmarks_analysis_cost_is_measured_where_merges_batch() -> None:
    """`benchmarks/control_flow.py` reports the batching analysis' cost per
    merged node: its instrument wraps the merged runs' forward. It wrapped
    `batched.forward` after the merged runs had come to call
    `batched.stepwise`, and reported 'none' for merges that batched."""
    from benchmarks import control_flow

    merge_us, analysis_us, runs, nodes = control_flow.costs(hidden=16, batch=32)
    assert runs > 1 and nodes > 32 * runs / 2
    assert merge_us > 0 and analysis_us > 0
