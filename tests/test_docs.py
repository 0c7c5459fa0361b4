"""The docs site builds with ``mkdocs build --strict``, and its troubleshooting page stays true to the source.

The troubleshooting page quotes each error message dmuon raises, one per line, in the form

    > **ValueError**: `dmuon.dedicate_params: the predicate selected no parameters…`

where ``…`` stands for whatever the message fills in at run time (a name, a shape, a list). Two checks,
both derived from dmuon's source with ``ast`` (nothing is imported, so they cost well under a second):

* no stale entries: every quote matches a string that is still in dmuon's source, and where it matches
  a ``raise``, the quoted exception class is the one raised;
* no missing entries: every ``raise SomeError(<literal, f-string or their sum>)`` in ``dmuon/`` is
  matched by a quote that carries a fair part of its literal text. The few raises whose message has no
  literal text to match are listed in ``NOT_QUOTABLE`` below, each with the reason.

A third check keeps the API reference complete: every name of ``dmuon.__all__`` has its entry there.
The build itself takes a few seconds: griffe reads the docstrings statically, without importing torch.

And the words and code a reader meets: no private names for our own docs, no pointer to a page that does
not exist, and every python block of README.md and docs/ either runs (``test_docs_snippets_run_on_two_cpu_ranks``:
one torchrun job of 2 gloo ranks, about 20 s; the markers are explained above ``PAGES``), is an excerpt
of one that runs, or says why not.
"""

from __future__ import annotations

import ast
import functools
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "src" / "dmuon"
PAGE = ROOT / "docs" / "troubleshooting.md"
REFERENCE = ROOT / "docs" / "reference"
HOLE = "…"  # what a quote (and a rendered message template) shows where the message inserts a value

# A quote must carry at least this many letters and digits of the message's literal text (or all of them,
# for a shorter message), so that a vague quote ("dmuon: ") cannot cover many raises at once.
MIN_QUOTED = 24
# Raises whose literal text has fewer letters and digits than this cannot be matched to a quote.
MIN_LITERAL = 8

# Raises with no literal message text to check the page against: (file under dmuon/, exception class,
# rendered template) -> why, and where the page covers the message instead.
NOT_QUOTABLE = {
    ("optim/groups.py", "ValueError", "…: …"):
        "a hyperparameter error of a user param group, re-raised with the group's name in front; the "
        "hyperparameter messages themselves are quoted",
    ("runtime/guard.py", "NotHeldError", "…"):
        "NotHeldError(_message(...)): the text is built by guard._message, whose f-string the page quotes "
        "(the stale check matches it)",
    ("tools/demo.py", "SystemExit", "…"): "SystemExit(1) after the demo printed its own explanation",
    ("tools/bench.py", "KeyError", "…"): "KeyError(key) from BENCH_PRESETS.__missing__: the dict protocol",
}
# `raise AssertionError(...)` marks a line that cannot be reached: a bug, not a situation a user can fix.
# (dmuon's own internal error, DMuonInternalError, has its entry on the page all the same.)
UNREACHABLE = {"AssertionError"}


