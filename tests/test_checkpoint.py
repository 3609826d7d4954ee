"""Checkpoints: `ml.save` / `ml.load`, the weights' setters, resuming bit-identically."""

from __future__ import annotations

import collections
import copy
import functools
import json
import os
import re
import subprocess
import sys
import threading
import warnings
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, ClassVar, NamedTuple

import anyio
import numpy as np
import pytest
from safetensors import SafetensorError, safe_open
from safetensors.numpy import load_file, save_file

import monadl as ml
from monadl import checkpoint

ROOT = Path(__file__).resolve().parent.parent


# ---- a model with nested dicts, lists and dataclasses, every kind of optimizer state -------
@dataclass
class Dense:
    weight: ml.ArrayWeight
    bias: ml.ArrayWeight


def build() -> dict[str, Any]:
    rng = np.random.default_rng(0)
    return {
        "encoder": [
            Dense(
                ml.Weight(rng.normal(size=(4, 8)), optimizer=ml.optim.adam(0.01)),
                ml.Weight(np.zeros(8), optimizer=ml.optim.adam(0.01)),
            ),
            Dense(
                ml.Weight(rng.normal(size=(8, 3)), optimizer=ml.optim.momentum(0.05)),
                ml.Weight(np.zeros(3), optimizer=ml.optim.nesterov(0.05)),
            ),
        ],
        "head": {
            # sparse steps: only looked-up rows and their Adam moments change
            "embedding": ml.Weight(rng.normal(size=(5, 4)), optimizer=ml.optim.adam(0.01)),
            # a schedule: its step count is an int in the state
            "scale": ml.Weight(1.0, optimizer=ml.optim.sgd(ml.optim.exponential_decay(0.05, 0.99))),
            "shift": ml.Weight(np.array(0.5), optimizer=ml.optim.rmsprop(0.01)),  # a 0-d array
        },
    }


def loss(model: dict[str, Any], step: int) -> ml.ScalarLayer:
    rng = np.random.default_rng(1000 + step)
    indices = rng.integers(0, 5, size=6)
    labels = rng.integers(0, 3, size=6)
    first, second = model["encoder"]
    hidden = ml.relu(ml.dense(ml.embedding(model["head"]["embedding"], indices), first.weight, first.bias))
    logits = ml.dense(hidden, second.weight, second.bias) * model["head"]["scale"] + model["head"]["shift"]
    return ml.cross_entropy(logits, labels)


async def train(model: dict[str, Any], steps: range) -> None:
    for step in steps:
        await loss(model, step).train()


def resume(saved: str, out: str) -> None:
    """The fresh process: rebuild, load, train steps 50-99, save."""
    model = build()
    ml.load(saved, model)
    anyio.run(train, model, range(50, 100))
    ml.save(out, model)


def contents(path: Path) -> tuple[dict[str, tuple[str, tuple[int, ...], bytes]], Any]:
    """Every tensor's dtype, shape and bytes, and the manifest."""
    with safe_open(str(path), framework="numpy") as file:
        manifest = json.loads(file.metadata()["monadl"])
    tensors = {k: (str(v.dtype), v.shape, v.tobytes()) for k, v in load_file(str(path)).items()}
    return tensors, manifest


def test_a_resumed_run_in_a_fresh_process_is_bit_identical(tmp_path: Path) -> None:
    model = build()
    anyio.run(train, model, range(50))
    ml.save(tmp_path / "at50.safetensors", model)
    anyio.run(train, model, range(50, 100))
    ml.save(tmp_path / "straight.safetensors", model)

    subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from tests.test_checkpoint import resume; resume(sys.argv[1], sys.argv[2])",
            str(tmp_path / "at50.safetensors"),
            str(tmp_path / "resumed.safetensors"),
        ],
        cwd=ROOT,
        check=True,
        timeout=600,  # a hang guard, not a speed check
    )
    straight, straight_manifest = contents(tmp_path / "straight.safetensors")
    resumed, resumed_manifest = contents(tmp_path / "resumed.safetensors")
    assert straight == resumed
    assert straight_manifest == resumed_manifest
    at50, _ = contents(tmp_path / "at50.safetensors")
    assert all(at50[name] != straight[name] for name in ml.checkpoint.named_weights(model))  # all trained
    # Adam's moments and the schedule's step count were saved and restored, not restarted.
    assert "optimizer_state/encoder.0.weight[0].mu" in resumed
    states = {w["name"]: w["optimizer_state"] for w in resumed_manifest["weights"]}
    assert states["encoder.0.weight"]["items"][0]["items"][0] == {"kind": "int", "value": 100}
    assert states["head.scale"] == {"kind": "int", "value": 100}


def test_the_modules_names_are_its_api_not_the_helpers_it_imports() -> None:
    # A user's tab completion of monadl.checkpoint offered decode, encode, match, stable,
    # put ... (helpers imported by name) beside save, load and named_weights.
    assert dir(checkpoint) == ["CheckpointError", "load", "named_weights", "save"]
    assert checkpoint.__all__ == ["load", "named_weights", "save"]


def test_named_weights_walk_dicts_lists_dataclasses_attributes_slots_and_named_tuples() -> None:
    class Pair(NamedTuple):
        left: ml.ArrayWeight
        right: ml.ArrayWeight

    class Slotted:
        __slots__ = ("inner",)

        def __init__(self, inner: object) -> None:
            self.inner = inner

    class Model:
        def __init__(self) -> None:
            self.shared = ml.Weight(np.zeros(1))
            self.blocks = [Slotted({"pair": Pair(ml.Weight(np.zeros(2)), self.shared)})]
            self.again = self.shared  # shared: named once, by its first path
            self.built = self.shared * 2.0  # a layer: not walked into
            self.me = self  # a cycle
            self.data = np.zeros(3)

    model = Model()
    names = ml.checkpoint.named_weights(model)
    assert list(names) == ["shared", "blocks.0.inner.pair.left"]
    assert names["shared"] is model.shared
    assert list(ml.checkpoint.named_weights(build())) == [
        "encoder.0.weight",
        "encoder.0.bias",
        "encoder.1.weight",
        "encoder.1.bias",
        "head.embedding",
        "head.scale",
        "head.shift",
    ]


def test_weights_in_a_set_are_refused_for_want_of_a_stable_name() -> None:
    with pytest.raises(ml.CheckpointError, match="weights in a set have no stable name"):
        ml.checkpoint.named_weights({"bag": {ml.Weight(np.zeros(1))}})
    assert ml.checkpoint.named_weights({"tags": {"a", "b"}}) == {}


def test_a_deep_model_is_walked_without_recursion() -> None:
    model: list[Any] = [ml.Weight(np.zeros(1))]
    for _ in range(5000):
        model = [model]
    assert list(ml.checkpoint.named_weights(model)) == [".".join(["0"] * 5001)]


_SHARED = ml.Weight(np.ones((2, 2)))  # a module's weight, which a cell reads as a global


def test_an_operations_names_are_its_functions_not_its_traces() -> None:
    import functools

    class Model:
        def __init__(self) -> None:
            self.w = ml.Weight(np.ones((2, 2)))
            self.params = {"u": ml.Weight(np.ones((2, 2)))}
            self.cell = ml.operation(self._cell)
            self.other = ml.operation(functools.partial(lambda p, x: x @ p["u"], self.params))

        def _cell(self, x: ml.ArrayOperand) -> ml.ArrayLayer:
            return ml.tanh(x @ self.w) @ _SHARED

    model = Model()
    before = list(ml.checkpoint.named_weights(model))
    anyio.run(ml.sum(model.cell(np.ones((1, 2))) + model.other(np.ones((1, 2)))).predict)  # traced
    assert list(ml.checkpoint.named_weights(model)) == before == ["w", "params.u"]
    fold_style = ml.checkpoint.named_weights({"f": model.other})  # held only by the operation's partial
    assert list(fold_style.values()) == [model.params["u"]]


