"""dmuon's runtime: what happens to a dedicated matrix between ``dedicate_params`` and ``step()``.

Imports nothing from the rest of dmuon (a test checks it); every module above builds on these:

* ``comm.py``: every collective and the counter of what they move, on dmuon's own process groups;
* ``config.py``: the frozen settings of one model;
* ``param.py``: the per-matrix record and its gradient state machine;
* ``group.py``: one hook boundary's buckets and their sharded / unsharded / reducing lifecycle;
* ``prefetch.py``: which boundary to fetch ahead;
* ``replicated.py``: averaging the gradients of plain parameters;
* ``hooks.py``: the per-model state and the module / autograd hooks that drive all of the above;
* ``precision.py``, ``errors.py``: dtype rules and internal errors.

See ``docs/architecture.md``.
"""
