"""How a graph runs.

A reader's map (each module one concern; lower ones never import higher ones):

* `settings`: the knobs (``ml.settings``), scoped by a context variable.
* `evaluation`: one evaluation's records, shared values, open resources;
  `nested`: the steps refused inside a running one.
* `frames`: the interpreter's continuation frames and fibers.
* `node`: collecting a layer graph; one node's forward, its checks and error text.
* `backward`: ONE function that back-propagates one node; every scheduler calls it.
* `schedule`: when and how together nodes run: `inline` (the forward loop, the
  reverse sweep, the counted release), `pool` (worker threads for coarse
  graphs), `cuda` (a CUDA stream per branch), `fibers` (fibers parked at
  their graphs, run merged and batched: batching across control flow).
* `graphs`: one layer graph, computed by the scheduler that fits it.
* `interpret`: the iterative ``Do`` interpreter (fibers for parallel branches);
  `stepping`: how it steps a direct-style coroutine; `requests`: what it asks
  of its driver.
* `drive`: running the interpreter on the event loop (awaits, turns, tasks);
  `turns`: when and how the event loop gets a turn, and the look before a commit.
* `entry`: ``train`` / ``predict`` / ``gradients`` / ``run`` / ``acquire``.
* `process`: everything that touches the whole process (malloc, GC, BLAS).
"""