# --------------------------------------------------------------------------------------------------- #
# The source side                                                                                       #
# --------------------------------------------------------------------------------------------------- #
def _render(node: ast.expr) -> str:
    """A message expression as its template: literal text kept, every computed part shown as HOLE."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else HOLE for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _render(node.left) + _render(node.right)
    return HOLE


def _letters(text: str) -> int:
    return len(re.sub(r"[\W_]", "", text.replace(HOLE, "")))


@dataclass(frozen=True)
class Raise:
    path: str  # relative to dmuon/
    line: int
    exc: str  # the exception class as written
    template: str


@functools.cache
def _scan_source() -> tuple[list[Raise], list[str]]:
    """Every ``raise X(message, ...)`` in dmuon/, and every other string template (helpers that build
    messages, problem lists that a raise joins), docstrings left out."""
    raises, strings = [], []
    for path in sorted(SOURCE.rglob("*.py")):
        rel = path.relative_to(SOURCE).as_posix()
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        except SyntaxError as e:  # the package would not import either
            pytest.fail(f"dmuon/{rel} does not parse on Python {sys.version.split()[0]}: {e}")
        docstrings = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr)}
        in_fstring = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
        for node in ast.walk(tree):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and node.exc.args:
                func = node.exc.func
                exc = func.id if isinstance(func, ast.Name) else getattr(func, "attr", ast.unparse(func))
                raises.append(Raise(rel, node.lineno, exc, _render(node.exc.args[0])))
            elif (isinstance(node, ast.JoinedStr) or (isinstance(node, ast.Constant) and isinstance(node.value, str)
                                                      and id(node) not in in_fstring)) and id(node) not in docstrings:
                strings.append(_render(node))
    return raises, strings  # the tests only read these lists


# --------------------------------------------------------------------------------------------------- #
# The page side                                                                                         #
# --------------------------------------------------------------------------------------------------- #
_QUOTE = re.compile(r"^> \*\*(?P<exc>\w+)\*\*: (?P<tick>`+) ?(?P<msg>.+?) ?(?P=tick)\s*$")


@dataclass(frozen=True)
class Quote:
    line: int
    exc: str
    msg: str

    def pattern(self) -> re.Pattern[str]:
        return re.compile(".*?".join(re.escape(part) for part in self.msg.split(HOLE)), re.S)


def _quotes() -> list[Quote]:
    out = []
    for i, line in enumerate(PAGE.read_text(encoding="utf-8").splitlines(), start=1):
        m = _QUOTE.match(line)
        if m:
            out.append(Quote(i, m["exc"], m["msg"]))
        elif line.startswith("> **"):
            pytest.fail(f"troubleshooting.md:{i}: looks like a quote but is not `> **Error**: `message``: {line!r}")
    return out


# --------------------------------------------------------------------------------------------------- #
# Tests                                                                                                 #
# --------------------------------------------------------------------------------------------------- #
def test_docs_build_strictly(tmp_path: Path) -> None:
    """``mkdocs build --strict`` into a temporary directory: any warning (a broken link or anchor, a page
    outside the nav, a docstring griffe cannot read) fails the build, and so this test."""
    for module in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python"):
        try:
            __import__(module)
        except ImportError:
            pytest.fail(f"{module} is missing: the docs dependencies come with pip install -e '.[test]'")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # mkdocs-material's banner about MkDocs 2.0
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
         "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{log}"
    warnings = [line for line in log.splitlines() if re.match(r"\s*(WARNING|ERROR)\b", line)]
    assert not warnings, "mkdocs build printed warnings:\n" + "\n".join(warnings)
    assert (tmp_path / "site" / "troubleshooting" / "index.html").is_file()


def test_troubleshooting_quotes_only_messages_that_exist() -> None:
    raises, strings = _scan_source()
    quotes = _quotes()
    assert len(quotes) > 50, f"only {len(quotes)} quotes found on {PAGE.name}: has its format changed?"
    stale = []
    for q in quotes:
        rx = q.pattern()
        matching = [r for r in raises if rx.search(r.template)]
        if matching:
            if q.exc not in {r.exc for r in matching}:
                stale.append(f"line {q.line}: {q.exc}, but dmuon raises {sorted({r.exc for r in matching})} "
                             f"({matching[0].path}:{matching[0].line}): {q.msg!r}")
        elif not any(rx.search(s) for s in strings):
            stale.append(f"line {q.line}: no string in dmuon/ reads {q.msg!r}")
    assert not stale, "troubleshooting.md quotes messages dmuon no longer has:\n" + "\n".join(stale)


def test_troubleshooting_covers_every_raised_message() -> None:
    raises, _ = _scan_source()
    quotes = [(q, q.pattern()) for q in _quotes()]
    missing, unlisted = [], []
    for r in raises:
        if r.exc in UNREACHABLE:
            continue
        if _letters(r.template) < MIN_LITERAL:
            if (r.path, r.exc, r.template) not in NOT_QUOTABLE:
                unlisted.append(f"dmuon/{r.path}:{r.line}: raise {r.exc}({r.template!r})")
            continue
        need = min(MIN_QUOTED, _letters(r.template))
        if not any(_letters(q.msg) >= need and rx.search(r.template) for q, rx in quotes):
            missing.append(f"dmuon/{r.path}:{r.line}: {r.exc}: {r.template}")
    assert not missing, (
        f"{PAGE.relative_to(ROOT)} has no entry for these messages (add each, quoted as "
        f"`> **Error**: `text with {HOLE} for values``, with its cause and fix):\n" + "\n".join(missing)
    )
    assert not unlisted, (
        "these raises have no literal message text to check the troubleshooting page against; give them "
        "one, or list them in NOT_QUOTABLE with the reason:\n" + "\n".join(unlisted)
    )
    present = {(r.path, r.exc, r.template) for r in raises}
    gone = [key for key in NOT_QUOTABLE if key not in present]
    assert not gone, f"NOT_QUOTABLE lists raises that are gone: {gone}"


def _all_of(path: Path) -> list[str]:
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise AssertionError(f"{path} has no __all__")


def test_api_reference_lists_every_public_name() -> None:
    """Every name of ``dmuon.__all__`` has an entry on the reference page (modules: a page of their own)."""
    page = (REFERENCE / "dmuon.md").read_text(encoding="utf-8")
    documented = set(re.findall(r"^::: dmuon\.(\w+)\s*$", page, re.M))
    modules = {p.stem for p in REFERENCE.glob("*.md")}
    missing = [n for n in _all_of(SOURCE / "__init__.py") if n not in documented and n not in modules]
    assert not missing, f"docs/reference/dmuon.md has no `::: dmuon.NAME` entry for {missing}"


# --------------------------------------------------------------------------------------------------- #
# Words a reader can follow                                                                              #
# --------------------------------------------------------------------------------------------------- #
#: What a reader sees: the README, the docs pages, the examples and dmuon's own docstrings and messages.
USER_FACING = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "examples").glob("*.py")),
               *sorted(SOURCE.rglob("*.py"))]
#: Names for our docs that only the people who wrote them knew ("the seed" was the design brief the README
#: grew from), and recipe headings quoted from it that exist on no page.
PRIVATE_WORDS = re.compile(r"\bthe seed\b|\bseed's\b|\bseed recipes?\b|\"[A-Z][\w ]+\"( integration)? recipes?", re.I)


def test_user_facing_text_names_pages_that_exist() -> None:
    """No private names for our docs, and every ``docs/....md`` a docstring or page points to exists."""
    private, missing = [], []
    for path in USER_FACING:
        rel = path.relative_to(ROOT).as_posix()
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if PRIVATE_WORDS.search(line):
                private.append(f"{rel}:{i}: {line.strip()}")
            for page in re.findall(r"\bdocs/[\w./-]+?\.md\b", line):
                if not (ROOT / page).is_file():
                    missing.append(f"{rel}:{i}: {page}")
    assert not private, "name our own docs pages instead:\n" + "\n".join(private)
    assert not missing, "these point to docs pages that do not exist:\n" + "\n".join(missing)


# --------------------------------------------------------------------------------------------------- #
# Snippets that run                                                                                     #
# --------------------------------------------------------------------------------------------------- #
# Every ```python block of README.md and docs/ carries a marker on the line before its fence:
#
#   <!-- run: program[; stand-ins: A, B] -->     a whole script; the stand-ins are names the page leaves to
#                                                the reader (tests/_docs_stand_ins.py defines them)
#   <!-- run: custom-loop, WHERE -->             lines of the custom-loop guide's program, which it runs
#                                                with them: WHERE is one of PLACES below
#   <!-- excerpt: PAGE -->                       every code line is a line of PAGE's runnable snippets
#   <!-- not run: REASON -->                     an outline, not meant to run as is
#   <!-- runnable: KIND -->                      README.md's own blocks (tests/test_readme.py runs them)
#
# All "run" snippets run in one torchrun job of 2 CPU ranks (tests/_docs_snippets.py).
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
CONTEXT_PAGE = ROOT / "docs" / "guides" / "custom-loop.md"
PLACES = ("replacing its dmuon lines", "replacing its dmuon lines and loop", "replacing its optimizer line",
          "replacing its loop", "after its loop")
_BLOCK = re.compile(r"^(?P<marker>[^\n]*)\n```python\n(?P<code>.*?)^```", re.M | re.S)
_MARKER = re.compile(r"<!-- (?P<kind>run|excerpt|not run|runnable): (?P<arg>.+?) -->")


@dataclass(frozen=True)
class Snippet:
    page: Path
    line: int  # of the fence
    kind: str
    arg: str
    code: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT).as_posix()}:{self.line}"


def _snippets() -> list[Snippet]:
    out = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for m in _BLOCK.finditer(text):
            line = text.count("\n", 0, m.start("code"))
            marker = _MARKER.fullmatch(m["marker"].strip())
            if not marker:
                pytest.fail(f"{page.relative_to(ROOT)}:{line}: a python block without a marker on the line before "
                            f"its fence (<!-- run: ... -->, <!-- excerpt: PAGE -->, <!-- not run: REASON -->)")
            out.append(Snippet(page, line, marker["kind"], marker["arg"], m["code"]))
    return out


def _context() -> tuple[list[str], tuple[str, ...]]:
    """The custom-loop guide's program as lines, and its stand-ins."""
    (program,) = [s for s in _snippets() if s.page == CONTEXT_PAGE and s.kind == "run"]
    return program.code.splitlines(), _stand_ins(program.arg)


