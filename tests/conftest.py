"""Every process the tests start imports this checkout's dmuon, also when another dmuon is installed.

pytest's ``pythonpath = ["src"]`` (pyproject.toml) reaches only the test process itself. The ranks of
``tests/_dist.run_distributed`` fork from a forkserver that imports dmuon *before* it takes the parent's
``sys.path`` (its preload), so without this it would import whatever ``pip install -e`` last pointed at;
``PYTHONPATH`` is read when an interpreter starts, by the forkserver and every subprocess alike.
"""

from __future__ import annotations

import os
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(_ROOT / "src"), str(_ROOT), os.environ.get("PYTHONPATH", "")) if p)
