"""``python -m dmuon.demo``: the demo: dmuon next to FSDP2 + AdamW on a few local ranks (:mod:`dmuon.tools.demo`).

An entry point only: it forwards to the tool so the command keeps its short name, and the library
never imports it.
"""

from __future__ import annotations

import sys

from dmuon.tools.demo import main

if __name__ == "__main__":
    sys.exit(main())
