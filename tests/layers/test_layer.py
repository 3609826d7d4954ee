"""A `Layer` as a Python object: weakly referenced, as a `Weight` is."""

from __future__ import annotations

import gc
import weakref

import numpy as np

import monadl as ml


def test_a_layer_can_be_weakly_referenced_and_goes_with_its_last_reference() -> None:
    """A cache keyed by layers (``WeakKeyDictionary``), ``weakref.finalize``
    and ``WeakSet`` raised "cannot create weak reference to 'Layer' object"."""
    w = ml.Weight(np.ones(2))
    layer = w * 2.0
    cache: weakref.WeakKeyDictionary[ml.ArrayLayer, str] = weakref.WeakKeyDictionary()
    cache[layer] = "seen"
    gone: list[str] = []
    weakref.finalize(layer, gone.append, "layer")
    assert cache[layer] == "seen" and weakref.ref(layer)() is layer
    del layer
    gc.collect()
    assert gone == ["layer"] and len(cache) == 0
