"""Programs mypy must accept (with their inferred types pinned) and programs it
must reject, each for one reason. All are checked by one call to mypy's API.

The programs live here as strings, not as files under tests/, so the project's
own mypy run does not see the ones written to fail.
"""

from __future__ import annotations

import textwrap

import pytest

from tests._mypy import mypy_errors as run_mypy

pytest.importorskip("mypy.api")

PRELUDE = """\
from typing import Any, assert_type
import numpy as np
import numpy.typing as npt
import monadl as ml

array = np.ones(3)
array_weight = ml.Weight(np.ones(3))
scalar_weight = ml.Weight(1.0)
array_layer: ml.ArrayLayer = array_weight * 2.0
scalar_layer: ml.ScalarLayer = scalar_weight * 2.0
"""

ACCEPT = {
    "weight_data_and_state_are_settable": """
        assert_type(array_weight.data, ml.Array)
        assert_type(scalar_weight.data, float)
        array_weight.data = np.zeros(3)
        scalar_weight.data = 0.5
        array_weight.state = array_weight.state
        array_weight.optimizer = ml.optim.adam(1e-3)
    """,
    "weight_shape_dtype_ndim_size": """
        assert_type(array_weight.shape, tuple[int, ...])
        assert_type(scalar_weight.shape, tuple[int, ...])
        assert_type(array_weight.ndim, int)
        assert_type(array_weight.size, int)
        assert_type(array_weight.dtype, Any)  # (another library's weight has its library's dtype)
    """,
    "paper_listing": """
        def guess_next_number(question: ml.Array) -> ml.ScalarLayer:
            return ml.sum(question * array_weight) + scalar_weight
        assert_type(guess_next_number(array), ml.ScalarLayer)
    """,
    "data_typed_ml_array_on_the_left_is_any_the_layer_on_the_left_is_typed": """
        def f(question: ml.Array) -> None:
            assert_type(question * array_weight, Any)  # NumPy's stubs (the README's one blind spot)
            assert_type(array_weight * question, ml.ArrayLayer)
            assert_type(array * array_weight, ml.ArrayLayer)  # (data of a known dtype: typed)
    """,
    "numpy_scalars_are_numbers": """
        w32 = ml.Weight(np.ones(3, dtype=np.float32))
        assert_type(w32 * np.float32(2.0), ml.ArrayLayer)  # (a float32 model keeps its arrays)
        assert_type(np.float32(2.0) * w32, ml.ArrayLayer)
        assert_type(ml.mean(array_weight * array) - np.mean(array), ml.ScalarLayer)  # (np.mean: floating[Any])
        assert_type(ml.sum(array_weight) + np.int64(2), ml.ScalarLayer)
        assert_type(scalar_weight * np.float32(0.5), ml.ScalarLayer)
        assert_type(np.float32(0.5) * scalar_layer, ml.ScalarLayer)
        assert_type(np.int64(2) - scalar_layer, ml.ScalarLayer)
        assert_type(scalar_layer ** np.float32(2.0), ml.ScalarLayer)
        assert_type(scalar_layer * np.float32(2.0) + array_layer, ml.ArrayLayer)
        assert_type(ml.maximum(array_weight, np.float32(0.0)), ml.ArrayLayer)
        assert_type(ml.maximum(scalar_layer, np.float32(0.0)), ml.ScalarLayer)
        assert_type(ml.exp(np.mean(array)), ml.ScalarLayer)
        assert_type(ml.as_layer(np.float32(1.0)), ml.ScalarLayer)
        assert_type(ml.Weight(np.float32(1.0)), ml.ScalarWeight)  # (its value typed float, as a float32 sum's)
        assert_type(ml.Weight(np.int64(1)), ml.ScalarWeight)
        assert_type(ml.optim.sgd(np.float32(0.1)), ml.optim.GradientTransformation)
        assert_type(ml.optim.adam(np.mean(array)), ml.optim.GradientTransformation)
    """,
    "an_expression_of_any_is_not_taken_for_a_scalar": """
        def untyped(data: Any, layer: ml.Layer[Any, Any]) -> None:
            v = ml.Weight(data)  # (Xavier's rng.normal(size=(4, 3)) / np.sqrt(4) is Any to NumPy's stubs)
            assert_type(v, ml.Weight[Any, Any])
            assert_type(v * 2.0, ml.Layer[Any, Any])  # (it was the first overload's: ml.ScalarLayer)
            assert_type(2.0 * v, ml.Layer[Any, Any])
            h: ml.ArrayLayer = v * 2.0
            assert_type(v * array, ml.ArrayLayer)  # (arrays win)
            assert_type(v + array_layer, ml.ArrayLayer)
            assert_type(v * scalar_layer, ml.Layer[Any, Any])
            assert_type(layer - v, ml.Layer[Any, Any])
            assert_type(layer ** 2.0 + layer, ml.Layer[Any, Any])
            assert_type(array_layer[0] * 2.0, ml.Layer[Any, Any])
            typed: ml.ArrayWeight = ml.Weight(data)  # (the README's advice: annotate it where it is made)
            assert_type(typed * 2.0, ml.ArrayLayer)
            assert_type(ml.tanh(v), ml.Layer[Any, Any])
            assert_type(ml.softplus(v), ml.Layer[Any, Any])
            assert_type(ml.sin(v), ml.Layer[Any, Any])
            assert_type(ml.maximum(0.0, layer), ml.Layer[Any, Any])
            rows = [ml.tanh(data @ v) for _ in range(2)]  # (in the list's context it took the scalar overload)
            assert_type(ml.concatenate([ml.relu(r) for r in rows]), ml.ArrayLayer)
    """,
    "array_methods_keep_arrays_and_scalars_join_by_stack": """
        assert_type(array_layer.T, ml.ArrayLayer)
        assert_type(array_weight.transpose(), ml.ArrayLayer)
        assert_type(scalar_layer.reshape(1), ml.ArrayLayer)  # (a scalar reshaped is an array)
        assert_type(ml.reshape(scalar_weight, (1, 1)), ml.ArrayLayer)
        assert_type(ml.stack([scalar_layer, scalar_weight, 2.0]), ml.ArrayLayer)
        assert_type(ml.concatenate([array_layer, array_weight, array]), ml.ArrayLayer)
    """,
    "another_librarys_weight_is_not_typed_numpy": """
        import array_api_strict as xp
        a = xp.asarray([1.0, 2.0])
        w = ml.Weight(a)
        assert_type(w * a, ml.Layer[Any, Any])  # (it was ml.ArrayLayer, whose value is typed np.ndarray)
        assert_type(w * 2.0, ml.Layer[Any, Any])
    """,
    "weight_times_array_plus_layer": """
        assert_type(array_weight * array + array_layer, ml.ArrayLayer)
        assert_type(array_weight * array, ml.ArrayLayer)
    """,
    "scalars_stay_scalars": """
        assert_type(scalar_weight * 2.0 + scalar_layer, ml.ScalarLayer)
        assert_type(2.0 - scalar_weight, ml.ScalarLayer)
        assert_type(ml.exp(scalar_layer), ml.ScalarLayer)
        assert_type(ml.sin(scalar_weight), ml.ScalarLayer)
        assert_type(ml.cos(-scalar_layer), ml.ScalarLayer)
        assert_type(ml.softplus(scalar_weight), ml.ScalarLayer)
        assert_type(ml.log_sigmoid(-scalar_layer), ml.ScalarLayer)
    """,
    "arrays_win": """
        assert_type(scalar_layer * array_weight, ml.ArrayLayer)
        assert_type(scalar_weight + array, ml.ArrayLayer)
        assert_type(ml.log_sigmoid(array_weight), ml.ArrayLayer)
        assert_type(ml.sin(array_layer), ml.ArrayLayer)
        assert_type(ml.cos(array_weight * 2.0), ml.ArrayLayer)
    """,
    "reductions": """
        assert_type(ml.sum(array_layer), ml.ScalarLayer)
        assert_type(ml.sum(array_layer, axis=0), ml.ArrayLayer)
        assert_type(array_layer.mean(), ml.ScalarLayer)
        assert_type(array_layer.max(axis=1), ml.ArrayLayer)
        assert_type(ml.sum(array_layer, keepdims=True), ml.ArrayLayer)  # (shape (1, ...): not a scalar)
        assert_type(ml.logsumexp(array_layer, None, True), ml.ArrayLayer)
        assert_type(array_layer.mean(keepdims=True), ml.ArrayLayer)
        assert_type(ml.mean(array_layer, keepdims=False), ml.ScalarLayer)
        assert_type(ml.cross_entropy(array_layer, np.array([1])), ml.ScalarLayer)
        assert_type(ml.binary_cross_entropy_with_logits(array_layer, array), ml.ScalarLayer)
        assert_type(ml.binary_cross_entropy_with_logits(array_layer, array_layer, pos_weight=array), ml.ScalarLayer)
    """,
    "cross_entropys_options_keep_a_scalar": """
        assert_type(ml.cross_entropy(array_layer, np.array([1]), weight=np.array([0.5, 2.0, 1.0])), ml.ScalarLayer)
        assert_type(ml.cross_entropy(array_layer, np.array([1]), ignore_index=np.int64(-1)), ml.ScalarLayer)
        assert_type(ml.cross_entropy(array_weight, np.array([1]), label_smoothing=0.1), ml.ScalarLayer)
    """,
    "numpy_integer_axes_and_sizes": """
        i = np.int64(1)
        assert_type(ml.sum(array_layer, axis=i), ml.ArrayLayer)
        assert_type(array_layer.max(axis=(i, -1)), ml.ArrayLayer)
        assert_type(ml.softmax(array_layer, axis=i), ml.ArrayLayer)
        assert_type(ml.concatenate([array_layer], axis=i), ml.ArrayLayer)
        assert_type(ml.split(array_layer, i), tuple[ml.ArrayLayer, ...])
        assert_type(ml.reshape(array_layer, np.array([3, 1])), ml.ArrayLayer)
    """,
    "reshape_and_transpose_methods_take_numpys_forms": """
        assert_type(array_layer.reshape((3, 1)), ml.ArrayLayer)
        assert_type(array_weight.reshape(3, 1), ml.ArrayLayer)
        assert_type(array_layer.reshape(np.array([3, 1])), ml.ArrayLayer)
        assert_type(array_layer.transpose((0,)), ml.ArrayLayer)
        assert_type(array_weight.transpose(0), ml.ArrayLayer)
        assert_type(array_layer.transpose(None), ml.ArrayLayer)
        assert_type(array_layer.transpose(), ml.ArrayLayer)
    """,
    "slices_keep_arrays": """
        assert_type(array_layer[1:], ml.ArrayLayer)
        assert_type(array_layer[:, 2:5], ml.ArrayLayer)
        assert_type(array_layer[..., None], ml.ArrayLayer)
        assert_type(ml.tanh(array_weight[:2]), ml.ArrayLayer)
        assert_type(array_layer[0], ml.Layer[Any, Any])  # an element or a row: not known statically
    """,
    "gathers_keep_arrays": """
        sources = np.array([0, 2, 2])
        assert_type(array_layer[sources], ml.ArrayLayer)  # (a GNN's gather: it was Layer[Any, Any])
        assert_type(array_weight[np.arange(2)] * 0.5, ml.ArrayLayer)
        assert_type(array_layer[array > 0.0], ml.ArrayLayer)
        assert_type(array_layer[[0, 1]], ml.ArrayLayer)
        assert_type(array_layer[range(2)], ml.ArrayLayer)
        assert_type(array_layer[0, 1], ml.Layer[Any, Any])  # (a tuple: an element, not a gather)
        from collections.abc import Sequence
        def rows(h: ml.ArrayLayer, at: Sequence[int]) -> ml.Layer[Any, Any]:
            return h[at]  # (a Sequence may be a tuple, an element's index: accepted, not known to gather)
    """,
    "gathers_by_index_arrays_in_a_tuple_keep_arrays": """
        # Inferred without a context (assert_type's picked the overload it asked for): index arrays of a
        # dtype mypy does not know (np.array's) fitted both overloads, and mypy gave up for Layer[Any, Any].
        sources, labels = np.array([0, 2, 2]), np.array([0, 1, 1])
        picked = array_layer[np.arange(3), labels]  # (a class-weighted loss's log_softmax(z)[rows, y])
        assert_type(picked, ml.ArrayLayer)
        by_rows, by_columns, row_cut = array_layer[sources, 0], array_layer[:, sources], array_weight[0, sources]
        assert_type(by_rows, ml.ArrayLayer)
        assert_type(by_columns, ml.ArrayLayer)
        assert_type(row_cut, ml.ArrayLayer)
        alone, lists, whole = array_layer[(sources,)], array_weight[[0, 1], [2, 2]], array_layer[()]
        assert_type(alone, ml.ArrayLayer)
        assert_type(lists, ml.ArrayLayer)
        assert_type(whole, ml.ArrayLayer)
        row, element, deeper = array_layer[0, :], array_layer[0, 1], array_layer[:, :, sources]
        assert_type(row, ml.Layer[Any, Any])  # (a row or an element: not known statically)
        assert_type(element, ml.Layer[Any, Any])
        assert_type(deeper, ml.Layer[Any, Any])  # (an array third or later: accepted, not known to gather)
        def parts(h: ml.ArrayLayer, arrays: tuple[ml.Array, ...], mixed: tuple[int | slice, ...]) -> None:
            assert_type(h[arrays], ml.ArrayLayer)
            assert_type(h[mixed], ml.Layer[Any, Any])
    """,
    "lists_and_tuples_beside_an_index_array_gather": """
        # Beside an index array, a sequence is an index array too (NumPy's x[ids, (0, 1)] gathers): all
        # were rejected for a while ("Invalid index type"), where NumPy and monadl run them.
        from collections.abc import Sequence
        ids = np.array([0, 2])
        def parts(h: ml.ArrayLayer, cols: Sequence[int], mixed: tuple[int | ml.Array, ...]) -> None:
            by_sequence, by_tuple, by_mask = h[ids, cols], h[ids, (0, 1)], h[ids, [True, False, True]]
            assert_type(by_sequence, ml.ArrayLayer)
            assert_type(by_tuple, ml.ArrayLayer)
            assert_type(by_mask, ml.ArrayLayer)
            nested, first, built = h[ids, [[0, 1], [1, 2]]], h[cols, ids], h[mixed]
            assert_type(nested, ml.ArrayLayer)
            assert_type(first, ml.ArrayLayer)
            assert_type(built, ml.ArrayLayer)  # (a tuple that may hold index arrays, of a length known at run time)
            ints: tuple[int, ...] = (0, 1)
            element, beside_ints = h[ints], h[0, (0, 1)]
            assert_type(element, ml.Layer[Any, Any])  # (no array in it: an element's index)
            assert_type(beside_ints, ml.Layer[Any, Any])
    """,
    "segment_sums_are_arrays": """
        targets = np.array([0, 2, 2])
        assert_type(ml.segment_sum(array_layer, targets, 3), ml.ArrayLayer)
        assert_type(ml.segment_sum(array_weight, targets, np.int64(3)), ml.ArrayLayer)
        assert_type(ml.segment_sum(array, targets, 3) * 0.5, ml.ArrayLayer)
    """,
    "frozen_keeps_weight_types": """
        from monadl.estimate import frozen
        assert_type(frozen([array_weight]), list[ml.ArrayLayer])
    """,
    "polymorphic_function": """
        def polymorphic(a: ml.AsArray, b: ml.AsArray, c: ml.AsArray, d: ml.AsArray) -> ml.ArrayLayer:
            result = ml.as_layer(a) * b + c * d
            assert_type(result, ml.ArrayLayer)
            return result
        assert_type(polymorphic(array, array_weight, array_layer, array), ml.ArrayLayer)
        assert_type(ml.as_layer(1.0), ml.ScalarLayer)
        assert_type(ml.as_layer(array_weight), ml.ArrayLayer)
    """,
    "predict_and_train": """
        async def run() -> None:
            assert_type(await scalar_layer.predict(), float)
            assert_type(await array_layer.train(), ml.Array)
    """,
    "data_parallel_train_is_typed_as_train": """
        from monadl.distributed import DataParallel
        async def steps(dp: DataParallel, loss: ml.Layer[Any, Any]) -> list[float]:
            assert_type(await dp.train(scalar_layer), float)
            assert_type(await dp.train(array_layer, step=1), ml.Array)
            assert_type(await dp.train(loss), Any)
            assert_type(float(await dp.train(scalar_weight)), float)  # (mypy took the loss's type from float())
            return [await dp.train(scalar_layer)]
    """,
    "gradients_and_values_are_typed_by_their_layers": """
        async def gradients(ws: list[ml.Weight[Any, Any]]) -> None:
            assert_type(await ml.gradients(scalar_layer, [array_weight]), list[ml.Array])
            assert_type(await ml.gradients(scalar_layer, [scalar_weight]), list[float])
            assert_type(await ml.gradients(scalar_layer, [array_weight, scalar_weight]), list[float | ml.Array])
            assert_type(await ml.gradients(scalar_layer, ws), Any)  # (weights of Any match every overload)
            value, grads = await ml.value_and_gradients(scalar_layer)
            assert_type(value, float)  # (as train()'s)
            assert_type((await ml.value_and_gradients(array_layer))[0], ml.Array)
        @ml.direct
        async def six(s: ml.ScalarLayer, x: ml.ArrayLayer) -> ml.ScalarLayer:
            assert_type(await ml.values(s, s, s, s, s, x), tuple[float | ml.Array, ...])
            assert_type(await ml.values(s, s, s, s, s, s), tuple[float, ...])
            return s
    """,
    "pythons_sum_of_layers_with_a_start_or_ml_sum_of_a_stack": """
        from typing import Literal
        losses = [ml.sum(array_weight * x) for x in (array, array)]
        assert_type(sum(losses, start=ml.as_layer(0.0)), ml.ScalarLayer)  # (the README's Types section)
        assert_type(ml.sum(ml.stack(losses)), ml.ScalarLayer)
        assert_type(sum((array_weight * x for x in (array, array)), start=ml.as_layer(np.zeros(3))), ml.ArrayLayer)
        assert_type(sum(losses), ml.ScalarLayer | Literal[0])  # (typeshed's: the 0 it starts from)
    """,
    "do_combinators": """
        assert_type(ml.Do.pure(1).map(str), ml.Do[str])
        assert_type(ml.Do.pure(1).bind(lambda v: ml.Do.pure(v * 2.0)), ml.Do[float])
        assert_type(ml.Do.zip(ml.Do.pure(1), ml.Do.pure("a")), ml.Do[tuple[int, str]])
        assert_type(ml.Do.gather([ml.Do.pure(1)]), ml.Do[tuple[int, ...]])
        assert_type(array_layer.forward(), ml.Do[ml.Tape[ml.Array, ml.Array]])
    """,
    "returns_flow_and_pointfree": """
        from returns.pipeline import flow
        from returns.pointfree import bind, map_
        assert_type(flow(ml.Do.pure(1), map_(str)), ml.Do[str])
        def halve(v: int) -> ml.Do[float]:
            return ml.Do.pure(v / 2)
        assert_type(flow(ml.Do.pure(1), bind(halve), map_(round)), ml.Do[int])
        assert_type(ml.Do.pure(1).apply(ml.Do.pure(str)), ml.Do[str])
    """,
    "cupy_stubs": """
        import cupy
        def on_device(x: ml.Array) -> ml.Array:
            stream = cupy.cuda.Stream(non_blocking=True)
            with stream:
                y = cupy.asarray(x) * 2.0 + 1.0
                done = stream.record()
            stream.wait_event(done)
            assert_type(y, cupy.ndarray)
            assert_type(cupy.get_default_memory_pool().used_bytes(), int)
            return cupy.asnumpy(y)
    """,
    "monadic_layer": """
        def gated(x: ml.ArrayLayer) -> ml.ArrayLayer:
            forward: ml.Do[ml.Tape[ml.Array, ml.Array]] = scalar_layer.forward().bind(
                lambda t: (x * 2.0).forward() if t.data > 0 else x.forward()
            )
            return ml.Layer(forward)
        assert_type(gated(array_layer), ml.ArrayLayer)
    """,
    "direct_style": """
        @ml.direct
        async def chosen(x: ml.ArrayLayer, s: ml.ScalarLayer) -> ml.ArrayLayer:
            value, vector = await ml.values(s, x)
            assert_type(value, float)
            assert_type(vector, ml.Array)
            assert_type(await s, float)
            return x * s if value > 0 else x
        assert_type(chosen(array_layer, scalar_layer), ml.ArrayLayer)
    """,
    "scopes_entered_with_with": """
        with ml.settings(check_finite=True) as s:
            assert_type(s, ml.Settings)
        with ml.optim.using_default(ml.optim.adam(1e-3)) as nothing:
            assert_type(nothing, None)
    """,
    "optimizers": """
        w = ml.Weight(np.zeros(3), optimizer=ml.optim.chain(ml.optim.add_decayed_weights(1e-4), ml.optim.adam(1e-3)))
        v = ml.Weight(0.5, optimizer=ml.optim.sgd(ml.optim.exponential_decay(0.1, 0.9)))
        assert_type(w, ml.ArrayWeight)
        assert_type(v.data, float)
    """,
    "roll_takes_python_and_numpy_integers": """
        assert_type(ml.roll(array_weight, 1), ml.ArrayLayer)
        assert_type(ml.roll(array_layer, np.int64(-1), axis=np.intp(0)), ml.ArrayLayer)
        assert_type(ml.roll(array, array.ndim - 1, array.shape[0]), ml.ArrayLayer)
        assert_type(ml.roll(array, np.argmax(array)), ml.ArrayLayer)
    """,
    "axes_sizes_and_labels_take_python_and_numpy_integers": """
        matrix = np.ones((2, 3))
        assert_type(ml.concatenate([array_layer, array], axis=np.intp(0)), ml.ArrayLayer)
        assert_type(ml.stack([array_layer, array], axis=array.ndim - 1), ml.ArrayLayer)
        assert_type(ml.softmax(array_layer, axis=np.int64(-1)), ml.ArrayLayer)
        assert_type(ml.log_softmax(matrix, np.argmax(matrix.shape)), ml.ArrayLayer)
        assert_type(ml.sum(ml.as_layer(matrix), axis=(0, np.intp(1))), ml.ArrayLayer)
        assert_type(ml.split(array_layer, np.int64(3), axis=0), tuple[ml.ArrayLayer, ...])
        assert_type(ml.segment_sum(matrix, np.array([0, 1]), np.int64(2)), ml.ArrayLayer)
        assert_type(ml.reshape(array_layer, matrix.shape[::-1]), ml.ArrayLayer)
        assert_type(ml.as_layer(matrix).transpose(np.intp(1), 0), ml.Layer[ml.Array, ml.Array])
        assert_type(ml.cross_entropy(matrix, np.array([0, 1]), ignore_index=np.int64(2)), ml.ScalarLayer)
    """,
    "an_operation_keeps_its_functions_signature": """
        @ml.operation
        def cell(x: ml.ArrayOperand, h: ml.ArrayLayer, scale: float) -> tuple[ml.ArrayLayer, ml.ArrayLayer]:
            z = ml.tanh(array_weight * x) + h
            return z, z * scale

        assert_type(cell(array, array_layer, 2.0), tuple[ml.ArrayLayer, ml.ArrayLayer])
    """,
    "a_marked_partial_is_untyped_a_marked_closure_keeps_its_signature": """
        import functools
        def scaled(h: ml.ArrayLayer, factor: float) -> ml.ArrayLayer:
            return ml.tanh(h) * factor
        # (the README's Types section: mypy checks a partial's own calls, not an operation made of it)
        assert_type(ml.operation(functools.partial(scaled, factor=0.5)), ml.Operation[..., ml.ArrayLayer])
        def scaled_by(factor: float) -> ml.Operation[[ml.ArrayLayer], ml.ArrayLayer]:
            def cell(h: ml.ArrayLayer) -> ml.ArrayLayer:
                return scaled(h, factor)
            return ml.operation(cell)
        assert_type(scaled_by(0.5)(array_layer), ml.ArrayLayer)
    """,
    "fold_blocks_compose_with_inferred_types": """
        from collections.abc import Sequence
        from monadl.fold import AllOf, Block, ForwardDeclaration, Function, InputTransform, Map, Record, Reduce, Scalar, Vector

        def add(ab: tuple[ml.ArrayLayer, ml.ArrayLayer]) -> ml.ArrayLayer:
            return ab[0] + ab[1]

        assert_type(InputTransform(str.split) >> InputTransform(len), Block[str, int])
        assert_type(Map(Vector(2)) >> Reduce(Function(add)), Block[Sequence[Sequence[float]], ml.ArrayLayer])
        assert_type(AllOf(InputTransform(len), InputTransform(str.upper))("ab"), tuple[int, str])
        assert_type(Record(Scalar(), Vector(2))((1.0, [2.0, 3.0])), tuple[ml.ArrayLayer, ml.ArrayLayer])
        node = ForwardDeclaration[str, int]()
        node.resolve_to(InputTransform(len))
        assert_type(node.batch(["a"]), list[int])
    """,
    "fold_vector_takes_a_flat_sequence_or_an_array_from_its_context": """
        from collections.abc import Sequence
        from monadl.fold import Block, InputTransform, Vector

        def one_hot(digit: int) -> np.ndarray[Any, np.dtype[np.float64]]:
            out: np.ndarray[Any, np.dtype[np.float64]] = np.eye(10)[digit]
            return out

        # (a new user's: the array a block before it gives was refused, Vector's input typed as a sequence alone)
        assert_type(InputTransform(one_hot) >> Vector(10, np.float64), Block[int, ml.ArrayLayer])
        assert_type(Vector(2), Vector[Sequence[float]])
    """,
    "fold_scalar_and_vector_take_numpys_numbers_and_arrays": """
        from monadl.fold import Scalar, Vector

        # (a new user's: each ran, and mypy refused NumPy's scalars, Scalar's input typed a float)
        row: npt.NDArray[np.float64] = np.ones(2)
        assert_type(Scalar()(np.float32(1.0)), ml.ArrayLayer)
        assert_type(Scalar()(np.int64(2)), ml.ArrayLayer)
        assert_type(Vector[npt.NDArray[np.float64]](2)(row), ml.ArrayLayer)  # (an array named: a sequence by default)
        assert_type(Vector[npt.NDArray[np.float64]](2).batch([row, row]), list[ml.ArrayLayer])
        assert_type(Vector(2)([1.0, 2.0]), ml.ArrayLayer)
    """,
    "fold_rnn_step_passes_the_state_through_identity": """
        from collections.abc import Sequence
        from monadl.fold import Fold, Function, Identity, Record, Vector, Zeros

        def cell(sx: tuple[ml.ArrayLayer, ml.ArrayLayer]) -> ml.ArrayLayer:
            return ml.tanh(sx[0] + sx[1])

        rnn = Fold(Record(Identity[ml.ArrayLayer](), Vector(2)) >> Function(cell), Zeros((2,)))
        assert_type(rnn, Fold[Sequence[float], ml.ArrayLayer])
    """,
    "dyna_goal_takes_its_runs_options": """
        from monadl.dyna import ArrayProgram, ArrayRun, ArrayRunOptions, Rule, RunOptions, parse

        def early(run: ArrayRun) -> bool:
            return run.pops > 3

        options: RunOptions = {"max_pops": 3, "priority": "value"}
        assert_type(parse("s += x(I) * x(I).").goal(("s",), weights={"x": array_weight}, **options), ml.ScalarLayer)
        program = ArrayProgram([Rule(("s",), [("x", "I"), ("x", "I")])], arrays={"x": {0: 3}})
        batched: ArrayRunOptions = {"tolerance": 1e-9, "stop": early}
        assert_type(program.goal(("s",), weights={"x": array_weight}, **batched), ml.ScalarLayer)
    """,
}

