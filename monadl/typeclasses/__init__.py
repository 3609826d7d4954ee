"""Type classes: one per module, each with its laws beside it."""

from monadl.typeclasses.deep_learning import DeepLearning, forward
from monadl.typeclasses.monoid import DENSE, SPARSE_ROWS, Monoid, SparseRows, associativity_law, identity_law

__all__ = ["DeepLearning", "forward", "DENSE", "SPARSE_ROWS", "Monoid", "SparseRows", "associativity_law", "identity_law"]