_BIAS = ml.Weight(np.full(2, 4.0))  # (a default's weight)


def test_weights_held_by_code_are_named_by_what_the_code_reads(tmp_path: Path) -> None:
    # A partial's, a closure's and a default's weights were not walked: save wrote
    # the model without them and load left them as they were, without a word.
    import functools

    def scaled(w: ml.ArrayWeight, x: ml.Array, *, by: ml.ArrayWeight) -> ml.ArrayLayer:
        return w * x * by

    def make_head() -> Any:
        head = ml.Weight(np.full(2, 3.0))
        return lambda x: head * x

    def with_default(x: ml.Array, bias: ml.ArrayWeight = _BIAS) -> ml.ArrayLayer:
        return bias + x

    class Net:
        def __init__(self) -> None:
            self.w = ml.Weight(np.full(2, 5.0))

        def forward(self, x: ml.Array) -> ml.ArrayLayer:
            return self.w * x

    def build_it() -> dict[str, Any]:
        shared = ml.Weight(np.full(2, 1.0))
        return {
            "scale": functools.partial(scaled, shared, by=ml.Weight(np.full(2, 2.0))),
            "head": make_head(),
            "default": with_default,
            "step": Net().forward,
            "cell": ml.operation(functools.partial(scaled, shared, by=shared)),  # all seen before
        }

    model = build_it()
    names = ml.checkpoint.named_weights(model)
    assert list(names) == ["scale.0", "scale.by", "head.head", "default.bias", "step.w"]
    assert [float(w.data[0]) for w in names.values()] == [1.0, 2.0, 3.0, 4.0, 5.0]
    ml.save(tmp_path / "m.safetensors", model)
    fresh = ml.checkpoint.named_weights(build_it())
    for w in fresh.values():
        w.data = np.zeros(2)
    ml.load(tmp_path / "m.safetensors", build_it())
    assert [float(w.data[0]) for w in fresh.values()] == [0.0, 0.0, 0.0, 4.0, 0.0]  # (only the default is shared)
    ml.load(tmp_path / "m.safetensors", fresh)
    assert [float(w.data[0]) for w in fresh.values()] == [1.0, 2.0, 3.0, 4.0, 5.0]


def test_what_data_holds_keeps_its_name_before_what_code_holds() -> None:
    # Code is walked after data: a method or closure met first must not rename the
    # weights a checkpoint written before code was walked names by their data path.
    class Net:
        def __init__(self) -> None:
            self.activation = self.swish  # (a bound method, before the weights)
            self.w = ml.Weight(np.ones(2))

        def swish(self, x: ml.ArrayLayer) -> ml.ArrayLayer:
            return x * ml.sigmoid(x * self.w)

    params = {"w": ml.Weight(np.ones(2))}
    teacher = {"t": ml.Weight(np.ones(2))}
    model = {"loss": lambda x: ml.sum(params["w"] * teacher["t"] * x), "params": params, "net": Net()}
    assert list(ml.checkpoint.named_weights(model)) == ["params.w", "net.w", "loss.teacher.t"]


def test_a_large_sequence_that_only_code_holds_is_not_walked() -> None:
    # A loss's partial over a million samples took seconds a save, for no weight.
    samples = [(np.zeros(3), i) for i in range(20_000)]
    w = ml.Weight(np.ones(3))
    model = {"w": w, "loss": functools.partial(lambda data, i: ml.sum(w), samples)}
    assert ml.checkpoint.named_weights(model) == {"w": w}


def test_strict_false_loads_the_weights_both_have_and_names_the_others(tmp_path: Path) -> None:
    ml.save(tmp_path / "m.safetensors", {"a": ml.Weight(np.ones(2)), "b": ml.Weight(np.ones(2))})
    model = {"a": ml.Weight(np.zeros(2)), "c": ml.Weight(np.zeros(2))}
    with pytest.raises(ml.CheckpointError, match="strict=False"):
        ml.load(tmp_path / "m.safetensors", model)
    with pytest.warns(UserWarning, match=r"missing from the checkpoint: 'c'; .* does not have: 'b'"):
        ml.load(tmp_path / "m.safetensors", model, strict=False)
    assert model["a"].data.tolist() == [1.0, 1.0] and model["c"].data.tolist() == [0.0, 0.0]


@pytest.mark.parametrize("keys", [("a.b", "a"), (0, "0")])
def test_two_weights_of_one_name_are_refused(keys: tuple[Any, Any], tmp_path: Path) -> None:
    # {"a.b": w1, "a": {"b": w2}}: save kept one of them, and load restored one.
    first, second = keys
    model = {
        first: ml.Weight(np.ones(1)),
        second: {"b": ml.Weight(np.ones(1))} if second == "a" else ml.Weight(np.ones(1)),
    }
    with pytest.raises(ml.CheckpointError, match="two weights have the name"):
        ml.save(tmp_path / "m.safetensors", model)


def test_the_weights_values_alone_load_into_a_model_of_other_optimizers(tmp_path: Path) -> None:
    # A training checkpoint (Adam's moments) into a model for inference, built with the default optimizer.
    trained = {"w": ml.Weight(np.arange(3.0), optimizer=ml.optim.adam(0.1))}
    ml.optim.apply_gradients({trained["w"]: np.ones(3)})
    ml.save(tmp_path / "m.safetensors", trained)
    serving = {"w": ml.Weight(np.zeros(3))}
    with pytest.raises(ml.CheckpointError, match=r"optimizer_state=False"):
        ml.load(tmp_path / "m.safetensors", serving)
    state = serving["w"].state
    ml.load(tmp_path / "m.safetensors", serving, optimizer_state=False)
    np.testing.assert_array_equal(serving["w"].data, trained["w"].data)
    assert serving["w"].state is state


def test_a_weight_of_another_dtype_than_the_checkpoints_is_told_what_to_build(tmp_path: Path) -> None:
    ml.save(tmp_path / "m.safetensors", {"w": ml.Weight(np.ones(2))})
    with pytest.raises(ml.CheckpointError, match=r"the checkpoint holds float64, the model's weight is float32"):
        ml.load(tmp_path / "m.safetensors", {"w": ml.Weight(np.ones(2, np.float32))})


# ---- errors ---------------------------------------------------------------------------------
@pytest.fixture
def saved(tmp_path: Path) -> Path:
    path = tmp_path / "model.safetensors"
    ml.save(path, build(), metadata={"epoch": 7})
    return path


def test_load_returns_the_metadata_and_restores_values(saved: Path) -> None:
    model = build()
    model["encoder"][0].weight.data = np.ones((4, 8))
    assert ml.load(saved, model) == {"epoch": 7}
    np.testing.assert_array_equal(model["encoder"][0].weight.data, build()["encoder"][0].weight.data)


def test_missing_and_extra_weights_are_named(saved: Path) -> None:
    model = build()
    model["head"]["bonus"] = ml.Weight(np.zeros(2))
    del model["head"]["scale"]
    with pytest.raises(ml.CheckpointError) as error:
        ml.load(saved, model)
    assert "missing from the checkpoint: 'head.bonus'" in str(error.value)
    assert "the model does not have: 'head.scale'" in str(error.value)


