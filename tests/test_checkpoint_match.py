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
    names, aliases, _ = named_weights_and_aliases(model)
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


def test_a_key_with_a_dot_is_one_key_and_makes_no_alias(tmp_path: Path) -> None:
    """The reviewer's model: 'a.b' is a key of its own, not 'b' under the block
    at 'a', so the block's other path 'z' gives 'z.q' and no 'z.b.w' (which
    loaded W2 into another model's own 'z.b.w' under strict=True)."""
    block = {"q": ml.Weight(np.full(2, 1.0))}
    model = {"a": block, "z": block, "a.b": {"w": ml.Weight(np.full(2, 2.0))}}
    names, aliases, left_out = named_weights_and_aliases(model)
    assert (list(names), aliases, left_out) == (["a.q", "a.b.w"], {"z.q": "a.q"}, 0)
    ml.save(tmp_path / "m.safetensors", model)
    assert manifest(tmp_path / "m.safetensors")["aliases"] == {"z.q": "a.q"}
    own = ml.Weight(np.full(2, -7.0))
    untied = {
        "a": {"q": ml.Weight(np.zeros(2))},
        "z": {"q": ml.Weight(np.zeros(2)), "b": {"w": own}},
        "a.b": {"w": ml.Weight(np.zeros(2))},
    }
    with pytest.raises(ml.CheckpointError, match=r"missing from the checkpoint: 'z\.b\.w'\n"):
        ml.load(tmp_path / "m.safetensors", untied)
    assert own.data.tolist() == [-7.0, -7.0]


def test_a_model_that_reaches_nothing_twice_spends_nothing_on_aliases(monkeypatch: pytest.MonkeyPatch) -> None:
    """A chain 2,000 dicts deep: every dotted prefix of every name was built
    (2 s a save at 1,000 deep); with one weight tied across it, the parts
    spelt are those of the one alias made."""
    import monadl._named as named

    spelt: list[int] = []
    spell = named._spell

    def counted(path: Any) -> tuple[list[str], tuple[int, ...]]:
        spelt.append(len(spell(path)[0]))
        return spell(path)

    monkeypatch.setattr(named, "_spell", counted)
    root: dict[str, Any] = {}
    node = root
    for _ in range(2000):
        node["w"] = ml.Weight(np.zeros(1))
        node["next"] = node = {}
    assert named_weights_and_aliases(root)[1:] == ({}, 0)
    assert spelt == []
    node["tied"] = root["w"]
    _, aliases, _ = named_weights_and_aliases(root)
    assert aliases == {"next." * 2000 + "tied": "w"}
    assert spelt == [2001]


def test_back_pointers_keep_the_shortest_aliases_within_a_bounded_header(tmp_path: Path) -> None:
    """1,000 blocks each holding the one before: half a million paths, up to
    1,000 '.prev' long, made a 25 MB header and 12 s a save; the shortest are
    kept, the header stays near a megabyte, and the save says what it left out."""

    class Block:
        def __init__(self, prev: Block | None) -> None:
            self.w = ml.Weight(np.zeros(2))
            self.prev = prev

    blocks: list[Block] = []
    for _ in range(1000):
        blocks.append(Block(blocks[-1] if blocks else None))
    _, aliases, left_out = named_weights_and_aliases({"blocks": blocks})
    assert len(aliases) + left_out == 1000 * 999 // 2
    assert "blocks.999.prev.w" in aliases and "blocks.5.prev.prev.prev.prev.prev.w" in aliases
    assert len(aliases) < 20_000 and max(map(len, aliases)) < 100
    with pytest.warns(UserWarning, match=rf"{left_out} other paths of shared weights were not recorded"):
        ml.save(tmp_path / "p.safetensors", {"blocks": blocks})
    assert (tmp_path / "p.safetensors").stat().st_size < 1_600_000
    assert manifest(tmp_path / "p.safetensors")["aliases_left_out"] == left_out


def test_aliases_left_out_are_said_at_save_and_at_a_load_that_misses_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An ALBERT-like block shared by 3 layers, past a limit of 5 aliases:
    the 3 paths past it are named at save, and a model that unties the
    layers is told why its last weights are missing."""
    import monadl._named as named

    monkeypatch.setattr(named, "_MOST_ALIASES", 5)
    shared = {f"p{i}": ml.Weight(np.full(2, float(i))) for i in range(4)}
    with pytest.warns(UserWarning, match=r"3 other paths of shared weights were not recorded \(past 5 aliases"):
        ml.save(tmp_path / "a.safetensors", {"layers": [{"shared": shared} for _ in range(3)]})
    untied = {"layers": [{"shared": {f"p{i}": ml.Weight(np.zeros(2)) for i in range(4)}} for _ in range(3)]}
    with pytest.raises(ml.CheckpointError) as refused:
        ml.load(tmp_path / "a.safetensors", untied)
    assert (
        "missing from the checkpoint: 'layers.2.shared.p1', 'layers.2.shared.p2', 'layers.2.shared.p3' (the "
        "checkpoint left 3 other paths of its shared weights unrecorded" in str(refused.value)
    )


def test_a_tied_weight_held_apart_loads_its_first_path_in_walk_order(tmp_path: Path) -> None:
    """'c' is met before the block's second path 'b.w' (the alias made first)."""
    ml.save(tmp_path / "f.safetensors", {"c": ml.Weight(np.full(2, 3.0)), "b": {"w": ml.Weight(np.full(2, 2.0))}})
    tied_weight = ml.Weight(np.zeros(2))
    block = {"w": tied_weight}
    with pytest.warns(UserWarning, match="loaded 'c', passed over 'b.w'"):
        ml.load(tmp_path / "f.safetensors", {"a": block, "c": tied_weight, "b": block}, strict=False)
    assert tied_weight.data.tolist() == [3.0, 3.0]
