"""Run a function on N real processes and collect what each rank returns.

By default the ranks are CPU processes on gloo. ``DMUON_TEST_DEVICE=cuda`` re-runs the same jobs on NCCL with
one GPU per rank (the distributed tests' NCCL pass, issue 7): the jobs get their device from ``device()``,
and a test module whose jobs do so says ``RUNS_ON_CUDA = True`` (the others are skipped in that pass).
"""

from __future__ import annotations

import gc
import os
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.multiprocessing as mp

from dmuon.tools.launch import free_port

TIMEOUT_S = float(os.environ.get("DMUON_TEST_TIMEOUT", "240"))
#: "cpu" (gloo) or "cuda" (NCCL, rank r on GPU r)
DEVICE_TYPE = os.environ.get("DMUON_TEST_DEVICE", "cpu")
if DEVICE_TYPE not in ("cpu", "cuda"):
    raise ValueError(f"DMUON_TEST_DEVICE must be 'cpu' or 'cuda', got {DEVICE_TYPE!r}")
#: the intra-op threads of every rank
RANK_THREADS = 1


def device() -> torch.device:
    """This process's device: the CPU, or under ``DMUON_TEST_DEVICE=cuda`` the rank's GPU (GPU 0 in pytest's own
    process, where the single-process oracles run)."""
    if DEVICE_TYPE == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@contextmanager
def rank_threads() -> Iterator[None]:
    """Run the block on the ranks' thread count: for a single-process oracle that must reproduce the ranks'
    bits, so that no kernel can split a reduction differently there (none does at the tests' sizes, up to
    32 threads, measured with torch 2.13 on AMX and AVX2 kernels), and a small model runs faster on one
    thread anyway."""
    before = torch.get_num_threads()
    torch.set_num_threads(RANK_THREADS)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _entry(rank: int, world: int, port: int, outdir: str, fn: Callable[..., Any], args: tuple,
           pg_timeout: timedelta | None = None) -> None:
    import torch.distributed as dist

    timeout = {} if pg_timeout is None else {"timeout": pg_timeout}

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(RANK_THREADS)
    try:
        if DEVICE_TYPE == "cuda":
            torch.cuda.set_device(rank)
            dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank),
                                    **timeout)
        else:
            # a FileStore in the job's own directory, not a TCP port: two suites (or a suite and a helper's run)
            # on one machine cannot collide on a port picked by free_port() and bound later
            store = f"file://{os.path.join(outdir, 'store')}"
            dist.init_process_group("gloo", init_method=store, rank=rank, world_size=world, **timeout)
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


#: imported once by the forkserver, before it forks any rank
_PRELOAD = ["torch", "torch.distributed.fsdp", "torch.distributed.checkpoint", "dmuon", "tests._training"]


def world_available(world: int) -> bool:
    """Whether this pass can run ``world`` ranks (always on the CPU; one GPU per rank under CUDA)."""
    return DEVICE_TYPE == "cpu" or torch.cuda.device_count() >= world


def run_distributed(fn: Callable[..., Any], world: int, *args: Any, pg_timeout: timedelta | None = None) -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` spawned processes; returns the per-rank results, on the CPU.

    ``fn`` must be importable (a module-level function). A failure on any rank raises with its traceback.
    ``pg_timeout``: the default process group's timeout (dmuon's groups take it too), for jobs that check
    that no rank waits for one.
    """
    if DEVICE_TYPE == "cuda":
        import sys

        import pytest

        if not getattr(sys.modules[fn.__module__], "RUNS_ON_CUDA", False):
            pytest.skip(f"{fn.__module__} builds CPU meshes: not part of the NCCL pass")
        if not world_available(world):
            pytest.skip(f"{world} ranks need {world} GPUs, {torch.cuda.device_count()} visible")
    # forkserver, not spawn: every rank forks from one server process that imported torch and dmuon once,
    # instead of paying that import (seconds) per rank per job; unlike plain fork it never copies a parent
    # whose OpenMP or CUDA state is live.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    with tempfile.TemporaryDirectory() as outdir:
        port = free_port()
        procs = [ctx.Process(target=_entry, args=(r, world, port, outdir, fn, args, pg_timeout)) for r in range(world)]
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
        return [torch.load(os.path.join(outdir, f"rank{r}.pt"), map_location="cpu", weights_only=False)
                for r in range(world)]
