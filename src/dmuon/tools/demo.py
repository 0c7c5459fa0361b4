"""``python -m dmuon.demo``: dmuon next to plain FSDP2 + AdamW, on a few local ranks.

What it shows, end to end and without any setup:

* ``dedicate_params`` splits the projection matrices of a small Llama-shaped model over the ranks (the
  owner table: who stores which matrices and runs their Newton–Schulz, and how balanced that is);
* ``fully_shard`` (per layer, then the root) still works on top, sharding everything else;
* ``dmuon.Muon`` trains it with the ordinary ``zero_grad / forward / backward / step`` loop;
* what one step costs in dmuon's own collectives (``dmuon.diagnostics``);
* that it learns: the same model, init and data trained with FSDP2 + ``torch.optim.AdamW`` on all
  parameters as a baseline, both loss curves printed and plotted to ``<out>/loss.png``.

The data is a fixed random Markov chain over the vocabulary (each token has a handful of likely
successors), so the loss has a known floor (the chain's entropy) and falls visibly within a few dozen
steps. It spawns its own ranks: 2 on CPU (gloo) by default, or one per GPU (NCCL) when CUDA is present.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from datetime import timedelta
from multiprocessing.connection import wait as wait_sentinels
from typing import Any

import torch

from .launch import free_port, quiet_closed_stdout

__all__ = ["main", "DemoSettings", "MarkovTask"]

#: Successor probabilities of every token in the chain: sharp enough to learn fast, not deterministic.
SUCCESSOR_PROBS = (0.6, 0.25, 0.1, 0.05)


@dataclass(frozen=True)
class DemoSettings:
    """Everything a rank needs; frozen and picklable because it crosses the spawn boundary."""

    world_size: int
    steps: int
    device: str  # "cpu" or "cuda", already resolved
    zero: int
    seed: int = 0
    batch_per_rank: int = 8
    seq_len: int = 64
    vocab_size: int = 64
    dim: int = 128
    n_layers: int = 2
    hidden_dim: int = 256
    muon_lr: float = 0.02
    adamw_lr: float = 3e-3
    timeout_s: float = 300.0

    @property
    def global_batch(self) -> int:
        return self.batch_per_rank * self.world_size


class MarkovTask:
    """A fixed random first-order Markov chain: learnable quickly, with an exactly known loss floor."""

    def __init__(self, vocab_size: int, seed: int):
        gen = torch.Generator().manual_seed(seed + 7919)
        k = len(SUCCESSOR_PROBS)
        self.transition = torch.zeros(vocab_size, vocab_size)
        for tok in range(vocab_size):
            successors = torch.randperm(vocab_size, generator=gen)[:k]
            self.transition[tok, successors] = torch.tensor(SUCCESSOR_PROBS)
        self.vocab_size = vocab_size

    @property
    def entropy(self) -> float:
        """The best achievable mean cross-entropy (nats) on next-token prediction after the first token."""
        return -sum(p * math.log(p) for p in SUCCESSOR_PROBS)

    def batch(self, batch: int, seq_len: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """``(tokens, targets)`` of shape ``(batch, seq_len)``; targets are tokens shifted by one."""
        seq = torch.empty(batch, seq_len + 1, dtype=torch.long)
        seq[:, 0] = torch.randint(0, self.vocab_size, (batch,), generator=gen)
        for t in range(seq_len):
            seq[:, t + 1] = torch.multinomial(self.transition[seq[:, t]], 1, generator=gen).squeeze(1)
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


# --------------------------------------------------------------------------------------------------- #
# One rank                                                                                             #
# --------------------------------------------------------------------------------------------------- #
def _say(rank: int, *parts: Any, end: str = "\n") -> None:
    """Rank 0 speaks for everyone; flush so lines interleave sensibly with the parent's output."""
    if rank == 0:
        print(*parts, end=end, flush=True)


