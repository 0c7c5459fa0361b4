"""``DistributedDataParallel`` as dmuon's engine ([Note: engines] in ``base.py``).

DDP takes the dedicated params out of its broadcasts and all-reduces through torch's own ignore list
(``_ddp_params_and_buffers_to_ignore``, read when the wrapper is built) and averages every other gradient itself,
so dmuon averages no plain param. ``dmuon.no_sync`` enters DDP's own ``no_sync`` when given the wrapper.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import ClassVar

import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from .base import Engine

__all__ = ["DDP"]

#: The attribute DDP reads at construction: names of the params and buffers it leaves alone.
IGNORE_ATTR = "_ddp_params_and_buffers_to_ignore"


class DDP(Engine):
    """DDP averages every non-dedicated gradient; dmuon averages the dedicated ones to their owners."""

    kind: ClassVar[str] = "ddp"
    averages_plain: ClassVar[bool] = True

    @classmethod
    def claims(cls, model: nn.Module) -> bool:
        return isinstance(model, DistributedDataParallel)

    @classmethod
    def unwrap(cls, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, DistributedDataParallel) else model

    @classmethod
    def refuse_taken(cls, model: nn.Module) -> None:
        if isinstance(model, DistributedDataParallel):
            raise ValueError(
                "dmuon.dedicate_params: got a DistributedDataParallel wrapper; call dedicate_params on the model "
                "first, then wrap it: dmuon.dedicate_params(model, mesh, ...); ddp = DistributedDataParallel(model); "
                "optimizer = dmuon.Muon(ddp, ...). DDP then leaves the dedicated params to dmuon."
            )

    @classmethod
    def leave_dedicated(cls, model: nn.Module, fqns: list[str]) -> None:
        # A DistributedDataParallel built on this model later reads this list and leaves these params out of
        # its broadcasts and all-reduces (torch's own ignore mechanism); without DDP nothing reads it.
        setattr(model, IGNORE_ATTR, list(fqns))

    @contextmanager
    def no_sync(self, *, resume: bool) -> Iterator[None]:
        with self.wrapper.no_sync():  # type: ignore[operator]
            yield
