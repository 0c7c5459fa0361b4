"""Prefetch: guess which boundary runs next from the order a previous pass ran in, so its broadcast can
start before the current boundary's own is waited for.

[Note: prefetch]
A *forward pass* is one call of the root module (the model given to ``dedicate_params``) outside
backward. Each pass records the order its boundaries ran in, separately for grad-enabled and no-grad
passes. The next pass of the same kind follows that order with a cursor (``_OrderCursor``): in the
pre-forward of boundary i it starts the broadcast of the boundary the recorded order puts after i,
without waiting. Backward does the same along the reverse of this step's grad-enabled forwards.

* Same order on every rank: the guess depends only on the boundaries' hook history and states, which
  every rank of an SPMD model shares (dmuon already needs each rank to run the same boundaries, since
  every unshard is a collective). So every rank issues the same prefetches in the same order.
* A guess is a hint. A boundary off the recorded path resynchronises the cursor at its position in the
  recorded order (or gets no guess if the order never saw it); a prefetched boundary that does not run
  is released (wait, free) at the end of the pass or of the backward: a wrong guess costs one broadcast
  and memory, never correctness. The first pass of each kind has no recorded order and prefetches
  nothing; a boundary run outside a root call is never prefetched.
* Memory: at most one prefetched boundary is outstanding; the next prefetch is issued only once that
  one's own hook took it over. Under Z3 at most two boundaries hold non-owner copies during forward
  (the running one and the prefetched one; more only with nested boundaries). Only resting groups are
  prefetched (forward: SHARDED, or REDUCING after an accumulation backward; backward: SHARDED with a
  backward pending), so Z2 copies and already-reduced groups are never touched.
* ``prefetch=False`` (``dedicate_params``) turns it off; orders are still recorded.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from .group import BoundaryGroup, GroupState

__all__ = ["Prefetcher"]


class _OrderCursor:
    """Follows a running pass along the boundary order a previous pass recorded, to guess what runs next."""

    def __init__(self, guide: Sequence[BoundaryGroup]):
        self.guide = tuple(guide)
        #: Index in ``guide`` of the boundary expected to run next.
        self.pos = 0

    def advance(self, g: BoundaryGroup) -> BoundaryGroup | None:
        """``g`` runs now: move past it; return what the guide puts after it (``None``: no guess).

        Off the recorded path, resynchronise on ``g``'s next occurrence (searching ahead first, then
        from the start); a boundary the guide never saw leaves the cursor where it was."""
        guide, n = self.guide, len(self.guide)
        if self.pos < n and guide[self.pos] is g:
            self.pos += 1
        else:
            found = next((i for i in (*range(self.pos, n), *range(self.pos)) if guide[i] is g), None)
            if found is None:
                return None
            self.pos = found + 1
        return guide[self.pos] if self.pos < n else None


@dataclasses.dataclass(eq=False)
class _ForwardPass:
    """One call of the root module outside backward."""

    grad_enabled: bool
    cursor: _OrderCursor
    #: Boundaries in the order their pre-forward ran (becomes the next pass's guide).
    ran: list[BoundaryGroup] = dataclasses.field(default_factory=list)
    #: The boundary whose broadcast was prefetched and whose own pre-forward has not run yet.
    prefetched: BoundaryGroup | None = None


class Prefetcher:
    """The recorded orders and the outstanding guesses of one model. It decides and records; the hooks
    issue the broadcasts (``BoundaryGroup.unshard``) and release wrong guesses."""

    def __init__(self, enabled: bool):
        #: ``dedicate_params(prefetch=...)``: guess at all (orders are recorded either way).
        self.enabled = enabled
        # Forward #
        #: Boundary order of the last finished forward pass, per grad mode (``torch.is_grad_enabled()``).
        self._forward_orders: dict[bool, tuple[BoundaryGroup, ...]] = {}
        #: The root call in progress (``None`` outside one), and how deeply the root is nested in itself.
        self._pass: _ForwardPass | None = None
        self._root_depth = 0
        # Backward #
        #: Boundaries whose pre-backward hook was registered since the last backward, in forward order.
        self._backward_order: list[BoundaryGroup] = []
        #: Built at the first pre-backward from the reverse of ``_backward_order``.
        self._backward_cursor: _OrderCursor | None = None
        #: The boundary prefetched for backward whose own pre-backward has not run yet.
        self._backward_prefetched: BoundaryGroup | None = None

    # ------------------------------------------------------------------ #
    # Forward passes                                                       #
    # ------------------------------------------------------------------ #
    def open_pass(self, grad_enabled: bool) -> None:
        """The root module's pre-forward (outside backward)."""
        self._root_depth += 1
        if self._root_depth == 1:
            self._pass = _ForwardPass(grad_enabled, _OrderCursor(self._forward_orders.get(grad_enabled, ())))

    def close_pass(self) -> BoundaryGroup | None:
        """The root module's post-forward: record the order; return a prefetched boundary that never ran
        (the caller releases it)."""
        self._root_depth = max(0, self._root_depth - 1)
        if self._root_depth > 0 or self._pass is None:
            return None
        p, self._pass = self._pass, None
        self._forward_orders[p.grad_enabled] = tuple(p.ran)
        return p.prefetched

    def forward_guess(self, g: BoundaryGroup) -> BoundaryGroup | None:
        """Record that ``g`` runs; the boundary to prefetch now, if any. Issues nothing."""
        p = self._pass
        if p is None:  # a boundary called outside a root call
            return None
        p.ran.append(g)
        if p.prefetched is g:
            p.prefetched = None
        nxt = p.cursor.advance(g)
        if not self.enabled or p.prefetched is not None or nxt is None or nxt is g:
            return None
        # forward: a resting group, or one whose last reduce is still in flight (accumulation)
        if nxt.needs_bind() or nxt.state not in (GroupState.SHARDED, GroupState.REDUCING):
            return None
        return nxt

    def forward_prefetched(self, g: BoundaryGroup) -> None:
        """The caller issued ``g``'s broadcast on :meth:`forward_guess`'s advice."""
        if self._pass is not None:
            self._pass.prefetched = g

    # ------------------------------------------------------------------ #
    # Backward                                                             #
    # ------------------------------------------------------------------ #
    def record_backward(self, g: BoundaryGroup) -> None:
        """A grad-enabled forward of ``g`` registered its pre-backward hook."""
        self._backward_order.append(g)

    def backward_guess(self, g: BoundaryGroup) -> BoundaryGroup | None:
        """The boundary expected to run backward after ``g``, if it needs a broadcast now. Issues nothing."""
        if self._backward_cursor is None:
            self._backward_cursor = _OrderCursor(self._backward_order[::-1])
        if self._backward_prefetched is g:
            self._backward_prefetched = None
        nxt = self._backward_cursor.advance(g)
        if not self.enabled or self._backward_prefetched is not None or nxt is None or nxt is g:
            return None
        # backward: only copies freed after forward (Z3) whose backward is still to come
        if nxt.state is not GroupState.SHARDED or not nxt.backward_pending or nxt.needs_bind():
            return None
        return nxt

    def backward_prefetched(self, g: BoundaryGroup) -> None:
        self._backward_prefetched = g

    def reset_backward(self) -> None:
        """End of a backward, or forwards whose backward never came (their graphs were dropped)."""
        self._backward_order.clear()
        self._backward_cursor = None
        self._backward_prefetched = None