# name: (program, the error code mypy must report)
REJECT = {
    "string_operand": ("array_weight + 'one'", "operator"),
    "cupy_stream_with_a_string_flag": ("import cupy\ncupy.cuda.Stream(non_blocking='yes')", "arg-type"),
    "cupy_array_is_not_numpy": ("import cupy\nx: ml.Array = cupy.zeros(3)", "assignment"),
    "list_operand": ("array_weight * [1.0, 2.0, 3.0]", "operator"),
    "reflected_string_operand": ("'one' * scalar_layer", "operator"),
    "string_to_function": ("ml.exp('x')", "call-overload"),
    "list_to_sum": ("ml.sum([1.0, 2.0])", "call-overload"),
    "string_weight": ("ml.Weight('abc')", "call-overload"),
    "layer_as_weight_data": ("ml.Weight(array_layer)", "call-overload"),
    "weight_as_weight_data": ("ml.Weight(array_weight)", "call-overload"),
    "scalar_where_array_required_softmax": ("ml.softmax(scalar_layer)", "arg-type"),
    "scalar_where_array_required_matmul": ("ml.matmul(scalar_layer, array)", "arg-type"),
    "scalar_where_array_required_conv": ("ml.conv2d(scalar_weight, array)", "arg-type"),
    "scalar_layer_assigned_to_array_layer": ("x: ml.ArrayLayer = scalar_layer * 2.0", "assignment"),
    "array_layer_assigned_to_scalar_layer": ("x: ml.ScalarLayer = array_weight * 2.0", "assignment"),
    "kept_dimensions_are_no_scalar": ("x: ml.ScalarLayer = ml.sum(array_layer, keepdims=True)", "assignment"),
    "scalar_layer_in_a_matrix_product": ("scalar_layer @ array_weight", "operator"),
    "scalar_weight_in_a_matrix_product": ("array @ scalar_weight", "operator"),
    "layer_where_plain_labels_expected": ("ml.cross_entropy(array_layer, array_layer)", "arg-type"),
    "weight_inside_an_index": ("array_layer[array_weight, 0]", "index"),  # (fails when it runs)
    # Class weights are data (no delta flows into them, as in PyTorch), and the options are keywords.
    "weight_where_plain_class_weights_expected": (
        "ml.cross_entropy(array_layer, np.array([1]), weight=array_weight)",
        "arg-type",
    ),
    "cross_entropys_weight_passed_by_position": ("ml.cross_entropy(array_layer, np.array([1]), array)", "call-arg"),
    "label_smoothing_a_string": ("ml.cross_entropy(array_layer, np.array([1]), label_smoothing='0.1')", "arg-type"),
    "layer_where_plain_segment_ids_expected": ("ml.segment_sum(array_layer, array_layer, 2)", "arg-type"),
    "scalar_where_array_required_segment_sum": ("ml.segment_sum(scalar_layer, np.array([0]), 1)", "arg-type"),
    "segment_count_a_float": ("ml.segment_sum(array_layer, np.array([0, 0, 1]), 2.0)", "arg-type"),
    "do_int_where_do_tape_expected": ("ml.Layer(ml.Do.pure(3))", "arg-type"),
    "weight_shape_is_read_only": ("array_weight.shape = (3,)", "misc"),
    "a_layers_value_read_as_a_float": ("float(scalar_layer)", "arg-type"),
    "a_layers_value_read_as_an_int": ("int(scalar_layer)", "call-overload"),
    "string_optimizer": ("ml.Weight(np.zeros(3), optimizer='adam')", "call-overload"),
    "optimizer_factory_not_called": ("ml.Weight(np.zeros(3), optimizer=ml.optim.sgd)", "call-overload"),
    "string_learning_rate": ("ml.optim.adam('fast')", "arg-type"),
    "pytorchs_keyword_names": ("ml.optim.adam(lr=1e-3, betas=(0.5, 0.999))", "call-arg"),
    "string_to_softplus": ("ml.softplus('x')", "call-overload"),
    "string_to_sin": ("ml.sin('x')", "call-overload"),
    "chain_of_non_optimizer": ("ml.optim.chain(ml.optim.sgd(0.1), 0.5)", "arg-type"),
    "direct_returns_a_number": (
        "@ml.direct\nasync def f() -> float:\n    return 1.0",
        "arg-type",
    ),
    "direct_on_a_plain_function": (
        "@ml.direct\ndef f() -> ml.ScalarLayer:\n    return scalar_layer",
        "arg-type",
    ),
    "await_gives_data_not_a_layer": (
        "@ml.direct\nasync def f() -> ml.ScalarLayer:\n    v: ml.ScalarLayer = await scalar_layer\n    return v",
        "assignment",
    ),
    "values_of_plain_data": (
        "@ml.direct\nasync def f() -> ml.ScalarLayer:\n    await ml.values(1.0)\n    return scalar_layer",
        "call-overload",
    ),
    "bind_returning_a_plain_value": ("ml.Do.pure(1).bind(lambda v: v + 1)", "return-value"),
    "flow_binding_a_plain_function": (
        "from returns.pipeline import flow\nfrom returns.pointfree import bind\nflow(ml.Do.pure(1), bind(str))",
        "arg-type",
    ),
    "map_using_a_missing_method": ("ml.Do.pure(1).map(lambda v: v.upper())", "attr-defined"),
    "do_of_the_wrong_type": ("d: ml.Do[str] = ml.Do.pure(1)", "arg-type"),  # inferred from the context
    "zip_of_a_plain_value": ("ml.Do.zip(ml.Do.pure(1), 2)", "call-overload"),
    "predict_result_misused": (
        "async def f() -> None:\n    s: str = await scalar_layer.predict()",
        "assignment",
    ),
    "array_gradients_taken_for_floats": (
        "async def f() -> None:\n    g: list[float] = await ml.gradients(scalar_layer, [array_weight])",
        "assignment",
    ),
    "a_scalar_losss_value_taken_for_an_array": (
        "async def f() -> None:\n    v, _ = await ml.value_and_gradients(scalar_layer)\n    v.shape",
        "attr-defined",
    ),
    "train_on_pythons_sum_without_a_start": ("sum([scalar_layer, scalar_layer]).train()", "union-attr"),
    "train_with_an_argument": ("scalar_layer.train(1)", "call-arg"),
    "await_a_layer_outside_a_coroutine": ("def f() -> float:\n    return await scalar_layer", "await-not-async"),
    "await_a_forward_expecting_a_tape": (
        "async def f() -> None:\n    t: ml.Tape[float, float] = await scalar_layer.forward()",
        "assignment",
    ),
    # Weight.data is settable (checkpoints, issue 16), but only to data of the weight's kind.
    "weight_data_set_to_a_layer": ("array_weight.data = array_layer", "assignment"),
    "scalar_weight_data_set_to_an_array": ("scalar_weight.data = np.zeros(3)", "assignment"),
    # A scalar has no index, no axes to permute and none to join along (an IndexError, a scalar for .T, a
    # ShapeError at run time).
    "index_of_a_scalar_layer": ("scalar_layer[0]", "misc"),
    "slice_of_a_scalar_weight": ("scalar_weight[1:]", "misc"),
    "transpose_of_a_scalar_layer": ("scalar_layer.T", "misc"),
    "transpose_method_of_a_scalar_weight": ("scalar_weight.transpose()", "misc"),
    "transpose_function_of_a_scalar": ("ml.transpose(scalar_layer)", "arg-type"),
    "concatenate_scalars": ("ml.concatenate([scalar_layer, scalar_weight])", "list-item"),
    "string_operand_of_an_expression_of_any": ("def f(v: ml.Weight[Any, Any]) -> None:\n    v * 'a'", "operator"),
    # NumPy's scalars are numbers; a string or a complex one is none that monadl computes with.
    "numpy_string_operand": ("array_weight * np.str_('a')", "operator"),
    "numpy_complex_operand": ("scalar_weight + np.complex128(1j)", "operator"),
    "numpy_complex_to_a_function": ("ml.maximum(scalar_layer, np.complex64(1j))", "call-overload"),
    # A float64 scalar weight refuses a float32 scalar (DTypeError): `float(x)` takes the weight's dtype.
    "scalar_weight_data_set_to_a_float32": ("scalar_weight.data = np.float32(0.5)", "assignment"),
    "settings_with_a_string": ("ml.settings(workers='2')", "arg-type"),
    "reshape_to_an_int": ("ml.reshape(array_layer, 3)", "arg-type"),
    "axis_a_string": ("ml.sum(array_layer, axis='0')", "arg-type"),
    "reshape_method_given_both_forms": ("array_layer.reshape((3, 1), 2)", "call-overload"),
    "tape_with_a_non_callable_backward": ("ml.Tape(1.0, backward=5)", "arg-type"),
    "pool_with_a_float_kernel": ("ml.max_pool2d(array_layer, 2.5)", "arg-type"),
    "dense_with_a_string_bias": ("ml.dense(array, array_weight, 'b')", "arg-type"),
    # roll's shift and axis are integers: a bool and an array are refused at run time (SupportsIndex took both).
    "roll_shift_a_bool": ("ml.roll(array_layer, True)", "arg-type"),
    "roll_shift_an_array": ("ml.roll(array_layer, np.array(1))", "arg-type"),
    "roll_shift_an_array_of_shifts": ("ml.roll(array_weight, np.array([1, 2]))", "arg-type"),
    "roll_axis_a_bool": ("ml.roll(array_layer, 1, axis=False)", "arg-type"),
    "roll_shift_a_numpy_bool": ("ml.roll(array_layer, np.True_)", "arg-type"),
    # So are the other axes, sizes and labels (a bool and an array passed type checks: SupportsIndex took both).
    "concatenate_axis_a_bool": ("ml.concatenate([array_layer, array], axis=True)", "arg-type"),
    "stack_axis_an_array": ("ml.stack([array_layer, array], axis=np.array(0))", "arg-type"),
    "softmax_axis_a_bool": ("ml.softmax(array_layer, axis=False)", "arg-type"),
    "sum_axes_with_a_bool": ("ml.sum(array_layer, axis=(0, True))", "arg-type"),
    "split_sections_a_bool": ("ml.split(array_layer, True)", "arg-type"),
    "segment_sum_count_a_bool": ("ml.segment_sum(array_layer, np.array([0]), True)", "arg-type"),
    "reshape_method_with_a_bool": ("array_layer.reshape(3, True)", "call-overload"),
    "cross_entropy_ignore_index_a_bool": (
        "ml.cross_entropy(array_layer, np.array([0]), ignore_index=True)",
        "arg-type",
    ),
    "data_parallel_train_value_used_as_a_string": (
        "from monadl.distributed import DataParallel\nasync def f(dp: DataParallel) -> None:\n    v: str = await dp.train(scalar_layer)",
        "assignment",
    ),
    "data_parallel_train_of_an_array": (
        "from monadl.distributed import DataParallel\nasync def f(dp: DataParallel) -> None:\n    await dp.train(array)",
        "call-overload",
    ),
    # An operation is called as its function is.
    "operation_called_with_a_string": (
        "@ml.operation\ndef cell(x: ml.ArrayLayer) -> ml.ArrayLayer:\n    return ml.tanh(x)\ncell('x')",
        "arg-type",
    ),
    "operation_of_a_closure_called_with_a_string": (  # (the typed way to mark a partial: README, Types)
        "def scaled(h: ml.ArrayLayer, factor: float) -> ml.ArrayLayer:\n    return ml.tanh(h) * factor\n"
        "def half(h: ml.ArrayLayer) -> ml.ArrayLayer:\n    return scaled(h, 0.5)\n"
        "ml.operation(half)('h')",
        "arg-type",
    ),
    "operation_result_used_as_data": (
        "@ml.operation\ndef cell(x: ml.ArrayLayer) -> ml.ArrayLayer:\n    return ml.tanh(x)\ny: ml.Array = cell(array_layer)",
        "assignment",
    ),
    # Fold blocks: ``a >> b`` needs a's output to be b's input.
    "fold_ill_typed_composition": (
        "from monadl.fold import InputTransform, Vector\nupper = InputTransform(str.upper)\nVector(3) >> upper",
        "operator",
    ),
    "fold_vector_after_a_block_of_strings": (  # (its input from the context: a sequence of numbers or an array)
        "from monadl.fold import InputTransform, Vector\nInputTransform(str) >> Vector(3)",
        "operator",
    ),
    "fold_map_over_a_non_sequence": (
        "from monadl.fold import Map, Scalar, Vector\nVector(3) >> Map(Scalar())",
        "operator",
    ),
    "fold_record_field_mismatch": (
        "from monadl.fold import Record, Scalar, Vector\nRecord(Scalar(), Vector(2))((1.0, 'ab'))",
        "arg-type",
    ),
    "fold_scalar_of_an_array": (  # (NumPy's real scalars are taken, an array is not: Vector(n)'s)
        "from monadl.fold import Scalar\nScalar()(np.ones(2))",
        "arg-type",
    ),
    "fold_record_field_mismatch_against_an_annotation": (  # (it fell to the overload of any number of blocks)
        "from monadl.fold import Block, InputTransform, Record, Vector\n"
        "rec: Block[tuple[list[float], float], tuple[ml.ArrayLayer, str]] = Record(Vector(2), InputTransform(str.upper))",
        "arg-type",
    ),
    "fold_identity_of_no_named_type_in_a_fold": (  # (inferred as Never: its type must be named)
        "from monadl.fold import Fold, Function, Identity, Record, Vector, Zeros\n"
        "def cell(sx: tuple[ml.ArrayLayer, ml.ArrayLayer]) -> ml.ArrayLayer:\n    return sx[0] + sx[1]\n"
        "Fold(Record(Identity(), Vector(2)) >> Function(cell), Zeros((2,)))",
        "arg-type",
    ),
    "fold_forward_declaration_resolved_to_another_type": (
        "from monadl.fold import ForwardDeclaration, InputTransform\n"
        "node = ForwardDeclaration[str, int]()\nnode.resolve_to(InputTransform(str.upper))",
        "arg-type",
    ),
    # A layer's truth is refused at run time; to mypy it is a bool (a NoReturn __bool__ made the rest of the
    # function unreachable, unchecked), so what follows a truth test is checked.
    "code_after_a_truth_test_of_a_layer_is_checked": (
        "def f(x: ml.ScalarLayer) -> int:\n    if x:\n        return 1\n    y: str = 3\n    return 0",
        "assignment",
    ),
    "code_after_assert_of_a_layer_is_checked": (
        "def f(x: ml.ScalarLayer) -> int:\n    assert ml.sum(x * 2.0)\n    return 'not an int'",
        "return-value",
    ),
    # Comparisons are refused at run time; max(), min() and sorted() compare, so mypy rejects them too.
    "comparison_of_layers": ("scalar_layer < scalar_layer * 2.0", "operator"),
    "builtin_max_of_layers": ("max(scalar_layer, scalar_layer * 2.0)", "call-overload"),
    "builtin_min_of_a_list_of_layers": ("min([array_layer, array_layer * 2.0])", "type-var"),
    "builtin_sorted_layers": ("sorted([scalar_layer, scalar_weight])", "type-var"),
    "fold_block_output_used_as_data": (
        "from monadl.fold import Vector\nx: ml.Array = Vector(2)([1.0, 2.0])",
        "assignment",
    ),
    # A goal passes its options on to its runs: they are the run's keywords (and refused at goal() too).
    "dyna_goal_with_a_misspelt_run_option": (
        "from monadl.dyna import parse\nparse('s += x(I) * x(I).').goal(('s',), weights={'x': array_weight}, max_pop=3)",
        "call-arg",
    ),
    "dyna_array_goal_with_a_priority": (  # (Program's run has one; ArrayProgram's agenda is FIFO)
        "from monadl.dyna import ArrayProgram, Rule\n"
        "program = ArrayProgram([Rule(('s',), [('x', 'I'), ('x', 'I')])], arrays={'x': {0: 3}})\n"
        "program.goal(('s',), weights={'x': array_weight}, priority='value')",
        "call-arg",
    ),
    "dyna_goal_option_of_the_wrong_type": (
        "from monadl.dyna import parse\nparse('s += x(I).').goal(('s',), weights={'x': array_weight}, max_pops='3')",
        "arg-type",
    ),
    "dyna_array_goal_stop_on_an_item_at_a_time_run": (
        "from monadl.dyna import ArrayProgram, Rule, Run\n"
        "def early(run: Run) -> bool:\n    return run.pops > 3\n"
        "program = ArrayProgram([Rule(('s',), [('x', 'I')])], arrays={'x': {0: 3}})\n"
        "program.goal(('s',), weights={'x': array_weight}, stop=early)",
        "arg-type",
    ),
}


