"""Every way a script can end after dmuon ran, each in real child processes: none may abort.

A gloo worker thread that drops the last collective's tensors after the interpreter began to finalize ends
the process with "terminate called without an active exception" (SIGABRT) after the script's last line;
dmuon frees its groups before that ([Note: groups at exit] in ``dmuon/runtime/comm.py``). The job
(``tests/_exit_job.py``) makes that window likely, not occasional, so one run of each ending checks it.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests._asserts import ROOT, child_env
from tests._exit_job import ENDINGS

WORLD = 2
#: the exit code of a clean ending: the uncaught exception's is Python's 1, every other ending's 0
EXPECTED = {ending: 1 if ending == "raise" else 0 for ending in ENDINGS}


@pytest.mark.parametrize("ending", ENDINGS)
def test_a_script_ends_without_abort(ending, tmp_path):
    store = tmp_path / "store"
    procs = [subprocess.Popen([sys.executable, "-m", "tests._exit_job", ending, str(r), str(WORLD), str(store)],
                              cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(WORLD)]
    outputs = []
    for p in procs:
        try:
            outputs.append(p.communicate(timeout=180))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    codes = [p.returncode for p in procs]
    tails = "\n".join(f"--- rank {r} stderr ---\n{err[-3000:]}" for r, (_, err) in enumerate(outputs))
    assert codes == [EXPECTED[ending]] * WORLD, f"{ending}: exit codes {codes}, expected {EXPECTED[ending]}\n{tails}"
    assert not any("terminate called" in err for _, err in outputs), f"{ending}: aborted\n{tails}"
    if ending == "raise":  # the user's own exception is what ended it, with its traceback
        assert all("the user's script fails after the refusal" in err for _, err in outputs), tails
