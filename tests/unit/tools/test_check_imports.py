"""tools/check_imports.py finds circles however the imports are written."""

from __future__ import annotations

from pathlib import Path

from tools.check_imports import circles, import_graph, module_files


def _tree(root: Path, files: dict[str, str]) -> dict[str, Path]:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return module_files(["pkg"], root)


def test_top_level_chain_is_no_circle(tmp_path: Path) -> None:
    files = _tree(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from pkg.b import f\n",
        "pkg/b.py": "from pkg.c import g\n",
        "pkg/c.py": "import os\n",
    })
    assert circles(import_graph(files)) == []


def test_function_level_and_type_checking_imports_count(tmp_path: Path) -> None:
    files = _tree(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "def f():\n    from pkg.b import g\n    return g\n",
        "pkg/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                    "    from pkg.c import h\n",
        "pkg/c.py": "from . import a\n",
        "pkg/d.py": "from pkg import a\n",
    })
    assert circles(import_graph(files)) == [["pkg.a", "pkg.b", "pkg.c"]]


def test_relative_import_from_a_package_names_its_init(tmp_path: Path) -> None:
    files = _tree(tmp_path, {
        "pkg/__init__.py": "from .sub import thing\n",
        "pkg/sub/__init__.py": "from ..top import value\nthing = 1\n",
        "pkg/top.py": "from pkg import thing\nvalue = 2\n",
    })
    graph = import_graph(files)
    assert graph["pkg.sub"] == {"pkg.top": {"value"}}
    assert circles(graph) == [["pkg", "pkg.sub", "pkg.top"]]

