"""A job whose rank 1 dies between steps: what rank 0 sees (run as a child process by tests/test_faults.py).

``python -m tests._peer_death OUT``: two spawned ranks on gloo, ``init_process_group(timeout=15 s)``; writes
dmuon's own group timeout, how long rank 0 took to fail and how, then prints it with the exit codes.
"""

from __future__ import annotations

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT_S = 15

def rank_main(rank, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=TIMEOUT_S))
    import dmuon
    from dmuon.runtime.comm import Dim
    from dmuon.tools.models import TinyLlama, TinyLlamaConfig, projection_predicate
    from torch.distributed.device_mesh import init_device_mesh
    model = TinyLlama(TinyLlamaConfig(vocab_size=32, dim=16, n_layers=2, n_heads=2, n_kv_heads=1, hidden_dim=32, max_seq_len=8))
    model.init_weights(0)
    dmuon.dedicate_params(model, init_device_mesh("cpu", (2,)), projection_predicate)
    opt = dmuon.Muon(model)
    g = model._dmuon_state.ctx.groups[Dim.WORLD]
    timeout = g._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    tok = torch.randint(0, 32, (2, 9))
    model(tok[:, :-1], tok[:, 1:]).loss.backward()
    opt.step()
    if rank == 1:
        os._exit(3)  # dies mid-training, between steps
    t = time.monotonic()
    try:
        model(tok[:, :-1], tok[:, 1:]).loss.backward()
        opt.step()
        result = "no error"
    except Exception as e:  # noqa: BLE001
        result = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    with open(out, "w") as f:
        f.write(f"{timeout} {time.monotonic() - t:.1f} {result}\n")
    os._exit(0)

if __name__ == "__main__":
    from dmuon.tools.launch import free_port
    out = sys.argv[1]
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, port, out)) for r in range(2)]
    for p in procs: p.start()
    for p in procs: p.join(120)
    print(open(out).read().strip(), [p.exitcode for p in procs])
