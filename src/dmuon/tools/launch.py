"""What the tools, the examples and the test harness need to start local ranks.

* :func:`free_port`: a free TCP port for a rendezvous the tool sets up itself (the demo, the bench).
* :func:`main_or_spawn`: the entry point of a script that should work both under ``torchrun`` and as a
  plain ``python script.py``: it parses the arguments first (so ``--help`` and a wrong argument end there,
  before any rank starts), then, without torchrun's ``RANK`` in the environment, starts the ranks itself
  (``torchrun --standalone``) instead of failing in ``init_process_group`` with torch's
  ``environment variable RANK expected``.
* :func:`quiet_closed_stdout`: output piped into a reader that stops early (``| head -3``) neither kills
  the job nor prints a ``BrokenPipeError`` traceback; the run goes on to its end with its output dropped.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Any, TextIO

__all__ = ["free_port", "main_or_spawn", "quiet_closed_stdout"]


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on now (the OS picks it), for ``MASTER_PORT``."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _ClosedReaderSafe:
    """``sys.stdout`` that, once the reader of its pipe is gone, sends what follows to the null device.

    Raising ``BrokenPipeError`` instead would kill the rank that prints (rank 0), and its peers would then
    fail in their next collective ("Connection closed by peer"): one closed reader would end the whole job.
    """

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def _reader_gone(self) -> None:
        # Point the descriptor itself at the null device: the buffered text, the interpreter's last flush
        # at exit and anything written below Python (a C extension) all land there quietly.
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(null, self._stream.fileno())
        finally:
            os.close(null)

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._reader_gone()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._reader_gone()

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding, ...: the stream's own
        return getattr(self._stream, name)


def quiet_closed_stdout() -> None:
    """From now on, a closed reader of this process's stdout (``| head``) drops the output, not the run.

    Call it in every process of a job that prints: the parent that starts the ranks and each rank (a
    spawned rank starts a fresh interpreter, so the parent's call does not reach it). The run then ends as
    it would have, files and exit code included (0 on success), like ``python -m dmuon.plan | head``.
    Calling it twice is harmless.

    Example::

        def main() -> int:
            quiet_closed_stdout()  # `python -m mytool | head -3` now ends like a run nobody piped
            for step in range(100):
                print(f"step {step}")  # after head has left: dropped, no BrokenPipeError
            return 0
    """
    if sys.stdout is not None and not isinstance(sys.stdout, _ClosedReaderSafe):
        sys.stdout = _ClosedReaderSafe(sys.stdout)  # type: ignore[assignment]


def _local_gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - a broken CUDA setup means: run on the CPU
        return 0


def main_or_spawn(fn: Callable[[argparse.Namespace], int], *,
                  parse_args: Callable[[Sequence[str] | None], argparse.Namespace], nprocs: int = 2,
                  script: str | None = None, argv: Sequence[str] | None = None) -> int:
    """Parse the arguments, then run ``fn(args)`` on this rank if a launcher started us, else start ``nprocs``
    local ranks of ``script``.

    ``parse_args(argv)`` (the script's own ``argparse``, checks with ``parser.error`` included) runs first,
    in every process: ``--help`` prints the help and exits 0, and a wrong argument prints one usage error
    and exits 2, both before any rank starts. Under ``torchrun`` (``RANK`` is set) the rest is just
    ``fn(args)``. Run as ``python script.py [args]``, it prints the command it uses and re-runs the script as
    ``python -m torch.distributed.run --standalone --nproc_per_node N script.py [args]``, so every rank gets
    the environment torchrun gives. With at least ``nprocs`` GPUs the ranks take one GPU each (the script
    picks NCCL); with fewer, CUDA is hidden from them so they run on the CPU with gloo (two ranks on one GPU
    would fail in NCCL). Output piped into a reader that stops early is dropped, not fatal
    (:func:`quiet_closed_stdout`). Returns the exit code for ``sys.exit``: ``fn``'s, or the launcher's
    (non-zero if any rank failed).

    Example::

        def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
            parser = argparse.ArgumentParser(description="what this script shows")
            parser.add_argument("--steps", type=int, default=10)
            return parser.parse_args(argv)

        def main(args: argparse.Namespace) -> int:
            ...  # init_process_group, build, train for args.steps
            return 0

        if __name__ == "__main__":
            sys.exit(main_or_spawn(main, parse_args=parse_args))
    """
    args = parse_args(argv)
    quiet_closed_stdout()
    if "RANK" in os.environ:
        return fn(args)
    script = os.path.abspath(script or sys.argv[0])
    forwarded = list(sys.argv[1:] if argv is None else argv)
    env = dict(os.environ)
    gpus = _local_gpus()
    where = f"{nprocs} GPUs (NCCL)"
    if gpus < nprocs:
        env["CUDA_VISIBLE_DEVICES"] = ""
        where = "CPU (gloo)" + (f", as {gpus} GPU(s) are fewer than {nprocs} ranks" if gpus else "")
        # the ranks share the cores; torchrun would set 1 and print a warning about it
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nprocs)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nprocs), script,
           *forwarded]
    name = os.path.basename(script)
    print(f"{name}: no RANK in the environment, so starting {nprocs} local ranks on {where}:\n"
          f"  torchrun --standalone --nproc_per_node {nprocs} {os.path.relpath(script)} {' '.join(forwarded)}"
          .rstrip(), flush=True)
    try:
        return subprocess.run(cmd, env=env, check=False).returncode
    except KeyboardInterrupt:
        return 130
