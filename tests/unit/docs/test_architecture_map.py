"""docs/architecture.md stays true to the code it maps.

The map's conventions (its introduction states them) make every name in it checkable:

- a backticked ``path.py:name`` or ``path.py:Class.member`` names a top-level def, class or
  assignment of that file, or a member of that class (a method, a class attribute, a
  dataclass field, an attribute its methods set on ``self``, or one of a base class defined
  in the same file);
- a path is relative to ``services/`` unless it starts with one of ``ROOTED``; in the
  module tables, a file is relative to the directory in the table's heading;
- a bare ``Class.member`` is defined in a file the same step (or anywhere in the map)
  names, or, for a gRPC service's name, is an rpc of ``shared/proto/*.proto``;
- every module under services/ and shared/ but generated code and ``__init__``/``__main__``
  has exactly one line in the module tables.

A reference may wrap across a line break inside its backticks. Each test lists every
problem it finds, by line of the map, so one run says all that is missing.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
MAP = ROOT / "docs" / "architecture.md"
ROOTED = ("shared/", "bench/", "clients/", "tests/", "tools/", "docs/")
MAPPED = ("services", "shared")  # every module of these has a line in the tables
PACKAGES_SECTION = "## Packages"

FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
SPAN = re.compile(r"`([^`]+)`")
REF = re.compile(r"^(?P<path>[\w./-]+\.py):(?P<name>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)?)$")
FILE = re.compile(r"^[\w.-]+(?:/[\w.-]+)+\.(?:py|md|proto|js|json|yaml|toml|html)$")
BARE = re.compile(r"^(?P<cls>[A-Z]\w*)\.(?P<member>(?!(?:md|py|proto|txt)$)[A-Za-z_]\w*)$")
NUMBERED = re.compile(r"^\d+[a-z]?\.")  # a step of a walk starts a new segment
RPC = re.compile(r"^service\s+(\w+)\s*\{(.*?)^\}", re.MULTILINE | re.DOTALL)


@dataclass(frozen=True)
class Span:
    """One backticked name of the map."""

    text: str  # whitespace removed: a reference may wrap inside its backticks
    line: int
    segment: int  # the step, paragraph or table row it is in
    base: str | None  # in a module table: the heading's directory (from the root)


def _blank_fences(text: str) -> str:
    """``text`` with fenced blocks (pictures) blanked, line count kept."""
    return FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)


def _heading_base(heading: str) -> str:
    """The directory a module table's heading names ("services/" when it names none)."""
    for raw in SPAN.findall(heading):
        if raw.endswith("/"):
            return raw if raw.startswith(ROOTED) else "services/" + raw
    return "services/"


def read_map(text: str) -> list[Span]:
    """Every backticked name outside the pictures, with its line, its segment (a new one
    at each heading, blank line, numbered step and table row) and, in a module table of
    the Packages section, the directory its heading names."""
    lines = _blank_fences(text).split("\n")
    segment_of: list[int] = []
    base_of: list[str | None] = []
    segment, in_packages, base = 0, False, "services/"
    for line in lines:
        stripped = line.strip()
        if line.startswith("## "):
            in_packages = line.startswith(PACKAGES_SECTION)
        if line.startswith("### "):
            base = _heading_base(line)
        if not stripped or line.startswith("#") or NUMBERED.match(stripped) \
                or stripped.startswith("|"):
            segment += 1
        segment_of.append(segment)
        base_of.append(base if in_packages and stripped.startswith("|") else None)
    blanked = "\n".join(lines)
    spans = []
    for m in SPAN.finditer(blanked):
        line = blanked.count("\n", 0, m.start())
        spans.append(Span(re.sub(r"\s+", "", m.group(1)), line + 1, segment_of[line],
                          base_of[line]))
    return spans


def resolve(path: str, base: str | None) -> Path:
    if base is not None:
        return ROOT / base / path
    if path.startswith(ROOTED):
        return ROOT / path
    return ROOT / "services" / path


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        out: list[ast.expr] = []
        for t in node.targets:
            out.extend(t.elts if isinstance(t, ast.Tuple | ast.List) else [t])
        return out
    if isinstance(node, ast.AnnAssign | ast.AugAssign):
        return [node.target]
    return []


def _bound(node: ast.stmt) -> list[str]:
    """Names a statement of a module or class body defines."""
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return [node.name]
    return [t.id for t in _targets(node) if isinstance(t, ast.Name)]


