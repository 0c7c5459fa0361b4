"""Communication counter: what dmuon's own collectives move, so tests and benchmarks can check the cost model.

Every collective dmuon issues goes through :mod:`dmuon.runtime.comm`, which records its payload in the
model's :class:`CommCounter`; this page reads it.
Counts are *payload elements per collective* (the number of tensor elements in the broadcast or reduce
buffer) and their bytes (which tell dtypes apart: a bf16 model's reduce with
``reduce_dtype=torch.float32`` moves 4 bytes per element, its broadcasts 2), identical on every rank of
the collective. For dedicated parameters of total size P, one training step therefore shows
``forward_broadcast == P``, ``backward_broadcast == P`` under Z3 (0 under Z2) and ``reduce == P``.

Example::

    dmuon.diagnostics.reset_comm_counts(model)
    loss = model(batch).loss; loss.backward(); optimizer.step()
    print(dmuon.diagnostics.comm_counts(model))
    # {'forward_broadcast': {'elements': 4096, 'bytes': 16384, 'calls': 4, 'by_dim': {'shard': {...}}}, ...}
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from .optim.muon import Muon
from .optim.newton_schulz import explain
from .runtime.comm import CommCounter, CommKind
from .runtime.hooks import get_state

__all__ = ["CommKind", "CommCounter", "comm_counts", "reset_comm_counts", "ns_backends"]


def _counter(model: nn.Module) -> CommCounter:
    return get_state(model).ctx.counter


def comm_counts(model: nn.Module) -> dict[str, Any]:
    """Totals since the last :func:`reset_comm_counts` for a model prepared by ``dedicate_params``.

    Example::

        counts = dmuon.diagnostics.comm_counts(model)
        assert counts["reduce"]["elements"] == sum(p.numel() for p in dmuon.get_dedicated_params(model).values())
    """
    return _counter(model).as_dict()


def reset_comm_counts(model: nn.Module) -> None:
    """Zero the counters (e.g. at the start of the step you want to measure).

    Example::

        dmuon.diagnostics.reset_comm_counts(model)
        train_one_step()
        print(dmuon.diagnostics.comm_counts(model)["forward_broadcast"])
    """
    _counter(model).reset()


def ns_backends(optimizer: Muon) -> list[dict[str, Any]]:
    """Per shape group of the matrices this rank owns: the batched Newton–Schulz call ``step()`` makes
    (``"shape"``: batch x rows x cols), its form and dtype, which kernel forms the symmetric products and
    why (a missing package, a GPU older than Hopper, a matrix too small to gain). Local, no collective.

    Example::

        for row in dmuon.diagnostics.ns_backends(optimizer):
            print(row["shape"], row["form"], row["symmetric_products"], row["why"])
        # (4, 2048, 8192) gram quack quack's symmetric GEMM (Hopper+)
    """
    if not isinstance(optimizer, Muon):
        raise TypeError(f"dmuon.diagnostics.ns_backends needs a dmuon.Muon, got {type(optimizer).__name__}")
    out = []
    for group in optimizer.param_groups:
        if group["kind"] != "muon":
            continue
        counts: dict[tuple[int, ...], int] = {}
        device = None
        for p in group["params"]:
            counts[tuple(p.shape)] = counts.get(tuple(p.shape), 0) + 1
            device = p.device
        for shape, n in sorted(counts.items()):
            out.append({"shape": (n, *shape), **explain((n, *shape), group["ns_backend"],
                                                         device=device or torch.device("cpu"))})
    return out
