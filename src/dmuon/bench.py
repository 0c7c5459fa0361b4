"""``python -m dmuon.bench``: the benchmark of dmuon against FSDP2 + AdamW, naive FSDP2 + Muon and torch.optim.Muon (:mod:`dmuon.tools.bench`).

An entry point only: it forwards to the tool so the command keeps its short name, and the library
never imports it.
"""

from __future__ import annotations

import sys

from dmuon.tools.bench import main

if __name__ == "__main__":
    sys.exit(main())