def _flat(body: list[ast.stmt]) -> list[ast.stmt]:
    """A body's statements, those under a top-level if/try/with included."""
    out = []
    for node in body:
        out.append(node)
        if isinstance(node, ast.If | ast.Try | ast.With):
            for part in ("body", "orelse", "finalbody", "handlers"):
                for sub in getattr(node, part, []):
                    out.extend(_flat(sub.body) if isinstance(sub, ast.ExceptHandler)
                               else _flat([sub]))
    return out


class Definitions:
    """What each Python file of the repository defines (parsed once each)."""

    def __init__(self) -> None:
        self._top: dict[Path, dict[str, ast.stmt]] = {}

    def top(self, path: Path) -> dict[str, ast.stmt]:
        if path not in self._top:
            tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
            self._top[path] = {name: node for node in _flat(tree.body)
                               for name in _bound(node)}
        return self._top[path]

    def members(self, path: Path, cls: ast.ClassDef, seen: tuple[str, ...] = ()) -> set[str]:
        out: set[str] = set()
        for node in _flat(cls.body):
            out.update(_bound(node))
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                for sub in ast.walk(node):
                    out.update(t.attr for t in _targets(sub) if isinstance(t, ast.Attribute)
                               and isinstance(t.value, ast.Name) and t.value.id == "self")
        top = self.top(path)
        for b in cls.bases:
            parent = top.get(b.id) if isinstance(b, ast.Name) else None
            if isinstance(parent, ast.ClassDef) and parent.name not in seen:
                out |= self.members(path, parent, (*seen, cls.name))
        return out

    def lacks(self, path: Path, name: str) -> str:
        """Why ``name`` (``f`` or ``Class.member``) is not defined in ``path`` ("" if it is)."""
        first, _, member = name.partition(".")
        node = self.top(path).get(first)
        if node is None:
            return f"no top-level def, class or assignment `{first}`"
        if not member:
            return ""
        if not isinstance(node, ast.ClassDef):
            return f"`{first}` is not a class, so it has no `{member}`"
        if member not in self.members(path, node):
            return f"class `{first}` defines no `{member}`"
        return ""


def rpcs() -> dict[str, set[str]]:
    """gRPC service -> its rpcs, from shared/proto/*.proto."""
    out: dict[str, set[str]] = {}
    for proto in sorted((ROOT / "shared" / "proto").glob("*.proto")):
        for service, body in RPC.findall(proto.read_text(encoding="utf-8")):
            out[service] = set(re.findall(r"^\s*rpc\s+(\w+)", body, re.MULTILINE))
    return out


def report(what: str, problems: list[str]) -> None:
    """Fail with every problem, one a line (no traceback: the list says it all)."""
    if problems:
        pytest.fail(f"docs/architecture.md: {what}:\n" + "\n".join(problems), pytrace=False)


def shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


@pytest.fixture(scope="module")
def spans() -> list[Span]:
    return read_map(MAP.read_text(encoding="utf-8"))


def test_the_map_has_references(spans: list[Span]) -> None:
    # (a parser that found nothing would pass every check below)
    assert sum(bool(REF.match(s.text)) for s in spans) > 100


def test_every_file_function_reference_resolves(spans: list[Span]) -> None:
    defs = Definitions()
    problems = []
    for s in spans:
        m = REF.match(s.text)
        if m is None:
            continue
        path, name = m["path"], m["name"]
        where = f"line {s.line}: `{path}:{name}`"
        if path.startswith("services/"):
            problems.append(f"{where}: write paths relative to services/ (drop the prefix)")
            continue
        file = resolve(path, s.base)
        if not file.is_file():
            problems.append(f"{where}: there is no file {shown(file)}")
        elif why := defs.lacks(file, name):
            problems.append(f"{where}: in {shown(file)}, {why}")
    report("names the code lacks", problems)


def _named_files(spans: list[Span]) -> dict[int, list[Path]]:
    """The Python files each segment (step) of the map names, by segment."""
    named: dict[int, list[Path]] = {}
    for s in spans:
        m = REF.match(s.text)
        path = m["path"] if m else s.text if FILE.match(s.text) else ""
        if path.endswith(".py") and (file := resolve(path, s.base)).is_file():
            named.setdefault(s.segment, []).append(file)
    return named


