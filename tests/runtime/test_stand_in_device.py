"""The GPU's code paths on the CPU, for CI (which has no GPU): a stand-in device library.

Its arrays are NumPy's data under another type, with another namespace (every
function NumPy's, its results of the stand-in type), and a stand-in ``cupy``
module makes the runtime treat them as device arrays: graphs take the
device's path (batching, else streams), gathers index with the library's
own index arrays, and index data on the host is checked there and copied over.
A host array (a NumPy index or operand) that meets a device array is noted,
and every test here fails if one did: on CuPy it would be a hidden copy per
use, and on a stricter library an error. Each test runs twice: with a scatter
through ``add.at`` (as CuPy's namespace has) and without (the one-hot product
of other libraries). `tests/runtime/test_cuda.py` runs the same on a real GPU.
"""

from __future__ import annotations

import contextlib
import sys
import traceback
import types
from collections.abc import Iterator
from typing import Any

import anyio
import array_api_compat.numpy as npx
import numpy as np
import pytest

import monadl as ml
from monadl import _namespace
from monadl.deltas import SparseRows
from monadl.layers._program import Program
from monadl.layers._site import PACKAGE_DIR
from monadl.runtime import entry
from monadl.runtime.schedule import batched_records, batched_run
from monadl.runtime.schedule import cuda as cuda_schedule
from tests.runtime._device_cases import cells_reading_one_shared_cell, joint_reading_two_output_cells
from tests.runtime._tree_lstm_reference import host_reference, loom_calls

DEVICE = "stand-in"
LEAKS: list[str] = []  # where a host array met a device array


def _host(x: Any) -> bool:
    return type(x) is np.ndarray and x.ndim > 0


def _leak(what: str) -> None:
    """Note a host array met by monadl's code (not by NumPy's own, which implements the stand-in)."""
    caller = traceback.extract_stack()[-3]
    # (monadl's own directory: a clone named "monadl" holds the venv's NumPy and the examples too)
    if caller.filename.startswith(PACKAGE_DIR):
        LEAKS.append(f"{what} at {caller.filename}:{caller.lineno}")


def _to_device(x: Any) -> Any:
    if isinstance(x, np.generic):
        x = np.asarray(x)
    return x.view(DeviceArray) if type(x) is np.ndarray else x


class DeviceArray(np.ndarray[Any, Any]):
    """An array of the stand-in library."""

    @property
    def device(self) -> str:  # type: ignore[override]
        return DEVICE

    def __getitem__(self, index: Any) -> Any:
        if any(map(_host, index if type(index) is tuple else (index,))):
            _leak("an index on the host")
        return super().__getitem__(index)

    def __setitem__(self, index: Any, value: Any) -> None:
        if any(map(_host, index if type(index) is tuple else (index,))) or _host(value):
            _leak("an index or a value on the host")
        super().__setitem__(index, value)

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        if any(hasattr(x, "__array_ufunc__") and not isinstance(x, (np.ndarray, np.generic)) for x in inputs):
            return NotImplemented  # a layer: its own operator
        if any(map(_host, inputs)):
            _leak(f"an operand of {ufunc.__name__} on the host")
        args = [x.view(np.ndarray) if isinstance(x, DeviceArray) else x for x in inputs]
        if "out" in kwargs:
            kwargs["out"] = tuple(o.view(np.ndarray) if isinstance(o, DeviceArray) else o for o in kwargs["out"])
        out = getattr(ufunc, method)(*args, **kwargs)
        if method == "at":
            return out
        return tuple(map(_to_device, out)) if type(out) is tuple else _to_device(out)


class _Namespace:
    """NumPy's array API namespace, its arrays made device arrays; ``device=`` is the stand-in's.
    ``add_at``: its ``add`` a ufunc with ``at`` (a scatter, as CuPy's)."""

    def __init__(self, add_at: bool) -> None:
        self.add_at = add_at

    def __getattr__(self, name: str) -> Any:
        if name == "add" and self.add_at:
            return np.add
        f = getattr(npx, name)
        if not callable(f) or isinstance(f, type):
            return f

        def on_device(*args: Any, **kwargs: Any) -> Any:
            if kwargs.pop("device", DEVICE) != DEVICE:
                raise ValueError("another device")
            flat = [y for x in args for y in (x if type(x) in (list, tuple) else (x,))]
            if name != "asarray" and any(map(_host, flat)):
                _leak(f"an argument of {name} on the host")
            out = f(*args, **kwargs)
            if isinstance(out, tuple):  # (unique_inverse's is a named tuple)
                parts = list(map(_to_device, out))
                return type(out)(*parts) if hasattr(out, "_fields") else tuple(parts)
            return _to_device(out)

        return on_device


class _Event:
    done = True

    def __init__(self, **_: Any) -> None:
        pass

    def record(self, *_: Any) -> None:
        pass


class _Stream:
    def __init__(self, **_: Any) -> None:
        pass

    def record(self) -> _Event:
        return _Event()

    def wait_event(self, _: Any) -> None:
        pass

    def __enter__(self) -> _Stream:
        return self

    def __exit__(self, *_: Any) -> None:
        pass


def _on_device(x: Any) -> Any:
    return np.asarray(x).view(DeviceArray)


