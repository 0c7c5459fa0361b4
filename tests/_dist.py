"""Run a function on N real processes (gloo on CPU) and collect what each rank returns."""

from __future__ import annotations

import gc
import os
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

TIMEOUT_S = float(os.environ.get("DMUON_TEST_TIMEOUT", "240"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, outdir: str, fn: Callable[..., Any], args: tuple) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        result = fn(rank, world, *args)
        torch.save(result, os.path.join(outdir, f"rank{rank}.pt"))
        del result
        gc.collect()  # FSDP2 modules alive at teardown sometimes abort the process on gloo (torch 2.13)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        with open(os.path.join(outdir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise


def run_distributed(fn: Callable[..., Any], world: int, *args: Any) -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` spawned gloo processes; returns the per-rank results.

    ``fn`` must be importable (a module-level function). A failure on any rank raises with its traceback.
    """
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as outdir:
        port = _free_port()
        procs = [ctx.Process(target=_entry, args=(r, world, port, outdir, fn, args)) for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + TIMEOUT_S
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        errors = []
        for r in range(world):
            err = os.path.join(outdir, f"rank{r}.err")
            if os.path.exists(err):
                errors.append(f"--- rank {r} ---\n" + open(err).read())
        if errors or hung or any(p.exitcode != 0 for p in procs):
            codes = [p.exitcode for p in procs]
            raise RuntimeError(f"distributed run failed (exit codes {codes}, hung ranks {hung})\n" + "\n".join(errors))
        return [torch.load(os.path.join(outdir, f"rank{r}.pt"), weights_only=False) for r in range(world)]
