"""One rank of a script that ends in a given way (run as a child process by ``tests/test_exit.py``).

``python -m tests._exit_job ENDING RANK WORLD STORE``: FSDP2 + dmuon on gloo for two steps, then

- ``destroy``: a refused ``set_state_dict`` (caught), then ``destroy_process_group()`` with the model and
  the optimizer alive;
- ``exit``: the refusal, then ``sys.exit(0)`` without destroying anything;
- ``raise``: the refusal, then an uncaught exception (exit code 1);
- ``end``: the refusal, then the script's last line;
- ``success``: a checkpoint saved and loaded back (accepted), then ``destroy_process_group()``.

Three things make the abort that [Note: groups at exit] (``dmuon/runtime/comm.py``) explains likely rather
than occasional (without them: 2 of 44 runs ending in ``sys.exit``, 2 of 34 in ``destroy_process_group()``).
Each rank runs on one core, and the threads that ``dedicate_params`` starts (dmuon's gloo groups' workers) get
the lowest priority, so that after a collective the main thread runs on while the worker that still has to
drop the collective's tensors (which takes the GIL) waits, as on a busy machine. The switch interval is raised
before the ending, so that the main thread keeps the GIL until it blocks: the worker waits into the
interpreter's finalization. And an object freed during finalization sleeps, releasing the GIL there, as any
finalizer that flushes a file or joins a thread does (the natural aborts came from such a release: the main
thread was in finalization's garbage collection). Linux only (``/proc``, affinity and priorities), as the
suite is.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dmuon
from dmuon.tools.models import TinyLlama, TinyLlamaConfig, projection_predicate

ENDINGS = ("destroy", "exit", "raise", "end", "success")


class _SleepsWhenFreed:
    """Freed while the interpreter finalizes (a module global): releases the GIL for a moment."""

    def __del__(self, _sleep=time.sleep) -> None:
        _sleep(0.2)


CFG = TinyLlamaConfig(vocab_size=32, dim=16, n_layers=2, n_heads=2, n_kv_heads=1, hidden_dim=32, max_seq_len=8)


def main(ending: str, rank: int, world: int, store: str) -> None:
    torch.set_num_threads(1)
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[rank % len(os.sched_getaffinity(0))]})
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    model = TinyLlama(CFG)
    model.init_weights(0)
    before = set(os.listdir("/proc/self/task"))
    dmuon.dedicate_params(model, mesh, projection_predicate, verbose=False)
    for tid in set(os.listdir("/proc/self/task")) - before:  # dmuon's groups' threads: see the docstring
        os.setpriority(os.PRIO_PROCESS, int(tid), 19)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = dmuon.Muon(model, lr=0.01)
    tok = torch.randint(0, CFG.vocab_size, (2, 9), generator=torch.Generator().manual_seed(rank))
    for _ in range(2):
        optimizer.zero_grad()
        model(tok[:, :-1], tok[:, 1:]).loss.backward()
        optimizer.step()
    sd = dmuon.get_state_dict(model, optimizer)
    sys.setswitchinterval(60.0)  # see the module docstring
    if ending == "success":
        dmuon.set_state_dict(model, optimizer, sd)
        dist.destroy_process_group()
        return
    name = next(iter(sd["model"]))
    sd["model"][name] = sd["model"][name][:1]  # a wrong shape: refused on every rank
    try:
        dmuon.set_state_dict(model, optimizer, sd)
    except ValueError:
        pass
    else:
        raise AssertionError("the corrupted checkpoint was accepted")
    if ending == "destroy":
        dist.destroy_process_group()
    elif ending == "exit":
        sys.exit(0)
    elif ending == "raise":
        raise RuntimeError("the user's script fails after the refusal")


if __name__ == "__main__":
    _finalizer = _SleepsWhenFreed()
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
