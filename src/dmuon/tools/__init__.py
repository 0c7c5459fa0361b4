"""The workshop: the demo, the benchmark, the planner and the model shapes they share.

Nothing in the library imports this package (a test checks it); the tools use the library like any
user script would. ``python -m dmuon.demo``, ``python -m dmuon.bench`` and ``python -m dmuon.plan``
forward here.
"""