def _progress_line(step: int, total: int, losses: tuple[float, float], rate: float, *, terminal: bool,
                   width: int = 24) -> str:
    """On a terminal, a bar redrawn in place (starts with ``\\r``, no newline); in a log, a plain line."""
    text = f"{step:>4}/{total}  dmuon {losses[0]:.4f}  adamw {losses[1]:.4f}  {rate:5.2f} it/s"
    if not terminal:
        return f"  step {text}\n"
    filled = int(width * step / total)
    return f"\r[{'#' * filled}{'.' * (width - filled)}] {text}" + ("\n" if step == total else "")


def _build_model(s: DemoSettings, device: torch.device) -> torch.nn.Module:
    """Same weights on every rank and for both runs: the comparison starts from one init."""
    from .models import TinyLlama, TinyLlamaConfig

    cfg = TinyLlamaConfig(
        vocab_size=s.vocab_size, dim=s.dim, n_layers=s.n_layers, n_heads=4, n_kv_heads=2,
        hidden_dim=s.hidden_dim, max_seq_len=s.seq_len,
    )
    torch.manual_seed(s.seed)
    model = TinyLlama(cfg)
    model.init_weights(s.seed)
    return model.to(device)


def _shard(model: torch.nn.Module, mesh: Any, reshard_after_forward: bool) -> None:
    """FSDP2 per layer, then the root. The root keeps FSDP2's default (its params stay gathered until
    backward, which starts right away): forcing ``True`` there breaks backward on torch 2.11 CUDA."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh)


def _print_plan(rank: int, plan: Any, dedicated_elements: int) -> None:
    _say(rank, "\nOwner assignment (dedicate_params):")
    _say(rank, "  " + plan.summary_line())
    total_cost = sum(r.cost for r in plan.ranks) or 1.0
    _say(rank, f"  {'rank':>4}  {'params':>6}  {'elements':>10}  {'share':>6}  {'NS cost share':>13}")
    for r in plan.ranks:
        _say(rank, f"  {r.rank:>4}  {len(r.fqns):>6}  {r.numel:>10,}  {r.numel / dedicated_elements:>6.1%}  "
                   f"{r.cost / total_cost:>13.1%}")


def _print_comm(rank: int, counts: dict[str, dict[str, int]], dedicated_elements: int, zero: int) -> None:
    _say(rank, f"\nCommunication of one dmuon step (dmuon.diagnostics, Z{zero}; dedicated elements P = "
               f"{dedicated_elements:,}):")
    _say(rank, f"  {'collective':<28}  {'calls':>5}  {'elements':>10}  {'x P':>5}")
    for kind, c in counts.items():
        _say(rank, f"  {kind:<28}  {c['calls']:>5}  {c['elements']:>10,}  {c['elements'] / dedicated_elements:>5.2f}")


def _train_both(rank: int, s: DemoSettings, batches: list[tuple[torch.Tensor, torch.Tensor]],
                run_a: tuple[Any, Any], run_b: tuple[Any, Any], device: torch.device
                ) -> tuple[list[float], list[float], dict[str, dict[str, int]]]:
    """Step (a) dmuon and (b) the baseline on the same batches; the loss curves (mean over ranks) and
    dmuon's traffic in one steady step."""
    import torch.distributed as dist

    import dmuon

    (model_a, opt_a), (model_b, opt_b) = run_a, run_b
    lo, hi = rank * s.batch_per_rank, (rank + 1) * s.batch_per_rank
    measured_step = min(1, s.steps - 1)  # step 0 may do one-off work; measure a steady one
    comm: dict[str, dict[str, int]] = {}
    curve_a: list[float] = []
    curve_b: list[float] = []
    interactive = sys.stdout.isatty()
    t0 = time.perf_counter()
    for step, (tok, tgt) in enumerate(batches):
        tok, tgt = tok[lo:hi].to(device), tgt[lo:hi].to(device)
        if step == measured_step:
            dmuon.diagnostics.reset_comm_counts(model_a)
        opt_a.zero_grad()
        loss_a = model_a(tok, tgt).loss
        loss_a.backward()
        opt_a.step()
        if step == measured_step:
            comm = dmuon.diagnostics.comm_counts(model_a)

        opt_b.zero_grad()
        loss_b = model_b(tok, tgt).loss
        loss_b.backward()
        opt_b.step()

        logged = torch.stack([loss_a.detach(), loss_b.detach()])
        dist.all_reduce(logged, op=dist.ReduceOp.AVG)
        la, lb = logged.tolist()
        curve_a.append(la)
        curve_b.append(lb)
        # Redraw every step on a terminal; in a captured log, a line every 5th step is plenty.
        if interactive or (step + 1) % 5 == 0 or step + 1 == s.steps:
            rate = (step + 1) / max(time.perf_counter() - t0, 1e-9)
            _say(rank, _progress_line(step + 1, s.steps, (la, lb), rate, terminal=interactive), end="")
    _say(rank, f"  {s.steps} steps of both runs in {time.perf_counter() - t0:.1f} s")
    return curve_a, curve_b, comm


