"""CI: the README's first steps on a bare install, in a clean venv, laid out the way the README lays them out.

    python .ci/bare_install.py [--keep]

What a newcomer does, with nothing that the test extras would bring along:

1. clone this checkout into a temporary folder named ``dmuon`` (what ``git clone URL`` creates, and the name
   README.md's clone command uses);
2. a fresh ``python -m venv`` (no system site-packages), then ``pip install torch==X -e CLONE`` with no
   extras (the torch pin read from README.md's install line);
3. README.md's complete script saved as ``minimal.py`` *beside* the clone (not inside it) and started with
   the README's torchrun line on 2 CPU ranks (gloo): it must print ``minimal: OK``;
4. ``python -m dmuon.demo`` for a few steps from the same venv.

So a dependency dmuon uses but does not declare (numpy was one: torch's object collectives need it and
torch does not declare it) fails here, and so does a clone folder that shadows the package: with the package
at the checkout's top, a folder named ``dmuon`` beside the script was imported as an empty namespace package
instead of the installed dmuon; the ``src/`` layout is what lets the clone keep that name.
The clone is of the committed tree (HEAD); uncommitted changes are not in it. Uses only the standard
library, so it runs before anything is installed. Exit code 0 on success.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
#: the clone's folder: the package's own name, the one that shadowed it before the src/ layout
CLONE_NAME = "dmuon"


def _block(text: str, kind: str) -> str:
    match = re.search(rf"<!-- runnable: {kind} -->\n```\w+\n(.*?)```", text, re.S)
    if not match:
        sys.exit(f"bare_install: README.md has no '<!-- runnable: {kind} -->' block")
    return match.group(1)


def _run(cmd: list[str], cwd: Path, env: dict[str, str], what: str, timeout: float) -> str:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    print(f"bare_install: {what}: {time.perf_counter() - t0:.1f} s, exit code {proc.returncode}", flush=True)
    if proc.returncode != 0:
        sys.stdout.write(proc.stdout[-6000:])
        sys.stdout.write(proc.stderr[-6000:])
        sys.exit(f"bare_install: FAILED at: {what}\n  {' '.join(cmd)}\n  (in {cwd})")
    return proc.stdout


def main() -> int:
    t_start = time.perf_counter()
    readme = README.read_text(encoding="utf-8")
    demo = _block(readme, "demo")
    clone = re.search(r'git clone "\$DMUON_REPO" (\S+) && cd (\S+)', demo)
    torch_pin = re.search(r"torch==[\w.+]+", demo)
    launch = re.search(r"^torchrun (--standalone --nproc_per_node 2 minimal\.py)", readme, re.M)
    if not (clone and torch_pin and launch):
        sys.exit("bare_install: README.md lost its clone line, its torch pin or its torchrun line for minimal.py")
    if clone.group(1) != CLONE_NAME or clone.group(2) != CLONE_NAME:
        sys.exit(f"bare_install: README.md clones into {clone.group(1)!r}; this check clones into {CLONE_NAME!r}, "
                 "the name a plain `git clone` gives")

    tmp = Path(tempfile.mkdtemp(prefix="dmuon_bare_"))
    try:
        env = {k: v for k, v in os.environ.items()
               if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME", "PIP_USER")}
        src = tmp / CLONE_NAME
        _run(["git", "clone", "-q", str(ROOT), str(src)], tmp, env, f"git clone into {src.name}/", 120)
        venv = tmp / "venv"
        _run([sys.executable, "-m", "venv", str(venv)], tmp, env, "python -m venv (clean)", 120)
        python = str(venv / "bin" / "python")
        _run([python, "-m", "pip", "install", "-q", torch_pin.group(0), "-e", str(src)], tmp, env,
             f"pip install {torch_pin.group(0)} -e {src.name} (no extras)", 900)
        listed = _run([python, "-m", "pip", "list", "--format", "freeze"], tmp, env, "pip list", 60)
        print("bare_install: installed: " + " ".join(sorted(listed.split())), flush=True)

        run_env = dict(env, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
        (tmp / "minimal.py").write_text(_block(readme, "script"))  # beside the clone, as a reader may save it
        out = _run([python, "-m", "torch.distributed.run", *launch.group(1).split()], tmp, run_env,
                   "torchrun --standalone --nproc_per_node 2 minimal.py", 300)
        if not re.search(r"^minimal: OK loss", out, re.M):
            sys.stdout.write(out)
            sys.exit("bare_install: FAILED: minimal.py did not print 'minimal: OK'")
        out = _run([python, "-m", "dmuon.demo", "--steps", "5", "--out", str(tmp / "demo_out")], tmp, run_env,
                   "python -m dmuon.demo --steps 5", 300)
        if "dmuon demo finished" not in out:
            sys.stdout.write(out)
            sys.exit("bare_install: FAILED: the demo did not finish")
    finally:
        if "--keep" in sys.argv:
            print(f"bare_install: kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"bare_install: OK in {time.perf_counter() - t_start:.0f} s (README script and demo on a bare install)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
