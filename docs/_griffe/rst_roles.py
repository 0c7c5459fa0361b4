"""A griffe extension for the API reference: dmuon's docstrings use a little reStructuredText
(``:func:`name```, ``:math:`x```, ``.. math::``, the form torch's docstrings use), which mkdocstrings
renders as Markdown. Without this, the roles would show up verbatim.

Roles become code spans (``:class:`~dmuon.partition.OwnerPlan``` reads ``OwnerPlan``, as in Sphinx); a
``.. math::`` block becomes an indented code block: the site builds and reads offline, so no MathJax.
Only the docstring text of the rendered objects changes; the source is not touched.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:func|class|mod|meth|attr|data|exc|obj|math):`(~?)([^`]+)`")
_MATH = re.compile(r"^(?P<indent>[ \t]*)\.\. math::[ \t]*$", re.M)


def _role(m: re.Match[str]) -> str:
    tilde, target = m.groups()
    return f"`{target.rsplit('.', 1)[-1] if tilde else target}`"


def convert(text: str) -> str:
    """reST roles to code spans, ``.. math::`` to a lead-in line and an indented (code) block."""
    return _MATH.sub(lambda m: f"{m['indent']}In symbols:\n", _ROLE.sub(_role, text))


class RstRoles(griffe.Extension):
    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = convert(obj.docstring.value)
