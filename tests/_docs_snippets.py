"""Runs the docs' snippets on every rank of one torchrun job (``tests/test_docs.py`` starts it).

    torchrun --standalone --nproc_per_node 2 tests/_docs_snippets.py SPEC.json OUT_DIR

``SPEC.json`` is a list of ``{"id", "code", "stand_ins"}``: each ``code`` is a whole script (a page's
program, or the custom-loop program with a page's fragment in place), run with ``exec`` in a fresh
``__main__`` namespace, from a folder of its own that every rank shares. The names in ``stand_ins`` are
defined first, from :mod:`tests._docs_stand_ins` (what the pages say stands for the reader's model or data).

One thing differs from running each script alone: the job keeps one process group. It is created here
before the first script, and a script's own ``dist.init_process_group`` / ``destroy_process_group`` calls
run but do nothing (torch 2.13 on gloo can hang when a process re-creates its default group: the store
keys of the previous group are reused). Each rank writes ``OUT_DIR/rank<R>.json``: per script ``"ok"`` or
the traceback, and the seconds it took; after a failure the rank stops, since the other ranks may be
waiting in a collective of the failed script.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests._docs_stand_ins
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # and dmuon itself

from tests import _docs_stand_ins  # noqa: E402


def main() -> int:
    spec = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    real_init, real_destroy = dist.init_process_group, dist.destroy_process_group
    dist.init_process_group = lambda *a, **k: None  # the scripts' own calls: see the module docstring
    dist.destroy_process_group = lambda *a, **k: None
    results: dict[str, dict[str, object]] = {}
    home = os.getcwd()
    try:
        for item in spec:
            workdir = out / "work" / item["id"].replace("/", "_").replace("#", "_")
            workdir.mkdir(parents=True, exist_ok=True)
            os.chdir(workdir)
            t0 = time.perf_counter()
            namespace: dict[str, object] = {"__name__": "__main__"}
            try:
                for name in item["stand_ins"]:
                    namespace[name] = _docs_stand_ins.make(name, workdir=out)
                exec(compile(item["code"], item["id"], "exec"), namespace)  # noqa: S102 - our own docs
                outcome = "ok"
            except BaseException:  # noqa: BLE001 - reported to the test, which fails with it
                outcome = traceback.format_exc()
            finally:
                namespace.clear()  # free FSDP2 modules before the next script (and before teardown)
                gc.collect()
                os.chdir(home)
            results[item["id"]] = {"outcome": outcome, "seconds": round(time.perf_counter() - t0, 2)}
            (out / f"rank{rank}.json").write_text(json.dumps(results, indent=1))
            if outcome != "ok":
                return 1
            dist.barrier()  # the next script starts together on every rank
    finally:
        dist.init_process_group, dist.destroy_process_group = real_init, real_destroy
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