@pytest.fixture(params=[True, False], ids=["add-at", "one-hot"])
def device(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The stand-in library, as ``cupy``: ``device.asarray(x)`` puts ``x`` on the device.
    Fails the test if a host array met a device array."""
    cuda = types.SimpleNamespace(Event=_Event, Stream=_Stream, get_current_stream=_Stream)
    stand_in = types.SimpleNamespace(ndarray=DeviceArray, cuda=cuda, asarray=_on_device, asnumpy=np.asarray)
    monkeypatch.setitem(sys.modules, "cupy", stand_in)
    # The runtime keeps its streams from graph to graph: where real CuPy ran earlier in this
    # process (the GPU tests), its streams must not meet the stand-in's events.
    monkeypatch.setattr(cuda_schedule, "_pool", [])
    monkeypatch.setitem(_namespace._BY_TYPE, DeviceArray, _Namespace(add_at=request.param))
    LEAKS.clear()
    yield stand_in
    assert not LEAKS, f"{len(LEAKS)} host arrays met device arrays, first: {LEAKS[:3]}"


@pytest.fixture
def alone(monkeypatch: pytest.MonkeyPatch) -> list[Program]:
    """The operations' programs run node by node (not as a group)."""
    calls: list[Program] = []
    call = Program.__call__

    def counted(self: Program, *args: Any) -> Any:
        calls.append(self)
        return call(self, *args)

    monkeypatch.setattr(Program, "__call__", counted)
    return calls


@pytest.fixture
def grouped(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes of the groups that ran batched."""
    sizes: list[int] = []
    record = batched_records.group_records

    def counted(groups: Any, members: list[Any], *args: Any) -> None:
        sizes.append(len(members))
        record(groups, members, *args)

    monkeypatch.setattr(batched_run, "group_records", counted)
    return sizes


@pytest.fixture
def joints(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The joint gathers (`batched_groups.Joint`) made from now on, in order."""
    from monadl.runtime.schedule import batched_groups

    made: list[Any] = []
    init = batched_groups.Joint.__init__

    def noted(self: Any, *args: Any) -> None:
        init(self, *args)
        made.append(self)

    monkeypatch.setattr(batched_groups.Joint, "__init__", noted)
    return made


def _benchmark_variant(
    weights: dict[str, Any], trees: list[Any], operation: bool, batching: bool
) -> tuple[float, dict[str, Any]]:
    """The GPU benchmark's variant (`benchmarks.treelstm_cuda`) on the stand-in device."""
    from benchmarks import treelstm_cuda

    name = (
        ("monadl cell" if batching else "monadl cell off")
        if operation
        else ("monadl batching" if batching else "monadl")
    )
    variant = treelstm_cuda.VARIANTS[name](weights)
    assert variant is not None
    loss, grads = anyio.run(variant.loss_and_gradients, trees)
    return float(loss), {k: np.asarray(g) for k, g in grads.items()}


@pytest.mark.parametrize("operation", [False, True], ids=["every-op-a-layer", "cell-as-operation"])
@pytest.mark.parametrize("batching", [False, True], ids=["node-by-node", "batched"])
def test_the_tree_lstm_on_the_device_has_the_hosts_gradients(
    device: Any, grouped: list[int], operation: bool, batching: bool
) -> None:
    weights, trees, want_loss, want = host_reference(6)
    grouped.clear()
    loss, grads = _benchmark_variant(weights, trees, operation, batching)
    assert loss == pytest.approx(want_loss, rel=1e-12)
    for name, g in want.items():
        np.testing.assert_allclose(grads[name], g, rtol=1e-10, atol=1e-13, err_msg=name)
    # 3 trees of 255 nodes: with batching, their layers run in groups (about 31 and 4 a node)
    assert sum(grouped) > (20_000 if not operation else 2_500) if batching else not grouped


@pytest.mark.parametrize("name", ["monadl cell inside", "monadl loom", "monadl fold"])
def test_the_gpu_benchmarks_cell_with_its_lookups_inside_has_the_hosts_gradients(
    device: Any, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """`benchmarks.treelstm_cuda`'s "monadl cell inside": the example's own marked cells;
    "monadl loom": those cells recorded in an ``ml.loom()`` block; "monadl fold": the Fold
    blocks' (a loom too). The looms run their groups on the device."""
    from benchmarks import treelstm_cuda

    weights, trees, want_loss, want = host_reference(6)
    calls = loom_calls(monkeypatch)
    variant = treelstm_cuda.VARIANTS[name](weights)
    assert variant is not None
    loss, grads = anyio.run(variant.loss_and_gradients, trees)
    assert float(loss) == pytest.approx(want_loss, rel=1e-12)
    for weight, g in want.items():
        np.testing.assert_allclose(np.asarray(grads[weight]), g, rtol=1e-10, atol=1e-13, err_msg=weight)
    assert sum(calls) == (0 if name == "monadl cell inside" else 2 * 765)  # (the gradients, then the loss)


@pytest.mark.parametrize("batching", [False, True], ids=["node-by-node", "batched"])
def test_the_examples_cell_takes_host_symbols_with_device_weights(
    device: Any, alone: list[Program], batching: bool
) -> None:
    """`examples.tree_lstm` as written: the lookups inside the marked cell, each node's symbol
    host data (an operation's integer data argument: its lookups copy it over)."""
    from examples.tree_lstm import Cells, labels, tree_logits

    weights, trees, want_loss, want = host_reference(6)
    w = {k: ml.Weight(device.asarray(v)) for k, v in weights.items()}
    loss = ml.cross_entropy(tree_logits(w, 6, trees, Cells.of(w, 6, operation=True)), labels(trees))
    alone.clear()
    with ml.settings(batching=batching):
        value, grads = anyio.run(entry.gradients, loss)
    assert float(value) == pytest.approx(want_loss, rel=1e-12)
    for name, g in want.items():
        np.testing.assert_allclose(np.asarray(_dense(grads[w[name]])), g, rtol=1e-10, atol=1e-13, err_msg=name)
    assert len(alone) <= 1 if batching else len(alone) == 765  # 3 trees of 255 nodes


def test_host_integers_computed_with_inside_an_operation_are_a_device_error(device: Any) -> None:
    """An operation's integer data goes with device weights as indices only."""
    w = ml.Weight(device.asarray(np.ones((1, 2))))
    scaled = ml.operation(lambda ints: ml.tanh(ints * w))
    with pytest.raises(ml.DeviceError, match=r"multiply at .*inside the operation"):
        anyio.run(ml.sum(scaled(np.array([[1, 2]]))).predict)


def test_the_marked_cell_runs_as_groups_on_the_device(device: Any, alone: list[Program]) -> None:
    """A group's operands mix operation outputs (the children's states) with device arrays:
    it batches all the same (it once ran node by node, on the streams' path)."""
    weights, trees, _, _ = host_reference(6)
    alone.clear()
    _benchmark_variant(weights, trees, operation=True, batching=True)
    assert len(alone) <= 1  # of 3 x 255 cells: at most a lone root


def test_device_values_stay_device_arrays_and_host_indices_are_copied_over(device: Any) -> None:
    table = ml.Weight(device.asarray(np.arange(12.0).reshape(4, 3)), optimizer=ml.optim.sgd(0.1))
    rows = [ml.embedding(table, np.array([i % 4])) for i in range(6)]  # host indices, a device table
    loss = ml.cross_entropy(ml.concatenate(rows, axis=0), np.array([0, 1, 2, 0, 1, 2]))  # host labels
    with ml.settings(batching=True):
        value, grads = anyio.run(entry.gradients, loss)
        step: Any = anyio.run(loss.train)  # (a float to the types: a 0-d array of the device here)
    delta = grads[table]
    assert type(delta) is SparseRows and type(delta.indices) is DeviceArray  # the indices were copied over
    assert type(value) is DeviceArray and type(step) is DeviceArray and type(table.data) is DeviceArray
    with pytest.raises(ml.ShapeError, match="indices must lie in"):
        anyio.run(ml.sum(ml.embedding(table, np.array([4]))).predict)


@pytest.mark.parametrize("batching", [False, True])
def test_cross_entropys_host_class_weights_and_ignored_labels_are_copied_over(
    device: Any, grouped: list[int], batching: bool
) -> None:
    """Per-example losses over device logits with host labels and one host weight
    array: the weights and the rows kept are copied over (no host array meets a
    device one), with the host's values, the 8 losses one group where batched."""
    rng = np.random.default_rng(5)
    xs = [rng.normal(size=(3, 4)) for _ in range(8)]
    ys = [rng.integers(0, 4, 3) for _ in range(8)]
    ys[2] = np.array([1, 1, 0])  # (rows ignored, one kept)
    weight = np.array([0.5, 2.0, 1.0, 3.0])

    def loss(w: ml.ArrayWeight, put: Any) -> ml.ScalarLayer:
        losses = [
            ml.cross_entropy(ml.as_layer(put(x)) @ w, y, weight=weight, ignore_index=1, label_smoothing=0.1)
            for x, y in zip(xs, ys)
        ]
        return ml.sum(ml.stack(losses))

    start = rng.normal(size=(4, 4))
    host, on_device = ml.Weight(start.copy()), ml.Weight(device.asarray(start.copy()))
    with ml.settings(batching=batching):
        want, want_grads = anyio.run(entry.gradients, loss(host, np.asarray))
        grouped.clear()
        value, grads = anyio.run(entry.gradients, loss(on_device, device.asarray))
    assert type(grads[on_device]) is DeviceArray
    assert float(value) == pytest.approx(float(want), rel=1e-12)
    np.testing.assert_allclose(np.asarray(grads[on_device]), want_grads[host], rtol=1e-12)
    assert (8 in grouped) is batching


def test_host_data_beside_a_device_operations_outputs_is_a_device_error(device: Any) -> None:
    """An operation reading both outputs of another (its node's `Outputs`, on the device) and host data."""
    pair = ml.operation(lambda x: (ml.tanh(x), x * 2.0))
    first, second = pair(ml.as_layer(device.asarray(np.ones((1, 2)))))
    mix = ml.operation(lambda x, both: ml.tanh(x) + both[0] * both[1])
    with pytest.raises(
        ml.DeviceError, match=r"mix an array of numpy \(host\) and an array of \w+ \(stand-in\)"
    ) as raised:
        line = sys._getframe().f_lineno + 1
        anyio.run(ml.sum(mix(np.ones((1, 2)), (first, second))).predict)
    assert str(raised.value).endswith(f"called at {__file__}:{line}")  # (the call's line)


@pytest.mark.parametrize("cells", [False, True], ids=["unmarked", "cells"])
def test_a_parser_batched_across_control_flow_on_the_device_has_the_hosts_gradients(
    device: Any, alone: list[Program], grouped: list[int], cells: bool
) -> None:
    """Fibers park on the device too, and their merged graphs run as groups."""
    from examples.shift_reduce import Log, Parser, make_sentences

    sentences = make_sentences(6, 2, 5, seed=1)
    logs: list[Log] = []
    host = Parser(8, seed=0, cells=cells)
    with ml.settings(batching=False):
        want_loss, want = anyio.run(entry.gradients, host.loss(sentences, logs))
    parser = Parser(8, seed=0, cells=cells, device="cuda")  # (the stand-in's `cupy`)
    alone.clear()
    grouped.clear()
    with ml.settings(batching=True):
        loss, grads = anyio.run(entry.gradients, parser.loss(sentences, logs))
    assert float(loss) == pytest.approx(float(want_loss), rel=1e-12)
    for w, v in zip(host.weights(), parser.weights()):
        g = _dense(grads[v])
        assert type(g) is DeviceArray
        np.testing.assert_allclose(np.asarray(g), _dense(want[w]), rtol=1e-10, atol=1e-13)
    assert sum(grouped) > 100  # the sentences' steps, merged round by round
    if cells:  # of 50 tracker and composition calls, merged round by round: the rounds' stragglers alone
        assert len(alone) <= 10


def test_with_batching_off_fibers_park_on_the_device_and_run_merged_on_streams(
    device: Any, grouped: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Batching off, the parser's sentences still park (they step in the
    order they would batched) and each merged graph runs as one graph that
    does not batch runs on a GPU: its branches on CUDA streams, nothing grouped."""
    from examples.shift_reduce import Log, Parser, make_sentences

    sentences = make_sentences(6, 2, 5, seed=1)
    logs: list[Log] = []
    host = Parser(8, seed=0)
    with ml.settings(batching=False):
        want_loss, want = anyio.run(entry.gradients, host.loss(sentences, logs))
    merged: list[int] = []
    forward = cuda_schedule.forward

    def counted(order: list[Any], *args: Any) -> None:
        merged.append(len(order))
        forward(order, *args)

    monkeypatch.setattr(cuda_schedule, "forward", counted)
    parser = Parser(8, seed=0, device="cuda")
    with ml.settings(batching=False):
        loss, grads = anyio.run(entry.gradients, parser.loss(sentences, logs))
    assert float(loss) == pytest.approx(float(want_loss), rel=1e-12)
    for w, v in zip(host.weights(), parser.weights()):
        g = _dense(grads[v])
        assert type(g) is DeviceArray
        np.testing.assert_allclose(np.asarray(g), _dense(want[w]), rtol=1e-10, atol=1e-13)
    # Ten merged runs, the first of every sentence's first graph (60 nodes); not
    # parked, a graph at a time: 30 runs of 6 to 27 nodes, example 0's steps first.
    assert grouped == [] and len(merged) < 15 and merged[0] >= 50


def _dense(g: Any) -> Any:
    return g.to_dense() if hasattr(g, "to_dense") else g


def test_a_nested_operation_reads_another_ones_outputs_on_the_device(device: Any) -> None:
    """Inside an operation, a nested operation's step may take another nested one's outputs
    (an `Outputs`) beside device arrays: one library, no error."""
    w = ml.Weight(device.asarray(np.full((2, 2), 0.5)))
    pair = ml.operation(lambda x: (ml.tanh(x @ w), x * 2.0))
    join = ml.operation(lambda x, both: x @ w + both[0] * both[1])
    outer = ml.operation(lambda x: join(x, pair(x)))
    x = device.asarray(np.ones((1, 2)))
    got = anyio.run(ml.sum(outer(ml.as_layer(x))).predict)
    want = np.sum(np.ones((1, 2)) @ np.full((2, 2), 0.5) + np.tanh(np.ones((1, 2)) @ np.full((2, 2), 0.5)) * 2.0)
    assert float(got) == pytest.approx(float(want), rel=1e-12)


def test_the_tree_lstm_example_trains_on_the_device(device: Any) -> None:
    """``python examples/tree_lstm.py --device cuda``, small: the same losses as on the host."""
    from examples import tree_lstm

    def run(device: str) -> Any:
        return tree_lstm.run(1, 8, 16, train_size=48, test_size=16, progress=False, device=device)

    on_host, on_device = anyio.run(run, "cpu"), anyio.run(run, "cuda")
    # (float32; the one-hot scatter of the table's rows sums in another order than add.at)
    np.testing.assert_allclose(on_device.tree_lstm.losses, on_host.tree_lstm.losses, rtol=1e-5)
    assert on_device.tree_lstm.accuracies == on_host.tree_lstm.accuracies
    assert type(tree_lstm.TreeLSTM(tree_lstm.init_weights(4), device="cuda").w["children"].data) is DeviceArray
    with pytest.raises(ValueError, match="device must be"):
        tree_lstm.TreeLSTM(tree_lstm.init_weights(4), device="tpu")


@pytest.mark.parametrize("batching", [True, False], ids=["batched", "one-by-one"])
def test_a_loom_runs_the_tree_lstms_cells_by_depth_on_the_device(
    device: Any, alone: list[Program], grouped: list[int], monkeypatch: pytest.MonkeyPatch, batching: bool
) -> None:
    """The example's cells recorded in an ``ml.loom()`` block with device weights: the
    loom's groups run on the device (its arenas the device's, its host row numbers
    copied over), with the host's loss and gradients."""
    from examples.tree_lstm import TreeLSTM

    weights, trees, want_loss, want = host_reference(6)
    calls = loom_calls(monkeypatch)
    model = TreeLSTM(weights, device="cuda", loom=True)
    alone.clear()
    grouped.clear()
    with ml.settings(batching=batching):
        value, grads = anyio.run(entry.gradients, model.loss(trees))
    assert float(value) == pytest.approx(want_loss, rel=1e-12)
    for name, g in want.items():
        got = _dense(grads[model.w[name]])
        assert type(got) is DeviceArray
        np.testing.assert_allclose(np.asarray(got), g, rtol=1e-10, atol=1e-13, err_msg=name)
    if batching:  # 3 trees of 255 cells: one batched call per group (a leaf's or an internal node's) and depth
        assert sum(calls) == 765 and len(calls) < 40 and not alone and not grouped
    else:
        assert not calls and len(alone) == 765


def test_a_loom_stacks_a_devices_rows_given_as_data_and_refuses_host_rows_beside_device_weights(
    device: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A loom's calls over rows of the device (as layers, and as data arguments) run
    as groups, with the host's values and gradients; host rows beside device weights
    are built as nodes, whose error names the line of the call."""
    calls = loom_calls(monkeypatch)
    rng = np.random.default_rng(4)
    xs = [rng.normal(size=(1, 3)) for _ in range(6)]
    start = rng.normal(size=(3, 3))

    def loss(put: Any) -> tuple[ml.ScalarLayer, ml.ArrayWeight]:
        w = ml.Weight(put(start.copy()))
        step = ml.operation(lambda h, x: ml.tanh(h @ w + x))
        with ml.loom():
            ends = [step(step(ml.as_layer(put(x)), put(x)), put(2 * x)) for x in xs]
        return ml.sum(ml.concatenate(ends, axis=0)), w

    want, host = loss(np.asarray)
    want_value, want_grads = anyio.run(entry.gradients, want)
    calls.clear()
    got, on_device = loss(device.asarray)
    value, grads = anyio.run(entry.gradients, got)
    assert type(grads[on_device]) is DeviceArray
    assert float(value) == pytest.approx(float(want_value), rel=1e-12)
    np.testing.assert_allclose(np.asarray(grads[on_device]), want_grads[host], rtol=1e-12)
    assert calls == [6, 6]  # (two depths of six calls each, each one batched call)
    w = ml.Weight(device.asarray(start.copy()))
    step = ml.operation(lambda h, x: ml.tanh(h @ w + x))
    with ml.loom():
        line = sys._getframe().f_lineno + 1
        ends = [step(ml.as_layer(device.asarray(x)), x) for x in xs]  # host rows: data of another library
    with pytest.raises(
        ml.DeviceError, match=r"operands mix an array of \w+ \(stand-in\) and an array of numpy"
    ) as raised:
        anyio.run(ml.sum(ml.concatenate(ends, axis=0)).predict)
    assert str(raised.value).endswith(f"called at {__file__}:{line}")  # (built as nodes: the node's error)


def test_a_loom_on_the_device_reruns_its_reached_members_over_device_rows(device: Any) -> None:
    """A group some of whose members get no delta runs its others again as a group of
    their own: its data rows (the device's) indexed by a copy of the members kept
    (the fixture fails on a host index), with the host's gradients."""

    def loss(put: Any) -> tuple[ml.ScalarLayer, ml.ArrayWeight]:
        w = ml.Weight(put(np.eye(2)))
        cell = ml.operation(lambda h: ml.sqrt(h @ w))
        with ml.loom():
            cell(ml.as_layer(put(np.array([[0.0, 1.0]]))))  # (never read: no delta; sqrt's derivative at 0 infinite)
            b = cell(ml.as_layer(put(np.array([[1.0, 4.0]]))))
            c = cell(ml.as_layer(put(np.array([[2.0, 9.0]]))))
        return ml.sum(cell(b)) + ml.sum(c), w

    host, w = loss(np.asarray)
    on_device, v = loss(device.asarray)
    _, want = anyio.run(entry.gradients, host)
    _, got = anyio.run(entry.gradients, on_device)
    np.testing.assert_allclose(np.asarray(got[v]), want[w], rtol=1e-12)


@pytest.mark.parametrize("batching", [None, False])
def test_a_loom_refuses_a_host_mask_beside_device_weights_as_its_nodes_do(device: Any, batching: Any) -> None:
    def loss(loom: bool) -> ml.ScalarLayer:
        w = ml.Weight(device.asarray(np.ones((3, 3))))
        pick = ml.operation(lambda x, m: ml.tanh(x @ w)[m])
        with ml.loom() if loom else contextlib.nullcontext():
            outs = [ml.sum(pick(ml.as_layer(device.asarray(np.ones((3, 3)))), np.array([1, 0, 1], bool)))]
        return ml.sum(ml.stack(outs))

    for loom in (False, True):
        with ml.settings(batching=batching), pytest.raises(ml.DeviceError, match=r"operands mix .*; called at"):
            anyio.run(entry.gradients, loss(loom))


@pytest.mark.parametrize("first", ["host", "device"])
def test_a_looms_data_of_two_libraries_at_one_position_run_as_their_nodes(device: Any, first: str) -> None:
    """Indices of the host and of the device at one position of a group: as nodes (each
    call's lookup takes its own); rows of the two: the nodes' DeviceError."""
    puts = [np.asarray, device.asarray] if first == "host" else [device.asarray, np.asarray]
    table = ml.Weight(device.asarray(np.random.default_rng(2).normal(size=(6, 3))))
    w = ml.Weight(device.asarray(np.random.default_rng(3).normal(size=(3, 3))))
    leaf = ml.operation(lambda ids: ml.tanh(ml.embedding(table, ids)))
    step = ml.operation(lambda h, x: ml.tanh(h @ w + x))

    def ids_loss(loom: bool) -> ml.ScalarLayer:
        with ml.loom() if loom else contextlib.nullcontext():
            outs = [leaf(puts[i % 2](np.array([i % 6]))) for i in range(4)]
        return ml.sum(ml.concatenate(outs, axis=0))

    def rows_loss(loom: bool) -> ml.ScalarLayer:
        with ml.loom() if loom else contextlib.nullcontext():
            outs = [
                step(ml.as_layer(device.asarray(np.ones((1, 3)) * i)), puts[i % 2](np.ones((1, 3)))) for i in range(4)
            ]
        return ml.sum(ml.concatenate(outs, axis=0))

    want, want_grads = anyio.run(entry.gradients, ids_loss(False))
    got, grads = anyio.run(entry.gradients, ids_loss(True))
    assert float(got) == pytest.approx(float(want), rel=1e-12)
    np.testing.assert_allclose(np.asarray(_dense(grads[table])), np.asarray(_dense(want_grads[table])), rtol=1e-12)
    for loom in (False, True):
        with pytest.raises(ml.DeviceError, match=r"operands mix .*; called at"):
            anyio.run(entry.gradients, rows_loss(loom))


def test_deltas_on_the_device_are_checked_for_infinities_with_one_reading_back(
    device: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`all_finite_deltas` (a loom's group whose members read different outputs):
    arrays, sparse rows and factors of the device, and host ones beside them."""
    from monadl.deltas import Outer
    from monadl.layers._non_finite import all_finite_deltas

    readings: list[Any] = []
    to_bool = DeviceArray.__bool__

    def read_back(x: Any) -> bool:
        readings.append(x)
        return to_bool(x)

    monkeypatch.setattr(DeviceArray, "__bool__", read_back)
    ones = device.asarray(np.ones((2, 3)))
    rows = SparseRows(device.asarray(np.array([0, 1])), ones, (4, 3))
    outer = Outer(device.asarray(np.ones((2, 3))), device.asarray(np.ones((2, 3))))
    assert all_finite_deltas([ones, rows, outer, np.ones(2)]) and len(readings) == 1
    for bad in (ones * np.inf, SparseRows(rows.indices, ones * np.nan, (4, 3)), Outer(ones, ones * np.inf)):
        assert not all_finite_deltas([ones, bad])
    assert not all_finite_deltas([np.array([np.nan]), ones])
    assert all_finite_deltas([])


def test_host_integers_beside_a_nested_operations_device_outputs_are_a_device_error(device: Any) -> None:
    w = ml.Weight(device.asarray(np.ones((1, 2))))
    pair = ml.operation(lambda x: (ml.tanh(x @ w), x))
    outer = ml.operation(lambda x, ints: ints * pair(x)[0])
    with pytest.raises(ml.DeviceError, match=r"multiply at .*inside the operation"):
        anyio.run(ml.sum(outer(ml.as_layer(device.asarray(np.ones((1, 1)))), np.array([[1, 2]]))).predict)


def test_a_gather_from_several_groups_reads_their_concatenation_once_on_the_device(
    device: Any, joints: list[Any]
) -> None:
    """On a device, an operand whose rows come from several groups is one
    index into their outputs concatenated, and its delta one scatter (each a
    launch on a GPU, where a gather group by group took two a group). Rows
    read twice add their deltas up; both give the gradients node by node."""
    rng = np.random.default_rng(11)
    w = ml.Weight(device.asarray(rng.standard_normal((3, 3))))
    v = ml.Weight(device.asarray(rng.standard_normal((3, 3))))
    mix = ml.operation(lambda x, y: ml.tanh(x @ w) * y + ml.sigmoid(y @ v))
    xs = [device.asarray(rng.standard_normal((1, 3))) for _ in range(8)]
    a = [ml.tanh(x @ w) for x in xs]
    b = [ml.sigmoid(x @ v) for x in xs]
    firsts = [a[i] if i % 3 else b[i] for i in range(8)]  # from two groups
    seconds = [a[1] if i % 2 else b[i % 4] for i in range(8)]  # from two groups, each row read twice or more
    mixed = [mix(firsts[i], seconds[i]) for i in range(8)]
    loss = ml.sum(ml.concatenate(mixed, axis=0) * ml.concatenate(a, axis=0))
    with ml.settings(batching=False):
        want_value, want = anyio.run(entry.gradients, loss)
    with ml.settings(batching=True):
        value, grads = anyio.run(entry.gradients, loss)
    assert sorted((len(j.groups), j.unique) for j in joints) == [(2, False), (2, True)]
    assert float(value) == pytest.approx(float(want_value), rel=1e-12)
    for weight in (w, v):
        np.testing.assert_allclose(np.asarray(_dense(grads[weight])), np.asarray(_dense(want[weight])), rtol=1e-12)
    assert all(j._full is None for j in joints)  # the delta's scatter dropped once every group took its rows


def test_a_joint_gather_sends_no_delta_to_the_group_its_stopped_rows_read(device: Any, joints: list[Any]) -> None:
    """A joint's ``tanh`` group reads the online and the target network's
    products; only the online's rows get a delta (the target's feed
    ``stop_gradient``), and some of them none (read only): the target's
    weight gets no gradient, as node by node, and the others theirs."""
    rng = np.random.default_rng(3)
    online = ml.Weight(device.asarray(rng.standard_normal((3, 3))))
    target = ml.Weight(device.asarray(rng.standard_normal((3, 3))))
    xs = [device.asarray(rng.standard_normal((1, 3))) for _ in range(6)]
    guesses = [ml.tanh(x @ online) for x in xs]
    targets = [ml.stop_gradient(ml.tanh(x @ target)) for x in xs]
    terms = [ml.sum((g - t) ** 2.0) for g, t in zip(guesses[:4], targets[:4])]
    loss = ml.Layer(ml.Do.gather([ml.sum(ml.stack(terms)).forward(), guesses[5].forward()]).map(lambda t: t[0]))
    with ml.settings(batching=False):
        want = anyio.run(entry.gradients, loss)[1]
    with ml.settings(batching=True):
        got = anyio.run(entry.gradients, loss)[1]
    assert [len(j.groups) for j in joints] == [2]
    assert list(got) == list(want) == [online]
    np.testing.assert_allclose(np.asarray(got[online]), np.asarray(want[online]), rtol=1e-12)


def _group_by_group(groups: list[Any], places: list[Any]) -> list[Any]:
    """`batched_groups._joint`'s stand-in: a source per group, each gathered on
    its own (the path before joints), for comparison."""
    from monadl.runtime.schedule import batched_groups

    rows: dict[Any, list[int]] = {}
    for p, place in enumerate(places):
        rows.setdefault(place[0], []).append(p)
    return [batched_groups._source(g, at, [places[p][1] for p in at]) for g, at in rows.items()]


def test_a_group_read_by_many_levels_holds_one_delta_not_a_scatter_per_level(
    device: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chains that branch left and right: each level's cell reads the leaves'
    group and an earlier level's (a joint). Each joint's slices are summed into
    the group's own delta as they come, so the backward's memory stays within
    that of gathering group by group (it once held every level's scatter of
    the leaves: 36 times as much at 200 levels)."""
    import tracemalloc

    from monadl.runtime.schedule import batched_groups

    def peak(loss: ml.ScalarLayer) -> int:
        tracemalloc.start()
        with ml.settings(batching=True):
            anyio.run(entry.gradients, loss)
        top = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        return top

    rng = np.random.default_rng(0)
    width = 32
    w = ml.Weight(device.asarray(rng.standard_normal((width, width)) / width))
    u = ml.Weight(device.asarray(rng.standard_normal((width, width)) / width))
    cell = ml.operation(lambda left, right: ml.tanh(left @ w + right @ u))
    roots = []
    for t in range(16):
        leaves = [ml.tanh(ml.as_layer(device.asarray(rng.standard_normal((1, width)))) @ u) for _ in range(61)]
        h = leaves[0]
        for leaf in leaves[1:]:
            h = cell(h, leaf) if t % 2 else cell(leaf, h)
        roots.append(h)
    loss = ml.sum(ml.concatenate(roots, axis=0))
    jointly = peak(loss)

    monkeypatch.setattr(batched_groups, "_joint", _group_by_group)
    assert jointly < 1.5 * peak(loss)


def test_a_joint_gather_takes_fewer_device_calls_than_group_by_group(
    device: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU each call of the device library is a launch (the step is
    host-bound): the marked Tree-LSTM's training step over three random trees
    calls it less often with joint gathers than gathering group by group."""
    from monadl.runtime.schedule import batched_groups

    weights, trees, _, _ = host_reference(6)
    calls = [0]
    ufunc, getitem, setitem = DeviceArray.__array_ufunc__, DeviceArray.__getitem__, DeviceArray.__setitem__

    def counted(f: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            return f(*args, **kwargs)

        return call

    monkeypatch.setattr(DeviceArray, "__array_ufunc__", counted(ufunc))
    monkeypatch.setattr(DeviceArray, "__getitem__", counted(getitem))
    monkeypatch.setattr(DeviceArray, "__setitem__", counted(setitem))

    def step() -> int:
        calls[0] = 0
        _benchmark_variant(weights, trees, operation=True, batching=True)
        return calls[0]

    jointly = step()

    monkeypatch.setattr(batched_groups, "_joint", _group_by_group)
    apart = step()
    assert jointly < 0.9 * apart, (jointly, apart)


@pytest.mark.parametrize("stop", [True, False], ids=["stopped", "left-out"])
def test_a_row_read_twice_through_a_joint_with_a_member_without_delta_gets_both_deltas(
    device: Any, joints: list[Any], stop: bool
) -> None:
    # A reviewer's case: a group reads tanh(a0) twice from a joint of two groups' rows, and a
    # member gets no delta; the narrowed source called the joint's rows unique, and `out[index] += d`
    # kept one of the two additions (w1's gradient 0.068 batched, 0.133 node by node).
    rng = np.random.default_rng(3)
    w1 = ml.Weight(device.asarray(rng.standard_normal((3, 3))))
    w2 = ml.Weight(device.asarray(rng.standard_normal((3, 3))))
    xs = [device.asarray(rng.standard_normal((1, 3))) for _ in range(2)]
    a = [x @ w1 for x in xs]
    b = [x @ w2 for x in xs]
    s = [ml.tanh(a[0]), ml.tanh(a[0]), ml.tanh(a[1]), ml.tanh(b[0]), ml.tanh(b[1])]
    terms = [ml.sum(t) for t in s[:4]]
    if stop:
        loss = ml.sum(ml.stack([*terms, ml.sum(ml.stop_gradient(s[4]))]))
    else:  # (read, and left out of the loss)
        loss = ml.Layer(ml.Do.gather([ml.sum(ml.stack(terms)).forward(), s[4].forward()]).map(lambda t: t[0]))
    with ml.settings(batching=False):
        _, want = anyio.run(entry.gradients, loss)
    with ml.settings(batching=True):
        _, got = anyio.run(entry.gradients, loss)
    assert joints and not joints[0].unique  # (the case: a joint whose rows repeat)
    assert list(got) == list(want) and set(want) == {w1, w2}
    for w in want:
        np.testing.assert_allclose(np.asarray(got[w]), np.asarray(want[w]), rtol=1e-12, atol=1e-12)


def test_a_joint_gather_of_two_output_cells_sends_each_output_the_rows_that_read_it(
    device: Any, joints: list[Any]
) -> None:
    """`joint_reading_two_output_cells` on the device: each output of the
    joint gets the rows that reach it alone, and the weight's gradient is
    finite and as node by node (the per-output narrowing's device path;
    before it ran on NumPy's alone). `test_cuda` runs it on CuPy."""
    w, loss = joint_reading_two_output_cells(device.asarray)
    with ml.settings(batching=False):
        want = anyio.run(entry.gradients, loss)[1][w]
    with ml.settings(batching=True), np.errstate(divide="ignore", invalid="ignore"):
        got = anyio.run(entry.gradients, loss)[1][w]
    assert [len(j.groups) for j in joints] == [2, 2]  # (``h`` and ``r``: each from both producers' groups)
    assert np.isfinite(np.asarray(want)).all()
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-12, atol=1e-14)


def test_calls_that_all_read_one_earlier_cells_outputs_run_as_one_group_on_the_device(
    device: Any, alone: list[Program]
) -> None:
    """`cells_reading_one_shared_cell` on the device: the decoder's 40 calls
    one group beside the encoder's outputs on the device (the encoder's
    call alone runs node by node), with the gradients node by node."""
    weights, loss = cells_reading_one_shared_cell(device.asarray, either=True)
    with ml.settings(batching=False):
        want = anyio.run(entry.gradients, loss)[1]
    alone.clear()
    with ml.settings(batching=True):
        got = anyio.run(entry.gradients, loss)[1]
    assert len(alone) == 1
    for weight in weights:
        np.testing.assert_allclose(np.asarray(got[weight]), np.asarray(want[weight]), rtol=1e-12, atol=1e-14)


def test_a_loom_group_split_by_its_operands_shapes_takes_its_data_rows_by_a_device_index(
    device: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A loom's group whose calls read rows of two shapes at one position
    (a 0-d output of one cell's calls, a (1, 3) output of another's) runs as
    one call per pattern; each call's rows of data (a device's) were taken
    by a host index (an independent review's). Values and gradients as node
    by node."""
    from monadl.fold import _loom_arenas

    splits: list[int] = []
    split = _loom_arenas.Arenas.split

    def counted(self: Any, *args: Any) -> Any:
        for call in split(self, *args):
            splits.append(self.split_groups)
            yield call

    monkeypatch.setattr(_loom_arenas.Arenas, "split", counted)
    rng = np.random.default_rng(4)
    w = ml.Weight(device.asarray(rng.standard_normal((3, 3))))
    ones = device.asarray(np.ones((1, 3)))
    total = ml.operation(lambda a, x: ml.sum(ml.relu(a * x)))
    product = ml.operation(lambda a, x: ml.sigmoid(((a * ones) @ w) * x))

    def data() -> ml.ArrayLayer:
        return ml.as_layer(device.asarray(rng.standard_normal((1, 3))))

    with ml.loom():
        firsts = [(total if i % 2 else product)(data(), data()) for i in range(6)]  # (0-d, (1, 3), ...)
        seconds = [total(first, data()) for first in firsts]
    loss = ml.sum(ml.stack(seconds))
    with ml.settings(batching=False):
        want_value, want = anyio.run(entry.gradients, loss)
    splits.clear()
    with ml.settings(batching=True):
        value, got = anyio.run(entry.gradients, loss)
    assert splits  # (the case: a group split by its operands' shapes)
    assert float(value) == pytest.approx(float(want_value), rel=1e-12)
    np.testing.assert_allclose(np.asarray(got[w]), np.asarray(want[w]), rtol=1e-12, atol=1e-14)
