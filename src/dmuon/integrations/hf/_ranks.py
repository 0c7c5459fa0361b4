"""Rank 0 acts, every rank learns the outcome: the process-group helpers of the Trainer glue."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist


def _is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _barrier() -> None:
    if _is_distributed():
        dist.barrier()


def _from_rank0(fn: Callable[[], Any]) -> Any:
    """``fn()`` on global rank 0, its result (or its exception, re-raised everywhere) on every rank.

    Every rank must agree before a collective load starts, or the ranks that did not fail would wait
    forever for the one that did."""
    if not _is_distributed():
        return fn()
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = ("ok", fn())
        except Exception as e:  # noqa: BLE001 - re-raised on every rank below
            box[0] = ("error", f"{type(e).__name__}: {e}")
    dist.broadcast_object_list(box, src=0)
    status, value = box[0]
    if status == "error":
        raise RuntimeError(f"dmuon: rank 0 failed: {value}")
    return value


def _rank0_only(value_fn: Callable[[], Any], empty: Any) -> Any:
    """``value_fn()`` on global rank 0 and ``empty`` elsewhere, after rank 0 confirmed it succeeded."""
    result: list[Any] = [empty]

    def run() -> bool:
        result[0] = value_fn()
        return True

    _from_rank0(run)
    return result[0]
