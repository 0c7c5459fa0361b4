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
    over both ranks' parts; the loss falls. ``DMuonCheckpointManager`` saves both parts at step 3, restores them
    after step 4, and step 4 runs again to the same loss bit for bit."""
    proc = torchrun("examples/torchtitan_dmuon.py", "--pp", "2", "--pp-schedule", "Interleaved1F1B", "--steps", "4",
                    "--resume", timeout=300)
    assert "2 model parts of 4 stages on rank 0" in proc.stdout, proc.stdout
    assert "torchtitan_dmuon: OK loss" in proc.stdout, proc.stdout
    # DMuonCheckpointManager over both parts: step 3 saved, restored after step 4, and step 4 again bit for bit
    assert "resumed step 3, step 4 loss" in proc.stdout and " equals the uninterrupted " in proc.stdout, proc.stdout
