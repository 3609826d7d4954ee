"""Schedulers decide when and how together nodes run, never what a node computes:
each calls `monadl.runtime.node.compute` forward and `monadl.runtime.backward.backprop`
backward."""
