"""The grids of data-parallel ranks that dmuon's process groups follow, from every rank's meshes: pure
arithmetic on rank numbers (no collective), so ``dedicate_params`` can check a replicate mesh before any group
exists and :meth:`dmuon.runtime.comm.CommContext.from_meshes` can build the same groups on every rank."""

from __future__ import annotations

__all__ = ["grids_from_views", "node_blocks"]


def grids_from_views(views: list[tuple[int, tuple[int, ...], tuple[int, ...]]]) -> list[tuple[tuple[int, ...], ...]]:
    """The grids of data-parallel ranks (one per tp index; one without TP), in a fixed order, from every rank's
    (rank, shard-mesh ranks, replicate-mesh ranks); each checked by :func:`_grid_from_views`."""
    components: list[set[int]] = []  # ranks linked by a shard row or a replicate column: one grid each
    for _, row, col in views:
        linked = set(row) | set(col)
        for c in [c for c in components if c & linked]:
            components.remove(c)
            linked |= c
        components.append(linked)
    return [_grid_from_views([v for v in views if v[0] in c]) for c in sorted(components, key=min)]


def _grid_from_views(views: list[tuple[int, tuple[int, ...], tuple[int, ...]]]) -> tuple[tuple[int, ...], ...]:
    """``grid[r][s]`` from each rank's (rank, shard-mesh ranks, replicate-mesh ranks), or a ValueError."""
    world = sorted(v[0] for v in views)
    S, R = len(views[0][1]), len(views[0][2])
    problem = None
    if any(len(row) != S or len(col) != R for _, row, col in views) or R * S != len(world):
        problem = f"sizes differ or do not multiply to the world size {len(world)}"
    grid: list[list[int | None]] = [[None] * S for _ in range(R)]
    if problem is None:
        for rank, row, col in views:
            if rank not in row or rank not in col:
                problem = f"rank {rank} is missing from its own meshes"
                break
            r, s = col.index(rank), row.index(rank)
            if grid[r][s] is not None:
                problem = f"ranks {grid[r][s]} and {rank} claim the same cell (replicate {r}, shard {s})"
                break
            grid[r][s] = rank
    if problem is None:
        by_rank = {rank: (row, col) for rank, row, col in views}
        for r in range(R):
            for s in range(S):
                rank = grid[r][s]
                row, col = by_rank[rank]  # type: ignore[index]
                if row != tuple(grid[r]) or col != tuple(grid[rr][s] for rr in range(R)):
                    problem = f"rank {rank}'s shard ranks {row} / replicate ranks {col} do not line up"
                    break
            if problem:
                break
    if problem is not None:
        raise ValueError(
            "dmuon.dedicate_params: the replicate mesh's ranks do not complete the shard mesh to a grid "
            f"({problem}). Pass the two dimensions of one 2-D mesh, e.g. mesh['shard'] and "
            "mesh['replicate'] of init_device_mesh(..., (R, S), mesh_dim_names=('replicate', 'shard'))."
        )
    return tuple(tuple(int(x) for x in row) for row in grid)  # type: ignore[arg-type]


def node_blocks(row: tuple[int, ...], per_node: int) -> str | None:
    """Why the 1-D mesh ``row`` (global ranks in slot order) is not whole nodes of ``per_node`` ranks by
    torchrun's numbering (node ``g // per_node`` for global rank ``g``), one node's ranks as consecutive slots,
    at least two nodes; ``None`` when it is."""
    if per_node < 1:
        return "the ranks per node are unknown (LOCAL_WORLD_SIZE unset, or not the same on every rank)"
    if len(row) % per_node or len(row) // per_node < 2:
        return f"its {len(row)} ranks are not two or more whole nodes of {per_node} ranks (LOCAL_WORLD_SIZE)"
    nodes = [{g // per_node for g in row[i : i + per_node]} for i in range(0, len(row), per_node)]
    if any(len(n) != 1 for n in nodes) or len({min(n) for n in nodes}) != len(nodes):
        return f"its ranks {row} do not list each node's {per_node} ranks together"
    return None