def test_shape_and_dtype_mismatches_name_the_weight_and_change_nothing(saved: Path) -> None:
    model = build()
    model["encoder"][0].weight = ml.Weight(np.zeros((4, 9)), optimizer=ml.optim.adam(0.01))
    model["encoder"][1].bias = ml.Weight(np.zeros(3, np.float32), optimizer=ml.optim.nesterov(0.05))
    model["head"]["embedding"].data = np.full((5, 4), 3.0)  # loadable, but must stay as it is
    with pytest.raises(ml.CheckpointError) as error:
        ml.load(saved, model)
    message = str(error.value)
    assert "weight 'encoder.0.weight': expected shape (4, 9), got (4, 8)" in message
    assert "weight 'encoder.1.bias': the checkpoint holds float64, the model's weight is float32" in message
    np.testing.assert_array_equal(model["head"]["embedding"].data, np.full((5, 4), 3.0))


def test_an_optimizer_of_another_structure_is_refused(saved: Path) -> None:
    model = build()
    model["encoder"][0].weight.optimizer = ml.optim.momentum(0.01)
    with pytest.raises(
        ml.CheckpointError,
        match=r"weight .encoder.0.weight., optimizer state\[0\]: the checkpoint has AdamState of 3, the model.s optimizer has ndarray",
    ) as info:
        ml.load(saved, model)
    assert "build the model with the optimizers it was saved with" in str(info.value)


def test_an_array_state_loaded_into_another_optimizers_state_names_the_weight(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    ml.save(path, {"encoder": ml.Weight(np.ones(3), optimizer=ml.optim.momentum(1e-2, 0.9))})  # its state: an array
    for other in (ml.optim.adam(1e-2), ml.optim.rmsprop(1e-2)):
        model = {"encoder": ml.Weight(np.zeros(3), optimizer=other)}
        with pytest.raises(
            ml.CheckpointError, match=r"weight 'encoder', optimizer state.*: the checkpoint has an array"
        ):
            ml.load(path, model)  # (it said only 'AdamState is not an array of a known array library')
        np.testing.assert_array_equal(model["encoder"].data, np.zeros(3))


def test_save_with_the_path_second_and_files_that_are_no_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="the path comes first"):
        ml.save(build(), str(tmp_path / "x"))  # type: ignore[arg-type]  # PyTorch's order, on purpose
    with pytest.raises(TypeError, match="metadata must be JSON"):
        ml.save(tmp_path / "x", build(), metadata={"rng": np.random.default_rng()})
    save_file({"w": np.zeros(2)}, str(tmp_path / "plain.safetensors"))
    with pytest.raises(ml.CheckpointError, match="not a monadl checkpoint"):
        ml.load(tmp_path / "plain.safetensors", build())
    (tmp_path / "junk").write_bytes(b"not a checkpoint at all")
    with pytest.raises(ml.CheckpointError, match="not a safetensors file"):
        ml.load(tmp_path / "junk", build())
    for call in (ml.save, ml.load):  # (load said "No such device (os error 19)", save named a temporary file)
        with pytest.raises(IsADirectoryError, match="a checkpoint is a file, and this is a directory"):
            call(tmp_path, build())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["junk", "plain.safetensors"]  # nothing written


def test_a_model_without_weights_is_refused_and_nothing_is_written(tmp_path: Path, saved: Path) -> None:
    empty = tmp_path / "empty.safetensors"
    with pytest.raises(ml.CheckpointError, match=r"the model, a dict, holds no Weight.*pass the object that holds"):
        ml.save(empty, {"w": np.zeros(3), "lr": 0.1})  # plain arrays: no weight
    loss = ml.sum(ml.Weight(np.ones(2)) * 2.0)
    with pytest.raises(ml.CheckpointError, match=r"a Layer, holds no Weight.*a built Layer .* is not walked into"):
        ml.save(empty, loss)
    weights = [ml.Weight(np.ones(2))]
    with pytest.raises(ml.CheckpointError, match=r"a generator, holds no Weight.* not walked into .*pass a list"):
        ml.save(empty, (w for w in weights))  # (a trial's: it held a weight, unread)
    assert not empty.exists()
    before = saved.read_bytes()
    with pytest.raises(ml.CheckpointError, match="holds no Weight"):
        ml.save(saved, [])
    assert saved.read_bytes() == before  # a previous checkpoint stays
    assert os.listdir(tmp_path) == [saved.name]  # no empty file, no temporary file


