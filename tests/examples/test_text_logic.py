"""Text-Logic (EstiNet) at a small, seeded size."""

from __future__ import annotations

import anyio
import numpy as np

from examples import text_logic


def test_estinet_finds_the_arguments_and_answers_exactly_where_end_to_end_only_approximates() -> None:
    args = text_logic.parser().parse_args(
        [
            "--sizes",
            "400",
            "--steps",
            "1000",
            "--pretrain-steps",
            "1000",
            "--test-count",
            "1000",
            "--sampling",
            "offline",
        ]
    )
    estinet, end_to_end = anyio.run(text_logic.run, args, False)
    assert (estinet.name, end_to_end.name) == ("EstiNet (offline)", "end-to-end")
    assert estinet.selection_accuracy == 1.0  # x and y found in all ten templates
    assert estinet.accuracy == 1.0  # so the real comparison is always right
    assert 0.8 < end_to_end.accuracy < estinet.accuracy
    assert "EstiNet (offline)" in text_logic.table([estinet, end_to_end])


def test_questions_and_the_black_box() -> None:
    q = text_logic.questions(200, np.random.default_rng(0))
    assert q.words.shape == q.values.shape == (200, text_logic.LENGTH)
    x = q.values[np.arange(200), q.where[:, 0]]
    y = q.values[np.arange(200), q.where[:, 1]]
    np.testing.assert_array_equal(q.answers, (x > y).astype(int))
    np.testing.assert_array_equal(text_logic.compare(np.stack([x, y], axis=1)), q.answers)
    assert len({tuple(w) for w in q.words}) == len(text_logic.TEMPLATES)  # all ten templates drawn
    assert 0.3 < q.answers.mean() < 0.7