def _stand_ins(arg: str) -> tuple[str, ...]:
    _, _, names = arg.partition("; stand-ins: ")
    return tuple(n.strip() for n in names.split(",") if n.strip())


def _script(s: Snippet) -> tuple[str, tuple[str, ...]]:
    """The whole script a "run" snippet runs as, and its stand-ins."""
    if s.arg.startswith("program"):
        return s.code, _stand_ins(s.arg)
    place = s.arg.removeprefix("custom-loop, ")
    assert place in PLACES, f"{s.where}: unknown place {s.arg!r}; one of {PLACES}"
    lines, stand_ins = _context()

    def first(prefix: str) -> int:
        return next(i for i, line in enumerate(lines) if line.startswith(prefix))

    ded, opt, loop = first("dmuon.dedicate_params"), first("optimizer = dmuon.Muon"), first("for batch in dataloader")
    frag = s.code.splitlines()
    parts = {"replacing its dmuon lines": lines[:ded] + frag + [""] + lines[loop:],
             "replacing its dmuon lines and loop": lines[:ded] + frag,
             "replacing its optimizer line": lines[:opt] + frag + [""] + lines[loop:],
             "replacing its loop": lines[:loop] + frag,
             "after its loop": lines + [""] + frag}[place]
    return "\n".join(parts) + "\n", stand_ins


