"""Which ranks hold the same part of the model: the pipeline stages of a job.

[Note: pipeline stages]
Under pipeline parallelism every rank holds one stage of the model (its layers, with the full model's FQNs)
and calls ``dedicate_params`` on that stage with the stage's data-parallel mesh (``mesh["dp"]``), which covers
only the ranks of its stage. dmuon never needs to be told about the pipeline dimension: the ranks a rank's
meshes link to (its shard row, its replicate column, its tp ranks) are the ranks that hold the same part of
the model, so the stages are the connected parts of those links, learnt from the one gather
``dedicate_params`` runs anyway. A job without pipeline parallelism is one stage holding every rank. Under an
interleaved schedule a rank holds several stage modules, each dedicated on its own over the same ``mesh["dp"]``
(every rank in the same order): each module's :class:`Topology` names the ranks of the rank's dp group, which
hold the same stage modules, so everything below holds per module; ``clip_grad_norm_`` takes the rank's list.

What follows from it, everywhere else:

* owners, broadcasts and reduces live inside a stage (``CommContext``'s grid is the stage's data-parallel
  ranks), so nothing about them changes;
* what concerns the stage's params is agreed within the stage: ``dedicate_params``' plan fingerprint (ranks of
  one stage must plan alike; ranks of two stages hold different params) and ``dmuon.Muon``'s param groups;
* what concerns the job is agreed over every rank: every rank's verdict (each stage's ``dedicate_params`` runs
  at the same time, and a refusal on one stage must stop them all), the optimizer's settings, and the gradient
  norm, which sums every stage's share (``clip_grad_norm_``).

Pure data: no collective here; ``dedicate_params`` gathers the links and builds the :class:`Topology`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["Topology", "stages_from_links"]


@dataclass(frozen=True)
class Topology:
    """The job's stages (one without pipeline parallelism) and this process's. Same on every rank."""

    #: The global ranks of each stage, ascending; stages ordered by their lowest rank.
    stages: tuple[tuple[int, ...], ...]
    #: This process's stage: an index into :attr:`stages`.
    stage: int

    @classmethod
    def single(cls, world_size: int) -> Topology:
        """One stage holding every rank: a job without pipeline parallelism."""
        return cls((tuple(range(world_size)),), 0)

    @classmethod
    def from_links(cls, links: Sequence[tuple[int, Iterable[int]]], me: int) -> Topology:
        """The stages from every rank's ``(rank, the ranks its meshes link it to)``; ``me``: this rank."""
        stages = stages_from_links(links)
        return cls(stages, next(i for i, ranks in enumerate(stages) if me in ranks))

    @property
    def pipelined(self) -> bool:
        """Whether the job has more than one stage."""
        return len(self.stages) > 1

    @property
    def stage_ranks(self) -> tuple[int, ...]:
        """The global ranks of this process's stage."""
        return self.stages[self.stage]

    def stage_of_rank(self) -> tuple[int, ...]:
        """The stage of every global rank, indexed by rank (for per-stage comparisons of gathered views)."""
        out = [0] * sum(len(s) for s in self.stages)
        for i, ranks in enumerate(self.stages):
            for r in ranks:
                out[r] = i
        return tuple(out)


def stages_from_links(links: Sequence[tuple[int, Iterable[int]]]) -> tuple[tuple[int, ...], ...]:
    """The connected parts of the ranks, two ranks being connected when one's meshes name the other."""
    parts: list[set[int]] = []
    for rank, linked in links:
        joined = {rank, *linked}
        for part in [p for p in parts if p & joined]:
            parts.remove(part)
            joined |= part
        parts.append(joined)
    return tuple(sorted((tuple(sorted(p)) for p in parts), key=lambda s: s[0]))
