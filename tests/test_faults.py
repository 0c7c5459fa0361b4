"""Faults: a rank that dies mid-training makes the others fail with an error instead of hanging, and
dmuon's own process groups time out when the user's would (they inherit ``init_process_group``'s timeout;
``new_group`` alone would give gloo's 30 minutes). The job runs in child processes, so whatever it does
is a failing test, not a dead suite."""

from __future__ import annotations

from tests._asserts import run_script
from tests._peer_death import TIMEOUT_S


def test_a_dead_peer_fails_the_others_within_the_timeout(tmp_path):
    out = tmp_path / "rank0.txt"
    run_script(["-m", "tests._peer_death", str(out)], timeout=180)
    timeout, elapsed, result = out.read_text().split(" ", 2)
    assert float(timeout) == TIMEOUT_S, f"dmuon's group timeout {timeout} s is not init_process_group's {TIMEOUT_S}"
    assert result.startswith("RuntimeError"), result
    assert float(elapsed) <= TIMEOUT_S + 5, f"rank 0 took {elapsed} s to notice"


def test_trainer_glue_replaces_checkpoint_files_only_once_written(tmp_path, monkeypatch):
    """The HF glue writes optimizer.pt / scheduler.pt to a temporary name and renames it: a crash mid-write
    (here: torch.save raising after writing half a file) leaves the previous file loadable."""
    import torch

    from dmuon.integrations.hf import _files

    path = str(tmp_path / "optimizer.pt")
    _files.save_replacing({"step": 1}, path)
    real_save = torch.save

    def crash(obj, f, *args, **kwargs):
        with open(f, "wb") as fh:
            fh.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crash)
    try:
        _files.save_replacing({"step": 2}, path)
    except OSError:
        pass
    else:
        raise AssertionError("the simulated crash did not happen")
    monkeypatch.setattr(torch, "save", real_save)
    assert torch.load(path) == {"step": 1}