def _code_lines(code: str) -> list[str]:
    """Statements of a block as comparable lines: comments and blank lines dropped, spaces trimmed."""
    out = []
    for line in code.splitlines():
        line = re.sub(r"\s+#.*$", "", line).strip()
        if line and not line.startswith("#"):
            out.append(line)
    return out


def test_every_python_block_is_marked_and_every_excerpt_is_runnable_code() -> None:
    snippets = _snippets()
    assert len([s for s in snippets if s.kind == "run"]) >= 15, "fewer runnable snippets than expected"
    runnable: dict[Path, set[str]] = {}
    for s in snippets:
        if s.kind == "run":
            runnable.setdefault(s.page, set()).update(_code_lines(_script(s)[0]))
    for s in snippets:
        if s.kind == "excerpt":
            source = ROOT / s.arg
            assert source in runnable, f"{s.where}: {s.arg} has no runnable snippet to excerpt"
            stray = [line for line in _code_lines(s.code) if line not in runnable[source]]
            assert not stray, f"{s.where}: lines that are not in {s.arg}'s runnable snippets: {stray}"
        else:
            assert s.kind in ("run", "not run", "runnable"), (s.where, s.kind)


def test_docs_snippets_run_on_two_cpu_ranks(tmp_path: Path) -> None:
    """Each "run" snippet as its whole script, in one torchrun job of 2 gloo ranks (about 40 s here)."""
    import json

    from tests._asserts import child_env

    for module in ("transformers", "accelerate"):
        try:
            __import__(module)
        except ImportError:
            pytest.fail(f"{module} is missing: the HF guides' snippets need it (pip install -e '.[test]')")
    spec = []
    for s in _snippets():
        if s.kind == "run":
            code, stand_ins = _script(s)
            spec.append({"id": s.where, "code": code, "stand_ins": list(stand_ins)})
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(ROOT / "tests" / "_docs_snippets.py"), str(tmp_path / "spec.json"), str(tmp_path)],
                          cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=600)
    ranks = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank*.json"))]
    failed = {sid: r["outcome"] for rank in ranks for sid, r in rank.items() if r["outcome"] != "ok"}
    assert not failed, "docs snippets that do not run as written:\n" + "\n".join(
        f"--- {sid} (as the script below)\n{tb}\n{_numbered(next(x['code'] for x in spec if x['id'] == sid))}"
        for sid, tb in failed.items())
    assert len(ranks) == 2 and all(len(r) == len(spec) for r in ranks), proc.stdout[-3000:] + proc.stderr[-6000:]
    assert proc.returncode == 0, proc.stderr[-6000:]


def _numbered(code: str) -> str:
    return "\n".join(f"{i:4} {line}" for i, line in enumerate(code.splitlines(), start=1))


def test_the_trainer_guide_counts_the_lines_it_marks() -> None:
    """docs/guides/hf-trainer.md says how many lines of a Trainer script change and marks each `# dmuon`."""
    page = ROOT / "docs" / "guides" / "hf-trainer.md"
    (program,) = [s for s in _snippets() if s.page == page and s.kind == "run"]
    marked = sum("# dmuon" in line for line in program.code.splitlines())
    stated = re.search(r"Against a plain `Trainer` script, (\d+) lines change", page.read_text(encoding="utf-8"))
    assert stated and int(stated.group(1)) == marked, (stated and stated.group(0), marked)


def test_the_docs_requirements_are_the_docs_extra() -> None:
    """requirements-docs.txt (the docs alone, no torch) and the `docs` / `test` extras pin the same packages."""
    wanted = sorted(line.strip() for line in (ROOT / "requirements-docs.txt").read_text().splitlines()
                    if line.strip() and not line.startswith("#"))
    pyproject = (ROOT / "pyproject.toml").read_text()
    extras = {m["name"]: re.findall(r'"([^"]+)"', m["deps"])  # a list ends with the "]" that ends its line
              for m in re.finditer(r"^(?P<name>\w+) = \[(?P<deps>.*?)\]$", pyproject, re.M | re.S)}
    assert sorted(extras["docs"]) == wanted, (extras["docs"], wanted)
    assert set(wanted) <= set(extras["test"]), extras["test"]