def _program(body: str) -> str:
    return PRELUDE + textwrap.dedent(body).strip() + "\n"


@pytest.fixture(scope="module")
def mypy_errors(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[tuple[int, str, str]]]:
    """Run mypy once over every program; errors by program name, lines counted from the body."""
    programs = {**{f"accept_{n}": b for n, b in ACCEPT.items()}, **{f"reject_{n}": p for n, (p, _) in REJECT.items()}}
    found = run_mypy(tmp_path_factory.mktemp("typing_corpus"), {n: _program(b) for n, b in programs.items()})
    prelude_lines = PRELUDE.count("\n")
    return {
        name: [(line - prelude_lines, message, code) for line, message, code in errs] for name, errs in found.items()
    }


@pytest.mark.parametrize("name", list(ACCEPT))
def test_mypy_accepts(name: str, mypy_errors: dict[str, list[tuple[int, str, str]]]) -> None:
    assert mypy_errors[f"accept_{name}"] == []


@pytest.mark.parametrize("name", list(REJECT))
def test_mypy_rejects(name: str, mypy_errors: dict[str, list[tuple[int, str, str]]]) -> None:
    errors = mypy_errors[f"reject_{name}"]
    expected = REJECT[name][1]
    assert errors, "mypy accepted a program it must reject"
    assert all(line >= 1 for line, _, _ in errors), f"the prelude itself failed: {errors}"
    assert expected in {code for _, _, code in errors}, errors


def test_the_corpus_is_large_enough() -> None:
    assert len(REJECT) >= 30
