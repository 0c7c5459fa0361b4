"""README.md's copy-paste blocks do what the README says.

Blocks a reader is meant to run as they are carry a marker line before the fence, ``<!-- runnable: KIND -->``:

* ``demo``: clone, install, ``python -m dmuon.demo`` (run by hand on a fresh machine; here only its shape
  is checked, since it clones and installs);
* ``tests``: install and run this suite; ``.ci/run`` must run the same commands, so CI tests what a reader
  would (the block is not re-run from inside the suite it starts);
* ``script``: the complete minimal script, run here on 2 CPU ranks with the torchrun line the README gives.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

from tests._asserts import ROOT, child_env

README = ROOT / "README.md"
MARKED = re.compile(r"<!-- runnable: (\w+) -->\n```(\w+)\n(.*?)```", re.S)


def runnable_blocks() -> dict[str, tuple[str, str]]:
    """``{kind: (language, text)}`` of README's marked blocks; a kind marked twice is an error."""
    blocks: dict[str, tuple[str, str]] = {}
    for kind, lang, text in MARKED.findall(README.read_text()):
        assert kind not in blocks, f"README.md marks two blocks '<!-- runnable: {kind} -->'"
        blocks[kind] = (lang, text)
    return blocks


def _commands(text: str) -> list[str]:
    """Shell commands of a block or script, one per ``&&`` part, comments and ``set``/``cd`` lines dropped,
    and spelled one way: ``pip`` as ``python -m pip``, without ``-q``."""
    out = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        for part in filter(None, (p.strip() for p in line.split("&&"))):
            words = [w for w in shlex.split(part) if w != "-q"]
            if words[0] == "pip":
                words = ["python", "-m", "pip", *words[1:]]
            if words[0] not in ("set", "cd"):
                out.append(" ".join(words))
    return out


def test_every_marked_kind_is_there_once() -> None:
    blocks = runnable_blocks()
    assert set(blocks) == {"demo", "tests", "script"}, sorted(blocks)
    assert [lang for lang, _ in blocks.values()] == ["bash", "bash", "python"]
    demo = blocks["demo"][1]
    assert "git clone" in demo and "python -m dmuon.demo" in demo and "torch==2.13.0" in demo, demo


def test_the_clone_keeps_the_package_name() -> None:
    """A clone folder named ``dmuon`` beside a script used to be imported as an empty namespace package in place
    of the installed dmuon (``module 'dmuon' has no attribute 'dedicate_params'``), so README cloned into
    ``dmuon-src``. The package now sits in ``src/dmuon``: README clones under the package's own name, and
    ``.ci/bare_install.py`` clones into that name and runs the script from beside the clone to prove it."""
    demo = runnable_blocks()["demo"][1]
    clone = re.search(r'git clone "\$DMUON_REPO" (\S+) && cd (\S+)', demo)
    assert clone and clone.group(1) == clone.group(2) == "dmuon", demo
    assert (ROOT / "src" / "dmuon" / "__init__.py").is_file()
    assert 'CLONE_NAME = "dmuon"' in (ROOT / ".ci" / "bare_install.py").read_text()


def test_ci_installs_the_bare_package_and_runs_the_readme_script() -> None:
    """CI checks README's path on a clean venv with no extras, so an undeclared dependency fails CI (numpy,
    which torch's object collectives need, was one); the test extras would hide it."""
    ci = _commands((ROOT / ".ci" / "run").read_text())
    assert "python .ci/bare_install.py" in ci, ci
    script = (ROOT / ".ci" / "bare_install.py").read_text()
    assert '"-m", "venv"' in script and "system-site-packages" not in script.replace("(no system site-packages)", "")


def test_ci_runs_the_readme_test_command() -> None:
    readme = _commands(runnable_blocks()["tests"][1])
    assert readme == ['python -m pip install torch==2.13.0 -e .[test,torchtitan]', "python -m pytest tests"], readme
    ci = _commands((ROOT / ".ci" / "run").read_text())
    assert ci[-len(readme):] == readme, f".ci/run ends with {ci[-len(readme):]}, README.md says {readme}"


def test_minimal_script_trains_on_two_cpu_ranks(tmp_path: Path) -> None:
    """The script block, saved as minimal.py and started with the README's first torchrun line."""
    script = runnable_blocks()["script"][1]
    (tmp_path / "minimal.py").write_text(script)
    readme = README.read_text()
    launch = re.search(r"^torchrun (--standalone --nproc_per_node 2 minimal\.py)", readme, re.M)
    assert launch, "README.md lost its 'torchrun --standalone --nproc_per_node 2 minimal.py' line"
    cmd = [sys.executable, "-m", "torch.distributed.run", *launch.group(1).split()]
    proc = subprocess.run(cmd, cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-6000:]
    match = re.search(r"^minimal: OK loss (\d+\.\d+) -> (\d+\.\d+)$", proc.stdout, re.M)
    assert match, proc.stdout + proc.stderr[-3000:]
    first, last = map(float, match.groups())
    assert last < 0.5 * first, (first, last)
    # dedicate_params prints its plan on rank 0 by default: once, not once per rank
    assert proc.stdout.count("dmuon: 4 dedicated params over 2 ranks") == 1, proc.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["minimal.py"]  # it writes nothing


#: a call in the first cell of an API-table row: ``name(params)``, ``name`` maybe dotted (``dmuon.diagnostics.x``)
_API_CALL = re.compile(r"`((?:dmuon\.)?[\w.]+)\(([^`]*)\)`")


def _top_level_params(params: str) -> list[str]:
    """The parameter names of ``a, b=(1, 2), *, c=[...]``: split at commas outside brackets, ``*`` dropped."""
    names, depth, start = [], 0, 0
    for i, ch in enumerate(params + ","):
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            name = params[start:i].split("=")[0].strip()
            if name and name != "*":
                names.append(name)
            start = i + 1
    return names


def test_api_table_names_every_option() -> None:
    """Each row of README's API table lists every parameter with a default of the function it names (issue 31:
    ``dedicate_params``' row had no ``blocks=``), and no option the function lacks; ``...`` marks a row that
    lists only some."""
    import importlib
    import inspect

    api = README.read_text().split("\n## API\n", 1)[1].split("\n## ", 1)[0]
    checked = []
    for row in (line for line in api.splitlines() if line.startswith("| `")):
        home = "dmuon"  # a bare name after a dotted one lives in the dotted one's module
        for name, params in _API_CALL.findall(row.split(" | ")[0]):
            parts = name.split(".")
            if len(parts) > 1:
                home = ".".join(parts[:-1] if parts[0] == "dmuon" else ["dmuon", *parts[:-1]])
            fn = getattr(importlib.import_module(home), parts[-1], None)
            assert callable(fn), f"README.md's API table names {name}, which {home} does not have"
            listed = _top_level_params(params)
            sig = inspect.signature(fn).parameters
            options = [p for p, v in sig.items() if v.default is not inspect.Parameter.empty]
            missing = [] if "..." in listed else [p for p in options if p not in listed]
            unknown = [p for p in listed if f"{p}=" in params and p not in sig]
            assert not missing, f"README.md's API table: {name}(...) does not list {missing}"
            assert not unknown, f"README.md's API table: {name}(...) lists options it does not have: {unknown}"
            checked.append(name)
    assert {"dedicate_params", "Muon", "clip_grad_norm_"} <= set(checked), checked
