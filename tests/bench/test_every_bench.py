"""Every bench has its smoke run here, and no bench imports the tests: a new bench script
(a module of bench/ with a ``main``) fails this until a smoke test calls it."""

from __future__ import annotations

import ast
from pathlib import Path

from bench.harness import REPO

BENCH = REPO / "bench"
HERE = Path(__file__).resolve().parent


def _modules() -> dict[str, ast.Module]:
    return {".".join(p.relative_to(REPO).with_suffix("").parts): ast.parse(p.read_text())
            for p in sorted(BENCH.rglob("*.py"))}


def test_every_bench_script_has_a_smoke_test() -> None:
    scripts = [name for name, tree in _modules().items()
               if any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body)]
    smoke = "\n".join(p.read_text() for p in HERE.glob("test_*.py"))
    called = {name for name in scripts
              if f"{name.rpartition('.')[2]}.main(" in smoke or f'"-m", "{name}"' in smoke}
    assert len(scripts) >= 16
    assert set(scripts) == called, sorted(set(scripts) - called)


def test_no_bench_imports_the_tests() -> None:
    for name, tree in _modules().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                targets = [node.module or ""]
            else:
                continue
            assert not any(t == "tests" or t.startswith("tests.") for t in targets), name
