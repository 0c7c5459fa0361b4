"""What the tools, the examples and the test harness need to start local ranks.

* :func:`free_port`: a free TCP port for a rendezvous the tool sets up itself (the demo, the bench).
* :func:`main_or_spawn`: the entry point of a script that should work both under ``torchrun`` and as a
  plain ``python script.py``: without torchrun's ``RANK`` in the environment it starts the ranks itself
  (``torchrun --standalone``) instead of failing in ``init_process_group`` with torch's
  ``environment variable RANK expected``.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Callable, Sequence

__all__ = ["free_port", "main_or_spawn"]


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on now (the OS picks it), for ``MASTER_PORT``."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _local_gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - a broken CUDA setup means: run on the CPU
        return 0


def main_or_spawn(fn: Callable[[], int], *, nprocs: int = 2, script: str | None = None,
                  argv: Sequence[str] | None = None) -> int:
    """Run ``fn()`` on this rank if a launcher started us, else start ``nprocs`` local ranks of ``script``.

    Under ``torchrun`` (``RANK`` is set) this is just ``fn()``. Run as ``python script.py [args]``, it
    prints the command it uses and re-runs the script as ``python -m torch.distributed.run --standalone
    --nproc_per_node N script.py [args]``, so every rank gets the environment torchrun gives. With at
    least ``nprocs`` GPUs the ranks take one GPU each (the script picks NCCL); with fewer, CUDA is hidden
    from them so they run on the CPU with gloo (two ranks on one GPU would fail in NCCL). Returns the
    exit code for ``sys.exit``: ``fn``'s, or the launcher's (non-zero if any rank failed).
    """
    if "RANK" in os.environ:
        return fn()
    script = os.path.abspath(script or sys.argv[0])
    args = list(sys.argv[1:] if argv is None else argv)
    env = dict(os.environ)
    gpus = _local_gpus()
    where = f"{nprocs} GPUs (NCCL)"
    if gpus < nprocs:
        env["CUDA_VISIBLE_DEVICES"] = ""
        where = "CPU (gloo)" + (f", as {gpus} GPU(s) are fewer than {nprocs} ranks" if gpus else "")
        # the ranks share the cores; torchrun would set 1 and print a warning about it
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nprocs)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nprocs), script,
           *args]
    name = os.path.basename(script)
    print(f"{name}: no RANK in the environment, so starting {nprocs} local ranks on {where}:\n"
          f"  torchrun --standalone --nproc_per_node {nprocs} {os.path.relpath(script)} {' '.join(args)}".rstrip(),
          flush=True)
    try:
        return subprocess.run(cmd, env=env, check=False).returncode
    except KeyboardInterrupt:
        return 130
