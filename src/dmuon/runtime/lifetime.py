"""The lifetime of the process groups dmuon creates: freed before the interpreter finalizes, so a script ends
cleanly however it ends ([Note: groups at exit]). ``comm.CommContext.from_meshes`` registers each context here."""

from __future__ import annotations

import atexit
import weakref
from typing import Any

import torch.distributed as dist

__all__ = ["track", "release_groups"]


# [Note: groups at exit]
# A gloo group runs each collective on one of its worker threads, which drops the collective's tensors
# once it is done; on torch 2.13 that drop takes the GIL (the tensors' Python objects). If the interpreter
# starts to finalize before the thread got the GIL (the script ends within a few milliseconds of a
# blocking collective: right after a refused set_state_dict, whose agreed verdict is the last collective),
# CPython ends the thread inside a C++ destructor that may not throw: "terminate called without an active
# exception", SIGABRT, after the script's last line, whether or not it called destroy_process_group()
# (which shuts groups down but leaves them alive while dmuon holds them). So dmuon frees its own groups
# before Python finalizes, in an atexit hook: it drops its references and unregisters the gloo groups
# that torch still knows (destroy_process_group(group): local for gloo); freeing a gloo group releases
# the GIL and joins its worker threads, so they are all done before the interpreter goes. Groups of
# other backends are only dropped: NCCL's shutdown may wait for a collective that a dead peer never
# joins, and their teardown stays torch's, as before. tests/test_exit.py ends a script each way.
_CONTEXTS: list[weakref.ReferenceType[Any]] = []


def track(ctx: Any) -> None:
    """Remember ``ctx`` for :func:`release_groups` (registered with ``atexit`` once, with the first)."""
    if not _CONTEXTS:
        atexit.register(release_groups)
    _CONTEXTS[:] = [r for r in _CONTEXTS if r() is not None] + [weakref.ref(ctx)]


def release_groups() -> None:
    """Free every process group dmuon created ([Note: groups at exit]); runs at interpreter exit. A
    context released here has no groups left: a collective on it afterwards raises ``KeyError``."""
    for ref in _CONTEXTS:
        ctx = ref()
        if ctx is None:
            continue
        groups = list({id(g): g for g in ctx.groups.values() if g is not None}.values())
        ctx.groups.clear()
        del ctx
        while groups:
            _unregister_gloo(groups.pop())  # the last reference goes with the call: freed (and joined) there
    _CONTEXTS.clear()


def _unregister_gloo(group: dist.ProcessGroup) -> None:
    """``destroy_process_group(group)`` if it is a gloo group torch still knows (not after the job's
    ``destroy_process_group()``, which forgot it)."""
    try:
        if dist.get_backend(group) == "gloo":
            dist.destroy_process_group(group)
    except (ValueError, RuntimeError):  # no longer registered
        pass
