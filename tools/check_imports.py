"""Fail when the project's modules import each other in a circle (``make lint``).

Every import counts, wherever it is written: at the top of a module, inside a function
(a function-level import that only hides a circle is still one) and under
``if TYPE_CHECKING:`` (two modules that need each other's types are one concept, or want
a third module both import). A package's ``__init__`` counts as the module of its name.

    python tools/check_imports.py [PACKAGE ...]      # default: services shared bench clients

Prints each circle with the names that tie it, one edge a line; exit status 1 if any.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PACKAGES = ("services", "shared", "bench", "clients")


def module_files(packages: Iterable[str], root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every Python source under ``packages``."""
    files: dict[str, Path] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            if "_pb2" in path.name:  # generated gRPC code
                continue
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            files[".".join(parts)] = path
    return files


def _imported(tree: ast.Module, module: str, is_package: bool,
              files: dict[str, Path]) -> Iterator[tuple[str, str]]:
    """(imported module, the name taken from it) for every import in the module. ``from
    pkg import a, b`` names the modules ``pkg.a`` and ``pkg.b`` where they are modules, and
    ``pkg`` itself (its ``__init__``) only when neither is."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: climb from the module's own package
                here = module.split(".") if is_package else module.split(".")[:-1]
                here = here[: len(here) - node.level + 1]
                base = ".".join([*here, base] if base else here)
            targets = [(f"{base}.{a.name}", a.name) for a in node.names]
            if not any(t in files for t, _ in targets):
                targets = [(base, a.name) for a in node.names]
            yield from targets


def _resolve(name: str, files: dict[str, Path]) -> str | None:
    """The longest known module that ``name`` is or lies in."""
    while name:
        if name in files:
            return name
        name = name.rpartition(".")[0]
    return None


def import_graph(files: dict[str, Path]) -> dict[str, dict[str, set[str]]]:
    """module -> {imported module: names taken from it}."""
    graph: dict[str, dict[str, set[str]]] = {m: {} for m in files}
    for module, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for target, name in _imported(tree, module, path.name == "__init__.py", files):
            found = _resolve(target, files)
            if found is not None and found != module:
                graph[module].setdefault(found, set()).add(name)
    return graph


def circles(graph: dict[str, dict[str, set[str]]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for start in graph:
        if start in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def main(argv: list[str] | None = None) -> int:
    packages = (argv if argv is not None else sys.argv[1:]) or list(DEFAULT_PACKAGES)
    files = module_files(packages)
    graph = import_graph(files)
    found = circles(graph)
    for component in found:
        members = set(component)
        print(f"import circle of {len(component)} modules:")
        for module in component:
            for target, names in sorted(graph[module].items()):
                if target in members:
                    print(f"  {module} -> {target}: {', '.join(sorted(names))}")
    if found:
        print(f"{len(found)} import circle(s) among {len(files)} modules", file=sys.stderr)
        return 1
    print(f"no import circle among {len(files)} modules")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