def bare_problem(defs: Definitions, cls: str, member: str, step: list[Path],
                 everywhere: list[Path], services: dict[str, set[str]]) -> str:
    """Why a bare ``cls.member`` does not resolve ("" if it does): the class is looked up
    in the files its step names, else in every file the map names; a name no such file
    defines may be a gRPC service's."""
    for files in (step, everywhere):
        classes = [(f, node) for f in dict.fromkeys(files)
                   if isinstance(node := defs.top(f).get(cls), ast.ClassDef)]
        if classes:
            if any(member in defs.members(f, node) for f, node in classes):
                return ""
            where = ", ".join(sorted({shown(f) for f, _ in classes}))
            return f"class `{cls}` ({where}) defines no `{member}`"
    if cls in services:
        return "" if member in services[cls] else (
            f"the {cls} service of shared/proto has no rpc `{member}`")
    return (f"no class `{cls}` in the files the map names, nor a gRPC service of that "
            "name: name its file (`path.py:Class.member`)")


def test_bare_class_members_resolve(spans: list[Span]) -> None:
    defs, services = Definitions(), rpcs()
    named = _named_files(spans)
    everywhere = [f for files in named.values() for f in files]
    problems = []
    for s in spans:
        m = BARE.match(s.text)
        if m is not None and (why := bare_problem(defs, m["cls"], m["member"],
                                                  named.get(s.segment, []), everywhere,
                                                  services)):
            problems.append(f"line {s.line}: `{s.text}`: {why}")
    report("names the code lacks", problems)


def test_every_named_file_exists(spans: list[Span]) -> None:
    problems = []
    for s in spans:
        m = REF.match(s.text)
        path = m["path"] if m else s.text
        if not (FILE.match(path) or (s.base is not None and path.endswith(".py"))):
            continue
        if s.base is None and path.startswith("services/"):
            problems.append(f"line {s.line}: `{path}`: write paths relative to services/")
            continue
        file = resolve(path, s.base)
        if not file.is_file():
            problems.append(f"line {s.line}: `{path}`: there is no file {shown(file)}")
    report("files that do not exist", problems)


def mapped_modules() -> set[Path]:
    return {p for top in MAPPED for p in (ROOT / top).rglob("*.py")
            if "_pb2" not in p.name and p.name not in ("__init__.py", "__main__.py")}


def test_every_module_has_one_line(spans: list[Span]) -> None:
    listed: dict[Path, list[int]] = {}
    for s in spans:
        if s.base is not None and s.text.endswith(".py"):
            listed.setdefault(resolve(s.text, s.base), []).append(s.line)
    missing = sorted(shown(p) for p in mapped_modules() - set(listed))
    twice = sorted(f"{shown(p)} (lines {', '.join(map(str, lines))})"
                   for p, lines in listed.items() if len(lines) > 1)
    problems = [f"{m}: no line in the module tables (add one under its package's heading)"
                for m in missing]
    problems += [f"{t}: listed more than once in the module tables" for t in twice]
    report("the module tables", problems)


def test_the_parser_reads_wrapped_references_tables_and_steps() -> None:
    text = (
        "1. **eng, loop** — `engine/async_engine.py:\n"
        "   AsyncEngine.generate` then `Worker.submit`.\n"
        "2. `Worker.flush`\n"
        "```\n`not/read.py:x`\n```\n"
        "## Packages, one line per module\n"
        "### `kvstore/` — the data plane\n"
        "| `store/tiered.py` | `TieredStore` |\n"
    )
    spans = read_map(text)
    got = [(s.text, s.line, s.base) for s in spans]
    assert got == [
        ("engine/async_engine.py:AsyncEngine.generate", 1, None),
        ("Worker.submit", 2, None),
        ("Worker.flush", 3, None),
        ("kvstore/", 8, None),
        ("store/tiered.py", 9, "services/kvstore/"),
        ("TieredStore", 9, "services/kvstore/"),
    ]
    assert spans[0].segment == spans[1].segment != spans[2].segment
    assert resolve("store/tiered.py", "services/kvstore/") == (
        ROOT / "services" / "kvstore" / "store" / "tiered.py")
    assert resolve("shared/hashing.py", None) == ROOT / "shared" / "hashing.py"
    assert resolve("engine/wire.py", None) == ROOT / "services" / "engine" / "wire.py"


def test_a_missing_member_is_named() -> None:
    defs = Definitions()
    core = ROOT / "services" / "engine" / "engine_core.py"
    assert defs.lacks(core, "EngineCore.step") == ""
    assert defs.lacks(core, "EngineCore.budget_retry_at") == ""  # set on self
    assert defs.lacks(core, "BUDGET_WAIT_S") == ""
    assert defs.lacks(core, "EngineCore.stepp") == "class `EngineCore` defines no `stepp`"
    assert defs.lacks(core, "Engine") == "no top-level def, class or assignment `Engine`"
