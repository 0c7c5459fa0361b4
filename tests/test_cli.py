"""What a newcomer types first: an example's ``--help`` or a wrong argument, and a tool's output piped into ``head``.

* Every example reads its command line before it starts ranks (``dmuon.tools.launch.main_or_spawn``):
  ``--help`` prints the help and exits 0, a wrong argument prints one usage error and exits 2, and neither
  starts ranks (no "starting 2 local ranks", no training, no torchrun ``ChildFailedError``).
* ``python -m dmuon.demo | head -3`` and ``python -m dmuon.bench | head -3``: the reader leaves after three
  lines; the run goes on to its end quietly (its files are written) and exits 0, with no traceback, and no
  rank of the demo fails in a collective ("Connection closed by peer").

Every case is a real subprocess started as a user would start it; the ones that must not start ranks are
cheap (their cost is importing torch and the example's libraries), so they run side by side.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests._asserts import ROOT, child_env

#: against a hang only (what these runs take is a few seconds each)
TIMEOUT_S = 180
EXAMPLES = sorted(p.name for p in (ROOT / "examples").glob("*.py") if p.name != "__init__.py")
#: what a failure in any process of a job looks like on stderr
CRASH_SIGNS = ("Traceback", "BrokenPipeError", "Connection closed", "ChildFailedError", "Exception ignored")


def _env() -> dict[str, str]:
    """A user's shell: no torchrun variables, so an example that starts ranks would do it itself."""
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    return {k: v for k, v in child_env().items() if k not in drop}


def _run(args: list[str]) -> subprocess.CompletedProcess[str]:
    """``python ARGS`` in its own session, so a run that started ranks and hangs is killed with all of them."""
    proc = subprocess.Popen([sys.executable, *args], cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        err += f"\n(killed after {TIMEOUT_S} s)"
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


def _run_all(cases: list[list[str]]) -> list[subprocess.CompletedProcess[str]]:
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        return list(pool.map(_run, cases))


def _description(example: str) -> str:
    """The first paragraph of the example's docstring, whitespace folded: what its ``--help`` must say."""
    text = (ROOT / "examples" / example).read_text()
    doc = re.search(r'"""(.*?)"""', text, re.S)
    assert doc, example
    return " ".join(doc.group(1).split("\n\n")[0].split())


def test_every_example_answers_help_without_starting_ranks() -> None:
    results = _run_all([[f"examples/{name}", "--help"] for name in EXAMPLES])
    for name, proc in zip(EXAMPLES, results):
        what = f"{name} --help: exit {proc.returncode}\n--- stdout ---\n{proc.stdout[-3000:]}\n--- stderr ---\n" \
               f"{proc.stderr[-3000:]}"
        assert proc.returncode == 0, what
        assert proc.stdout.startswith(f"usage: {name} [-h]"), what
        assert _description(name) in " ".join(proc.stdout.split()), what
        assert "local ranks" not in proc.stdout and not any(s in proc.stderr for s in CRASH_SIGNS), what


def test_a_wrong_argument_is_one_usage_error_before_any_rank() -> None:
    cases = [[f"examples/{name}", "--no-such-option"] for name in EXAMPLES]
    cases.append(["examples/hf_dmuon.py", "--arch", "gpt2"])  # issue 31's report: printed twice under ChildFailedError
    for args, proc in zip(cases, _run_all(cases)):
        name = Path(args[0]).name
        what = f"{' '.join(args)}: exit {proc.returncode}\n--- stdout ---\n{proc.stdout[-3000:]}\n--- stderr ---\n" \
               f"{proc.stderr[-3000:]}"
        assert proc.returncode == 2, what
        assert "local ranks" not in proc.stdout, what
        assert proc.stderr.count("usage: ") == 1 and proc.stderr.count(f"{name}: error: ") == 1, what
        wrong = "unrecognized arguments: --no-such-option" if args[1] == "--no-such-option" else \
            "argument --arch: invalid choice: 'gpt2'"
        assert wrong in proc.stderr and not any(s in proc.stderr for s in CRASH_SIGNS), what


def _head_3(args: list[str], tmp_path: Path) -> tuple[list[str], int, str]:
    """``python ARGS | head -3``: read three lines of a real pipe, close the reader, wait for the writer.

    Returns the lines, the writer's exit code and its stderr."""
    err_path = tmp_path / "stderr.txt"
    with open(err_path, "w") as err:
        proc = subprocess.Popen([sys.executable, *args], cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=err,
                                text=True, start_new_session=True)
        try:
            lines = [proc.stdout.readline() for _ in range(3)]
            proc.stdout.close()  # the reader is gone: every later write of the job meets a closed pipe
            rc = proc.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            rc = proc.wait()
    return lines, rc, err_path.read_text()


def test_demo_piped_into_head_finishes_quietly(tmp_path: Path) -> None:
    """Rank 0 writes into the closed pipe while training (its progress lines, its tables): before the fix it
    died of BrokenPipeError and rank 1 then of "Connection closed by peer" in its next collective."""
    out = tmp_path / "demo_out"
    lines, rc, err = _head_3(["-m", "dmuon.demo", "--steps", "5", "--out", str(out)], tmp_path)
    assert lines[0].startswith("dmuon demo: 2 ranks on cpu (gloo)"), lines
    assert rc == 0 and not any(s in err for s in CRASH_SIGNS), f"exit {rc}\n{err[-6000:]}"
    assert (out / "loss.png").is_file(), "the demo stopped before its plot"  # the job ran to its end


def test_bench_piped_into_head_finishes_quietly(tmp_path: Path) -> None:
    """Three variants: three "[round ...]" lines fill ``head -3``; the table comes after the reader left."""
    out = tmp_path / "bench_out"
    lines, rc, err = _head_3(["-m", "dmuon.bench", "--preset", "tiny", "--variants", "fsdp_adamw,torch_muon,dmuon_z3",
                              "--rounds", "1", "--steps", "1", "--warmup", "0", "--e2e-steps", "1", "--out", str(out)],
                             tmp_path)
    assert [line.split(" ...")[0] for line in lines] == [
        "[round 1/1, 1/3] fsdp_adamw", "[round 1/1, 2/3] torch_muon", "[round 1/1, 3/3] dmuon_z3"], lines
    assert rc == 0 and not any(s in err for s in CRASH_SIGNS), f"exit {rc}\n{err[-6000:]}"
    assert (out / "results.json").is_file() and (out / "chart.png").is_file(), "the bench stopped before its files"
