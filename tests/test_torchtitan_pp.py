"""torchtitan with pipeline parallelism: ``examples/torchtitan_dmuon.py --pp 2`` (torchtitan's ``pipeline_llm``,
``with_dmuon`` on every model part, ``DMuonOptimizersContainer`` over the parts, the Trainer's clip call) on gloo.
Skipped when torchtitan or triton (which its llama3 module imports) are missing."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")
pytest.importorskip("torchtitan")
pytest.importorskip("torchtitan.models.llama3")

from tests._asserts import torchrun  # noqa: E402


def test_example_script_runs_with_pipeline_parallelism() -> None:
    """``pipeline_parallel_degree=2`` with torchtitan's ``pipeline_llm`` and interleaved 1F1B: four virtual stages,
    two model parts per rank, each dedicated on its own, one ``dmuon.Muon`` per part in the container and one clip
    over both ranks' parts; the loss falls."""
    proc = torchrun("examples/torchtitan_dmuon.py", "--pp", "2", "--pp-schedule", "Interleaved1F1B", "--steps", "4",
                    timeout=300)
    assert "2 model parts of 4 stages on rank 0" in proc.stdout, proc.stdout
    assert "torchtitan_dmuon: OK loss" in proc.stdout, proc.stdout