def _print_losses(rank: int, s: DemoSettings, task: MarkovTask, curve_a: list[float], curve_b: list[float]) -> None:
    _say(rank, f"\nLoss (global mean over ranks; floor {task.entropy:.3f}):")
    _say(rank, f"  {'step':>5}  {'dmuon':>8}  {'AdamW':>8}")
    every = 5
    shown = sorted({0, *range(every - 1, s.steps, every), s.steps - 1})
    for i in shown:
        _say(rank, f"  {i + 1:>5}  {curve_a[i]:>8.4f}  {curve_b[i]:>8.4f}")


def _train_rank(rank: int, s: DemoSettings, result_path: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import dmuon
    from .models import projection_predicate

    if s.device == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        # The ranks share the machine's cores; oversubscribing them makes every rank slower.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // s.world_size))
        backend = "gloo"
    # device_id binds NCCL to this rank's GPU up front (and keeps barrier() from guessing it).
    dist.init_process_group(backend, rank=rank, world_size=s.world_size, timeout=timedelta(seconds=s.timeout_s),
                            device_id=device if device.type == "cuda" else None)
    try:
        mesh = init_device_mesh(device.type, (s.world_size,))
        z3 = s.zero == 3
        task = MarkovTask(s.vocab_size, s.seed)
        data_gen = torch.Generator().manual_seed(s.seed + 1)
        batches = [task.batch(s.global_batch, s.seq_len, data_gen) for _ in range(s.steps)]

        # (a) dmuon: owners for the projections, FSDP2 for the rest, one optimizer for both.
        model_a = _build_model(s, device)
        plan = dmuon.dedicate_params(model_a, mesh, predicate=projection_predicate, reshard_after_forward=z3,
                                     verbose=False)  # _print_plan shows it, with the per-rank table
        _shard(model_a, mesh, z3)
        opt_a = dmuon.Muon(model_a, lr=s.muon_lr, adamw_lr=s.adamw_lr)
        dedicated = sum(p.numel() for p in dmuon.get_dedicated_params(model_a).values())

        # (b) baseline: FSDP2 on everything, AdamW on everything.
        model_b = _build_model(s, device)
        _shard(model_b, mesh, z3)
        opt_b = torch.optim.AdamW(model_b.parameters(), lr=s.adamw_lr)

        n_params = sum(p.numel() for p in model_b.parameters())
        _say(rank, f"dmuon demo: {s.world_size} ranks on {device.type} ({backend}), Z{s.zero}, {s.steps} steps, "
                   f"TinyLlama {n_params:,} params ({s.n_layers} layers, dim {s.dim}), global batch "
                   f"{s.global_batch} x {s.seq_len} tokens")
        _say(rank, f"task: next token of a random Markov chain over {s.vocab_size} tokens; uniform guess "
                   f"ln({s.vocab_size}) = {math.log(s.vocab_size):.3f}, best possible loss = {task.entropy:.3f}")
        _print_plan(rank, plan, dedicated)

        _say(rank, f"\nTraining (a) dmuon.Muon lr={s.muon_lr} + AdamW lr={s.adamw_lr} and (b) AdamW lr={s.adamw_lr}, "
                   "same init and data:")
        curve_a, curve_b, comm = _train_both(rank, s, batches, (model_a, opt_a), (model_b, opt_b), device)
        _print_losses(rank, s, task, curve_a, curve_b)
        _print_comm(rank, comm, dedicated, s.zero)
        _say(rank, f"\nfinal loss: dmuon {curve_a[-1]:.4f}, AdamW {curve_b[-1]:.4f} (from {curve_a[0]:.4f}; "
                   f"floor {task.entropy:.3f})")
        if rank == 0:
            with open(result_path, "w") as f:
                json.dump({"dmuon": curve_a, "adamw": curve_b, "floor": task.entropy, "settings": asdict(s),
                           "plan": plan.as_dict()}, f)
        dist.barrier()
        # FSDP2 modules still alive at teardown sometimes abort the process on gloo (torch 2.13)
        del model_a, model_b, opt_a, opt_b
        gc.collect()
    finally:
        dist.destroy_process_group()


def _rank_entry(rank: int, s: DemoSettings, port: int, workdir: str) -> None:
    """Spawned process body: run the rank, and on failure leave the traceback for the parent to print."""
    quiet_closed_stdout()  # rank 0 prints into the parent's stdout; `| head` must not end the job
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(s.world_size), LOCAL_RANK=str(rank))
    try:
        _train_rank(rank, s, os.path.join(workdir, "result.json"))
    except BaseException:  # noqa: BLE001 - report anything, including KeyboardInterrupt, to the parent
        with open(os.path.join(workdir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        sys.stdout.flush()
        raise SystemExit(1) from None


# --------------------------------------------------------------------------------------------------- #
# Parent: spawn, supervise, plot                                                                       #
# --------------------------------------------------------------------------------------------------- #
def _supervise(procs: list[Any], timeout_s: float, grace_s: float = 10.0) -> tuple[list[int], bool]:
    """Wait for all ranks; once one fails, give the rest ``grace_s`` then kill them (they would block
    in a collective forever). Returns the failed ranks and whether the overall timeout hit."""
    deadline = time.monotonic() + timeout_s
    kill_at: float | None = None
    timed_out = False
    while any(p.is_alive() for p in procs):
        now = time.monotonic()
        if kill_at is None and any(p.exitcode not in (None, 0) for p in procs):
            kill_at = now + grace_s
        limit = deadline if kill_at is None else min(deadline, kill_at)
        if now >= limit:
            timed_out = now >= deadline
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join(5.0)
            break
        wait_sentinels([p.sentinel for p in procs if p.is_alive()], timeout=min(1.0, limit - now))
    failed = [r for r, p in enumerate(procs) if p.exitcode != 0]
    return failed, timed_out


def _plot(result: dict[str, Any], out_dir: str) -> str | None:
    """Save both loss curves; a missing matplotlib is a note, not an error."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed, skipping the loss plot (pip install matplotlib)")
        return None
    s = result["settings"]
    steps = range(1, len(result["dmuon"]) + 1)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(steps, result["dmuon"], label="dmuon (Muon on projections + AdamW)", color="tab:blue", lw=2)
    ax.plot(steps, result["adamw"], label="baseline FSDP2 + AdamW", color="tab:orange", lw=2)
    ax.axhline(result["floor"], color="gray", ls="--", lw=1, label=f"best possible ({result['floor']:.2f})")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (mean over ranks)")
    ax.set_title(f"dmuon demo: {s['world_size']} ranks, {s['device']}, Z{s['zero']}")
    ax.set_xlim(1, max(2, len(result["dmuon"])))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "loss.png")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m dmuon.demo",
        description="Train a tiny Llama with dmuon and with FSDP2+AdamW on local ranks and compare the losses.",
    )
    parser.add_argument("--world-size", type=int, default=None, metavar="N",
                        help="number of ranks (default: 2 on CPU, every GPU on CUDA)")
    parser.add_argument("--steps", type=int, default=40, metavar="N", help="training steps per run (default 40)")
    parser.add_argument("--out", default="./dmuon_demo_out", metavar="DIR",
                        help="directory for loss.png (default ./dmuon_demo_out)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="auto: CUDA with NCCL if available, else CPU with gloo (default auto)")
    parser.add_argument("--zero", type=int, choices=(2, 3), default=3,
                        help="3: free gathered weights after forward (default); 2: keep them until backward")
    parser.add_argument("--no-plot", action="store_true", help="skip loss.png (no matplotlib needed)")
    parser.add_argument("--seed", type=int, default=0, metavar="S", help="init and data seed (default 0)")
    parser.add_argument("--timeout", type=float, default=300.0, metavar="SECONDS",
                        help="seconds before hung ranks are killed (default 300)")
    return parser


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    return _parser().parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the demo; returns the process exit code (0 on success, also when a reader such as ``head`` stopped
    reading the output early: the run goes on to its end quietly)."""
    args = _parse_args(argv)
    quiet_closed_stdout()
    if args.steps < 1:
        print("dmuon demo: --steps must be >= 1", file=sys.stderr)
        return 2
    if args.device == "cpu":
        device = "cpu"
    else:
        has_cuda = torch.cuda.is_available()
        if args.device == "cuda" and not has_cuda:
            print("dmuon demo: --device cuda requested but CUDA is not available", file=sys.stderr)
            return 2
        device = "cuda" if has_cuda else "cpu"
    if device == "cuda":
        n_gpus = torch.cuda.device_count()
        world = args.world_size if args.world_size is not None else n_gpus
        if not 1 <= world <= n_gpus:
            print(f"dmuon demo: --world-size must be in [1, {n_gpus}] (one rank per GPU), got {world}",
                  file=sys.stderr)
            return 2
    else:
        world = args.world_size if args.world_size is not None else 2
        if world < 1:
            print(f"dmuon demo: --world-size must be >= 1, got {world}", file=sys.stderr)
            return 2
    settings = DemoSettings(world_size=world, steps=args.steps, device=device, zero=args.zero, seed=args.seed,
                            timeout_s=args.timeout)

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="dmuon_demo_") as workdir:
        port = free_port()
        procs = [ctx.Process(target=_rank_entry, args=(r, settings, port, workdir), daemon=False)
                 for r in range(world)]
        for p in procs:
            p.start()
        failed, timed_out = _supervise(procs, args.timeout)
        if failed or timed_out:
            print(file=sys.stderr)
            errs = {r: os.path.join(workdir, f"rank{r}.err") for r in failed}
            # The earliest traceback is the cause; the others are usually peers losing their connection.
            for r in sorted(failed, key=lambda r: os.path.getmtime(errs[r]) if os.path.exists(errs[r]) else math.inf):
                detail = (open(errs[r]).read() if os.path.exists(errs[r])
                          else f"(no traceback; exit code {procs[r].exitcode})\n")
                print(f"--- rank {r} failed ---\n{detail}", file=sys.stderr)
            if timed_out:
                print(f"dmuon demo: timed out after {args.timeout:.0f} s; killed the remaining ranks",
                      file=sys.stderr)
            return 1
        with open(os.path.join(workdir, "result.json")) as f:
            result = json.load(f)
    if not args.no_plot:
        path = _plot(result, args.out)
        if path is not None:
            print(f"\nloss plot saved to {path}")
    print(f"dmuon demo finished in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
