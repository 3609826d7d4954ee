"""Which array of a checkpoint each weight loads: tied weights by any of their
paths (aliases), and a load that would load nothing at all."""

from __future__ import annotations

import json
import types
import warnings
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

import monadl as ml
from monadl._named import named_weights_and_aliases


def adam_weight(shape: tuple[int, ...], fill: float = 0.0) -> ml.ArrayWeight:
    return ml.Weight(np.full(shape, fill), optimizer=ml.optim.adam(1e-2))


def tied() -> tuple[dict[str, Any], ml.ArrayWeight]:
    """The tester's model: one embedding table, also the output projection."""
    rng = np.random.default_rng(0)
    embedding = ml.Weight(rng.normal(size=(5, 3)), optimizer=ml.optim.adam(1e-2))
    recurrent = ml.Weight(rng.normal(size=(3, 3)), optimizer=ml.optim.adam(1e-2))

    async def step() -> None:
        hidden = ml.tanh(ml.embedding(embedding, np.array([0, 2, 4])) @ recurrent)
        await ml.cross_entropy(hidden @ embedding.T, np.array([1, 2, 3])).train()

    anyio.run(step)
    return {"embed": embedding, "rnn": recurrent, "proj": embedding}, embedding


def manifest(path: Path) -> dict[str, Any]:
    with safe_open(str(path), framework="numpy") as file:
        return dict(json.loads(file.metadata()["monadl"]))


def test_every_other_path_of_a_shared_weight_or_block_is_an_alias() -> None:
    embedding = ml.Weight(np.ones(2))
    model = types.SimpleNamespace()
    model.me = model  # (a cycle: no path runs round it)
    model.a = {"e": embedding, "f": embedding, "sub": {"x": embedding}}
    model.b = model.a  # a block held twice: each of its paths again
    model.c = [model.a["sub"]]
    names, aliases = named_weights_and_aliases(model)
    assert list(names) == ["a.e"]
    assert sorted(aliases) == ["a.f", "a.sub.x", "b.e", "b.f", "b.sub.x", "c.0.x"]
    assert set(aliases.values()) == {"a.e"}
    assert ml.checkpoint.named_weights(model) == names


def test_a_tied_weight_is_stored_once_with_its_other_paths_as_aliases(tmp_path: Path) -> None:
    model, embedding = tied()
    path = tmp_path / "tied.safetensors"
    keyed: dict[object, Any] = {}
    keyed.update(model)
    keyed[lambda: None] = embedding  # (a key that reads as an address: no alias, as it would be no name)
    ml.save(path, keyed)
    assert sorted(load_file(str(path))) == [  # plain safetensors reads it; the table is stored once
        "embed",
        "optimizer_state/embed[0].mu",
        "optimizer_state/embed[0].nu",
        "optimizer_state/rnn[0].mu",
        "optimizer_state/rnn[0].nu",
        "rnn",
    ]
    assert manifest(path)["aliases"] == {"proj": "embed"}


def test_a_tied_weight_loads_under_whichever_of_its_paths_comes_first(tmp_path: Path) -> None:
    # The tester's case: {"proj": E, "rnn": W, "embed": E} named E 'proj', which the file did not have.
    model, embedding = tied()
    path = tmp_path / "tied.safetensors"
    ml.save(path, model)
    again, recurrent = adam_weight((5, 3)), adam_weight((3, 3))
    ml.load(path, {"proj": again, "rnn": recurrent, "embed": again})
    np.testing.assert_array_equal(again.data, embedding.data)
    assert again.state[0].step == 1
    np.testing.assert_array_equal(again.state[0].mu, embedding.state[0].mu)
    np.testing.assert_array_equal(recurrent.data, model["rnn"].data)


