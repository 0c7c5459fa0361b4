"""dmuon.diagnostics.summarize: per rank, the owned matrices, what a step should move by kind next to what
the counters measured (equal, 1-D and HSDP), the NS call of each shape group; a table and JSON."""

from __future__ import annotations

import json

import pytest
import torch
from torch.distributed.fsdp import fully_shard

import dmuon
from dmuon.tools.bench import make_mesh
from tests._dist import DEVICE_TYPE, device, run_distributed
from tests._training import GLOBAL_BATCH, KJ, batches, build_model, projection_predicate


def summarize_job(rank: int, world: int, layout: str) -> dict:
    mesh = make_mesh(DEVICE_TYPE, world, replicate=2 if layout == "hsdp" else 1)
    model = build_model().to(device())
    dmuon.dedicate_params(model, mesh, projection_predicate)
    fully_shard(model, mesh=mesh)
    opt = dmuon.Muon(model, lr=0.01, ns_coefficients=KJ)
    per = GLOBAL_BATCH // world
    for step, (tok, tgt) in enumerate(batches(2)):
        if step == 1:  # the first step also syncs the holders' initial copies (HSDP): measure the second
            dmuon.diagnostics.reset_comm_counts(model)
        opt.zero_grad()
        model(tok[rank * per:(rank + 1) * per].to(device()), tgt[rank * per:(rank + 1) * per].to(device())).loss.backward()
        opt.step()
    dmuon.wait_all_replicate_broadcasts(model)
    s = dmuon.diagnostics.summarize(model, optimizer=opt)
    return {"dict": s.as_dict(), "table": str(s), "owned": sorted(dmuon.get_owned_params(model)),
            "dedicated": sorted(dmuon.get_dedicated_params(model))}


@pytest.mark.parametrize("world, layout", [(2, "flat"), (4, "hsdp")])
def test_summary_matches_the_counters_and_the_owners(world, layout):
    results = run_distributed(summarize_job, world, layout)
    rows = results[0]["dict"]["ranks"]
    assert all(r["dict"] == results[0]["dict"] for r in results), "every rank gets every row"
    assert [row["rank"] for row in rows] == list(range(world))
    json.dumps(results[0]["dict"])  # JSON-able
    for rank, (row, res) in enumerate(zip(rows, results)):
        assert sorted(p["fqn"] for p in row["owned"]) == res["owned"]
        assert row["owned_elements"] == sum(p["numel"] for p in row["owned"])
        for kind, want in row["expected"].items():
            assert row["measured"].get(kind, 0) == want, (layout, rank, kind, row["measured"], row["expected"])
        assert {tuple(g["shape"][1:]) for g in row["ns_backends"]} == {tuple(p["shape"]) for p in row["owned"]}
        assert all(g["form"] == "direct" for g in row["ns_backends"])  # on the CPU
        assert f"rank {rank}: " in res["table"]
    P = sum(row["owned_elements"] for row in rows)
    assert P == sum(torch.Size(p["shape"]).numel() for row in rows for p in row["owned"])
    assert sorted(p["fqn"] for row in rows for p in row["owned"]) == results[0]["dedicated"]
    if layout == "hsdp":  # the replicate stages move each column's tensors on each of its 2 holders
        assert sum(row["expected"]["replicate_publish"] for row in rows) == 2 * P
