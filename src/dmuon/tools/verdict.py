"""What ``OK`` means on an example's last line: the loss fell by a margin, not just "last below first".

Every step of an example sees a new batch, so one step's loss is noisy: the torchtitan example once went
from 7.22 to 7.65 at its last step, and "last < first" passed runs that had barely learned. The examples
compare the *first* logged loss with the *mean of the last three*, and ask for a relative drop each
example states (about half of what it reaches on CPU). :func:`within` adds a parity check against a
single-process run, for the examples small enough to repeat on one process.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["loss_fell", "within"]


def loss_fell(losses: Sequence[float], *, by: float, last: int = 3) -> tuple[bool, str]:
    """``(ok, text)``: is the mean of the last ``last`` losses (the first one never among them) at least the
    fraction ``by`` below the first? ``text`` reads ``loss 4.2425 -> 2.6957 (mean of the last 3), -36%
    (needs -10%)``."""
    if len(losses) < 2:
        return False, f"{len(losses)} logged loss(es): nothing to compare"
    tail = list(losses[max(1, len(losses) - last):])
    end = sum(tail) / len(tail)
    change = end / losses[0] - 1
    ok = change <= -by
    return ok, (f"loss {losses[0]:.4f} -> {end:.4f} (mean of the last {len(tail)}), {change:+.0%} "
                f"(needs -{by:.0%})")


def within(got: Sequence[float], want: Sequence[float], *, rtol: float) -> tuple[bool, str]:
    """``(ok, text)``: every ``got[i]`` within ``rtol`` (relative) of ``want[i]``; ``text`` gives the worst."""
    if len(got) != len(want):
        return False, f"{len(got)} losses against {len(want)}"
    worst = max(abs(g - w) / abs(w) for g, w in zip(got, want))
    return worst <= rtol, f"worst step {worst:.1e} (bound {rtol:.0e})"
