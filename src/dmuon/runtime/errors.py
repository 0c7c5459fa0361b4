"""Internal errors: a broken invariant of dmuon itself (not a user mistake), reported with the rank.

``assert`` would vanish under ``python -O``; these do not. User mistakes get ``ValueError`` /
``TypeError`` naming the value and the fix, raised where the input is checked.
"""

from __future__ import annotations

from typing import NoReturn

import torch.distributed as dist

__all__ = ["DMuonInternalError", "raise_internal"]


class DMuonInternalError(AssertionError):
    """dmuon reached a state its own code should never produce; please report it with the message.

    An ``AssertionError`` (as FSDP2's internal checks raise), raised explicitly so ``-O`` keeps it."""


def raise_internal(msg: str) -> NoReturn:
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    raise DMuonInternalError(f"dmuon internal error on rank {rank}: {msg}")
