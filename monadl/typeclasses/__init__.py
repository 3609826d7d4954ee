"""Type classes: one per module, each with its laws beside it."""

from monadl.typeclasses.deep_learning import DeepLearning, as_layer, forward
from monadl.typeclasses.monoid import DENSE, SPARSE_ROWS, Monoid, SparseRows, associativity_law, identity_law

__all__ = [
    "DENSE",
    "SPARSE_ROWS",
    "DeepLearning",
    "Monoid",
    "SparseRows",
    "as_layer",
    "associativity_law",
    "forward",
    "identity_law",
]
