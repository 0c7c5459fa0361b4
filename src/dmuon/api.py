"""Explicit drains and introspection for a model prepared by :func:`dmuon.dedicate_params`.

``Muon.step()`` calls the drains for you; call them yourself only when you read gradients or weights
outside the usual ``backward(); step()`` rhythm.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .engines import state_of as get_state

__all__ = [
    "wait_all_reduces", "broadcast_all_updates", "wait_all_replicate_broadcasts", "get_dedicated_params",
    "get_owned_params", "get_owned_grads",
]


def wait_all_reduces(model: nn.Module) -> None:
    """Finish every pending gradient reduce: afterwards each owner's dedicated ``param.grad`` holds the
    gradient averaged over all ranks (non-owners hold none); with a ``reduce_dtype`` wider than the
    param's, the owner holds it in that dtype instead (see :func:`get_owned_grads`). A ``backward()``
    outside :func:`no_sync` already ends with this, so it is needed only to close an accumulation whose
    last backward ran none of dmuon's hooks; it stays as an explicit, idempotent drain.

    Example::

        loss.backward()
        dmuon.wait_all_reduces(model)      # a no-op here: backward() finished the reduces
        owned_grads = {n: p.grad for n, p in dmuon.get_owned_params(model).items()}
    """
    get_state(model).wait_all_reduces()


def broadcast_all_updates(model: nn.Module) -> None:
    """Make the owners' current weights the ones every rank will compute with. Collective.

    Under HSDP the owners publish to their column's holders (asynchronously; the next forward waits);
    then every non-holder copy is dropped, so the next forward of each boundary broadcasts up-to-date
    tensors. Call it after changing owned weights by hand (``Muon.step()`` already does).

    Example::

        with torch.no_grad():
            for p in dmuon.get_owned_params(model).values():
                p.mul_(0.5)
        dmuon.broadcast_all_updates(model)
    """
    state = get_state(model)
    state.publish_updates()
    state.reshard_all()


def wait_all_replicate_broadcasts(model: nn.Module) -> None:
    """Finish every pending post-step publish of updated weights over the replicate dimension (HSDP with
    ``replicate_async=True``), so every holder has the new weights. Collective. On a 1-D mesh nothing is
    ever pending and it returns at once. The state-dict functions call it themselves, and a read of a
    holder's copy (``p.detach()``, an EMA over ``model.parameters()``) waits for its own bucket's publish by
    itself, so this is only the drain that finishes them all at once.

    Example::

        dmuon.wait_all_replicate_broadcasts(model)
        model_sd = dmuon.get_model_state_dict(model)
    """
    get_state(model).wait_all_replicate_broadcasts()


def get_dedicated_params(model: nn.Module) -> dict[str, nn.Parameter]:
    """All dedicated params by FQN, in plan order. On non-owners these are 0-byte placeholders between
    steps: check :func:`get_owned_params` before reading values.

    Example::

        for fqn, p in dmuon.get_dedicated_params(model).items():
            print(fqn, tuple(p.shape), p._dedicated_owner_rank)
    """
    state = get_state(model)
    state.bind_if_needed(allow_meta=True)
    return {dp.fqn: dp.current() for dp in state.dedicated()}


def get_owned_params(model: nn.Module, rank: int | None = None) -> dict[str, nn.Parameter]:
    """Dedicated params owned by mesh rank ``rank`` (default: this process), by FQN. Their values can be
    read on the owner between steps; during a training pass (a forward until its backward ends) only inside
    their hook boundary, like on every other rank (``OutsideBoundaryError`` otherwise).

    Example::

        mine = dmuon.get_owned_params(model)            # what this rank runs Newton–Schulz for
        theirs = dmuon.get_owned_params(model, rank=1)  # placeholders here unless rank 1 is us
    """
    state = get_state(model)
    if rank is None:
        rank = state.rank()
    if not isinstance(rank, int) or not 0 <= rank < state.ctx.world_size:
        raise ValueError(f"dmuon.get_owned_params: rank must be in [0, {state.ctx.world_size}), got {rank!r}")
    state.bind_if_needed(allow_meta=True)
    return {dp.fqn: dp.current() for dp in state.dedicated() if dp.owner == rank}


def get_owned_grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    """This rank's averaged gradients of the dedicated params it owns, by FQN, after waiting for pending
    reduces: ``param.grad``, or the wider gradient a ``dedicate_params(reduce_dtype=...)`` keeps in its
    place (torch refuses a ``.grad`` whose dtype differs from the param's). ``None`` where there is none.
    The tensors are the live ones: scaling them in place scales what ``dmuon.Muon`` applies. Call it on
    every rank: it finishes pending reduces, which are collective.

    Example::

        loss.backward()
        grads = dmuon.get_owned_grads(model)      # fp32 for a bf16 model with reduce_dtype=torch.float32
        print({n: g.dtype for n, g in grads.items() if g is not None})
    """
    state = get_state(model)
    state.bind_if_needed(allow_meta=True)
    state.wait_all_reduces()
    return {dp.fqn: dp.reduced_grad() for dp in state.owned()}
