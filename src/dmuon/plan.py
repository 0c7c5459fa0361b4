"""``python -m dmuon.plan``: the owner assignment, memory and traffic for a model shape, without a GPU (:mod:`dmuon.tools.plan`).

An entry point only: it forwards to the tool so the command keeps its short name, and the library
never imports it.
"""

from __future__ import annotations

import sys

from dmuon.tools.plan import cli

if __name__ == "__main__":
    sys.exit(cli())