def test_a_tied_checkpoint_loads_into_both_weights_of_an_untied_model(tmp_path: Path) -> None:
    # Fine-tuning with the projection untied: 'proj' stayed at its initial values, with a warning only.
    model, embedding = tied()
    path = tmp_path / "tied.safetensors"
    ml.save(path, model)
    embed, proj = adam_weight((5, 3)), adam_weight((5, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ml.load(path, {"embed": embed, "rnn": adam_weight((3, 3)), "proj": proj})  # strict: as PyTorch loads
    for weight in (embed, proj):
        np.testing.assert_array_equal(weight.data, embedding.data)
        np.testing.assert_array_equal(weight.state[0].nu, embedding.state[0].nu)
        assert weight.state[0].step == 1
    assert embed.data is not proj.data  # (two weights of their own, that train apart)


def test_a_block_held_twice_loads_into_two_blocks(tmp_path: Path) -> None:
    block = {"w": ml.Weight(np.arange(3.0)), "b": ml.Weight(np.ones(2))}
    path = tmp_path / "siamese.safetensors"
    ml.save(path, {"left": block, "right": block})
    apart = {side: {"w": ml.Weight(np.zeros(3)), "b": ml.Weight(np.zeros(2))} for side in ("left", "right")}
    ml.load(path, apart)
    assert [apart[side]["w"].data.tolist() for side in ("left", "right")] == [[0.0, 1.0, 2.0]] * 2
    assert [apart[side]["b"].data.tolist() for side in ("left", "right")] == [[1.0, 1.0]] * 2


def test_a_checkpoint_of_untied_weights_into_a_tied_model_is_refused_or_says_which_it_loaded(tmp_path: Path) -> None:
    path = tmp_path / "untied.safetensors"
    ml.save(path, {"embed": ml.Weight(np.ones(2)), "proj": ml.Weight(np.full(2, 2.0))})
    one = ml.Weight(np.zeros(2))
    with pytest.raises(ml.CheckpointError) as raised:
        ml.load(path, {"embed": one, "proj": one})
    assert str(raised.value) == (
        f"{path} does not fit the model:\n"
        "  - weight 'embed' is one Weight in the model, reached as 'embed', 'proj', and the checkpoint holds 2 "
        "arrays apart for it, 'embed', 'proj': build the model with them apart, as saved, or load(path, model, "
        "strict=False) loads 'embed' into it"
    )
    assert one.data.tolist() == [0.0, 0.0]
    with pytest.warns(UserWarning) as warned:
        ml.load(path, {"proj": one, "embed": one}, strict=False)
    assert one.data.tolist() == [2.0, 2.0]  # (its first path's, 'proj')
    assert [str(w.message) for w in warned] == [
        f"{path}: weight 'proj' is one Weight in the model, reached as 'proj', 'embed', and the checkpoint holds 2 "
        "arrays apart for it, 'proj', 'embed': loaded 'proj', passed over 'embed' (strict=False: passed over)"
    ]


def test_a_strict_load_still_refuses_a_weight_that_is_in_no_path_of_the_checkpoint(tmp_path: Path) -> None:
    model, _ = tied()
    path = tmp_path / "tied.safetensors"
    ml.save(path, model)
    with pytest.raises(ml.CheckpointError) as raised:
        ml.load(path, {"embed": adam_weight((5, 3)), "rnn": adam_weight((3, 3)), "head": adam_weight((5, 3))})
    assert str(raised.value) == (
        f"{path} does not fit the model:\n"
        "  - weights of the model missing from the checkpoint: 'head'\n"
        "  - load(path, model, strict=False) loads the weights both have and passes the others over"
    )


def test_a_checkpoint_written_before_aliases_loads_as_before(tmp_path: Path) -> None:
    model, embedding = tied()
    path = tmp_path / "old.safetensors"
    ml.save(path, model)
    with safe_open(str(path), framework="numpy") as file:
        header = dict(file.metadata())
    old = json.loads(header["monadl"])
    del old["aliases"]
    header["monadl"] = json.dumps(old)
    del header["monadl.digest"]
    save_file(load_file(str(path)), str(path), metadata=header)
    again = adam_weight((5, 3))
    ml.load(path, {"embed": again, "rnn": adam_weight((3, 3)), "proj": again})
    np.testing.assert_array_equal(again.data, embedding.data)
    embed, proj = adam_weight((5, 3)), adam_weight((5, 3))
    with pytest.warns(UserWarning, match=r"missing from the checkpoint: 'proj' \(strict=False: passed over\)"):
        ml.load(path, {"embed": embed, "rnn": adam_weight((3, 3)), "proj": proj}, strict=False)
    np.testing.assert_array_equal(embed.data, embedding.data)
    assert not proj.data.any()  # (the file does not say where else the table was: nothing to load it from)


def test_a_load_that_would_load_nothing_is_refused_even_with_strict_false(tmp_path: Path) -> None:
    # The tester's case: a trunk saved bare, loaded into {"trunk": ..., "head": ...}, only warned, and loaded nothing.
    path = tmp_path / "bare.safetensors"
    ml.save(path, {"W1": ml.Weight(np.ones((2, 3))), "b1": ml.Weight(np.ones(3))})
    big: dict[str, Any] = {
        "trunk": {"W1": ml.Weight(np.zeros((2, 3))), "b1": ml.Weight(np.zeros(3))},
        "head": ml.Weight(np.zeros(3)),
    }
    with pytest.raises(ml.CheckpointError) as raised:
        ml.load(path, big, strict=False)
    assert str(raised.value) == (
        f"{path} does not fit the model: no weight of the model is in the checkpoint, so nothing would load, even "
        "with strict=False (the checkpoint holds 'W1', 'b1'; the model 'trunk.W1', 'trunk.b1', 'head'); the model "
        "holds the checkpoint's weights under 'trunk' ('trunk.W1' for 'W1'): load into that part of the model, "
        "ml.load(path, model['trunk']); nothing was loaded"
    )
    assert not big["trunk"]["W1"].data.any()
    ml.load(path, big["trunk"])  # (what it says)
    assert big["trunk"]["W1"].data.tolist() == [[1.0] * 3] * 2


def test_a_load_of_nothing_names_the_part_as_the_models_containers_reach_it(tmp_path: Path) -> None:
    path = tmp_path / "bare.safetensors"
    ml.save(path, {"w": ml.Weight(np.ones(2))})

    class Model:
        def __init__(self) -> None:
            self.blocks = [{"w": ml.Weight(np.zeros(2))}]

    with pytest.raises(ml.CheckpointError, match=r"under 'blocks\.0' .*ml\.load\(path, model\.blocks\[0\]\)"):
        ml.load(path, Model())  # strict: the same refusal, with the same advice


def test_a_load_of_nothing_from_a_larger_model_says_so(tmp_path: Path) -> None:
    path = tmp_path / "whole.safetensors"
    ml.save(path, {"trunk": {"w": ml.Weight(np.ones(2))}, "head": ml.Weight(np.ones(2))})
    with pytest.raises(ml.CheckpointError) as raised:
        ml.load(path, {"w": ml.Weight(np.zeros(2))}, strict=False)
    assert str(raised.value).endswith(
        "the checkpoint holds the model's weights under 'trunk' ('trunk.w' for the model's 'w'): it was saved from a "
        "larger model; load it into that model, built whole, and take its 'trunk'; nothing was loaded"
    )


def test_a_load_into_an_object_without_weights_says_so(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    ml.save(path, {"w": ml.Weight(np.ones(2))})
    with pytest.raises(ml.CheckpointError, match=r"^load\(path, model\): the model, a dict, holds no Weight, so no"):
        ml.load(path, {"w": np.zeros(2)}, strict=False)