# ---- atomic writes -----------------------------------------------------------------------------
def test_a_crash_after_writing_the_temporary_file_keeps_the_previous_checkpoint(
    saved: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = saved.read_bytes()
    written = checkpoint._write_tensors

    def write_then_crash(tensors: dict[str, Any], path: str, header: dict[str, str]) -> None:
        written(tensors, path, header)
        assert os.path.getsize(path) > 0
        raise KeyboardInterrupt  # as if killed before the rename

    monkeypatch.setattr(checkpoint, "_write_tensors", write_then_crash)
    model = build()
    anyio.run(train, model, range(3))
    with pytest.raises(KeyboardInterrupt):
        ml.save(saved, model)
    assert saved.read_bytes() == before
    assert os.listdir(saved.parent) == [saved.name]  # no temporary file left behind


def test_a_failing_rename_keeps_the_previous_checkpoint(saved: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    before = saved.read_bytes()

    def refuse(source: str, target: str) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(OSError, match="disk full"):
        ml.save(saved, build())
    assert saved.read_bytes() == before
    assert os.listdir(saved.parent) == [saved.name]


def test_a_step_committed_on_another_thread_during_a_save_is_in_none_of_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``anyio.to_thread.run_sync(ml.save, ...)`` beside a ``train()``: a step
    that committed after the first weight was read and before the second
    was saved, as weights of steps k and k+1 mixed, which loaded silently.
    The step is forced between the two (no reliance on thread timing)."""
    model = build()
    anyio.run(train, model, range(3))
    ml.save(tmp_path / "before.safetensors", model)
    from monadl._state_file import put as stored

    stepped: list[threading.Thread] = []

    def put_then_step(tensors: dict[str, Any], key: str, value: Any) -> None:
        stored(tensors, key, value)
        if not stepped:  # (after the first weight: a whole train() commits on a thread of its own)
            stepped.append(threading.Thread(target=anyio.run, args=(train, model, range(3, 4))))
            stepped[0].start()
            stepped[0].join(timeout=60)
            assert not stepped[0].is_alive(), "the step waited for the save: it should go on beside it"

    monkeypatch.setattr(checkpoint, "put", put_then_step)
    ml.save(tmp_path / "during.safetensors", model)
    assert model["encoder"][0].bias.state[0].step == 4  # (the step was taken, during the save)
    # Every weight as it was before the step, the embedding's rows too (its sparse step
    # writes in place into arrays nobody holds: the snapshot holds them).
    assert contents(tmp_path / "during.safetensors") == contents(tmp_path / "before.safetensors")


KILLED_SAVE = """
import os, signal, sys, numpy as np, monadl as ml
from monadl import checkpoint
written = checkpoint._write_tensors
def write_then_die(tensors, target, header):
    written(tensors, target, header)
    with open(os.path.join(os.path.dirname(target), ".tmpAbC123"), "wb") as file:  # (safetensors' own, mid-write)
        file.write(bytes(100))
    os.kill(os.getpid(), signal.SIGKILL)
checkpoint._write_tensors = write_then_die
ml.save(sys.argv[1], {"w": ml.Weight(np.arange(4.0))})
"""


@pytest.mark.skipif(sys.platform == "win32", reason="no flock: leftovers are not removed there")
def test_what_a_killed_save_left_is_removed_by_the_next_save_of_its_path_and_nothing_else(tmp_path: Path) -> None:
    """kill -9 during a save left a checkpoint-sized .NAME.<uuid>.tmp and
    safetensors' own .tmpXXXXXX (named after nothing) that no save removed:
    a preempted job gathered one per kill."""
    path = tmp_path / "m.safetensors"
    ml.save(path, {"w": ml.Weight(np.zeros(4))})
    killed = subprocess.run([sys.executable, "-c", KILLED_SAVE, str(path)], cwd=ROOT, timeout=600)
    assert killed.returncode == -9
    (left,) = [name for name in os.listdir(tmp_path) if name != path.name]
    assert re.fullmatch(r"\.m\.safetensors\.[0-9a-f]{32}\.tmp", left)
    assert sorted(os.listdir(tmp_path / left)) == [".lock", ".tmpAbC123", "m.safetensors"]  # (all in one folder)
    not_ours = [".tmpXyZ789", "notes.txt", f".other.safetensors.{'0' * 32}.tmp", f".m.safetensors.{'0' * 31}.tmp"]
    for name in not_ours:
        (tmp_path / name).write_bytes(b"keep")
    model = {"w": ml.Weight(np.ones(4))}
    ml.load(path, model)  # (the previous checkpoint, intact)
    assert model["w"].data.tolist() == [0.0] * 4
    ml.save(path, model)
    assert sorted(os.listdir(tmp_path)) == sorted([path.name, *not_ours])


@pytest.mark.skipif(sys.platform == "win32", reason="no flock")
def test_a_save_of_the_same_path_still_at_work_is_left_alone(tmp_path: Path) -> None:
    import fcntl

    path = tmp_path / "m.safetensors"
    workspace = tmp_path / f".m.safetensors.{'a' * 32}.tmp"  # (as another process's save makes it, and locks it)
    workspace.mkdir()
    (workspace / "m.safetensors").write_bytes(b"half written")
    lock = os.open(workspace / ".lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        ml.save(path, {"w": ml.Weight(np.zeros(4))})
        assert sorted(os.listdir(workspace)) == [".lock", "m.safetensors"]
    finally:
        os.close(lock)  # (its writer gone)
    ml.save(path, {"w": ml.Weight(np.zeros(4))})
    assert os.listdir(tmp_path) == [path.name]


@pytest.mark.skipif(sys.platform == "win32", reason="no flock")
def test_a_writer_never_takes_the_lock_of_a_workspace_being_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save removing another's leftover released its lock before removing
    the lock file and the folder: a writer that had just made that folder
    and its lock file (a process's new save, its folder taken for a killed
    writer's) could lock it then and write into a folder being removed."""
    from monadl import _atomic_file

    workspace = tmp_path / f".m.safetensors.{'b' * 32}.tmp"
    workspace.mkdir()
    lock_path = str(workspace / ".lock")
    writers = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_EXCL)  # (made, not locked yet)
    taken: list[bool] = []
    close = os.close

    def close_then_writer_locks(descriptor: int) -> None:
        close(descriptor)
        if descriptor != writers and not taken:
            taken.append(_atomic_file._locked(writers, lock_path))

    monkeypatch.setattr(os, "close", close_then_writer_locks)
    try:
        _atomic_file._remove_leftovers(str(tmp_path), "m.safetensors")
    finally:
        monkeypatch.undo()
        os.close(writers)
    assert taken == [False]
    assert os.listdir(tmp_path) == []


def test_saves_of_one_path_on_several_threads_each_complete_and_leave_nothing(tmp_path: Path) -> None:
    """Each save removes the leftovers of its path: never another's at work."""
    path = tmp_path / "m.safetensors"
    failures: list[BaseException] = []

    def saves(value: float) -> None:
        try:
            for _ in range(5):
                ml.save(path, {"w": ml.Weight(np.full(1000, value))})
        except BaseException as error:
            failures.append(error)

    threads = [threading.Thread(target=saves, args=(float(i),)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    assert os.listdir(tmp_path) == [path.name]
    model = {"w": ml.Weight(np.zeros(1000))}
    ml.load(path, model)
    assert len(set(model["w"].data.tolist())) == 1


def test_a_checkpoint_gets_the_permissions_of_a_new_file(tmp_path: Path) -> None:
    ml.save(tmp_path / "a.safetensors", build())
    (tmp_path / "b").write_bytes(b"")
    assert os.stat(tmp_path / "a.safetensors").st_mode == os.stat(tmp_path / "b").st_mode


# ---- 0-d weights, setters, copies ---------------------------------------------------------------
def test_zero_d_weights_come_back_as_the_type_they_have_in_memory(tmp_path: Path) -> None:
    def model() -> list[ml.Weight[Any, Any]]:
        return [
            ml.Weight(np.array(1.5), optimizer=ml.optim.adam(0.1)),  # a 0-d array
            ml.Weight(np.float32(2.5), optimizer=ml.optim.adam(0.1)),  # a NumPy scalar
            ml.Weight(3.5, optimizer=ml.optim.momentum(0.1)),  # a float: np.float64
        ]

    original = model()
    ml.save(tmp_path / "w.safetensors", original)
    fresh = model()
    for w in fresh:
        w.data = 0.0
    kinds = [type(w.data) for w in fresh]
    ml.load(tmp_path / "w.safetensors", fresh)
    assert [type(w.data) for w in fresh] == kinds == [np.ndarray, np.float32, np.float64]
    assert [float(w.data) for w in fresh] == [1.5, 2.5, 3.5]
    assert fresh[1].state[0].mu.dtype == np.float32


def test_training_keeps_a_zero_d_weight_an_array() -> None:
    w = ml.Weight(np.array(1.5), optimizer=ml.optim.sgd(0.1))
    anyio.run((w * w).train)
    assert type(w.data) is np.ndarray


def test_the_data_setter_copies_and_checks_shape_dtype_and_library() -> None:
    import array_api_strict as xp

    w = ml.Weight(np.zeros(2, np.float32))
    source = np.array([1.0, 2.0], np.float32)
    w.data = source
    source[0] = 9.0
    np.testing.assert_array_equal(w.data, [1.0, 2.0])
    with pytest.raises(ml.ShapeError, match=r"Weight.data: expected shape \(2,\), got \(3,\)"):
        w.data = np.zeros(3, np.float32)
    with pytest.raises(ml.DTypeError, match=r"Weight\.data: expected dtype float32, got float64"):
        w.data = np.zeros(2)
    with pytest.raises(ml.DeviceError, match="holds a numpy array, got a array_api_strict array"):
        w.data = xp.zeros(2, dtype=xp.float32)  # type: ignore[assignment]  # the wrong library, on purpose
    with pytest.raises(ml.OperandError, match="expected an array or a number, got Layer"):
        w.data = w * 2.0  # type: ignore[assignment]  # a layer, on purpose
    scalar = ml.Weight(np.float32(1.0))
    scalar.data = 0.25
    data: object = scalar.data  # (typed float, as a float32 layer's value is: the README's Types section)
    assert type(data) is np.float32 and data == 0.25


def test_the_state_setter_checks_the_structure_and_the_optimizer_setter_starts_afresh() -> None:
    w = ml.Weight(np.zeros(2), optimizer=ml.optim.adam(0.1))
    anyio.run((w * w).sum().train)
    assert w.state[0].step == 1
    adam_state = type(w.state[0])
    w.state = (adam_state(5, np.ones(2), np.ones(2)), None)
    assert w.state[0].step == 5
    with pytest.raises(ml.OperandError, match=r"Weight.state\[0\].step: expected int, got float"):
        w.state = (adam_state(5.0, np.ones(2), np.ones(2)), None)
    with pytest.raises(ml.ShapeError, match=r"Weight.state\[0\].mu: expected shape \(2,\), got \(3,\)"):
        w.state = (adam_state(5, np.ones(3), np.ones(2)), None)
    with pytest.raises(
        ml.OperandError,
        match=r"Weight.state: expected \(AdamState\(int, float64\[2\], float64\[2\]\), None\), "
        r"got \(AdamState\(int, float64\[2\], float64\[2\]\)\);",
    ):
        w.state = (adam_state(5, np.ones(2), np.ones(2)),)
    w.optimizer = ml.optim.momentum(0.1)
    np.testing.assert_array_equal(w.state[0], np.zeros(2))
    with pytest.raises(ml.OperandError, match="GradientTransformation"):
        w.optimizer = "adam"  # type: ignore[assignment]  # what the check is for


def test_adams_state_kept_across_a_change_to_adamw_is_refused_with_both_structures_and_the_fix() -> None:
    # A new user kept Adam's state while switching to AdamW, as the recipe for a new rate does, and read
    # only 'Weight.state: expected tuple of 3, got tuple of 2': not which part is what, nor what to build.
    w = ml.Weight(np.ones(3), optimizer=ml.optim.adam(1e-2))
    anyio.run(ml.sum(w * w).train)
    old = w.state
    w.optimizer = ml.optim.adamw(1e-2, weight_decay=0.1)
    with pytest.raises(ml.OperandError) as refused:
        w.state = old
    adam = "AdamState(int, float64[3], float64[3])"
    assert str(refused.value) == (
        f"Weight.state: expected ({adam}, None, None), got ({adam}, None); the expected one is what the weight's "
        "optimizer, chain(scale_by_adam(b1=0.9, b2=0.999, eps=1e-08), add_decayed_weights(weight_decay=0.1), "
        "scale(-0.01)), makes (a chain's state holds one part per transformation, in its order), and another "
        "optimizer's state does not fit as it is: start from this optimizer's fresh state (w.state right after "
        "assigning w.optimizer) and put the old state's parts in their places, e.g. w.state = (old[0], "
        "*w.state[1:]) keeps the moments and step count of an old Adam state, old"
    )
    assert w.state[0].step == 0  # (refused: unchanged)
    w.state = (old[0], *w.state[1:])  # what the message says
    assert w.state[0].step == 1
    np.testing.assert_array_equal(w.state[0].mu, old[0].mu)
    # A part that differs deep inside (Adam with a rate, then with a schedule, which counts its own steps)
    # is named, and the whole states are shown beside it.
    w.optimizer = ml.optim.adam(lambda step: 1e-2)
    with pytest.raises(
        ml.OperandError,
        match=r"^Weight.state\[1\]: expected int, got None \(the whole state: expected \(AdamState\(int, "
        r"float64\[3\], float64\[3\]\), int\), got \(AdamState\(int, float64\[3\], float64\[3\]\), None\)\); "
        r"the expected one is what the weight's optimizer, chain\(scale_by_adam\(.*\), "
        r"scale_by_learning_rate\(schedule=.*<lambda>\)\), makes",
    ):
        w.state = old


def test_a_deep_copy_trains_on_its_own() -> None:
    w = ml.Weight(np.ones(2), optimizer=ml.optim.adam(0.1))
    twin = copy.deepcopy(w)
    anyio.run((twin * twin).sum().train)
    np.testing.assert_array_equal(w.data, np.ones(2))
    assert w.state[0].step == 0 and twin.state[0].step == 1
    assert not np.array_equal(twin.data, np.ones(2))


# ---- the digits demo ------------------------------------------------------------------------------
def test_the_digits_demo_resumes_as_if_never_stopped(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from examples import digits

    straight, half, resumed = (str(tmp_path / f"{n}.safetensors") for n in ("straight", "half", "resumed"))
    anyio.run(partial(digits.run, epochs=2, show_progress=False, save=straight))
    anyio.run(partial(digits.run, epochs=1, show_progress=False, save=half))
    digits.main(["--epochs", "1", "--resume", half, "--save", resumed, "--plot", str(tmp_path / "curve.png")])
    assert "test accuracy" in capsys.readouterr().out
    assert contents(Path(straight)) == contents(Path(resumed))
    assert contents(Path(straight)) != contents(Path(half))
    assert contents(Path(resumed))[1]["metadata"]["epoch"] == 2


def test_weights_of_another_array_library_round_trip_in_their_library(tmp_path: Path) -> None:
    import array_api_strict as xp

    def model() -> dict[str, ml.Weight[Any, Any]]:
        return {"w": ml.Weight(xp.asarray([1.0, 2.0]), optimizer=ml.optim.adam(0.1))}

    trained = model()
    anyio.run((trained["w"] * trained["w"]).sum().train)
    ml.save(tmp_path / "w.safetensors", trained)
    fresh = model()
    ml.load(tmp_path / "w.safetensors", fresh)
    assert type(fresh["w"].data) is type(trained["w"].data)
    assert type(fresh["w"].state[0].mu) is type(trained["w"].state[0].mu)
    np.testing.assert_array_equal(np.from_dlpack(fresh["w"].data), np.from_dlpack(trained["w"].data))
    assert fresh["w"].state[0].step == 1


def test_load_with_the_path_second_says_the_order(tmp_path: Path) -> None:
    model = build()
    with pytest.raises(TypeError, match=r"load\(path, model\): the path comes first"):
        ml.load(model, str(tmp_path / "x"))  # type: ignore[arg-type]  # save's order mistaken, on purpose


def test_numpy_scalars_in_metadata_are_kept_as_numbers(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    ml.save(path, build(), metadata={"epoch": np.int64(3), "loss": np.float32(0.5), "done": np.bool_(True)})
    assert ml.load(path, build()) == {"epoch": 3, "loss": 0.5, "done": True}
    with pytest.raises(TypeError, match=r"metadata must be JSON.*Generator is not JSON"):
        ml.save(path, build(), metadata={"rng": np.random.default_rng()})


def test_a_damaged_checkpoint_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    ml.save(path, {"w": ml.Weight(np.arange(4.0), optimizer=ml.optim.adam(0.1))})
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0xFF  # (a flipped byte in the last array's data: it loaded silently)
    path.write_bytes(bytes(raw))
    model = {"w": ml.Weight(np.zeros(4), optimizer=ml.optim.adam(0.1))}
    with pytest.raises(
        ml.CheckpointError, match=r"is damaged: the bytes of .* are not those saved; nothing was loaded"
    ):
        ml.load(path, model)
    np.testing.assert_array_equal(model["w"].data, np.zeros(4))


def test_a_damaged_manifest_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    """A byte changed in the header (an Adam step count 0 -> 7, the metadata's
    epoch 3 -> 9) loaded silently: the digests covered the arrays alone, and a
    wrong step count changes the bias correction of every later step."""
    path = tmp_path / "m.safetensors"
    ml.save(path, {"w": ml.Weight(np.ones(3), optimizer=ml.optim.adam(1e-3))}, metadata={"epoch": 3})
    raw = path.read_bytes()
    step = raw.index(b'\\"value\\": 0') + len(b'\\"value\\": ')
    epoch = raw.index(b'\\"epoch\\": 3') + len(b'\\"epoch\\": ')
    digest = raw.index(b'"monadl.digest":"') + len(b'"monadl.digest":"')
    for at, byte in ((step, b"7"), (epoch, b"9"), (digest, b"0" if raw[digest : digest + 1] != b"0" else b"1")):
        path.write_bytes(raw[:at] + byte + raw[at + 1 :])
        model = {"w": ml.Weight(np.zeros(3), optimizer=ml.optim.adam(1e-3))}
        with pytest.raises(ml.CheckpointError) as refused:
            ml.load(path, model)
        assert str(refused.value) == (
            f"{path} is damaged: its manifest (the weights' names and shapes, the optimizer states' numbers such as "
            "step counts, the metadata) is not the one saved; nothing was loaded"
        )
        assert model["w"].data.tolist() == [0.0] * 3 and model["w"].state[0].step == 0
    path.write_bytes(raw)
    assert ml.load(path, model) == {"epoch": 3}


def test_a_truncated_checkpoint_is_called_truncated_with_its_size_and_the_size_its_header_gives(
    tmp_path: Path,
) -> None:
    """A file cut short (a full disk, a copy interrupted) was 'not a safetensors
    file: Error while deserializing header: incomplete metadata, file not fully
    covered', as was one with bytes appended."""
    path = tmp_path / "m.safetensors"
    ml.save(path, {"w": ml.Weight(np.ones(1000), optimizer=ml.optim.adam(1e-3))})
    raw = path.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    cases = {
        raw[:-100]: f"is truncated: {len(raw) - 100} bytes, and its header expects {len(raw)} (a full disk, a copy "
        "cut short?); nothing was loaded",
        raw[: 8 + length // 2]: f"is truncated: {8 + length // 2} bytes, and its header expects at least "
        f"{8 + length} (a full disk, a copy cut short?); nothing was loaded",
        raw + b"garbage": f"has 7 bytes after its end ({len(raw) + 7} bytes, and its header expects {len(raw)}: "
        "written over a longer file, or appended to?); nothing was loaded",
        b"": "is 0 bytes long, too short for a checkpoint (a safetensors file begins with 8 bytes that give its "
        "header's length): truncated, or never written?; nothing was loaded",
    }
    for content, told in cases.items():
        path.write_bytes(content)
        model = {"w": ml.Weight(np.zeros(1000), optimizer=ml.optim.adam(1e-3))}
        with pytest.raises(ml.CheckpointError) as refused:
            ml.load(path, model)
        assert str(refused.value) == f"{path} {told}"
        assert not model["w"].data.any()
    path.write_bytes((length * 1000).to_bytes(8, "little") + raw[8:])  # (the length damaged, not the file cut)
    with pytest.raises(ml.CheckpointError, match=r"is not a safetensors file: .*invalid header length"):
        ml.load(path, {"w": ml.Weight(np.zeros(1000), optimizer=ml.optim.adam(1e-3))})


def test_a_checkpoint_cut_inside_its_headers_padding_is_called_truncated(tmp_path: Path) -> None:
    """The header's JSON whole, the spaces that pad it to 8 bytes cut, and
    every array byte gone: it was 'not a safetensors file: ... invalid header
    length'."""
    path = tmp_path / "m.safetensors"
    for k in range(8):  # (a note's length that leaves the header padded)
        ml.save(path, {"w": ml.Weight(np.ones(1000))}, metadata={"note": "x" * k})
        raw = path.read_bytes()
        length = int.from_bytes(raw[:8], "little")
        json_end = len(raw[8 : 8 + length].rstrip(b" "))
        if json_end < length:
            break
    assert len(raw) == 8 + length + 8000
    for cut in (8 + length - 1, 8 + json_end):
        path.write_bytes(raw[:cut])
        with pytest.raises(ml.CheckpointError) as refused:
            ml.load(path, {"w": ml.Weight(np.zeros(1000))})
        assert str(refused.value) == (
            f"{path} is truncated: {cut} bytes, and its header expects {len(raw)} (a full disk, a copy cut short?); "
            "nothing was loaded"
        )


def test_a_save_that_replaces_the_file_during_a_load_leaves_the_load_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Load opened the path twice, for the manifest and for the arrays: a
    process re-saving the checkpoint in between paired one file's manifest
    with the next one's arrays, and load said 'is damaged: the bytes of 'w'
    are not those saved' (27 of 11,600 loads beside a saving process)."""
    import monadl._checkpoint_file as checkpoint_file

    path = tmp_path / "m.safetensors"
    ml.save(path, {"w": ml.Weight(np.full(4, 1.0))}, metadata={"i": 1})
    read_manifest = checkpoint_file._manifest

    def then_saved_again(*args: Any) -> Any:
        manifest = read_manifest(*args)
        ml.save(path, {"w": ml.Weight(np.full(4, 2.0))}, metadata={"i": 2})
        return manifest

    monkeypatch.setattr(checkpoint_file, "_manifest", then_saved_again)
    model = {"w": ml.Weight(np.zeros(4))}
    assert ml.load(path, model) == {"i": 1}
    assert model["w"].data.tolist() == [1.0] * 4
    monkeypatch.undo()
    assert ml.load(path, model) == {"i": 2}
    assert model["w"].data.tolist() == [2.0] * 4


def test_a_checkpoint_without_digests_still_loads(tmp_path: Path) -> None:
    import json

    from safetensors.numpy import load_file, save_file

    path = tmp_path / "old.safetensors"
    ml.save(path, {"w": ml.Weight(np.arange(3.0))})
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as file:
        header = dict(file.metadata())
    manifest = json.loads(header["monadl"])
    del manifest["digests"]  # (as written before digests: of the arrays, and of the manifest)
    header["monadl"] = json.dumps(manifest)
    del header["monadl.digest"]
    save_file(load_file(str(path)), str(path), metadata=header)
    model = {"w": ml.Weight(np.zeros(3))}
    ml.load(path, model)
    np.testing.assert_array_equal(model["w"].data, np.arange(3.0))


def test_a_weight_under_a_key_that_reads_as_a_memory_address_is_refused(tmp_path: Path) -> None:
    """Its name would differ in the process that loads it (or on another rank)."""

    class Key:
        pass

    class Named:
        def __repr__(self) -> str:
            return f"<Named {id(self):#x}>"

    for key in (Key(), Named()):
        with pytest.raises(ml.CheckpointError, match="reads as a memory address"):
            checkpoint.save(tmp_path / "c", {"experts": {key: ml.Weight(np.ones(2))}})
        assert not (tmp_path / "c").exists()
    fine = {"config": {Key(): "no weight here"}, "w": ml.Weight(np.ones(2))}  # other values under such keys are fine
    checkpoint.save(tmp_path / "d", fine)
    checkpoint.load(tmp_path / "d", fine)


def test_saving_into_a_missing_folder_names_the_path_asked_for(tmp_path: Path) -> None:
    target = tmp_path / "no_such_dir" / "model.safetensors"
    with pytest.raises(FileNotFoundError) as caught:
        ml.save(target, ml.Weight(np.ones(2)))
    assert caught.value.filename == str(target) and ".tmp" not in str(caught.value)


# ---- from a new user's trial: what a checkpoint missed or said wrongly ----------------------
@pytest.mark.anyio
async def test_a_big_endian_array_trains_saves_and_loads_as_any_other(tmp_path: Path) -> None:
    # (a FITS or network-order file's array: the checkpoint's digests were of its bytes, and every load
    # called the file damaged)
    w = ml.Weight(np.arange(4.0).astype(">f8"), optimizer=ml.optim.adam(0.1))
    assert w.dtype == np.float64 and w.data.dtype.isnative
    assert ml.Weight(np.ones((3, 2)).T).data.flags.c_contiguous  # (copied in C order, as before)
    await ml.sum(w * w).train()
    ml.save(tmp_path / "w.safetensors", {"w": w})
    fresh = ml.Weight(np.zeros(4), optimizer=ml.optim.adam(0.1))
    ml.load(tmp_path / "w.safetensors", {"w": fresh})
    np.testing.assert_array_equal(fresh.data, w.data)
    fresh.data = np.ones(4).astype(">f8")  # (its values: the weight keeps its own byte order)
    assert fresh.data.dtype.isnative and fresh.data.tolist() == [1.0] * 4


class _Held:
    shared = ml.Weight(np.zeros(2))  # (a class attribute, as a quick script keeps one)

    def __init__(self) -> None:
        objects = np.empty(1, dtype=object)
        objects[0] = ml.Weight(np.ones(1))
        self.deque = collections.deque([ml.Weight(np.ones(3)), ml.Weight(np.ones(3))])
        self.objects = objects
        self.values = {"x": ml.Weight(np.ones(2))}.values()


def test_weights_in_a_deque_an_object_array_a_dicts_values_and_a_class_are_saved() -> None:
    # (they were left out without a word, and a load "succeeded" with them as built)
    assert list(checkpoint.named_weights(_Held())) == ["deque.0", "deque.1", "objects.0", "values.0", "shared"]


def test_a_load_that_fails_under_strict_false_says_nothing_of_passing_over(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    ml.save(path, {"a": ml.Weight(np.zeros(3)), "b": ml.Weight(np.zeros(2))})
    with pytest.raises(ml.CheckpointError) as raised, warnings.catch_warnings():
        warnings.simplefilter("error")  # (it warned that the others were passed over, though nothing loaded)
        ml.load(path, {"a": ml.Weight(np.zeros(4)), "c": ml.Weight(np.zeros(2))}, strict=False)
    assert "expected shape (4,), got (3,)" in str(raised.value)
    assert "strict=False" not in str(raised.value)  # (it advised what was given)
    with pytest.warns(UserWarning, match=r"missing from the checkpoint: 'c'.*passed over"):
        ml.load(path, {"a": ml.Weight(np.zeros(3)), "c": ml.Weight(np.zeros(2))}, strict=False)


def test_a_weight_of_another_dtype_and_shape_is_told_both(tmp_path: Path) -> None:
    ml.save(tmp_path / "m.safetensors", {"w": ml.Weight(np.zeros((3, 4)))})
    with pytest.raises(ml.CheckpointError, match=r"holds float64 and shape \(3, 4\) \(the model's: \(4, 3\)\)"):
        ml.load(tmp_path / "m.safetensors", {"w": ml.Weight(np.zeros((4, 3), np.float32))})


@pytest.mark.parametrize(
    ("metadata", "message"),
    [
        ({"best": {3: 0.9}}, r"metadata\['best'\] has a key that is no str, 3 \(int\).*load as '3'"),
        ([("epoch", 3)], "metadata is a dict of JSON data .*got a list"),
    ],
)
def test_metadata_that_would_not_load_as_given_is_refused(tmp_path: Path, metadata: Any, message: str) -> None:
    with pytest.raises(TypeError, match=message):
        ml.save(tmp_path / "m.safetensors", {"w": ml.Weight(np.zeros(2))}, metadata=metadata)
    assert not (tmp_path / "m.safetensors").exists()


def test_a_failed_write_is_an_os_error_and_keeps_the_previous_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "m.safetensors"
    ml.save(path, {"w": ml.Weight(np.ones(2))})

    def full(*args: Any, **kwargs: Any) -> None:
        raise SafetensorError("No space left on device (os error 28)")

    monkeypatch.setattr(checkpoint, "save_file", full)
    with pytest.raises(OSError, match="No space left on device"):
        ml.save(path, {"w": ml.Weight(np.zeros(2))})
    monkeypatch.undo()
    fresh = {"w": ml.Weight(np.zeros(2))}
    ml.load(path, fresh)
    assert fresh["w"].data.tolist() == [1.0, 1.0]


@pytest.mark.anyio
async def test_a_load_while_a_train_reads_its_weights_warns_and_one_between_steps_does_not(tmp_path: Path) -> None:
    # (the step in flight was taken from the loaded values along the old ones' gradients, without a word)
    path = tmp_path / "m.safetensors"
    ws = [ml.Weight(np.full((2, 2), 0.5)), ml.Weight(np.ones(2))]
    ml.save(path, ws)
    reached = anyio.Event()

    @ml.direct
    async def model() -> ml.ScalarLayer:
        h = await ml.tanh(np.ones((1, 2)) @ ws[0])  # (the first weight read, then the train() waits)
        reached.set()
        await anyio.sleep(0.05)
        return ml.sum(ml.as_layer(h) * ws[1] + ws[0])

    async def load_meanwhile() -> None:
        await reached.wait()
        with pytest.warns(UserWarning, match=r"load: a train\(\) in flight has read '0'.*load between steps"):
            ml.load(path, ws)

    async with anyio.create_task_group() as tg:
        tg.start_soon(load_meanwhile)
        await model().train()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ml.load(path, ws)  # (between steps: nothing in flight)


class _Registered:
    instances: ClassVar[list[_Registered]] = []  # (a class-level registry of every instance: other models' too)

    def __init__(self) -> None:
        self.w = ml.Weight(np.zeros(2))
        _Registered.instances.append(self)


def test_a_class_level_registry_is_not_walked_into() -> None:
    # (walking a class's lists named other models' weights, and renamed the model's own)
    _Registered()
    model = {"enc": _Registered(), "dec": _Registered()}
    assert list(checkpoint.named_weights(model)) == ["enc.w", "dec.w"]


def test_metadata_that_holds_itself_is_refused_not_walked_forever(tmp_path: Path) -> None:
    metadata: dict[str, Any] = {"epoch": 3}
    metadata["self"] = metadata
    with pytest.raises(TypeError, match="Circular reference"):
        ml.save(tmp_path / "m.safetensors", {"w": ml.Weight(np.zeros(2))}, metadata=metadata)


def _peak(call: Any) -> int:
    """The most memory ``call`` held at once, in bytes (NumPy's arrays as Python's)."""
    import tracemalloc

    tracemalloc.start()
    try:
        call()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _table(rows: int = 100_000) -> ml.ArrayWeight:
    w = ml.Weight(np.random.default_rng(0).standard_normal((rows, 16)), optimizer=ml.optim.adam(0.01))
    anyio.run(ml.sum(ml.embedding(w, np.arange(0, rows, 1000))).train)  # (its moments exist)
    return w


def test_a_load_reads_what_it_loads_once_and_hands_it_to_the_weights(tmp_path: Path) -> None:
    # A user's 2M x 32 table with Adam's moments (a 732 MB file) peaked at +1465 MB in load
    # (every array read, then copied into the weights), and load(optimizer_state=False) read
    # and hashed the moments too: 4 times the table it loaded. Now +732 MB and +244 MB.
    path = tmp_path / "m.safetensors"
    w = _table()
    table = w.data.nbytes
    ml.save(path, {"U": w})
    fresh = _table()
    assert _peak(lambda: ml.load(path, {"U": fresh})) < 3 * table + table // 10  # (the table and its two moments)
    np.testing.assert_array_equal(fresh.data, w.data)
    np.testing.assert_array_equal(fresh.state[0].nu, w.state[0].nu)
    values_alone = _table()
    assert _peak(lambda: ml.load(path, {"U": values_alone}, optimizer_state=False)) < table + table // 10
    np.testing.assert_array_equal(values_alone.data, w.data)
    arrays = [fresh.data, fresh.state[0].mu, values_alone.data]
    forms = [(a.dtype, a.flags.owndata, a.flags.writeable, a.flags.c_contiguous, a.flags.aligned) for a in arrays]
    assert forms == [(np.dtype(np.float64), True, True, True, True)] * 3  # (a weight's form: a step may write into it)
    assert all(
        a.dtype is np.dtype(np.float64) for a in arrays
    )  # (NumPy's own dtype object: nodes check it by identity)
    del arrays
    step = functools.partial(anyio.run, ml.sum(ml.embedding(values_alone, np.array([3]))).train)
    assert _peak(step) < table // 10  # (its sparse step wrote the row into the array: no copy of the table)


def test_a_save_hashes_the_arrays_without_copying_them(tmp_path: Path) -> None:
    # Each array's digest took a copy of its bytes (tobytes): a save of a 244 MB table peaked at +244 MB.
    w = _table()
    assert _peak(lambda: ml.save(tmp_path / "m.safetensors", {"U": w})) < w.data.nbytes // 10


def test_arrays_a_load_does_not_use_are_not_read(tmp_path: Path) -> None:
    # So a damaged moment does not stop load(optimizer_state=False), which never reads it; the
    # load that would use it is refused, as is a damaged weight, and neither changes anything.
    path = tmp_path / "m.safetensors"
    w = ml.Weight(np.arange(4.0), optimizer=ml.optim.adam(0.1))
    anyio.run(ml.sum(w * w).train)
    ml.save(path, {"w": w, "extra": ml.Weight(np.ones(3))})
    header = int.from_bytes(path.read_bytes()[:8], "little")
    offsets = json.loads(path.read_bytes()[8 : 8 + header])
    for damaged, loads in [("optimizer_state/w[0].nu", False), ("extra", False), ("w", True)]:
        raw = bytearray(path.read_bytes())
        raw[8 + header + offsets[damaged]["data_offsets"][0]] ^= 0xFF
        (tmp_path / "damaged.safetensors").write_bytes(bytes(raw))
        model = {"w": ml.Weight(np.zeros(4), optimizer=ml.optim.adam(0.1))}
        values = functools.partial(ml.load, tmp_path / "damaged.safetensors", model, optimizer_state=False)
        if loads:
            with pytest.raises(
                ml.CheckpointError, match=re.escape(f"is damaged: the bytes of '{damaged}' are not those saved")
            ):
                values(strict=False)
            np.testing.assert_array_equal(model["w"].data, np.zeros(4))
            continue
        with pytest.warns(UserWarning, match="passed over"):
            values(strict=False)
        np.testing.assert_array_equal(model["w"].data, w.data)
        if damaged != "extra":
            fresh = {"w": ml.Weight(np.zeros(4), optimizer=ml.optim.adam(0.1)), "extra": ml.Weight(np.zeros(3))}
            with pytest.raises(ml.CheckpointError, match=re.escape(f"the bytes of '{damaged}' are not those saved")):
                ml.load(tmp_path / "damaged.safetensors", fresh)
            assert not fresh["w"].data.any() and fresh["w"].state[0].step == 0


def test_two_weights_that_load_one_saved_array_get_arrays_of_their_own(tmp_path: Path) -> None:
    # The array read from the file is handed to the first weight; the second gets a copy,
    # so a step of one (written in place) never moves the other.
    path = tmp_path / "m.safetensors"
    shared = ml.Weight(np.arange(6.0).reshape(3, 2), optimizer=ml.optim.adam(0.1))
    anyio.run(ml.sum(ml.embedding(shared, np.array([1]))).train)
    ml.save(path, {"a": shared, "b": shared})
    untied = {
        "a": ml.Weight(np.zeros((3, 2)), optimizer=ml.optim.adam(0.1)),
        "b": ml.Weight(np.zeros((3, 2)), optimizer=ml.optim.adam(0.1)),
    }
    ml.load(path, untied)
    a, b = untied["a"], untied["b"]
    assert not np.shares_memory(a.data, b.data) and not np.shares_memory(a.state[0].nu, b.state[0].nu)
    anyio.run(ml.sum(ml.embedding(a, np.array([2]))).train)
    np.testing.assert_array_equal(b.data, shared.data)
    np.testing.assert_array_equal(b.state[0].nu, shared.state[0].nu)


# ---- a reviewer's finds in the reader of the file (the load that reads only what it loads) ----------------
def _with_header(path: Path, header: bytes) -> None:
    path.write_bytes(len(header).to_bytes(8, "little") + header)


def test_a_header_not_in_utf8_is_refused_as_safetensors_refuses_it(tmp_path: Path) -> None:
    # (json.loads of bytes reads UTF-16 and UTF-32 too: the reader took a header safetensors refuses)
    path = tmp_path / "c.safetensors"
    _with_header(path, json.dumps({"__metadata__": {"a": "b"}}).encode("utf-16"))
    with pytest.raises(ml.CheckpointError, match=r"is not a safetensors file: its header is not JSON: 'utf-8' codec"):
        ml.load(path, {"w": ml.Weight(np.zeros(2))})


def test_an_array_of_a_dtype_numpy_lacks_is_named_not_called_damage(tmp_path: Path) -> None:
    path = tmp_path / "c.safetensors"
    ml.save(path, {"w": ml.Weight(np.zeros(2))})
    data = path.read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + length])
    end = max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")
    header["x"] = {"dtype": "BF16", "shape": [2], "data_offsets": [end, end + 4]}
    _with_header(path, json.dumps(header).encode())
    path.write_bytes(path.read_bytes() + data[8 + length :] + b"\0" * 4)
    with pytest.raises(ml.CheckpointError) as info:
        ml.load(path, {"w": ml.Weight(np.zeros(2))})
    assert str(info.value) == (
        f"{path} is a safetensors file, but its array 'x' has safetensors dtype BF16, which NumPy has no dtype for "
        "and monadl does not read (a checkpoint of monadl's holds float16, float32 and float64 weights): convert "
        "the file's arrays first (with PyTorch: tensor.float())"
    )


def test_load_save_and_apply_gradients_in_a_marked_cell_are_refused(tmp_path: Path) -> None:
    # (a trace runs once: a load or a step in a cell ran at its first call and never again, silently)
    w = ml.Weight(np.ones(2))
    path = tmp_path / "w.safetensors"
    ml.save(path, {"w": w})
    calls: dict[str, Any] = {
        "ml.load": lambda: ml.load(path, {"w": w}),
        "ml.save": lambda: ml.save(path, {"w": w}),
        "apply_gradients": lambda: ml.optim.apply_gradients({w: np.ones(2)}),
    }
    for name, call in calls.items():

        @ml.operation
        def cell(h: ml.ArrayLayer, call: Any = call) -> ml.ArrayLayer:
            call()
            return h * 2.0

        with pytest.raises(ml.OperandError) as info:
            cell(ml.as_layer(np.ones(2)))
        assert f": the cell called {name} while it was traced; a trace runs once per signature" in str(info.value)
    np.testing.assert_array_equal(w.data, [1.0, 1.0])
